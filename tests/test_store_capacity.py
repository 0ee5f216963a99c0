"""The store's capacity, LRU order and pins: never over capacity, recently read blocks
outlive older ones (across a reopen), pinned blocks are never evicted.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import SMALL
from store_helpers import (
    SINGLE,
    check_consistency,
    full_blocks,
    hashes_of,
    one_block_envelopes,
)

from kvstore import (
    Store,
    StoreFullError,
    encode,
    join,
)

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
