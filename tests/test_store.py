"""The LMDB block store: puts, reads, zero-copy views, sequences, capacity/LRU/pins,
corruption, persistence, map growth, disk full, fork and multi-process use.

Every test runs a real LMDB environment under ``tmp_path``.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import lmdb
import numpy as np
import pytest
from conftest import SMALL, make_blocks, make_envelope

import kvstore.store.diskformat as L
import kvstore.store.keyset as keyset_module
import kvstore.store.lmdbenv as lmdbenv_module
import kvstore.store.state as state_module
import kvstore.store.writetxn as writetxn_module
from kvstore import (
    Block,
    BlockView,
    ChecksumError,
    FormatError,
    Geometry,
    PutReport,
    PutResult,
    ShapeError,
    Store,
    StoreError,
    StoreFullError,
    UnsupportedVersionError,
    chain_hashes,
    crc32c,
    decode,
    encode,
    join,
    split,
    transcode,
)
from kvstore.codec.crcmath import crc_combine, crc_shift
from kvstore.codec.layout import HEADER_SIZE, RECORD_SIZE, TRAILER_SIZE
from kvstore.errors import BadMagicError, PinnedError, TruncatedError, ViewClosedError
from kvstore.store.debug import lmdb_flags, pending_hits, raw_snapshot

REPO = Path(__file__).resolve().parent.parent
SINGLE = SMALL.envelope_bytes(1)  # bytes of one stored SMALL v1 block


def full_blocks(geometry: Geometry, n: int, seed: int) -> list[Block]:
    """``n`` full blocks of one chain (random tokens and KV)."""
    return make_blocks(geometry, n * geometry.block_tokens, seed)


def one_block_envelopes(n: int, seed: int = 0, geometry: Geometry = SMALL) -> list[bytes]:
    """``n`` single-block envelopes of distinct blocks."""
    return [encode(geometry, [b]) for b in full_blocks(geometry, n, seed)]


def hashes_of(envelope: bytes) -> list[int]:
    return list(decode(envelope).hashes.tolist())


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(tmp_path / "store") as s:
        yield s


def check_consistency(s: Store) -> None:
    """Every on-disk invariant: block index, byte count, pins, LRU order."""
    with raw_snapshot(s) as (txn, dbs):
        blocks = {bytes(k): len(v) for k, v in txn.cursor(db=dbs.blocks)}
        seqs = {bytes(k): bytes(v) for k, v in txn.cursor(db=dbs.seqs)}
        refs = {bytes(k): L.REFCOUNT.unpack(v)[0] for k, v in txn.cursor(db=dbs.refs)}
        atime = {bytes(k): bytes(v) for k, v in txn.cursor(db=dbs.atime)}
        lru = [bytes(k) for k in txn.cursor(db=dbs.lru).iternext(values=False)]
        meta_bytes = L.counter(txn.get(L.META_BYTES, None, dbs.meta))
        cur = txn.cursor(db=dbs.index)
        dups = list(cur.iternext_dup(keys=False)) if cur.set_key(L.INDEX_KEY) else []
        index = sorted(L.INDEX_VALUE.unpack(v)[0] for v in dups)
    assert index == sorted(L.BLOCK_KEY.unpack(k)[0] for k in blocks)
    assert meta_bytes == sum(blocks.values()) + sum(len(v) for v in seqs.values())
    want: dict[bytes, int] = {}
    for raw in seqs.values():
        parsed = L.parse_sequence(raw, s.geometry)
        assert parsed is not None
        for h in parsed.referenced():
            want[L.BLOCK_KEY.pack(h)] = want.get(L.BLOCK_KEY.pack(h), 0) + 1
    assert refs == want
    unpinned = {k for k in blocks if k not in refs}
    assert set(atime) == unpinned
    lru_pairs = [L.LRU_KEY.unpack(k) for k in lru]
    assert sorted(lru_pairs) == sorted(
        (L.COUNTER.unpack(v)[0], L.BLOCK_KEY.unpack(k)[0]) for k, v in atime.items()
    )


# --- helpers of the module -------------------------------------------------------------


def test_crc_combine_matches_crc_of_concatenation() -> None:
    rng = np.random.default_rng(1)
    for n1, n2 in [(0, 0), (1, 0), (0, 7), (28, 4108), (300, 1 << 16)]:
        a = rng.integers(0, 256, n1, dtype=np.uint8).tobytes()
        b = rng.integers(0, 256, n2, dtype=np.uint8).tobytes()
        assert crc_combine(crc32c(a), crc32c(b), n2) == crc32c(a + b)
    assert crc_shift(5) is crc_shift(5)


# --- opening --------------------------------------------------------------------------


def test_new_store_adopts_the_geometry_of_the_first_put(tmp_path: Path) -> None:
    with Store(tmp_path / "s") as s:
        assert s.geometry is None
        s.put(make_envelope())
        assert s.geometry == SMALL
        with pytest.raises(ShapeError):
            s.put(make_envelope(Geometry(4, 2, 2, 16)))
    with Store(tmp_path / "s") as s:
        assert s.geometry == SMALL
    with pytest.raises(ShapeError):
        Store(tmp_path / "s", geometry=Geometry(4, 2, 2, 16))


def test_geometry_given_at_creation_is_recorded(tmp_path: Path) -> None:
    g = Geometry(2, 1, 1, 2)
    Store(tmp_path / "s", geometry=g).close()
    with Store(tmp_path / "s") as s:
        assert s.geometry == g
        with pytest.raises(ShapeError):
            s.put(make_envelope())


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"capacity_bytes": 0}, ValueError),
        ({"capacity_bytes": -5}, ValueError),
        ({"capacity_bytes": 1.5}, TypeError),
        ({"capacity_bytes": True}, TypeError),
        ({"geometry": (4, 2, 2, 8)}, TypeError),
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict, error: type[Exception]) -> None:
    with pytest.raises(error):
        Store(tmp_path / "s", **kwargs)


def test_a_file_that_is_not_a_store(tmp_path: Path) -> None:
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "data.mdb").write_bytes(b"not an lmdb file" * 512)
    with pytest.raises(StoreError):
        Store(tmp_path / "s")


def test_another_store_format_is_refused(tmp_path: Path) -> None:
    Store(tmp_path / "s").close()
    env = lmdb.open(str(tmp_path / "s"), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.put(L.META_FORMAT, L.META_FORMAT_VALUE.pack(99), db=env.open_db(L.DB_META, txn=txn))
    env.close()
    with pytest.raises(StoreError, match="format 99"):
        Store(tmp_path / "s")


def test_closed_store_refuses_and_close_is_idempotent(tmp_path: Path) -> None:
    s = Store(tmp_path / "s")
    s.close()
    s.close()
    with pytest.raises(StoreError, match="closed"):
        s.get(1)
    with pytest.raises(StoreError, match="closed"):
        s.reader()


# --- put / get ------------------------------------------------------------------------


def test_put_stores_verbatim_single_block_envelopes(store: Store, buffer_type: type) -> None:
    envelope = make_envelope(SMALL, 14, seed=3)  # 3 full blocks + a partial tail
    result = store.put(buffer_type(envelope))
    assert result == PutResult(stored=3, duplicate=0, partial=1)
    parts = split(envelope)
    for h, part in zip(hashes_of(envelope), parts):
        if h:
            got = store.get(h)
            assert got == part and isinstance(got, bytes)
    assert store.put(envelope) == PutResult(stored=0, duplicate=3, partial=1)
    check_consistency(store)


def test_first_version_put_wins_and_get_transcodes(store: Store) -> None:
    envelope = make_envelope(SMALL, 8, seed=4)
    v2 = transcode(envelope, 2)
    store.put(envelope)
    assert store.put(v2) == PutResult(0, 2, 0)
    h = hashes_of(envelope)[0]
    assert store.get(h) == split(envelope)[0]
    assert store.get(h, version=1) == split(envelope)[0]
    assert store.get(h, version=2) == split(v2)[0]
    with pytest.raises(UnsupportedVersionError):
        store.get(h, version=3)


def test_a_multi_block_envelope_with_one_hash_twice(store: Store) -> None:
    blocks = full_blocks(SMALL, 2, seed=5)
    envelope = encode(SMALL, [blocks[0], blocks[1], blocks[0]])
    assert store.put(envelope) == PutResult(stored=2, duplicate=1, partial=0)
    assert store.stats()["blocks"] == 2


def test_put_report_names_the_hashes_in_envelope_order(store: Store) -> None:
    blocks = full_blocks(SMALL, 3, seed=6)
    a, b, c = (blk.hash for blk in blocks)
    store.put(encode(SMALL, [blocks[1]]))
    report = store.put_report(encode(SMALL, [blocks[0], blocks[1], blocks[2], blocks[0]]))
    assert report == PutReport(stored=[a, c], duplicate=[b, a], partial=0)
    assert report.counts() == PutResult(2, 2, 0)
    tail = make_envelope(SMALL, 5, seed=7)  # one full block and a partial tail
    (h,) = [x for x in hashes_of(tail) if x]
    assert store.put_report(tail) == PutReport(stored=[h], duplicate=[], partial=1)


def test_zero_block_envelope(store: Store) -> None:
    assert store.put(encode(SMALL, [])) == PutResult(0, 0, 0)
    assert store.geometry == SMALL


def _corrupt(envelope: bytes, offset: int) -> bytes:
    data = bytearray(envelope)
    data[offset] ^= 0x40
    return bytes(data)


BAD_ENVELOPES = [
    ("crc of a multi-block envelope", lambda e: _corrupt(e, len(e) - 100), ChecksumError),
    ("crc trailer", lambda e: _corrupt(e, len(e) - 1), ChecksumError),
    ("magic", lambda e: b"XLKV" + e[4:], BadMagicError),
    ("truncated", lambda e: e[:-1], TruncatedError),
    ("version 3", lambda e: e[:4] + b"\x03" + e[5:], UnsupportedVersionError),
    ("not a buffer", lambda e: 12345, TypeError),
]


@pytest.mark.parametrize("pipelined", [False, True], ids=["serial", "pipelined"])
@pytest.mark.parametrize(
    ("name", "mangle", "error"), BAD_ENVELOPES, ids=[b[0] for b in BAD_ENVELOPES]
)
def test_a_rejected_envelope_changes_nothing(
    store: Store, monkeypatch: pytest.MonkeyPatch, name: str, mangle, error: type, pipelined: bool
) -> None:
    if pipelined:
        monkeypatch.setattr(writetxn_module, "PIPELINE_MIN_RECORD", 0)
    store.put(make_envelope(SMALL, 4, seed=9))
    before = store.stats()
    envelope = make_envelope(SMALL, 16, seed=10)
    with pytest.raises(error):
        store.put(mangle(envelope))
    assert store.stats() == before
    assert store.has(hashes_of(envelope)) == [False] * 4
    check_consistency(store)


def test_single_block_with_bad_crc_is_rejected(store: Store) -> None:
    (envelope,) = one_block_envelopes(1, seed=11)
    with pytest.raises(ChecksumError):
        store.put(_corrupt(envelope, HEADER_SIZE + 20))
    assert store.stats()["blocks"] == 0


def test_the_pipelined_and_serial_writers_store_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    envelope = make_envelope(SMALL, 30, seed=12)
    got = []
    for limit in (1 << 40, 0):
        monkeypatch.setattr(writetxn_module, "PIPELINE_MIN_RECORD", limit)
        with Store(tmp_path / f"s{limit}") as s:
            s.put(envelope)
            got.append(s.get_many(hashes_of(envelope)[:-1]))
    assert got[0] == got[1] == split(envelope)[:-1]


def test_get_misses_and_bad_hashes(store: Store) -> None:
    assert store.get(123) is None
    assert store.get(0) is None
    for bad in (-1, 1 << 64):
        with pytest.raises(ValueError):
            store.get(bad)
    with pytest.raises(TypeError):
        store.get("12")  # type: ignore[arg-type]
    stats = store.stats()
    assert (stats["hits"], stats["misses"]) == (0, 2)


def test_get_many(store: Store) -> None:
    envelope = make_envelope(SMALL, 12, seed=13)
    store.put(envelope)
    hashes = hashes_of(envelope)
    assert store.get_many([hashes[1], 99, hashes[0]]) == [
        split(envelope)[1],
        None,
        split(envelope)[0],
    ]
    assert store.get_many(np.array(hashes, dtype=np.uint64)) == split(envelope)


# --- has / longest_prefix -------------------------------------------------------------


@pytest.mark.parametrize("scan", [True, False], ids=["key-set", "per-key"])
def test_has_and_longest_prefix(store: Store, monkeypatch: pytest.MonkeyPatch, scan: bool) -> None:
    monkeypatch.setattr(keyset_module, "SCAN_PER_LOOKUP", 1 << 30 if scan else 0)
    blocks = full_blocks(SMALL, 6, seed=14)
    chain = [b.hash for b in blocks]
    store.put(encode(SMALL, blocks[:4]))
    store.put(encode(SMALL, blocks[5:]))  # a gap at 4
    big = (1 << 64) - 1
    assert store.has([*chain, 0, big]) == [True] * 4 + [False, True, False, False]
    assert store.has(np.array(chain, dtype=np.uint64)) == [True] * 4 + [False, True]
    assert store.has(np.array([5, 6], dtype=np.int64)) == [False, False]
    assert store.has(h for h in chain[:2]) == [True, True]
    assert store.has([]) == []
    assert store.longest_prefix(chain) == 4
    assert store.longest_prefix(np.array(chain, dtype=np.uint64)) == 4
    assert store.longest_prefix(chain[:3]) == 3
    assert store.longest_prefix([7, *chain]) == 0
    assert store.longest_prefix([]) == 0
    for bad in ([-1], [1 << 64], np.array([-1]), np.array([1.5]), np.zeros((2, 2), np.uint64)):
        with pytest.raises(ValueError):
            store.has(bad)
    store.delete(chain[0])
    assert store.longest_prefix(chain) == 0  # the key set follows every write


def test_has_of_many_hashes_uses_one_snapshot_copy(store: Store) -> None:
    envelope = encode(SMALL, full_blocks(SMALL, 64, seed=15))
    store.put(envelope)
    hashes = np.array(hashes_of(envelope), dtype=np.uint64)
    queries = np.concatenate([hashes, hashes + 1])
    expected = [True] * 64 + [bool(np.isin(h, hashes)) for h in (hashes + 1)]
    assert store.has(queries) == expected
    assert store._h.keys._cached is not None
    assert store.longest_prefix(queries) == 64


# --- delete --------------------------------------------------------------------------


def test_delete(store: Store) -> None:
    envelope = make_envelope(SMALL, 8, seed=16)
    store.put(envelope)
    h0, h1 = hashes_of(envelope)
    assert store.delete(h0) is True
    assert store.delete(h0) is False
    assert store.get(h0) is None and store.get(h1) is not None
    assert store.stats()["bytes"] == SINGLE
    check_consistency(store)


# --- readers and zero-copy views -------------------------------------------------------


def test_view_is_a_zero_copy_read_only_blockview(store: Store) -> None:
    envelope = make_envelope(SMALL, 8, seed=17)
    store.put(envelope)
    h = hashes_of(envelope)[1]
    expected = decode(envelope)[1]
    with store.reader() as r:
        bv = r.view(h)
        assert isinstance(bv, BlockView)
        assert (bv.hash, bv.n_tokens, bv.version, bv.geometry) == (h, 4, 1, SMALL)
        assert np.array_equal(bv.kv, expected.kv) and bv.kv.dtype == np.float16
        assert np.array_equal(bv.k, expected.k) and np.array_equal(bv.v, expected.v)
        assert bytes(bv.raw) == bytes(expected.raw)
        assert not bv.kv.flags.writeable
        with pytest.raises(ValueError):
            bv.kv[0, 0, 0, 0, 0] = 1
        # No copy: the array's memory is inside the stored envelope's LMDB buffer.
        raw = np.frombuffer(r.envelope(h), dtype=np.uint8)
        assert bv.kv.__array_interface__["data"][0] == raw.__array_interface__["data"][0] + 40
        checked = r.view(h, verify=True)
        assert np.array_equal(checked.kv, bv.kv)
        assert r.view(999) is None and r.view(999, verify=True) is None
        assert r.envelope(999) is None
        for bad in (-1, 1 << 64):
            with pytest.raises(ValueError):
                r.view(bad)
            with pytest.raises(ValueError):
                r.envelope(bad)
        envelope_view = r.envelope(h)
        assert bytes(envelope_view) == split(envelope)[1] and envelope_view.readonly
    for use in (lambda: bv.kv, lambda: bv.k, lambda: bv.raw, lambda: bv.hash, lambda: checked.kv):
        with pytest.raises(ViewClosedError):
            use()
    assert "closed" in repr(bv)
    with pytest.raises(ValueError):  # released
        bytes(envelope_view)
    for use_reader in (lambda: r.view(h), lambda: r.envelope(h), lambda: list(r.iter_blocks())):
        with pytest.raises(ViewClosedError):
            use_reader()
    with pytest.raises(StoreError):
        r.__enter__()


def test_a_view_kept_past_its_reader_pins_nothing(store: Store) -> None:
    envelope = make_envelope(SMALL, 8, seed=19)
    store.put(envelope)
    h = hashes_of(envelope)[0]
    with store.reader() as r:
        bv = r.view(h)
        checked = r.view(h, verify=True)
        assert bv.kv.sum() == checked.kv.sum() and len(bv.raw) and bv.scales is None
    assert store.lingering_snapshots() == 0  # the views themselves hold no stored memory
    with pytest.raises(ViewClosedError):
        bv.kv  # noqa: B018


def test_arrays_kept_past_the_reader_never_see_reused_pages(store: Store) -> None:
    """An array taken from a view cannot be revoked: the reader's snapshot stays open
    while it lives, so deleting the block and churning the store never changes it."""
    envelope = make_envelope(SMALL, 8, seed=20)
    store.put(envelope)
    h = hashes_of(envelope)[0]
    with store.reader() as r:
        bv = r.view(h)
        kv, k = bv.kv, bv.k  # numpy views into LMDB's map
        raw = bv.raw[4:20]  # a slice of a memoryview
        whole = np.frombuffer(r.envelope(h), np.uint8)
        expected = (kv.copy(), k.copy(), bytes(raw), whole.tobytes())
    assert store.lingering_snapshots() == 1
    assert store.delete(h)
    for seed in range(5):  # churn: freed pages would be reused by these writes
        store.put(encode(SMALL, full_blocks(SMALL, 64, seed=100 + seed)))
    assert np.array_equal(kv, expected[0]) and np.array_equal(k, expected[1])
    assert bytes(raw) == expected[2] and whole.tobytes() == expected[3]
    del bv, kv, k, raw, whole
    store.put(encode(SMALL, full_blocks(SMALL, 1, seed=200)))  # a write reaps
    assert store.lingering_snapshots() == 0


def _run_isolated(script: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a fresh interpreter (a crash there fails the test, not pytest)."""
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])},
    )
    assert out.returncode == 0, out.stderr  # a segfault would be -11
    return out


def test_remapping_under_an_escaped_array_is_refused_not_a_crash(tmp_path: Path) -> None:
    """Growing the map moves it: with an array from a closed reader still alive, the
    store refuses (StoreError) instead of unmapping memory under it (a segfault)."""
    script = textwrap.dedent(
        f"""
        import numpy as np
        from kvstore import Geometry, Store, StoreError, encode
        from conftest import make_blocks

        g = Geometry(16, 4, 2, 64)
        with Store({str(tmp_path / "s")!r}, map_bytes=1 << 20) as s:
            first = make_blocks(g, 32, seed=1)
            s.put(encode(g, first))
            with s.reader() as r:
                kv = r.view(first[0].hash).kv
            expected = kv.copy()
            try:
                for i in range(8):  # 4 MiB into a 1 MiB map
                    s.put(encode(g, make_blocks(g, 16 * 32, seed=10 + i)))
                print("grew")
            except StoreError as exc:
                print("refused", "zero-copy" in str(exc))
            print("intact", bool(np.array_equal(kv, expected)))
            del kv
            s.put(encode(g, make_blocks(g, 16 * 32, seed=50)))
            print("grows after", s.map_bytes > 1 << 20)
        """
    )
    out = _run_isolated(script)
    assert out.stdout.split("\n")[:3] == ["refused True", "intact True", "grows after True"]


def test_closing_with_an_escaped_array_keeps_the_map(tmp_path: Path) -> None:
    """Closing would unmap what the array points into: the environment stays mapped."""
    script = textwrap.dedent(
        f"""
        import numpy as np
        from kvstore import Store, encode
        from conftest import SMALL, make_blocks

        s = Store({str(tmp_path / "s")!r})
        blocks = make_blocks(SMALL, 16, seed=21)
        s.put(encode(SMALL, blocks))
        with s.reader() as r:
            kv = r.view(blocks[0].hash).kv
        expected = kv.copy()
        s.close()
        print("intact", bool(np.array_equal(kv, expected)))
        """
    )
    out = _run_isolated(script)
    assert out.stdout.strip() == "intact True"
    assert "stays mapped" in out.stderr


def test_v2_views_have_codes_and_scales(store: Store) -> None:
    envelope = make_envelope(SMALL, 4, version=2, seed=18)
    store.put(envelope)
    (h,) = hashes_of(envelope)
    with store.reader() as r:
        bv = r.view(np.uint64(h))
        assert bv.kv.dtype == np.uint8 and bv.scales is not None
        assert np.array_equal(bv.to_float32(), decode(envelope)[0].to_float32())


def test_view_latency_does_not_grow_with_block_size(tmp_path: Path) -> None:
    """A view of a 2 MiB block costs about what a tiny one does, far less than a copy."""
    big_geometry = Geometry(16, 32, 8, 128)  # 2 MiB v1 payload
    latency = {}
    for name, g in (("tiny", SMALL), ("big", big_geometry)):
        kv = np.ones(g.kv_shape, dtype=np.float16)
        with Store(tmp_path / name, sync=False) as s:
            s.put(encode(g, [Block(7, g.block_tokens, kv)]))
            with s.reader() as r:
                times = []
                for _ in range(2000):
                    t0 = time.perf_counter()
                    _ = r.view(7).kv
                    times.append(time.perf_counter() - t0)
                latency[name] = statistics.median(times)
                value = r.envelope(7)
                copies = []
                for _ in range(50):
                    t0 = time.perf_counter()
                    bytes(value)
                    copies.append(time.perf_counter() - t0)
                copy = statistics.median(copies)
    # py-lmdb touches one byte per 4 KiB page of a value (~10 ns each), nothing more.
    assert latency["big"] < 10 * latency["tiny"] + 20e-6, latency
    assert latency["big"] < copy / 5, (latency, copy)


def test_iter_blocks_and_sequences(store: Store) -> None:
    envelope = make_envelope(SMALL, 10, seed=19)
    store.put(envelope)
    store.put_sequence("b", envelope)
    store.put_sequence("a", make_envelope(SMALL, 3, seed=20))
    with store.reader() as r:
        blocks = list(r.iter_blocks())
        assert [h for h, _ in blocks] == sorted(h for h in hashes_of(envelope) if h)
        assert [bytes(v) for _, v in blocks] == [
            split(envelope)[hashes_of(envelope).index(h)] for h, _ in blocks
        ]
        assert list(r.iter_sequences()) == [
            ("a", store.get_sequence("a")),
            ("b", envelope),
        ]
        records = list(r.iter_sequence_records())
    a_tail = split(make_envelope(SMALL, 3, seed=20))[0]
    assert records == [("a", [], a_tail), ("b", hashes_of(envelope)[:2], split(envelope)[2])]


def test_export_and_import_batch_round_trip(tmp_path: Path) -> None:
    envelope = make_envelope(SMALL, 22, seed=21)
    with Store(tmp_path / "a") as a:
        a.put(envelope)
        a.put_sequence("s", make_envelope(SMALL, 9, seed=22))
        with a.reader() as r:
            blocks = [bytes(v) for _, v in r.iter_blocks()]
            sequences = list(r.iter_sequences())
        with Store(tmp_path / "b") as b:
            assert b.import_batch(blocks, sequences) == PutResult(7, 2, 1)
            assert b.get_sequence("s") == a.get_sequence("s")
            assert b.get_many(hashes_of(envelope)[:-1]) == split(envelope)[:-1]
            check_consistency(b)


def test_import_batch_is_all_or_nothing(store: Store) -> None:
    good = make_envelope(SMALL, 8, seed=23)
    bad = _corrupt(make_envelope(SMALL, 8, seed=24), 100)
    with pytest.raises(ChecksumError):
        store.import_batch([good, bad])
    with pytest.raises(ValueError):
        store.import_batch([good], [("bad name!", good)])
    assert store.stats()["blocks"] == 0 and store.sequences() == []


# --- sequences ------------------------------------------------------------------------


@pytest.mark.parametrize("n_tokens", [3, 8, 10, 29])  # 0 tokens: refused (no block)
@pytest.mark.parametrize("version", [1, 2])
def test_sequence_round_trip_is_byte_identical(tmp_path: Path, n_tokens: int, version: int) -> None:
    envelope = make_envelope(SMALL, n_tokens, version=version, seed=n_tokens)
    with Store(tmp_path / "s") as s:
        s.put_sequence("chat-1", envelope)
        assert s.get_sequence("chat-1") == envelope
    with Store(tmp_path / "s") as s:
        assert s.get_sequence("chat-1") == envelope
        check_consistency(s)


def test_sequences_pin_their_blocks(store: Store) -> None:
    first = make_envelope(SMALL, 10, seed=25)
    h0, h1, _ = hashes_of(first)
    assert store.put_sequence("s", first) == PutResult(2, 0, 1)
    assert store.stats()["pinned_blocks"] == 2
    with pytest.raises(PinnedError) as info:
        store.delete(h0)
    assert info.value.http_status == 409
    second = encode(SMALL, full_blocks(SMALL, 1, seed=26))
    assert store.put_sequence("s", second) == PutResult(1, 0, 0)  # replaces: old pins go
    assert store.delete(h0) is True
    assert store.put_sequence("t", second) == PutResult(0, 1, 0)
    assert store.stats()["pinned_blocks"] == 1
    assert store.delete_sequence("s") is True
    assert store.delete_sequence("s") is False
    assert store.stats()["pinned_blocks"] == 1  # "t" still pins it
    store.delete_sequence("t")
    (h,) = hashes_of(second)
    assert store.delete(h) and store.delete(h1)
    assert store.stats() | {"hits": 0, "misses": 0} == {
        "blocks": 0,
        "bytes": 0,
        "capacity_bytes": None,
        "pinned_blocks": 0,
        "sequences": 0,
        "hits": 0,
        "misses": 0,
        "evictions": 0,
        "corrupt": 0,
    }
    check_consistency(store)


def test_sequence_blocks_are_deduplicated_with_the_block_space(store: Store) -> None:
    envelope = make_envelope(SMALL, 12, seed=27)
    store.put(envelope)
    assert store.put_sequence("s", envelope) == PutResult(0, 3, 0)
    assert store.stats()["blocks"] == 3
    assert store.get_sequence("s") == envelope


def test_sequence_over_blocks_stored_in_another_version_stays_identical(store: Store) -> None:
    envelope = make_envelope(SMALL, 10, seed=28)
    store.put(transcode(envelope, 2))  # the block space holds the v2 copies
    store.put_sequence("s", envelope)
    assert store.get_sequence("s") == envelope
    with store.reader() as r:
        assert next(r.iter_sequence_records())[1] is None  # not describable by reference
    check_consistency(store)


def test_a_hash_repeated_inside_a_sequence(store: Store) -> None:
    a, b = full_blocks(SMALL, 2, seed=29)
    envelope = encode(SMALL, [a, b, a])
    store.put_sequence("s", envelope)
    assert store.get_sequence("s") == envelope
    check_consistency(store)


def test_a_partial_block_must_be_the_last(store: Store) -> None:
    blocks = make_blocks(SMALL, 6, seed=30)  # full, partial
    with pytest.raises(FormatError, match="last block"):
        store.put_sequence("s", encode(SMALL, [blocks[1], blocks[0]]))
    assert store.sequences() == []


def test_a_sequence_needs_a_block(store: Store) -> None:
    with pytest.raises(ValueError, match="at least one block"):
        store.put_sequence("empty", encode(SMALL, []))
    assert store.sequences() == [] and store.stats()["bytes"] == 0


def test_a_store_path_that_is_a_file_is_a_store_error(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_bytes(b"not a store")
    with pytest.raises(StoreError):
        Store(f)


@pytest.mark.parametrize("sync", [True, False])
def test_sync_reaches_lmdb(tmp_path: Path, sync: bool) -> None:
    """sync=True must make LMDB fsync data and meta on every commit (no NOSYNC flags)."""
    with Store(tmp_path / "s", sync=sync) as s:
        flags = lmdb_flags(s)
        assert (flags["sync"], flags["metasync"]) == (sync, sync)


@pytest.mark.parametrize("name", ["", "a" * 129, "a/b", "..\\x", "ünï", "a b", None, 5, "name\n"])
def test_bad_sequence_names(store: Store, name: object) -> None:
    with pytest.raises(ValueError):
        store.put_sequence(name, make_envelope())  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        store.get_sequence(name)  # type: ignore[arg-type]


def test_sequence_names_and_listing(store: Store) -> None:
    for name in ["z", "A.b_c-1", "a" * 128, "0"]:
        store.put_sequence(name, make_envelope(SMALL, 2))
    assert store.sequences() == sorted(["z", "A.b_c-1", "a" * 128, "0"])
    assert store.get_sequence("missing") is None


# --- capacity, LRU, pins ---------------------------------------------------------------


def test_capacity_is_never_exceeded(tmp_path: Path) -> None:
    capacity = 10 * SINGLE
    with Store(tmp_path / "s", capacity_bytes=capacity) as s:
        for i, envelope in enumerate(one_block_envelopes(40, seed=31)):
            s.put(envelope)
            if i % 7 == 0:
                s.put(join(one_block_envelopes(3, seed=100 + i)))
            stats = s.stats()
            assert stats["bytes"] <= capacity
        assert stats["evictions"] > 0 and stats["blocks"] == 10
        assert stats["capacity_bytes"] == capacity
        check_consistency(s)


def test_recently_read_blocks_outlive_older_unread_ones(tmp_path: Path) -> None:
    envelopes = one_block_envelopes(8, seed=32)
    hashes = [hashes_of(e)[0] for e in envelopes]
    with Store(tmp_path / "s", capacity_bytes=4 * SINGLE) as s:
        for e in envelopes[:4]:
            s.put(e)
        assert s.get(hashes[0]) is not None  # read: now the most recent
        with s.reader() as r:
            assert r.view(hashes[1]) is not None  # a view is a read too
        s.put(envelopes[4])
        s.put(envelopes[5])
        assert s.has(hashes[:6]) == [True, True, False, False, True, True]
        s.put(envelopes[0])  # a re-put of a present block is a use as well
        s.put(envelopes[6])
        assert s.has(hashes[:7]) == [True, False, False, False, True, True, True]


def test_lru_order_survives_reopen(tmp_path: Path) -> None:
    envelopes = one_block_envelopes(4, seed=33)
    hashes = [hashes_of(e)[0] for e in envelopes]
    with Store(tmp_path / "s", capacity_bytes=3 * SINGLE) as s:
        for e in envelopes[:3]:
            s.put(e)
        s.get(hashes[0])  # pending until close flushes it
    with Store(tmp_path / "s", capacity_bytes=3 * SINGLE) as s:
        s.put(envelopes[3])
        assert s.has(hashes) == [True, False, True, True]


def test_pinned_blocks_are_never_evicted_and_full_means_full(tmp_path: Path) -> None:
    with Store(tmp_path / "s", capacity_bytes=6 * SINGLE) as s:
        sequence = encode(SMALL, full_blocks(SMALL, 4, seed=34))
        s.put_sequence("pinned", sequence)
        record = s.stats()["bytes"] - 4 * SINGLE
        assert record > 0  # the sequence record counts too
        for e in one_block_envelopes(10, seed=35):
            s.put(e)
            assert s.has(hashes_of(sequence)) == [True] * 4
            assert s.stats()["bytes"] <= 6 * SINGLE
        before = s.stats()
        with pytest.raises(StoreFullError) as info:
            s.put(encode(SMALL, full_blocks(SMALL, 3, seed=36)))  # cannot fit beside the pins
        assert info.value.http_status == 507
        assert s.stats() == before | {"hits": s.stats()["hits"]}
        with pytest.raises(StoreFullError):
            s.put_sequence("another", encode(SMALL, full_blocks(SMALL, 2, seed=37)))
        assert s.sequences() == ["pinned"]
        assert s.get_sequence("pinned") == sequence
        check_consistency(s)


def test_a_put_never_evicts_its_own_duplicates(tmp_path: Path) -> None:
    blocks = full_blocks(SMALL, 3, seed=38)
    with Store(tmp_path / "s", capacity_bytes=2 * SINGLE) as s:
        s.put(encode(SMALL, blocks[:1]))
        s.put(encode(SMALL, blocks[1:2]))
        s.put(encode(SMALL, [blocks[0], blocks[2]]))  # must evict blocks[1], not blocks[0]
        assert s.has([b.hash for b in blocks]) == [True, False, True]
        with pytest.raises(StoreFullError):
            s.put(encode(SMALL, full_blocks(SMALL, 3, seed=39)))


def test_unpinned_blocks_become_evictable(tmp_path: Path) -> None:
    with Store(tmp_path / "s", capacity_bytes=5 * SINGLE) as s:
        sequence = encode(SMALL, full_blocks(SMALL, 3, seed=40))
        s.put_sequence("s", sequence)
        s.delete_sequence("s")
        s.put(join(one_block_envelopes(5, seed=41)))
        assert s.has(hashes_of(sequence)) == [False] * 3
        check_consistency(s)


# --- integrity ------------------------------------------------------------------------


def flip_on_disk(path: Path, pattern: bytes, offset_in_pattern: int = 0, once: bool = True) -> None:
    """Flip one bit of ``pattern`` inside ``data.mdb`` (every copy, with ``once=False``:
    LMDB's copy-on-write leaves stale copies of small values in free pages)."""
    data_file = path / "data.mdb"
    data = bytearray(data_file.read_bytes())
    at = data.find(pattern)
    assert at >= 0
    while at >= 0:
        data[at + offset_in_pattern] ^= 0x01
        at = data.find(pattern, at + 1)
        assert not once or at < 0, "pattern must occur exactly once"
    data_file.write_bytes(bytes(data))


def marked_block(marker: float, h: int, n_tokens: int = SMALL.block_tokens) -> Block:
    """A block whose first KV row is ``marker + 0..7``: a byte pattern found once on disk."""
    kv = np.zeros(SMALL.kv_shape, dtype=np.float32)
    kv[0, 0, 0, 0, :] = marker + np.arange(SMALL.head_dim)
    return Block(h, n_tokens, kv)


def marker_bytes(marker: float) -> bytes:
    return (marker + np.arange(SMALL.head_dim)).astype(np.float16).tobytes()


def test_a_corrupt_block_on_disk_is_quarantined_never_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good, bad = marked_block(1.0, 11), marked_block(-3.5, 12)
    with Store(tmp_path / "s") as s:
        s.put(encode(SMALL, [good, bad]))
    flip_on_disk(tmp_path / "s", marker_bytes(-3.5), 7)
    with Store(tmp_path / "s") as s, caplog.at_level(logging.WARNING, "tlkv.store"):
        assert s.has([11, 12]) == [True, True]
        assert s.get(12) is None
        assert "000000000000000c" in caplog.text
        stats = s.stats()
        assert (stats["corrupt"], stats["blocks"], stats["bytes"]) == (1, 1, SINGLE)
        assert s.has([11, 12]) == [True, False]
        assert s.get(11) is not None
        check_consistency(s)
    with Store(tmp_path / "s") as s:
        assert s.stats()["corrupt"] == 1  # persisted


def test_corrupt_blocks_found_by_views_and_get_many(tmp_path: Path) -> None:
    with Store(tmp_path / "s") as s:
        s.put(encode(SMALL, [marked_block(2.0, 21), marked_block(-7.25, 22)]))
    flip_on_disk(tmp_path / "s", marker_bytes(-7.25), 3)
    with Store(tmp_path / "s") as s:
        with s.reader() as r:
            assert r.view(22) is not None  # unverified: the caller asked for speed
            assert r.view(22, verify=True) is None
            assert r.view(21, verify=True) is not None
        assert s.stats()["corrupt"] == 1  # quarantined when the reader closed
        assert s.get_many([21, 22]) == [s.get(21), None]


def test_a_corrupt_pinned_block_makes_its_sequence_a_miss_until_put_again(tmp_path: Path) -> None:
    blocks = [marked_block(1.5, 31), marked_block(-9.0, 32)]
    sequence = encode(SMALL, blocks)
    with Store(tmp_path / "s") as s:
        s.put_sequence("s", sequence)
    flip_on_disk(tmp_path / "s", marker_bytes(-9.0), 1)
    with Store(tmp_path / "s") as s:
        assert s.get_sequence("s") is None
        stats = s.stats()
        assert (stats["corrupt"], stats["blocks"], stats["pinned_blocks"]) == (1, 1, 1)
        with s.reader() as r:
            assert list(r.iter_sequences()) == []
        s.put(encode(SMALL, blocks[1:]))  # the hash is wanted again: served again
        assert s.get_sequence("s") == sequence
        assert s.stats()["pinned_blocks"] == 2
        with pytest.raises(PinnedError):
            s.delete(32)
        check_consistency(s)


@pytest.mark.parametrize("found_by", ["get_sequence", "put_sequence", "delete_sequence"])
def test_a_corrupt_sequence_record_is_removed_and_pins_recounted(
    tmp_path: Path, found_by: str
) -> None:
    tail = marked_block(6.5, 0, n_tokens=2)
    shared, only = marked_block(0.75, 41), marked_block(2.25, 42)
    with Store(tmp_path / "s") as s:
        s.put_sequence("broken", encode(SMALL, [shared, only, tail]))
        s.put_sequence("fine", encode(SMALL, [shared]))
    flip_on_disk(tmp_path / "s", marker_bytes(6.5), 5, once=False)
    with Store(tmp_path / "s") as s:
        if found_by == "get_sequence":
            assert s.get_sequence("broken") is None
            assert s.sequences() == ["fine"]
        elif found_by == "put_sequence":  # replacing it
            s.put_sequence("broken", encode(SMALL, [shared]))
            assert s.get_sequence("broken") == encode(SMALL, [shared])
        else:
            assert s.delete_sequence("broken") is True
            assert s.sequences() == ["fine"]
        assert s.stats()["corrupt"] == 1
        assert s.get_sequence("fine") == encode(SMALL, [shared])
        assert s.delete(42) is True  # its only pin was in the corrupt record
        with pytest.raises(PinnedError):
            s.delete(41)
        check_consistency(s)


# --- persistence, map growth, processes ---------------------------------------------------


def test_everything_survives_reopen_in_a_new_process(tmp_path: Path) -> None:
    envelope = make_envelope(SMALL, 13, seed=42)
    with Store(tmp_path / "s") as s:
        s.put(envelope)
        s.put_sequence("seq", envelope)
    script = textwrap.dedent(
        f"""
        import json
        from kvstore import Store, crc32c
        with Store({str(tmp_path / "s")!r}) as s:
            seq = s.get_sequence("seq")
            print(json.dumps({{"stats": s.stats(), "names": s.sequences(),
                               "seq": crc32c(seq), "has": s.has({hashes_of(envelope)!r})}}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    got = json.loads(out.stdout)
    assert got["names"] == ["seq"] and got["seq"] == crc32c(envelope)
    assert got["has"] == [True, True, True, False]
    assert got["stats"]["pinned_blocks"] == 3 and got["stats"]["blocks"] == 3


def test_the_map_grows_without_the_user_seeing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = Geometry(16, 4, 2, 64)  # 32 KiB blocks
    with Store(tmp_path / "s", map_bytes=1 << 20) as s:
        start = s.map_bytes
        stop = threading.Event()
        errors: list[BaseException] = []

        def read_loop() -> None:  # a concurrent reader thread: resizes must wait for it
            try:
                while not stop.is_set():
                    with s.reader() as r:
                        for _h, value in r.iter_blocks():
                            assert len(value) == g.envelope_bytes(1)
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        thread = threading.Thread(target=read_loop)
        thread.start()
        try:
            for i in range(8):
                s.put(encode(g, full_blocks(g, 16, seed=100 + i)))
        finally:
            stop.set()
            thread.join()
        assert not errors
        assert s.map_bytes > start
        assert s.stats()["blocks"] == 128


def test_map_full_inside_a_transaction_grows_and_retries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        lmdbenv_module.LmdbEnv, "map_room", lambda self: 1 << 62
    )  # no growing ahead
    g = Geometry(16, 4, 2, 64)
    envelope = encode(g, full_blocks(g, 64, seed=44))  # 2 MiB into a 1 MiB map
    with Store(tmp_path / "s", map_bytes=1 << 20) as s:
        assert s.put(envelope).stored == 64
        assert s.get_many(hashes_of(envelope)) == split(envelope)
        assert s.map_bytes > 1 << 20


def test_a_map_grown_by_another_process_is_adopted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = Geometry(16, 4, 2, 64)
    path = tmp_path / "s"
    with Store(path, geometry=g, map_bytes=1 << 20) as s:
        small = s.map_bytes
        script = textwrap.dedent(
            f"""
            import numpy as np
            from kvstore import Block, Geometry, Store, encode
            g = Geometry(16, 4, 2, 64)
            kv = np.ones(g.kv_shape, np.float32)
            with Store({str(path)!r}, map_bytes=1 << 20) as s:
                for i in range(4):
                    s.put(encode(g, [Block(1000 * i + j + 1, 16, kv) for j in range(32)]))
            """
        )
        subprocess.run(
            [sys.executable, "-c", script], check=True, env={**os.environ, "PYTHONPATH": str(REPO)}
        )
        assert s.has([1, 3032]) == [True, True]  # MapResizedError on begin: adopted
        assert s.map_bytes > small
        s.put(encode(g, full_blocks(g, 2, seed=45)))
        assert s.stats()["blocks"] == 130


def test_growing_while_this_thread_holds_a_reader_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = Geometry(16, 4, 2, 64)
    with Store(tmp_path / "s", map_bytes=1 << 20) as s:
        with s.reader(), pytest.raises(StoreError, match="reader"):
            s.put(encode(g, full_blocks(g, 64, seed=43)))
        assert s.stats()["blocks"] == 0
        s.put(encode(g, full_blocks(g, 64, seed=43)))  # fine once the reader is closed


def _mp_worker(path: str, me: int, rounds: int, queue: multiprocessing.Queue) -> None:
    """One of two processes writing and reading the same store at once."""
    g = Geometry(16, 2, 2, 64)
    try:
        with Store(path, map_bytes=1 << 20) as s:  # small: both processes grow it racing
            seen = 0
            for i in range(rounds):
                blocks = [
                    Block((me << 32) | (i * 4 + j + 1), 16, np.full(g.kv_shape, me + i, np.float32))
                    for j in range(4)
                ]
                s.put(encode(g, blocks))
                other = ((1 - me) << 32) | (i * 4 + 1)
                data = s.get(other)
                if data is not None:
                    assert decode(data)[0].hash == other
                    seen += 1
                if i % 5 == 0:
                    s.put_sequence(f"p{me}-{i}", encode(g, blocks[:2]))
                with s.reader() as r:
                    assert r.view((me << 32) | (i * 4 + 1)) is not None
            queue.put(("ok", me, seen))
    except BaseException as exc:  # reported to the parent
        queue.put(("error", me, repr(exc)))


def test_two_processes_read_and_write_concurrently(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    path = str(tmp_path / "s")
    Store(path).close()
    rounds = 40
    procs = [ctx.Process(target=_mp_worker, args=(path, me, rounds, queue)) for me in (0, 1)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert all(r[0] == "ok" for r in results), results
    with Store(path) as s:
        assert s.stats()["blocks"] == 2 * 4 * rounds
        assert len(s.sequences()) == 2 * (rounds // 5)
        assert s.stats()["pinned_blocks"] == 2 * 2 * (rounds // 5)
        check_consistency(s)


def test_a_store_used_after_fork_refuses(tmp_path: Path) -> None:
    if not hasattr(os, "fork"):
        pytest.skip("no fork on this platform")
    with Store(tmp_path / "s") as s:
        s.put(make_envelope())
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: must refuse, not touch the parent's environment
            try:
                s.get(1)
                os.write(write_end, b"served")
            except StoreError:
                os.write(write_end, b"refused")
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert os.read(read_end, 16) == b"refused"
        assert s.stats()["blocks"] == 2  # the parent's store is untouched


def test_disk_full_is_store_full_and_stores_nothing(tmp_path: Path) -> None:
    if sys.platform == "win32":
        pytest.skip("RLIMIT_FSIZE is POSIX")
    script = textwrap.dedent(
        f"""
        import json, resource, signal
        import numpy as np
        from kvstore import Block, Geometry, Store, StoreFullError, encode
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a file-size limit: the disk is "full"
        resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20))
        g = Geometry(16, 4, 2, 64)
        kv = np.ones(g.kv_shape, np.float32)
        with Store({str(tmp_path / "s")!r}) as s:
            stored, h = [], 1
            try:
                while True:
                    hashes = list(range(h, h + 4))
                    s.put(encode(g, [Block(x, 16, kv) for x in hashes]))
                    stored += hashes
                    h += 4
            except StoreFullError as exc:
                failed = hashes
            print(json.dumps({{"stored": stored, "failed": failed,
                               "has_stored": all(s.has(stored)), "has_failed": any(s.has(failed)),
                               "blocks": s.stats()["blocks"], "get": s.get(1) is not None}}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["stored"] and got["has_stored"] and got["get"]
    assert not got["has_failed"]
    assert got["blocks"] == len(got["stored"])


def test_pending_hits_are_flushed_in_the_background(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(state_module, "_FLUSH_INTERVAL", 0.0)
    with Store(tmp_path / "s") as s:
        envelope = make_envelope(SMALL, 4)
        s.put(envelope)
        s.get(hashes_of(envelope)[0])
        deadline = time.monotonic() + 10
        while pending_hits(s) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not pending_hits(s)


def test_stats_keys(store: Store) -> None:
    assert list(store.stats()) == [
        "blocks",
        "bytes",
        "capacity_bytes",
        "pinned_blocks",
        "sequences",
        "hits",
        "misses",
        "evictions",
        "corrupt",
    ]


def test_chain_hashes_are_the_keys(store: Store) -> None:
    tokens = list(range(40))
    hashes = chain_hashes(tokens, SMALL.block_tokens)
    blocks = [Block(h, 4, np.zeros(SMALL.kv_shape, np.float32)) for h in hashes]
    store.put(encode(SMALL, blocks))
    assert store.longest_prefix(chain_hashes(tokens + [99] * 8, 4)) == 10
    assert (
        store.get(hashes[3])[HEADER_SIZE:-TRAILER_SIZE]
        == split(encode(SMALL, blocks))[3][HEADER_SIZE:-TRAILER_SIZE]
    )


# --- envelopes the caller decoded already --------------------------------------------------


def test_put_report_takes_a_decoded_envelope(tmp_path: Path) -> None:
    data = make_envelope(SMALL, 3 * SMALL.block_tokens, seed=41)
    with Store(tmp_path / "a") as a, Store(tmp_path / "b") as b:
        assert a.put_report(decode(data)) == b.put_report(data)
        assert a.geometry == b.geometry == SMALL
        for h in hashes_of(data):
            assert a.get(h) == b.get(h) is not None
        assert a.put_report(decode(data)) == b.put_report(data)  # duplicates alike
        check_consistency(a)


def test_import_batch_takes_decoded_envelopes(tmp_path: Path) -> None:
    blocks = one_block_envelopes(4, seed=42)
    sequence = make_envelope(SMALL, 2 * SMALL.block_tokens + 1, seed=43)
    with Store(tmp_path / "a") as a, Store(tmp_path / "b") as b:
        got = a.import_batch([decode(x) for x in blocks], [("s", decode(sequence))])
        assert got == b.import_batch(blocks, [("s", sequence)])
        assert a.get_sequence("s") == b.get_sequence("s") == sequence
        assert [a.get(h) for h in hashes_of(b"".join(blocks[:1]))] == [blocks[0]]
        check_consistency(a)


def test_a_decoded_envelope_of_another_geometry_fails_as_its_bytes_do(tmp_path: Path) -> None:
    other = Geometry(block_tokens=4, n_layers=1, n_kv_heads=2, head_dim=8)
    data = make_envelope(other, other.block_tokens, seed=44)
    with Store(tmp_path / "s", geometry=SMALL) as s:
        with pytest.raises(ShapeError) as from_bytes:
            s.put_report(data)
        with pytest.raises(ShapeError) as from_env:
            s.put_report(decode(data))
        with pytest.raises(ShapeError):
            s.import_batch([decode(data)])
        assert str(from_env.value) == str(from_bytes.value)
        assert s.stats()["blocks"] == 0


def test_a_decoded_envelope_with_a_bad_crc_stores_nothing(tmp_path: Path) -> None:
    data = bytearray(make_envelope(SMALL, 2 * SMALL.block_tokens, seed=45))
    data[HEADER_SIZE + 20] ^= 0xFF  # a payload byte: the CRC no longer matches
    env = decode(data, verify_crc=False)
    with Store(tmp_path / "s") as s:
        with pytest.raises(ChecksumError):
            s.put_report(env)
        with pytest.raises(ChecksumError):
            s.import_batch([env])
        assert s.stats()["blocks"] == 0
        check_consistency(s)


@pytest.mark.parametrize("n_tokens", [SMALL.block_tokens, 2 * SMALL.block_tokens + 1])
def test_a_decoded_envelope_altered_after_its_decode_is_refused(
    tmp_path: Path, n_tokens: int
) -> None:
    """The store checks the CRC of a decoded envelope as it copies it: bytes changed after
    ``decode`` verified them (one block: the envelope is the stored value; several: the
    records are copied) are refused by every write, and nothing is stored."""
    data = bytearray(make_envelope(SMALL, n_tokens, seed=46))
    env = decode(data)  # the CRC verified here
    data[HEADER_SIZE + RECORD_SIZE + 3] ^= 0x01  # a KV byte of the first block, afterwards
    with Store(tmp_path / "s") as s:
        with pytest.raises(ChecksumError):
            s.put_report(env)
        with pytest.raises(ChecksumError):
            s.put(env)
        with pytest.raises(ChecksumError):
            s.put_sequence("s", env)
        with pytest.raises(ChecksumError):
            s.import_batch([env])
        with pytest.raises(ChecksumError):
            s.import_batch(sequences=[("s", env)])
        assert s.stats()["blocks"] == 0 and s.sequences() == []
        check_consistency(s)
