"""Read-only access to a store handle's raw LMDB state, for the invariant checks of tests
and drills: not part of the stable API (the sub-databases and records are
``diskformat``'s, and change with it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .diskformat import Dbs
from .store import Store

__all__ = ["lmdb_flags", "pending_hits", "raw_snapshot"]


@contextlib.contextmanager
def raw_snapshot(store: Store, *, buffers: bool = True) -> Iterator[tuple[Any, Dbs]]:
    """A read transaction of ``store`` and the sub-databases of its model:
    ``with raw_snapshot(s) as (txn, dbs): txn.cursor(db=dbs.blocks)``.

    ``buffers``: values are memoryviews into the map, valid only inside the ``with``
    block (py-lmdb's ``buffers``); False: bytes.
    """
    h = store._h
    txn = h.begin_read(buffers)
    try:
        yield txn, h.dbs
    finally:
        h.end_read(txn)


def lmdb_flags(store: Store) -> dict[str, Any]:
    """The flags of ``store``'s LMDB environment (py-lmdb's ``Environment.flags()``)."""
    return dict(store._h.env.lmdb.env.flags())


def pending_hits(store: Store) -> int:
    """Read hits ``store``'s handle holds in memory, not yet persisted to the LRU order."""
    return len(store._h.recency)
