"""Store benchmarks: zero-copy view, durable put, put under scrub, has/longest_prefix, churn.

Geometry (16, 32, 8, 128) -- a 2 MiB v1 payload per block. Every ratio is against a
baseline measured in this same run, in temporary directories on the same filesystem
(``$TLKV_BENCH_DIR``, default the system temp directory):

- view: ``with store.reader() as r: r.view(h).kv`` against py-lmdb's own zero-copy
  ``txn.get(key)`` + ``np.frombuffer`` on the same environment.
- put: ``Store.put`` (sync, validation included, 64 blocks per put) against raw LMDB
  puts of the same single-block envelopes (sync, 64 per transaction), against a
  file-per-block store (write a temp file, fsync, rename), and against the same store
  with write-behind turned off (what it adds).
- preallocation: ``Store.put``, ``sync=False`` and durable, into a store keeping
  ``PREALLOCATE`` bytes of its data file allocated and page-cached ahead
  (``kvstore.store.prealloc``), against the same puts into a store that grows its file,
  interleaved: the median round and the slowest; and what opening with it takes (reading
  the first room). Like the other rows, this process does not keep freed memory: both
  sides fault LMDB's dirty pages in afresh for each put.
- finite: ``check_finite`` (NaN/Inf and v2 scales, run by every put unless
  ``allow_nonfinite``) against CRC-32C of the same envelope.
- scrub: ``Store.put`` latency while the background scrub (``kvstore.store.scrub``) re-checks
  a store of 2 MiB blocks at 64 MiB/s (``tlkv serve``'s default) and at 1 GiB/s, against
  the same puts into a twin store with no scrub (interleaved rounds, per-round ratios).
- churn: puts at capacity until 20x the capacity went through; the last window's put
  throughput against the first's.
- models: ``has``/``longest_prefix`` of 8,192 hashes in one model of a store holding 4
  models of 16,384 blocks each (the same hashes in every model), and ``view`` of a 2 MiB
  block in a model other than ``default`` against one in ``default`` (interleaved rounds).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import lmdb
import numpy as np
from bench_common import Row, best_seconds, gbps, median_seconds
from bench_scale import scale_rows

from kvstore import Block, Geometry, Store, crc32c, decode, encode, split
from kvstore.codec.envelope import check_finite

GEOMETRY = Geometry(16, 32, 8, 128)
SMALL_GEOMETRY = Geometry(16, 1, 1, 64)  # 4 KiB payloads: many blocks for has()
KEY = struct.Struct(">Q")
VIEW_ROUNDS = 7
PREALLOCATE = 1 << 30  # the preallocation row's room: 8 puts of 64 x 2 MiB


def _envelope(geometry: Geometry, kv: np.ndarray, first_hash: int, n: int) -> bytes:
    return encode(geometry, [Block(first_hash + i, geometry.block_tokens, kv) for i in range(n)])


def _median_us(fn: Callable[[], object], repeat: int) -> float:
    """Median wall time of one call, in microseconds."""
    return median_seconds(fn, repeat) * 1e6


def _bench_view(root: Path, kv: np.ndarray, repeat: int) -> list[Row]:
    rows = []
    with Store(root / "view", geometry=GEOMETRY, sync=False) as store:
        store.put(_envelope(GEOMETRY, kv, 1, 8))
        env, db = store._h.env.lmdb.env, store._h.dbs.blocks  # the same environment, raw py-lmdb
        keys = [KEY.pack(h) for h in range(1, 9)]
        hashes = list(range(1, 9))
        # Interleaved rounds (the machine is shared): each round times both; the ratio
        # reported is the median of the per-round ratios, the times their medians.
        raws, views = [], []
        with env.begin(buffers=True) as txn, store.reader() as r:
            get, view = txn.get, r.view
            for _ in range(VIEW_ROUNDS):
                raws.append(
                    _median_us(
                        lambda: [np.frombuffer(get(k, None, db), dtype=np.uint8) for k in keys],
                        repeat,
                    )
                    / len(keys)
                )
                views.append(_median_us(lambda: [view(h).kv for h in hashes], repeat) / len(keys))
        with store.reader() as r:
            t_enter = _median_us(
                lambda: store.reader().__enter__().__exit__(None, None, None), repeat
            )
    ratios = sorted(v / r_ for v, r_ in zip(views, raws))
    ratio = statistics.median(ratios)
    t_view, t_raw = statistics.median(views), statistics.median(raws)
    rows.append(
        Row(
            "reader().view(h).kv, 2 MiB block",
            f"{t_view:.2f} us",
            f"py-lmdb get + np.frombuffer {t_raw:.2f} us",
            ratio,
            "<= 1.5x and < 15 us",
            ratio <= 1.5 and t_view < 15,
        )
    )
    rows.append(
        Row(
            f"  (per-round ratios, {VIEW_ROUNDS} rounds)",
            f"{ratios[0]:.2f}-{ratios[-1]:.2f}x",
        )
    )
    rows.append(Row("  (opening + closing a reader)", f"{t_enter:.2f} us"))
    return rows


def _bench_put(root: Path, kv: np.ndarray, rounds: int, per_put: int) -> list[Row]:
    envelopes = [_envelope(GEOMETRY, kv, 1_000_000 * (r + 1), per_put) for r in range(rounds + 1)]
    singles = [split(e) for e in envelopes]
    nbytes = sum(len(s) for s in singles[0])
    raw_env = lmdb.open(
        str(root / "raw"),
        map_size=(rounds + 3) * nbytes * 2,
        max_dbs=2,
        sync=True,
        metasync=True,
        readahead=False,
    )
    raw_db = raw_env.open_db(b"blocks")
    files = root / "files"
    files.mkdir()
    t_ours, t_raw, t_files, t_plain = [], [], [], []
    with (
        Store(root / "put", geometry=GEOMETRY, sync=True) as store,
        Store(root / "plain", geometry=GEOMETRY, sync=True) as plain,
    ):
        plain._h.env.lmdb._write_behind.close()  # the same store without write-behind
        # Round 0 warms up (file creation, first map growth) and is not counted; the
        # four writers are interleaved so the disk's weather hits them alike.
        for r in range(rounds + 1):
            first = 1_000_000 * (r + 1)
            t0 = time.perf_counter()
            with raw_env.begin(write=True) as txn:
                for i, value in enumerate(singles[r]):
                    txn.put(KEY.pack(first + i), value, db=raw_db)
            t1 = time.perf_counter()
            result = store.put(envelopes[r])
            t2 = time.perf_counter()
            assert result.stored == per_put
            for i, value in enumerate(singles[r]):
                name = files / f"{first + i:016x}"
                tmp = name.with_suffix(".tmp")
                with open(tmp, "wb") as f:
                    f.write(value)
                    f.flush()
                    os.fsync(f.fileno())
                os.rename(tmp, name)
            dfd = os.open(files, os.O_RDONLY)
            os.fsync(dfd)
            os.close(dfd)
            t3 = time.perf_counter()
            assert plain.put(envelopes[r]).stored == per_put
            t4 = time.perf_counter()
            if r:
                t_raw.append(t1 - t0)
                t_ours.append(t2 - t1)
                t_files.append(t3 - t2)
                t_plain.append(t4 - t3)
    raw_env.close()
    ours, raw, fpb, off = (nbytes / statistics.median(t) for t in (t_ours, t_raw, t_files, t_plain))
    # Ratios: the median of the per-round ratios (each round's runs are adjacent).
    vs_raw = statistics.median(r / o for o, r in zip(t_ours, t_raw))
    vs_files = statistics.median(f / o for o, f in zip(t_ours, t_files))
    vs_off = statistics.median(p / o for o, p in zip(t_ours, t_plain))
    return [
        Row(
            f"put sync, {per_put} x 2 MiB per put (median of {rounds})",
            gbps(nbytes, nbytes / ours),
            f"raw LMDB sync put {gbps(nbytes, nbytes / raw)}",
            vs_raw,
            ">= 0.8x",
            vs_raw >= 0.8,
        ),
        Row(
            "  same put vs file-per-block",
            gbps(nbytes, nbytes / ours),
            f"tmp+fsync+rename {gbps(nbytes, nbytes / fpb)}",
            vs_files,
            ">= 1x",
            vs_files >= 1,
        ),
        Row(
            "  same put vs the store without write-behind",
            gbps(nbytes, nbytes / ours),
            f"write-behind off {gbps(nbytes, nbytes / off)}",
            vs_off,
        ),
    ]


def _bench_prealloc(root: Path, kv: np.ndarray, rounds: int, per_put: int, sync: bool) -> list[Row]:
    """Puts into a store keeping ``PREALLOCATE`` ahead against the same puts into one
    without, interleaved (each going first in turn), after one untimed round."""
    first = 5_000_000 if sync else 6_000_000
    envelopes = [_envelope(GEOMETRY, kv, first * (r + 1), per_put) for r in range(rounds + 1)]
    nbytes = len(envelopes[0])
    mode = "sync" if sync else "sync=False"
    t0 = time.perf_counter()
    ahead = Store(
        root / f"prealloc-{mode}", geometry=GEOMETRY, sync=sync, preallocate_bytes=PREALLOCATE
    )
    t_open = time.perf_counter() - t0
    t_pre: list[float] = []
    t_grow: list[float] = []
    with ahead, Store(root / f"grow-{mode}", geometry=GEOMETRY, sync=sync) as grow:
        for r in range(rounds + 1):
            order = [(ahead, t_pre), (grow, t_grow)]
            for store, times in order if r % 2 else order[::-1]:
                t1 = time.perf_counter()
                assert store.put(envelopes[r]).stored == per_put
                if r:
                    times.append(time.perf_counter() - t1)
    ratios = sorted(g / p for p, g in zip(t_pre, t_grow))
    worst = max(t_grow) / max(t_pre)
    return [
        Row(
            f"put {mode}, {per_put} x 2 MiB, {PREALLOCATE >> 20} MiB preallocated "
            f"(median of {rounds}; rounds {ratios[0]:.2f}-{ratios[-1]:.2f}x)",
            gbps(nbytes, statistics.median(t_pre)),
            f"the same store growing {gbps(nbytes, statistics.median(t_grow))}",
            statistics.median(ratios),
        ),
        Row(
            "  the slowest round of each",
            f"{1e3 * max(t_pre):.0f} ms",
            f"growing {1e3 * max(t_grow):.0f} ms",
            worst,
        ),
        Row(f"  (opening with {PREALLOCATE >> 20} MiB preallocated)", f"{t_open:.2f} s"),
    ]


def _bench_lookup(root: Path, n_stored: int, repeat: int) -> list[Row]:
    kv = np.ones(SMALL_GEOMETRY.kv_shape, dtype=np.float16)
    rows = []
    with Store(root / "lookup", geometry=SMALL_GEOMETRY, sync=False) as store:
        for start in range(1, n_stored + 1, 4096):
            store.put(_envelope(SMALL_GEOMETRY, kv, start, min(4096, n_stored + 1 - start)))
        present = list(range(1, 8193))
        mixed = np.arange(n_stored - 4095, n_stored + 4097, dtype=np.uint64)  # half present
        t_has = _median_us(lambda: store.has(mixed), repeat) / 1e3
        t_lp = _median_us(lambda: store.longest_prefix(present), repeat) / 1e3
        assert store.longest_prefix(present) == 8192 and sum(store.has(mixed)) == 4096

        cold = []
        for _ in range(max(5, repeat // 10)):
            store.delete(n_stored)  # any write changes the snapshot: the key set is re-read
            t0 = time.perf_counter()
            store.has(mixed)
            cold.append(time.perf_counter() - t0)
            store.put(_envelope(SMALL_GEOMETRY, kv, n_stored, 1))
        t_cold = statistics.median(cold) * 1e3
    rows.append(
        Row(
            f"has(), 8,192 hashes ({n_stored:,} stored)",
            f"{t_has:.3f} ms",
            "",
            None,
            "<= 2 ms",
            t_has <= 2,
        )
    )
    rows.append(
        Row("longest_prefix(), 8,192 present", f"{t_lp:.3f} ms", "", None, "<= 2 ms", t_lp <= 2)
    )
    rows.append(
        Row(
            "  has(), first call after a write",
            f"{t_cold:.3f} ms",
            "",
            None,
            "<= 2 ms",
            t_cold <= 2,
        )
    )
    return rows


def _bench_churn(root: Path, kv: np.ndarray, capacity: int, turnover: int, per_put: int) -> Row:
    single = GEOMETRY.envelope_bytes(1)
    total_puts = -(-turnover * capacity // (single * per_put))
    windows = 10
    per_window = max(1, total_puts // windows)
    rates = []
    with Store(root / "churn", geometry=GEOMETRY, capacity_bytes=capacity, sync=True) as store:
        h = 1
        for _w in range(windows):
            elapsed = 0.0
            for _ in range(per_window):
                envelope = _envelope(GEOMETRY, kv, h, per_put)
                h += per_put
                t0 = time.perf_counter()
                store.put(envelope)
                elapsed += time.perf_counter() - t0
            rates.append(per_window * per_put * single / elapsed)
        stats = store.stats()
    assert stats["bytes"] <= capacity
    ratio = rates[-1] / rates[0]
    gib = capacity / 2**30
    return Row(
        f"churn at capacity {gib:g} GiB, {turnover}x turnover ({stats['evictions']:,} evictions)",
        f"last window {rates[-1] / 1e9:.2f} GB/s",
        f"first window {rates[0] / 1e9:.2f} GB/s",
        ratio,
        ">= 0.5x",
        ratio >= 0.5,
    )


def _bench_finite(kv: np.ndarray, repeat: int) -> list[Row]:
    """The finiteness check every put, sequence and restore runs (``check_finite``)
    against the CRC-32C of the same bytes, which every put computes anyway."""
    rows = []
    for version in (1, 2):
        blocks = [Block(i + 1, GEOMETRY.block_tokens, kv) for i in range(16)]
        data = encode(GEOMETRY, blocks, version)
        env = decode(data, verify_crc=False)
        t_check = best_seconds(lambda env=env: check_finite(env), repeat)
        t_crc = best_seconds(lambda data=data: crc32c(data), repeat)
        rows.append(
            Row(
                f"check_finite, 16 blocks v{version} ({len(data) >> 20} MiB)",
                gbps(len(data), t_check),
                f"CRC-32C {gbps(len(data), t_crc)}",
                t_crc / t_check,
            )
        )
    return rows


MODEL_IDS = ("default", "org/a@1", "org/b@2", "org/c:3")


def _bench_models(root: Path, n_stored: int, kv: np.ndarray, repeat: int) -> list[Row]:
    small = np.ones(SMALL_GEOMETRY.kv_shape, dtype=np.float16)
    with Store(root / "models", sync=False) as store:
        for model in MODEL_IDS:  # the same hashes in every model
            handle = store.model(model)
            for start in range(1, n_stored + 1, 4096):
                n = min(4096, n_stored + 1 - start)
                handle.put(_envelope(SMALL_GEOMETRY, small, start, n))
        m = store.model(MODEL_IDS[2])
        present = list(range(1, 8193))
        mixed = np.arange(n_stored - 4095, n_stored + 4097, dtype=np.uint64)
        t_has = _median_us(lambda: m.has(mixed), repeat) / 1e3
        t_lp = _median_us(lambda: m.longest_prefix(present), repeat) / 1e3
        assert m.longest_prefix(present) == 8192 and sum(m.has(mixed)) == 4096
    rows = [
        Row(
            f"has(), 8,192 hashes, in 1 of 4 models x {n_stored:,}",
            f"{t_has:.3f} ms",
            "",
            None,
            "<= 2 ms",
            t_has <= 2,
        ),
        Row(
            "longest_prefix(), 8,192 present, same store",
            f"{t_lp:.3f} ms",
            "",
            None,
            "<= 2 ms",
            t_lp <= 2,
        ),
    ]
    with Store(root / "models-view", sync=False) as store:
        hashes = list(range(1, 9))
        for model in MODEL_IDS:
            store.model(model).put(_envelope(GEOMETRY, kv, 1, 8))
        plain, other = [], []
        with store.reader() as r0, store.model(MODEL_IDS[3]).reader() as r1:
            v0, v1 = r0.view, r1.view
            for _ in range(VIEW_ROUNDS):
                plain.append(_median_us(lambda: [v0(h).kv for h in hashes], repeat) / 8)
                other.append(_median_us(lambda: [v1(h).kv for h in hashes], repeat) / 8)
    ratios = sorted(o / p for o, p in zip(other, plain))
    ratio = statistics.median(ratios)
    rows.append(
        Row(
            "view(h).kv in a model, 2 MiB block",
            f"{statistics.median(other):.2f} us",
            f"in default {statistics.median(plain):.2f} us",
            ratio,
            "unchanged (noise)",
            ratio <= 1.25,
        )
    )
    rows.append(
        Row(f"  (per-round ratios, {VIEW_ROUNDS} rounds)", f"{ratios[0]:.2f}-{ratios[-1]:.2f}x")
    )
    return rows


def _bench_scrub(root: Path, kv: np.ndarray, stored: int, rounds: int, per_put: int) -> list[Row]:
    from kvstore.store.scrub import Scrubber

    rows = []
    for rate in (64 << 20, 1 << 30):
        scrubbed_path, plain_path = root / f"scrubbed-{rate}", root / f"plain-{rate}"
        with (
            Store(scrubbed_path, geometry=GEOMETRY) as scrubbed,
            Store(plain_path, geometry=GEOMETRY) as plain,
        ):
            fill = _envelope(GEOMETRY, kv, 1, stored)  # what the scrub re-checks
            scrubbed.put(fill)
            plain.put(fill)
            checked = [0]

            def count(
                blocks: int, nbytes: int, found: int, repaired: int, c: list = checked
            ) -> None:
                c[0] += nbytes

            scrubber = Scrubber(scrubbed, rate=rate, period=1e-3, on_batch=count)
            t_on, t_off = [], []
            t_start = time.perf_counter()
            try:
                for r in range(rounds + 1):  # round 0 warms up
                    env = _envelope(GEOMETRY, kv, 1_000_000 * (r + 1), per_put)
                    # Alternate which store goes first: the second put of a round pays
                    # for the first one's writeback.
                    order = (scrubbed, plain) if r % 2 else (plain, scrubbed)
                    took = {}
                    for store in order:
                        t0 = time.perf_counter()
                        store.put(env)
                        took[store is scrubbed] = time.perf_counter() - t0
                    if r:
                        t_on.append(took[True])
                        t_off.append(took[False])
            finally:
                scrubber.stop()
                elapsed = time.perf_counter() - t_start
        ratio = statistics.median(off / on for on, off in zip(t_on, t_off))
        rows.append(
            Row(
                f"put sync, {per_put} x 2 MiB, scrub limited to {rate >> 20} MiB/s "
                f"(it read {checked[0] >> 20} MiB in {elapsed:.1f} s; median of {rounds})",
                f"{statistics.median(t_on) * 1e3:.1f} ms",
                f"no scrub {statistics.median(t_off) * 1e3:.1f} ms",
                ratio,
                ">= 0.9x" if rate == 64 << 20 else "",
                ratio >= 0.9 if rate == 64 << 20 else None,
            )
        )
    return rows


def run(args: argparse.Namespace) -> list[Row]:
    quick = bool(args.quick)
    base = Path(os.environ.get("TLKV_BENCH_DIR", tempfile.gettempdir()))
    root = Path(tempfile.mkdtemp(prefix="tlkv-bench-store-", dir=base))
    rng = np.random.default_rng(0)
    kv = rng.standard_normal(GEOMETRY.kv_shape).astype(np.float16)
    try:
        rows = _bench_view(root, kv, 200 if quick else 2000)
        rows += _bench_finite(kv, 3 if quick else 20)
        rows += _bench_put(root, kv, 2 if quick else 9, 16 if quick else 64)
        for sync in (False, True):
            rows += _bench_prealloc(root, kv, 2 if quick else 9, 16 if quick else 64, sync)
        rows += _bench_scrub(root, kv, 32, 8 if quick else 16, 16)
        rows += _bench_lookup(root, 16_384, 20 if quick else 200)
        rows += _bench_models(root, 16_384, kv, 20 if quick else 200)
        capacity = (256 << 20) if quick else (2 << 30)
        turnover = 5 if quick else 20
        free = shutil.disk_usage(root).free
        while capacity > (64 << 20) and free < 3 * capacity + (1 << 30):
            capacity //= 2  # not enough disk: a smaller churn, named in the row
        rows.append(_bench_churn(root, kv, capacity, turnover, 16 if quick else 64))
        rows += scale_rows(quick)  # bench_scale: 16k, 131k and 1M blocks
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows
