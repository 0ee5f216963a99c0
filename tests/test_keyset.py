"""kvstore.store.keyset: bulk has/longest_prefix, scanned or probed, against a plain set."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import SMALL, make_envelope
from store_helpers import elsewhere as _elsewhere

from kvstore import Block, Geometry, Store, decode, encode, split
from kvstore.store import keylog, keyset


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store(tmp_path / "s", geometry=SMALL, sync=False)
    for seed in range(6):
        s.put(make_envelope(SMALL, 4 * 8, seed=seed))
    return s


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "probe"])
def test_has_and_longest_prefix_agree_with_a_set(
    store: Store, monkeypatch: pytest.MonkeyPatch, scan: bool
) -> None:
    monkeypatch.setattr(keyset, "SCAN_PER_LOOKUP", 10**9 if scan else 0)
    stored = [
        int(h) for seed in range(6) for h in decode(make_envelope(SMALL, 32, seed=seed)).hashes
    ]
    rng = np.random.default_rng(1)
    absent = [int(x) for x in rng.integers(1, 2**63, 50, dtype=np.int64)]
    queries = stored[:10] + absent[:1] + stored[10:20] + absent[1:]
    expected = [h in set(stored) for h in queries]
    assert store.has(queries) == expected
    assert store.longest_prefix(queries) == 10
    assert store.longest_prefix(stored) == len(stored)
    assert store.longest_prefix([]) == 0 and store.has([]) == []
    assert store.has([0]) == [False]  # hash 0 names no block
    # one hash (an engine asking about a first page): one lookup answers
    assert [store.longest_prefix([h]) for h in (stored[5], absent[0], 0)] == [1, 0, 0]


def test_hash_array_refuses_what_is_not_u64() -> None:
    assert keyset.hash_array([1, 2**64 - 1]).dtype == np.uint64
    assert keyset.hash_array(np.array([3], dtype=np.int32)).tolist() == [3]
    for bad in ([-1], [2**64], np.array([-1]), np.zeros((2, 2), dtype=np.uint64), ["x"]):
        with pytest.raises(ValueError):
            keyset.hash_array(bad)


# --- the in-memory copy and the key log ------------------------------------------------


def _stored(envelopes: list[bytes]) -> list[int]:
    return [h for e in envelopes for h in decode(e).hashes.tolist()]


def test_the_copy_follows_another_processes_writes_through_the_log(tmp_path: Path) -> None:
    """A process's copy of the key set is brought forward with the key log: blocks another
    process stored and deleted since are answered right, without reading the set again."""
    path = tmp_path / "s"
    mine = [make_envelope(SMALL, 4 * 8, seed=seed) for seed in range(3)]
    theirs = [make_envelope(SMALL, 4 * 8, seed=seed) for seed in range(10, 12)]
    with Store(path, geometry=SMALL, sync=False) as s:
        for e in mine:
            s.put(e)
        queries = _stored(mine) + _stored(theirs)
        assert s.has(queries) == [True] * 24 + [False] * 16
        before = s._h.keys._copy
        assert before is not None
        gone = _stored(mine)[:3]
        _elsewhere(
            """
            import sys
            sys.path.insert(0, "tests")
            from conftest import SMALL, make_envelope
            from kvstore import Store
            with Store(sys.argv[1]) as s:
                for seed in (10, 11):
                    s.put(make_envelope(SMALL, 4 * 8, seed=seed))
                for h in sys.argv[2:]:
                    s.delete(int(h))
            """,
            str(path),
            *map(str, gone),
        )
        expected = [h not in gone for h in _stored(mine)] + [True] * 16
        assert s.has(queries) == expected
        copy = s._h.keys._copy
        assert copy is not None and copy.tid > before.tid
        assert copy.base is before.base  # brought forward, not read again
        assert sorted(copy.added.tolist()) == sorted(_stored(theirs))
        assert sorted(copy.removed.tolist()) == sorted(gone)
        assert s.longest_prefix(_stored(mine)) == 0
        assert s.longest_prefix(_stored(theirs)) == 16


def test_the_copy_agrees_with_a_set_through_random_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Puts, deletes, puts of deleted blocks again and merges of the changes into the
    copy: after every write, has() and longest_prefix() agree with a plain set."""
    monkeypatch.setattr(keyset, "_MERGE_AT", 8)
    rng = np.random.default_rng(7)
    envelopes = [one for seed in range(12) for one in split(make_envelope(SMALL, 4 * 4, seed=seed))]
    hashes = _stored(envelopes)
    held: set[int] = set()
    with Store(tmp_path / "s", geometry=SMALL, sync=False) as s:
        for _step in range(60):
            pick = rng.choice(len(envelopes), size=int(rng.integers(1, 6)), replace=False)
            for i in pick.tolist():
                if hashes[i] in held and rng.random() < 0.5:
                    s.delete(hashes[i])
                    held.discard(hashes[i])
                else:
                    s.put(envelopes[i])
                    held.add(hashes[i])
            assert s.has(hashes) == [h in held for h in hashes]
            chain = sorted(held)[:5] + [h for h in hashes if h not in held][:1]
            assert s.longest_prefix(chain) == min(5, len(held))


def test_a_trimmed_log_reads_the_set_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy older than what the log keeps is read again from the index."""
    monkeypatch.setattr(keylog, "KEEP_RECORDS", 2)
    monkeypatch.setattr(keylog, "TRIM_BATCH", 1)
    envelopes = split(make_envelope(SMALL, 4 * 8, seed=3))
    with Store(tmp_path / "s", geometry=SMALL, sync=False) as s:
        s.put(envelopes[0])
        hashes = _stored(envelopes)
        assert s.has(hashes) == [True] + [False] * 7
        before = s._h.keys._copy
        assert before is not None
        for e in envelopes[1:]:
            s.put(e)  # seven records: four trimmed
        assert s.has(hashes) == [True] * 8
        copy = s._h.keys._copy
        assert copy is not None and copy.base is not before.base and not copy.added.size


def test_a_writer_without_the_log_is_noticed(tmp_path: Path) -> None:
    """A block written by a process that keeps no key log (a release before it) changes
    the index's count: the copy is read again instead of answering from the log."""
    path = tmp_path / "s"
    envelopes = split(make_envelope(SMALL, 4 * 2, seed=4))
    hashes = _stored(envelopes)
    with Store(path, geometry=SMALL, sync=False) as s:
        s.put(envelopes[0])
        assert s.has(hashes) == [True, False]
        _elsewhere(
            """
            import struct, sys, lmdb
            env = lmdb.open(sys.argv[1], max_dbs=64)
            with env.begin(write=True) as txn:
                blocks = env.open_db(b"blocks", txn=txn)
                index = env.open_db(b"index", txn=txn, dupsort=True, dupfixed=True, integerdup=True)
                h = int(sys.argv[2])
                txn.put(struct.pack(">Q", h), bytes.fromhex(sys.argv[3]), db=blocks)
                txn.put(b"h", struct.pack("=Q", h), db=index)
            """,
            str(path),
            str(hashes[1]),
            envelopes[1].hex(),
        )
        assert s.has(hashes) == [True, True]


def test_a_deleted_model_is_read_again(tmp_path: Path) -> None:
    """Deleting a model empties its index wholesale (a reset in the log): a copy of it
    taken before answers nothing afterwards, and follows the model made again."""
    path = tmp_path / "s"
    envelopes = split(make_envelope(SMALL, 4 * 4, seed=5))
    hashes = _stored(envelopes)
    with Store(path, geometry=SMALL, sync=False) as s:
        m = s.model("m")
        for e in envelopes[:3]:
            m.put(e)
        assert m.has(hashes) == [True, True, True, False]
        s.delete_model("m")
        assert m.has(hashes) == [False] * 4
        m.put(envelopes[3])
        assert m.has(hashes) == [False, False, False, True]


def test_net_change_keeps_the_last_word_of_each_hash() -> None:
    """Changes in commit order: added then removed is no change, removed then added is no
    change, and a hash touched once keeps that change."""
    hashes = np.array([5, 7, 9, 5, 7, 11, 9], dtype=np.uint64)
    is_add = np.array([True, False, True, False, True, False, False])
    added, removed = keylog.net_change(hashes, is_add)
    assert added.tolist() == [] and removed.tolist() == [11]
    added, removed = keylog.net_change(np.array([3, 1], np.uint64), np.array([True, False]))
    assert added.tolist() == [3] and removed.tolist() == [1]


def test_bucket_search_agrees_with_a_whole_array_search() -> None:
    """The bucketed search of a large copy answers as searchsorted does: hashes spread
    evenly, crowded into one bucket (the fallback), at both ends of the u64 range."""
    rng = np.random.default_rng(11)
    spread = rng.integers(1, 2**64 - 1, 40_000, dtype=np.uint64)
    crowded = np.arange(1, 40_001, dtype=np.uint64)
    for stored in (spread, crowded, np.r_[spread, np.uint64(2**64 - 1), np.uint64(1)]):
        base = np.unique(stored)
        starts = keyset._buckets(base)
        assert starts is not None
        queries = np.r_[rng.choice(base, 3000), rng.integers(0, 2**64 - 1, 3000, np.uint64)]
        queries = np.r_[queries, base[:1], base[-1:], np.uint64(0), np.uint64(2**64 - 1)]
        expected = np.isin(queries, base)
        assert (keyset._in_buckets(base, starts, queries) == expected).all()


def test_a_large_store_answers_from_its_bucketed_copy(tmp_path: Path) -> None:
    """A store past the size where its copy keeps bucket starts: has() and
    longest_prefix() agree with a set, before and after writes."""
    tiny = Geometry(1, 1, 1, 8)
    kv = np.ones(tiny.kv_shape, dtype=np.float16)
    rng = np.random.default_rng(12)
    hashes = rng.integers(1, 2**64 - 1, keyset._BUCKETS_ABOVE + 500, dtype=np.uint64).tolist()
    with Store(tmp_path / "s", geometry=tiny, sync=False) as s:
        s.put(encode(tiny, [Block(h, 1, kv) for h in hashes]))
        absent = rng.integers(1, 2**64 - 1, 4000, dtype=np.uint64).tolist()
        queries = hashes[::3] + absent
        assert s.has(queries) == [True] * len(hashes[::3]) + [False] * 4000
        copy = s._h.keys._copy
        assert copy is not None and copy.starts is not None
        s.put(encode(tiny, [Block(h, 1, kv) for h in absent[:10]]))
        s.delete(hashes[0])
        assert (
            s.has(queries)
            == [False] + [True] * (len(hashes[::3]) - 1) + [True] * 10 + [False] * 3990
        )
        assert s.longest_prefix(hashes[1:2000]) == 1999
        assert s.longest_prefix(hashes[:2000]) == 0
