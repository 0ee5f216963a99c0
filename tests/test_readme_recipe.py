"""The multi-node recipe of docs/tier.md, run as written: its shell blocks (found by their
``<!-- recipe: multi-node, STEP -->`` markers) in bash, in an empty directory, and its
Python block (``<!-- snippet: run by tests/test_readme_recipe.py -->``) with ``MODEL``, the
variable it reads, naming a local directory holding a tiny random-weight Llama, against
moto's S3 API on loopback holding the bucket ``kv-bucket``, with the standard AWS
variables set as the recipe asks. The two nodes it starts are stopped by ending the
session that ran them.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from readme import bash, recipe, snippets_run_by
from s3_server import CREDENTIALS, S3Server

pytestmark = [pytest.mark.hf, pytest.mark.slow]
torch = pytest.importorskip("torch", reason="the hf extra (torch, transformers) is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
from hf_names import CACHE_KW, cache_of, tiny_llama_config  # noqa: E402

PORTS = (8101, 8102)  # the recipe's two nodes


def _free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ports_free(timeout: float) -> bool:
    """Whether the recipe's ports are free, waiting up to ``timeout`` seconds for nodes
    that are still shutting down."""
    deadline = time.monotonic() + timeout
    while not all(_free(p) for p in PORTS):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_two_nodes_share_a_tier_with_a_scoped_token(tmp_path: Path, s3_server: S3Server) -> None:
    assert _ports_free(15), f"the recipe's ports {PORTS} are in use"
    client: Any = s3_server.client()
    if "kv-bucket" not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
        client.create_bucket(Bucket="kv-bucket")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TLKV_", "AWS_"))}
    env.update(CREDENTIALS, AWS_ENDPOINT_URL=s3_server.endpoint)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    (python_block,) = snippets_run_by("test_readme_recipe.py")
    log_path = tmp_path.parent / f"{tmp_path.name}-nodes.log"  # the nodes keep writing to it
    with open(log_path, "w") as log:
        nodes = subprocess.Popen(
            ["bash", "-euo", "pipefail", "-c", recipe("multi-node", "start")],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the nodes it starts stay in this session, ended below
        )
    try:
        assert nodes.wait(timeout=120) == 0, log_path.read_text()
        torch.manual_seed(0)
        config = tiny_llama_config()
        model_dir = tmp_path.parent / f"{tmp_path.name}-model"  # MODEL: a local directory
        transformers.LlamaForCausalLM(config).to(torch.float16).save_pretrained(str(model_dir))
        os.environ["MODEL"] = str(model_dir)
        namespace: dict[str, Any] = {"__name__": "recipe"}
        try:
            exec(compile(python_block.text, python_block.where, "exec"), namespace)
        finally:
            del os.environ["MODEL"]
        model, input_ids, n = namespace["model"], namespace["input_ids"], namespace["n"]
        assert n == 32  # node B loaded what node A saved
        with torch.inference_mode():
            own = cache_of(model(input_ids[:, :n], use_cache=True))
            want = model(input_ids[:, n:], **{CACHE_KW: own}).logits
        assert torch.equal(namespace["logits"], want)
        check = bash(recipe("multi-node", "check"), tmp_path, env)
        assert check.returncode == 0, check.stderr
        assert "blocks           2" in check.stdout  # node B holds them now
        assert "NotFoundError: model 'default' not found" in check.stderr  # scoped token
        assert "default: not found" in check.stdout
        assert (tmp_path / "node-a").is_dir() and (tmp_path / "node-b").is_dir()
    finally:
        os.killpg(nodes.pid, signal.SIGTERM)
        if not _ports_free(15):
            os.killpg(nodes.pid, signal.SIGKILL)
