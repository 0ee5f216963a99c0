"""Engine-bridge benchmarks: per-layer KV -> envelope, store views -> per-layer KV, and the
transformers save/load against recomputing the prefix.

Geometry (16, 32, 8, 128) -- Llama-3-8B -- and 128 blocks (2,048 tokens, 256 MiB of f16
KV). Every ratio is against a baseline measured in this same run. The save/load rows use
the demo model of tools/prefix_cache_demo.py (needs the hf extra; skipped without it).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from bench_common import Row

from kvstore import Geometry, Store, chain_hashes, encode
from kvstore.kvlayout import blocks_from_layers, layers_from_views

GEOMETRY = Geometry(16, 32, 8, 128)
N_BLOCKS = 128


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _paired(
    fns: list[Callable[[], object]], repeat: int
) -> tuple[list[list[float]], list[list[float]]]:
    """Rounds of every function in turn (the first is the baseline): per function its
    times, and its per-round ratios to the baseline. On a shared machine a ratio taken
    within one round is steadier than best-of figures taken minutes apart."""
    for fn in fns:
        fn()  # warm up
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            times[i].append(_timed(fn))
    ratios = [[b / t for b, t in zip(times[0], ts)] for ts in times]
    return times, ratios


def _rate(nbytes: int, times: list[float]) -> str:
    """Median throughput, with the range over the rounds."""
    rates = sorted(nbytes / t / 1e9 for t in times)
    return f"{statistics.median(rates):.2f} GB/s ({rates[0]:.2f}-{rates[-1]:.2f})"


def _ratio_range(ratios: list[float]) -> str:
    return f"per-round ratio {min(ratios):.2f}-{max(ratios):.2f}x"


def _layer_rows(repeat: int) -> list[Row]:
    g = GEOMETRY
    t = N_BLOCKS * g.block_tokens
    rng = np.random.default_rng(0)
    shape = (g.n_kv_heads, t, g.head_dim)
    keys = [rng.standard_normal(shape).astype(np.float16) for _ in range(g.n_layers)]
    values = [rng.standard_normal(shape).astype(np.float16) for _ in range(g.n_layers)]
    tokens = np.arange(t, dtype=np.uint32)
    nbytes = 2 * sum(k.nbytes for k in keys)
    flat = np.concatenate([k.reshape(-1) for k in keys + values])
    dst = np.empty_like(flat)
    dst[:] = 0  # touched: the baseline copies into warm memory

    def save() -> bytes:
        return encode(g, blocks_from_layers(keys, values, tokens, g), 1)

    with (
        tempfile.TemporaryDirectory(prefix="tlkv-bench-") as tmp,
        Store(Path(tmp) / "s", geometry=g, sync=False) as store,
    ):
        store.put(save())
        hashes = chain_hashes(tokens, g.block_tokens)
        reused = np.empty((g.n_layers, 2, g.n_kv_heads, t, g.head_dim), dtype=np.float16)
        reused[:] = 0

        def load(out: np.ndarray | None = None) -> object:
            with store.reader() as r:
                views = [r.view(h) for h in hashes]
                return layers_from_views(views, out=out)  # type: ignore[arg-type]

        times, ratios = _paired(
            [
                lambda: np.copyto(dst, flat),
                lambda: np.copyto(np.empty_like(flat), flat),
                save,
                load,
                lambda: load(reused),
            ],
            repeat,
        )
    fresh_ratio = [[f / x for f, x in zip(times[1], ts)] for ts in times]
    rows = [
        Row(f"memcpy, {nbytes >> 20} MiB, into warm memory (baseline)", _rate(nbytes, times[0])),
        Row(
            "  memcpy into fresh memory (np.empty each time)",
            _rate(nbytes, times[1]),
            "",
            statistics.median(ratios[1]),
        ),
    ]
    names = {
        2: f"blocks_from_layers + encode v1, {N_BLOCKS} blocks",
        3: f"layers_from_views from a Store reader, {N_BLOCKS} blocks",
        4: "  same into a reused output (out=)",
    }
    for i, name in names.items():
        ratio = statistics.median(ratios[i])
        rows.append(
            Row(
                name,
                _rate(nbytes, times[i]),
                f"memcpy warm; {_ratio_range(ratios[i])}",
                ratio,
                ">= 0.5x",
                ratio >= 0.5,
            )
        )
        rows.append(
            Row(
                "    vs memcpy into fresh memory",
                "",
                _ratio_range(fresh_ratio[i]),
                statistics.median(fresh_ratio[i]),
            )
        )
    return rows


def _model_rows(repeat: int) -> list[Row]:
    try:
        import torch  # noqa: F401
        from prefix_cache_demo import build, cache_of, forward
    except ImportError:
        return [Row("save/load vs recompute", "skipped: the hf extra is not installed")]
    from kvstore.engines.transformers import load_prefix, save_prefix

    args = argparse.Namespace(
        tokens=2048, dtype="float16", layers=8, hidden=512, heads=8, kv_heads=4, head_dim=64
    )
    model, ids = build(args)
    forward(model, ids[:, :1])
    t0 = time.perf_counter()
    cache = cache_of(forward(model, ids))
    t_prefill = time.perf_counter() - t0
    saves, loads = [], []
    with tempfile.TemporaryDirectory(prefix="tlkv-bench-") as tmp:
        for i in range(repeat):
            with Store(Path(tmp) / f"s{i}") as store:  # durable puts (sync=True)
                t0 = time.perf_counter()
                save_prefix(store, ids, cache, config=model)
                saves.append(time.perf_counter() - t0)
            with Store(Path(tmp) / f"s{i}") as store:
                t0 = time.perf_counter()
                load_prefix(store, ids, config=model)
                loads.append(time.perf_counter() - t0)
    label = f"demo model ({args.layers} layers, {args.kv_heads}x{args.head_dim}, f16)"
    rows = [Row(f"recompute 2,048-token prefix, {label}", f"{t_prefill * 1e3:.0f} ms")]
    for name, ts in (("save_prefix, Store sync", saves), ("load_prefix, new Store", loads)):
        med = statistics.median(ts)
        rows.append(
            Row(
                f"  {name} (median, range of {len(ts)})",
                f"{med * 1e3:.1f} ms ({min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f})",
                f"recompute {t_prefill * 1e3:.0f} ms",
                t_prefill / med,
            )
        )
    return rows


def run(args: argparse.Namespace) -> list[Row]:
    repeat = 3 if args.quick else 9
    return _layer_rows(repeat) + _model_rows(3 if args.quick else 5)
