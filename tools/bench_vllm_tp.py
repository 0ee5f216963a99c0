"""The ``tools/bench.py vllm`` rows of tensor-parallel and fp8 engines.

The model and prompts of ``bench_vllm`` (12 layers, 4 KV heads, 1,024-token prompts,
``max_tokens=1``, the median TTFT of ``PROMPTS`` prompts after a first request), per run with
new prompts and fresh directories:

- TP=2 (``tensor_parallel_size=2``, ``mp`` executor, one core a rank: this machine's two):
  cold without a connector, cold with tlkv saving, warm with tlkv (a fresh engine on that
  store directory); then a TP=1 engine warm on the blocks the TP=2 engine saved.
- fp8 (``kv_cache_dtype="fp8"``): the same cold/warm pair at TP=1, where vLLM's CPU
  attention runs an fp8 cache (AVX-512 or AMX); elsewhere the rows say it was not run.
- Bytes per block: a stored block's envelope (v1, read from the store) against the v2
  envelope of the same geometry (E4M3 codes and a scale per slab).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bench_common import Row

FP8_NEEDS_AVX512 = "FP8 KV cache on CPU requires x86 with AVX-512 or AMX"


def _engine(model: str, connector: Any, prompts: list[list[int]], tp: int, **llm: Any) -> Any:
    from bench_vllm import ENV, PROMPTS
    from vllm_demo import run_engine, tensor_parallel

    tp_llm, tp_env = tensor_parallel(tp)
    spec = {
        "model": model,
        "connector": connector,
        "prompts": [{"tokens": p} for p in prompts],
        "max_tokens": 1,
        "llm": {**tp_llm, **llm},
    }
    results = run_engine(spec, {**ENV, **tp_env}, timeout=900)["results"]
    return {
        "seconds": statistics.median(r["seconds"] for r in results[1 : PROMPTS + 1]),
        "cached": min(r["cached"] for r in results[: PROMPTS + 1]),
    }


def one_run(run: int, model: str, root: Path) -> dict[str, float]:
    """One run's TTFTs (seconds) and bytes per block; fp8 ones only where vLLM runs fp8."""
    from bench_vllm import LOADED, PROMPTS, TOKENS
    from vllm_demo import prompt, tlkv_config

    from kvstore import Store
    from kvstore.codec.hashing import chain_hashes

    prompts = [prompt(TOKENS, seed=100 * run + i) for i in range(PROMPTS + 1)]
    hit = LOADED
    data = str(root / f"tp2-{run}")
    t: dict[str, float] = {}
    t["tp2_cold"] = _engine(model, None, prompts, 2)["seconds"]
    t["tp2_cold_save"] = _engine(model, tlkv_config(data), prompts, 2)["seconds"]
    warm = _engine(model, tlkv_config(data), prompts, 2)
    assert warm["cached"] == hit, warm
    t["tp2_warm"] = warm["seconds"]
    cross = _engine(model, tlkv_config(data), prompts, 1)
    assert cross["cached"] == hit, cross
    t["tp1_warm_on_tp2"] = cross["seconds"]
    with Store(data) as store:
        (ns,) = (m for m in store.models() if m != "default")
        handle = store.model(ns)
        block = handle.get(chain_hashes(prompts[1], 32)[0])
        assert block is not None and handle.geometry is not None
        t["v1_bytes"] = float(len(block))
        t["v2_bytes"] = float(handle.geometry.envelope_bytes(1, 2))
    fp8 = str(root / f"fp8-{run}")
    try:
        t["fp8_cold"] = _engine(model, tlkv_config(fp8), prompts, 1, kv_cache_dtype="fp8")[
            "seconds"
        ]
    except RuntimeError as exc:
        if FP8_NEEDS_AVX512 not in str(exc):
            raise
        return t
    warm8 = _engine(model, tlkv_config(fp8), prompts, 1, kv_cache_dtype="fp8")
    assert warm8["cached"] == hit, warm8
    t["fp8_warm"] = warm8["seconds"]
    return t


def rows(runs: list[dict[str, float]], ratio_row: Any) -> list[Row]:
    """The rows of these runs (``ratio_row``: bench_vllm's)."""
    out = [
        ratio_row("TTFT warm vs cold, TP=2 (tlkv store dir)", runs, "tp2_warm", "tp2_cold"),
        ratio_row(
            "TTFT cold, TP=2, tlkv saving vs no connector", runs, "tp2_cold_save", "tp2_cold"
        ),
        ratio_row(
            "TTFT warm TP=1 on TP=2's blocks vs TP=2 cold", runs, "tp1_warm_on_tp2", "tp2_cold"
        ),
    ]
    v1 = statistics.median(r["v1_bytes"] for r in runs)
    v2 = statistics.median(r["v2_bytes"] for r in runs)
    out.append(
        Row(
            "bytes per block, v2 (fp8) vs v1 (f16) envelope",
            f"{v2:.0f} B",
            f"v1 {v1:.0f} B",
            v2 / v1,
        )
    )
    if all("fp8_warm" in r for r in runs):
        out.append(
            ratio_row("TTFT warm vs cold, fp8 cache (tlkv v2)", runs, "fp8_warm", "fp8_cold")
        )
    else:
        out.append(Row("TTFT warm vs cold, fp8 cache", "not run", FP8_NEEDS_AVX512, None))
    return out
