"""kvstore.store.eviction: the LRU order on a real LMDB environment, and the hit buffer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest

from kvstore.store.diskformat import BLOCK_KEY
from kvstore.store.eviction import LruOrder, RecencyBuffer


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Any]:
    e = lmdb.open(str(tmp_path / "lru"), max_dbs=2, map_size=1 << 20)
    yield e
    e.close()


def order(env: Any, txn: Any) -> LruOrder:
    return LruOrder(txn, env.open_db(b"atime", txn=txn), env.open_db(b"lru", txn=txn), 0)


def test_oldest_first_touch_moves_to_the_end(env: Any) -> None:
    with env.begin(write=True) as txn:
        lru = order(env, txn)
        for h in (5, 3, 9, 1):
            lru.add(BLOCK_KEY.pack(h), h)
        lru.touch(5)  # 5 becomes the newest
        lru.touch(42)  # unknown (or pinned): nothing happens
        assert lru.tick == 5
        assert list(lru.evict(set(), lambda: False)) == [3, 9, 1, 5]
        assert list(lru.evict(set(), lambda: False)) == []  # every entry was consumed


def test_remove_and_protect_and_enough(env: Any) -> None:
    with env.begin(write=True) as txn:
        lru = order(env, txn)
        for h in range(1, 7):
            lru.add(BLOCK_KEY.pack(h), h)
        assert lru.remove(BLOCK_KEY.pack(2), 2) and not lru.remove(BLOCK_KEY.pack(2), 2)
        taken: list[int] = []
        for h in lru.evict({1, 4}, lambda: len(taken) >= 2):
            taken.append(h)
        assert taken == [3, 5]  # 1 and 4 protected, 2 removed, stopped once enough
        assert list(lru.evict(set(), lambda: False)) == [1, 4, 6]


def test_recency_buffer_keeps_first_hit_order() -> None:
    buf = RecencyBuffer()
    for h in (3, 1, 3, 2):
        buf.touch(h)
    assert len(buf) == 3
    taken = buf.take()
    assert taken == [3, 1, 2] and len(buf) == 0
    buf.touch(7)
    buf.restore(taken)  # a flush that failed: its hits count as older than new ones
    buf.discard(1)
    assert buf.take() == [3, 2, 7]
