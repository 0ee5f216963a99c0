"""The store's scale curve: 16,384, 131,072 and 1,048,576 blocks.

Blocks of a tiny geometry (1 token, 1 layer, 1 KV head, head_dim 8: a 90-byte envelope)
with random 64-bit hashes, so a million of them fit in a few hundred MB and build in a
minute; the key set, the B-tree and the per-block records are those of any geometry (only
the values are small: large ones sit on overflow pages, the key lookups are the same or
cheaper). Per size:

- put: blocks per second while building (puts of 4,096 blocks, ``sync=False``);
- has: ``Store.has`` of 8,192 random hashes, half stored (median, the key-set copy warm);
  then the first ``has`` after another write (a put of 32 blocks: the copy is brought
  forward with the key log);
- longest_prefix of 8,192 stored hashes (median);
- get: ``Store.get`` of one stored block (median over random blocks);
- reopen: opening the store again, and its first ``has`` calls until the copy is built;
- bytes on disk per block (the LMDB data file's allocated size).

Targets: ``has`` and ``longest_prefix`` <= 2 ms at every size.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_common import Row, median_seconds

from kvstore import Block, Geometry, Store, encode

TINY = Geometry(1, 1, 1, 8)
SIZES = (16_384, 131_072, 1_048_576)
QUERIES = 8192
PER_PUT = 4096
LIMIT = "<= 2 ms"


def _ms(fn: object, repeat: int) -> float:
    return median_seconds(fn, repeat) * 1e3  # type: ignore[arg-type]


def _put(store: Store, kv: np.ndarray, hashes: np.ndarray) -> None:
    store.put(encode(TINY, [Block(int(h), 1, kv) for h in hashes.tolist()]))


def _bench_size(root: Path, n: int, repeat: int) -> list[Row]:
    rng = np.random.default_rng(n)
    hashes = rng.integers(1, 2**63, n, dtype=np.uint64)
    kv = np.ones(TINY.kv_shape, dtype=np.float16)
    absent = rng.integers(2**63, 2**64 - 1, QUERIES // 2, dtype=np.uint64)
    queries = np.concatenate([rng.choice(hashes, QUERIES // 2, replace=False), absent])
    rng.shuffle(queries)
    chain = hashes[:QUERIES]
    path = root / f"scale-{n}"
    t0 = time.perf_counter()
    with Store(path, geometry=TINY, sync=False) as s:
        for start in range(0, n, PER_PUT):
            _put(s, kv, hashes[start : start + PER_PUT])
        put_rate = n / (time.perf_counter() - t0)
        while s._h.keys._copy is None:  # the copy is built after enough lookups
            s.has(queries)
        t_has = _ms(lambda: s.has(queries), repeat)
        assert sum(s.has(queries)) == QUERIES // 2
        t_lp = _ms(lambda: s.longest_prefix(chain), repeat)
        assert s.longest_prefix(chain) == QUERIES
        after = []
        for _ in range(max(5, repeat // 4)):
            _put(s, kv, rng.integers(2**62, 2**63, 32, dtype=np.uint64))
            t1 = time.perf_counter()
            s.has(queries)
            after.append(time.perf_counter() - t1)
        t_after = statistics.median(after) * 1e3
        picks = iter(rng.choice(hashes, 4 * repeat).tolist())
        t_get = median_seconds(lambda: s.get(next(picks)), repeat) * 1e6
    disk = os.stat(path / "data.mdb").st_blocks * 512
    t1 = time.perf_counter()
    s = Store(path)
    t_open = (time.perf_counter() - t1) * 1e3
    try:
        first = []
        while s._h.keys._copy is None:
            t1 = time.perf_counter()
            s.has(queries)
            first.append((time.perf_counter() - t1) * 1e3)
    finally:
        s.close()
    shutil.rmtree(path, ignore_errors=True)
    reopen = f"open {t_open:.1f} ms; has {first[0]:.1f} ms x {len(first) - 1} + {first[-1]:.1f} ms"
    return [
        Row(f"{n:,} blocks: put", f"{put_rate:,.0f} blocks/s"),
        Row(f"  has(), {QUERIES:,} hashes", f"{t_has:.3f} ms", target=LIMIT, ok=t_has <= 2),
        Row("  has(), first after a put", f"{t_after:.3f} ms", target=LIMIT, ok=t_after <= 2),
        Row(f"  longest_prefix(), {QUERIES:,}", f"{t_lp:.3f} ms", target=LIMIT, ok=t_lp <= 2),
        Row("  get(), one block", f"{t_get:.1f} us"),
        Row("  reopen (then has() until the copy is built)", reopen),
        Row("  bytes on disk per block", f"{disk / n:.0f} B (envelope {TINY.envelope_bytes(1)} B)"),
    ]


def scale_rows(quick: bool) -> list[Row]:
    """The scale curve (``--quick``: the two smaller sizes)."""
    base = Path(os.environ.get("TLKV_BENCH_DIR", tempfile.gettempdir()))
    root = Path(tempfile.mkdtemp(prefix="tlkv-bench-scale-", dir=base))
    try:
        rows: list[Row] = []
        for n in SIZES[:2] if quick else SIZES:
            rows += _bench_size(root, n, 20 if quick else 100)
        return rows
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(args: argparse.Namespace) -> list[Row]:
    return scale_rows(bool(args.quick))
