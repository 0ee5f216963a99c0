"""The LMDB block store's core API: opening, puts and gets, has and longest_prefix,
deletes, stats, and envelopes the caller decoded already. Its other areas have files of
their own: test_store_views (readers and zero-copy views), test_store_sequences,
test_store_capacity (capacity, LRU, pins), test_store_integrity (corruption on disk) and
test_store_processes (persistence, map growth, processes, disk full).

Every test runs a real LMDB environment under ``tmp_path``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest
from conftest import SMALL, make_envelope
from store_helpers import (
    SINGLE,
    check_consistency,
    flip_byte,
    full_blocks,
    hashes_of,
    one_block_envelopes,
)

import kvstore.store.diskformat as L
import kvstore.store.keyset as keyset_module
import kvstore.store.writetxn as writetxn_module
from kvstore import (
    Block,
    ChecksumError,
    Geometry,
    PutReport,
    PutResult,
    ShapeError,
    Store,
    StoreError,
    UnsupportedVersionError,
    chain_hashes,
    crc32c,
    decode,
    encode,
    split,
    transcode,
)
from kvstore.codec.crcmath import crc_combine, crc_shift
from kvstore.codec.layout import HEADER_SIZE, RECORD_SIZE, TRAILER_SIZE
from kvstore.errors import BadMagicError, TruncatedError
from kvstore.store.reads import PROBE_MAX

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


BAD_ENVELOPES = [
    ("crc of a multi-block envelope", lambda e: flip_byte(e, len(e) - 100), ChecksumError),
    ("crc trailer", lambda e: flip_byte(e, len(e) - 1), ChecksumError),
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
        store.put(flip_byte(envelope, HEADER_SIZE + 20))
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
    for n in range(1, 2 * PROBE_MAX):  # key by key up to PROBE_MAX, by the arrays above
        assert store.longest_prefix((chain * 3)[:n]) == min(n, 4)
        assert store.longest_prefix([chain[0], chain[4], *chain][:n]) == min(n, 1)
    bad_chains: list[Any] = [[chain[0], -1], [chain[0], 1 << 64], [chain[0], 1.5]]
    for bad in bad_chains:
        with pytest.raises(ValueError):
            store.longest_prefix(bad)
    bad_hashes: list[Any] = [[-1], [1 << 64], [1.5], np.array([-1]), np.array([1.5])]
    for bad in [*bad_hashes, np.zeros((2, 2), np.uint64)]:
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
    assert store._h.keys._copy is not None
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
    stored = store.get(hashes[3])
    assert stored is not None
    assert (
        stored[HEADER_SIZE:-TRAILER_SIZE]
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
