"""Every code block of the README and the documentation site runs, as a reader would run
them: page after page (README.md, then the site's nav), in one working directory, each
page's Python blocks in one session of their own (a page's later block uses the names an
earlier one of the same page defined), the shell blocks in bash.

What a reader has at hand is provided: a live ``tlkv serve`` (HTTP and tl.kv.v1), moto's
S3 API with the bucket ``kv-bucket`` and the standard AWS variables (``AWS_ENDPOINT_URL``
naming moto for the shell), and ``MODEL``, a
local directory holding a tiny random-weight Llama (the engine blocks read it, as they
read a hub id). The only change to a block's text is that the example endpoints it names
(``http://127.0.0.1:8000``, ``grpc://127.0.0.1:50051``, ``http://minio:9000``) point at
them. A block marked for another test (``tests/readme.py`` lists the markers) is run
there; this file checks that the test exists and runs it, and that a block marked as run
by ``.ci/run`` is there verbatim. Blocks that need the ``hf`` extra (they import torch or
transformers) run when it is installed; without it the test runs the rest and then
reports itself skipped, naming them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import tomllib
from http_server import ServerProcess, free_port
from readme import README, ROOT, Block, all_blocks, bash, pages, start
from s3_server import S3Server

pytestmark = pytest.mark.docs
TESTS = Path(__file__).resolve().parent
LANGS = {"python", "sh", "console", "toml", "json"}
# The one kind of block no test here can run: an engine launch that needs a GPU.
GPU_ONLY = "not run: needs a GPU (SGLang's engine runs its GPU kernels)"
_ENGINE = re.compile(r"^\s*(import|from) (torch|transformers)\b", re.M)


def _commands(text: str) -> list[str]:
    """A shell text's commands: continuation lines joined, comments and blank lines
    dropped, whitespace runs made one space."""
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        line = " ".join(line.split())
        if line and not line.startswith("#"):
            out.append(line)
    return out


def test_every_block_is_run_by_a_test_and_every_page_is_in_the_site() -> None:
    assert len(README.read_text().splitlines()) <= 250  # the front door; the manual is docs/
    for page in pages():
        assert page.is_file(), f"mkdocs.yml names {page}, which does not exist"
    listed = {p.name for p in pages()}
    assert {p.name for p in (ROOT / "docs").glob("*.md")} <= listed, "a page not in the nav"
    ci = " ".join(_commands((ROOT / ".ci" / "run").read_text()))
    found = all_blocks()
    assert sum(b.lang == "python" and not b.marker for b in found) >= 9
    for b in found:
        assert b.lang in LANGS, f"{b.where}: no test runs a {b.lang!r} block"
        if b.marker.startswith("snippet: run by tests/"):
            runner = TESTS / b.marker.removeprefix("snippet: run by tests/")
            assert runner.is_file(), f"{b.where}: {runner.name} does not exist"
            assert "from readme import" in runner.read_text(), f"{runner.name} does not run it"
        elif b.marker == "run by .ci/run":
            for command in _commands(b.text):
                assert command in ci, f"{b.where}: .ci/run does not run {command!r}"
        elif b.marker.startswith("not run: "):
            assert b.marker == GPU_ONLY, f"{b.where}: not run, and no GPU is why: {b.marker}"
        else:
            assert b.marker in ("",) or b.marker.startswith(("recipe: ", "server: ")), b


def test_the_route_table_lists_every_route() -> None:
    from api.app import create_app

    text = (ROOT / "docs" / "service.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    table = " ".join(rows)
    for route in create_app().routes:
        path = re.sub(r":\w+}", "}", getattr(route, "path", ""))  # {model:path} is {model}
        if path.startswith(("/docs", "/redoc", "/openapi")):
            continue
        for method in sorted(getattr(route, "methods", None) or ()):
            if method == "HEAD" and "GET" in route.methods:  # type: ignore[attr-defined]
                continue
            shown = re.search(rf"`[^`]*\b{method}\b[^`]* {re.escape(path)}(\[|`)", table)
            shown = shown or re.search(rf"{method}[^|]*`[^`]*{re.escape(path)}", table)
            assert shown, f"docs/service.md's route table omits {method} {path}"


@pytest.fixture
def kv_bucket(s3_server: S3Server) -> S3Server:
    client: Any = s3_server.client()
    names = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
    if "kv-bucket" not in names:
        client.create_bucket(Bucket="kv-bucket")
    return s3_server


def _swap(text: str, endpoints: dict[str, str]) -> str:
    for example, live in endpoints.items():
        text = text.replace(example, live)
    return text


def _env(model_dir: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TLKV_")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if model_dir is not None:
        env["MODEL"] = str(model_dir)
    return env


def _bash(block: Block, text: str, cwd: Path, env: dict[str, str]) -> str:
    proc = bash(text, cwd, env)
    assert proc.returncode == 0, f"{block.where}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def _shape(line: str) -> re.Pattern[str]:
    """A shown output line as a pattern: its words, any numbers."""
    return re.compile(re.sub(r"\d+(\\\.\d+)?", r"[\\d.]+", re.escape(line.strip())))


def _console(block: Block, text: str, cwd: Path, env: dict[str, str]) -> None:
    """Each ``$ command`` runs and ends with a line of the shape shown after it."""
    steps: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif steps and line.strip():
            steps[-1][1].append(line)
    assert steps, f"{block.where}: a console block without a command"
    for command, shown in steps:
        got = _bash(block, command, cwd, env).strip().splitlines()
        if shown:
            assert got and _shape(shown[-1]).fullmatch(got[-1]), (block.where, got, shown)


def _serve(block: Block, text: str, cwd: Path, env: dict[str, str]) -> None:
    """The block's server starts on free ports, answers /healthz, and stops."""
    assert "--port 8000" in text, f"{block.where}: a server block names its port, 8000"
    port = free_port()
    text = re.sub(r"\b8000\b", str(port), text)
    text = re.sub(r"\b50051\b", str(free_port()), text)
    log = cwd.parent / f"server-{block.page.stem}-{block.line}.log"
    proc = start(text, cwd, env, log)
    try:
        deadline = time.monotonic() + 120  # a loaded 2-core machine starts it slowly
        while True:
            assert proc.poll() is None, f"{block.where}: exited\n{log.read_text()[-3000:]}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"{block.where}: no /healthz in 120 s"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def _tokens(block: Block, text: str) -> None:
    """A token table loads as ``--token-file`` loads it, each token with its models."""
    from api.access import parse_tokens

    table = parse_tokens(text, block.where)
    doc = json.loads(text) if block.lang == "json" else tomllib.loads(text)
    assert doc["tokens"]
    for entry in doc["tokens"]:
        access = table.lookup(entry["token"].encode())
        assert access is not None, (block.where, entry["token"])
        assert set(access.read) == set(entry["read"]) and set(access.write) == set(entry["write"])


def _tiny_model(path: Path) -> Path:
    import torch
    import transformers
    from hf_names import tiny_llama_config

    torch.manual_seed(0)
    model: Any = transformers.LlamaForCausalLM(tiny_llama_config())
    model.to(torch.float16).save_pretrained(str(path))
    return path


def _hf_installed() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))


def test_the_documentation_runs_in_order(
    tmp_path: Path, kv_bucket: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    hf = _hf_installed()
    model_dir = _tiny_model(tmp_path / "tiny-llama") if hf else None
    if model_dir is not None:
        monkeypatch.setenv("MODEL", str(model_dir))
    cwd = tmp_path / "reader"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    env = _env(model_dir)
    env["AWS_ENDPOINT_URL"] = kv_bucket.endpoint  # the docs' S3-compatible server
    port = free_port()
    sessions: dict[str, dict[str, Any]] = {}
    left_out: list[str] = []
    with ServerProcess(tmp_path / "server", "--grpc-port", str(port)) as srv:
        endpoints = {
            "http://127.0.0.1:8000": srv.url,
            "grpc://127.0.0.1:50051": f"grpc://127.0.0.1:{port}",
            "http://minio:9000": kv_bucket.endpoint,
        }
        for page in pages():
            namespace: dict[str, Any] = {"__name__": "docs"}
            sessions[page.name] = namespace
            for block in (b for b in all_blocks() if b.page == page):
                if block.marker.startswith(("snippet: ", "recipe: ", "run by ", "not run: ")):
                    continue  # run by the test (or the .ci/run step) its marker names
                text = _swap(block.text, endpoints)
                if block.marker.startswith("server: "):
                    _serve(block, text, cwd, env)
                elif block.lang == "python":
                    if _ENGINE.search(text) and not hf:
                        left_out.append(block.where)
                        continue
                    exec(compile(text, block.where, "exec"), namespace)
                elif block.lang == "sh":
                    _bash(block, text, cwd, env)
                elif block.lang == "console":
                    _console(block, text, cwd, env)
                else:
                    _tokens(block, text)
    _check(sessions, cwd, hf)
    if left_out:
        pytest.skip(f"ran every block but these, which need the hf extra: {left_out}")


def _check(sessions: dict[str, dict[str, Any]], cwd: Path, hf: bool) -> None:
    """What the blocks computed is what their text says."""
    tour = sessions["README.md"]
    g = tour["g"]
    assert len(tour["hashes"]) == 2
    assert tour["k"].shape == (g.n_layers, g.n_kv_heads, g.block_tokens, g.head_dim)
    lib = sessions["library.md"]
    assert lib["single"] is not None and lib["bv"] is not None
    from kvstore import Store

    with Store(cwd / "tlkv-models") as store:  # the Models example's comment
        assert store.models() == ["default", "meta-llama/Llama-3.1-8B@5206a32/bf16"]
    assert sessions["service.md"]["report"].blocks == 3  # two full blocks and the tail
    assert (cwd / "restored").is_dir() and (cwd / "other").is_dir()
    if hf:
        _check_engine(tour)


def _check_engine(ns: dict[str, Any]) -> None:
    """The transformers example: the loaded prefix gives the logits of the model's own
    cache of it, and generate the tokens that cache gives."""
    import torch
    from hf_names import CACHE_KW, cache_of

    model, ids, n = ns["model"], ns["input_ids"], ns["n"]
    assert n == 32  # two blocks of 16 of the 45-token prompt
    with torch.inference_mode():
        own = cache_of(model(ids[:, :n], use_cache=True))
        want = model(ids[:, n:], **{CACHE_KW: own}).logits
        assert torch.equal(ns["logits"], want)
        own = cache_of(model(ids[:, :n], use_cache=True))
        tokens = model.generate(ids, max_new_tokens=20, do_sample=False, **{CACHE_KW: own})
    assert torch.equal(ns["tokens"], tokens)


def test_benchmark_runs_live_in_benchmarks_md() -> None:
    readme = README.read_text()
    benchmarks = (ROOT / "BENCHMARKS.md").read_text()
    assert "(docs/benchmarks.md)" in readme
    assert (ROOT / "docs" / "benchmarks.md").read_text().strip() == '--8<-- "BENCHMARKS.md"'
    headline = [line for line in readme.splitlines() if line.startswith("| measure |")]
    assert len(headline) == 1  # one short table of headline figures
    assert sum(line.startswith("| measure |") for line in benchmarks.splitlines()) >= 8
    assert "## Benchmarks" not in readme
