"""Every ```python snippet of the README runs, in order, as one session (a later snippet
uses the names an earlier one defined: ``g``, ``data``, ``hashes``, ``tokens``).

Each snippet runs in a fresh working directory (so each ``./tlkv-data`` is new). What a
reader has at hand is provided: a live ``tlkv serve`` (HTTP and tl.kv.v1) and moto's S3
API with the bucket ``kv-bucket``; the only change to a snippet's text is that the example
endpoints it names (``http://127.0.0.1:8000``, ``grpc://127.0.0.1:50051``,
``http://minio:9000``) point at them. The engine snippet gets ``model`` and ``input_ids``
(a tiny random-weight Llama and a prompt; the ``hf`` test), and what it computes is
checked against the cold run. A snippet marked ``<!-- snippet: run by tests/<file>.py -->``
is run by that test instead; this file checks that the file exists and runs it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from http_server import ServerProcess, free_port
from readme import Block, blocks
from s3_server import S3Server

TESTS = Path(__file__).resolve().parent
ENGINE = "kvstore.engines.transformers"


def _python() -> list[Block]:
    return [b for b in blocks() if b.lang == "python"]


def _own() -> list[Block]:
    return [b for b in _python() if not b.marker]


def _run(block: Block, namespace: dict[str, Any], cwd: Path, endpoints: dict[str, str]) -> None:
    text = block.text
    for example, live in endpoints.items():
        text = text.replace(example, live)
    cwd.mkdir(parents=True)
    here = Path.cwd()
    os.chdir(cwd)
    try:
        exec(compile(text, f"README.md:{block.line}", "exec"), namespace)
    finally:
        os.chdir(here)


def test_the_readme_has_its_snippets_and_every_marked_one_is_run_elsewhere() -> None:
    python = _python()
    assert len(_own()) >= 7
    assert sum(ENGINE in b.text for b in _own()) == 1
    for b in python:
        if not b.marker:
            continue
        assert b.marker.startswith("snippet: run by tests/"), b
        runner = TESTS / b.marker.removeprefix("snippet: run by tests/")
        assert runner.is_file(), f"README.md:{b.line}: {runner.name} does not exist"
        assert "snippets_run_by" in runner.read_text(), f"{runner.name} does not run it"


@pytest.fixture
def kv_bucket(s3_server: S3Server) -> S3Server:
    client: Any = s3_server.client()
    names = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
    if "kv-bucket" not in names:
        client.create_bucket(Bucket="kv-bucket")
    return s3_server


def test_every_snippet_without_an_engine_runs(tmp_path: Path, kv_bucket: S3Server) -> None:
    port = free_port()
    with ServerProcess(tmp_path / "server", "--grpc-port", str(port)) as srv:
        endpoints = {
            "http://127.0.0.1:8000": srv.url,
            "grpc://127.0.0.1:50051": f"grpc://127.0.0.1:{port}",
            "http://minio:9000": kv_bucket.endpoint,
        }
        namespace: dict[str, Any] = {"__name__": "readme"}
        ran = 0
        for i, block in enumerate(_own()):
            if ENGINE in block.text:
                continue  # test_the_engine_snippet
            _run(block, namespace, tmp_path / f"snippet-{i}", endpoints)
            ran += 1
    assert ran == len(_own()) - 1
    # What the snippets computed is what they say.
    assert len(namespace["hashes"]) == 2 and len(namespace["data"]) > 0
    assert namespace["single"] is not None and namespace["bv"] is not None
    assert namespace["report"].blocks == 3  # the gRPC push: two full blocks and the tail
    g = namespace["g"]
    assert namespace["k"].shape == (g.n_layers, g.n_kv_heads, g.block_tokens, g.head_dim)


@pytest.mark.hf
def test_the_engine_snippet(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch", reason="the hf extra is not installed")
    transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float16).eval()
    input_ids = torch.randint(0, 96, (1, 45), generator=torch.Generator().manual_seed(1))
    (block,) = [b for b in _own() if ENGINE in b.text]
    namespace: dict[str, Any] = {"__name__": "readme", "model": model, "input_ids": input_ids}
    with torch.no_grad():
        _run(block, namespace, tmp_path / "engine", {})
        n = namespace["n"]
        assert n == 32
        cold = model(input_ids[:, :n], use_cache=True).cache
        want = model(input_ids[:, n:], cache=cold).logits
        assert torch.equal(namespace["logits"], want)
        assert torch.equal(
            namespace["tokens"], model.generate(input_ids, max_new_tokens=20, do_sample=False)
        )


def test_benchmark_runs_live_in_benchmarks_md() -> None:
    readme = (TESTS.parent / "README.md").read_text()
    benchmarks = (TESTS.parent / "BENCHMARKS.md").read_text()
    # It was 1,149 lines, 44 % benchmark runs; what it has now is install, integrate and
    # operate (engines, the multi-node recipe, operators' kit), plus one headline table.
    assert len(readme.splitlines()) < 1100
    assert "[BENCHMARKS.md](BENCHMARKS.md)" in readme
    headline = [line for line in readme.splitlines() if line.startswith("| measure |")]
    assert len(headline) == 1  # one short table of headline figures
    assert sum(line.startswith("| measure |") for line in benchmarks.splitlines()) >= 8
    assert "## Benchmarks" not in readme
