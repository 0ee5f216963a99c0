"""The store's KV event log and kept token ids as its API presents them: turning the log
on or off, reading it (the publisher and the replay socket), and the token ids of blocks.

Functions over a ``state.Handle`` (``Store`` delegates to them); ``eventlog`` writes the
log inside write transactions, ``tokentxn`` keeps the token ids.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from . import eventlog
from .checks import check_hash
from .diskformat import BLOCK_KEY, unpack_tokens
from .eventlog import DEFAULT_EVENTS_LIMIT
from .state import Handle
from .writetxn import WriteTxn

__all__ = ["DEFAULT_EVENTS_LIMIT", "block_tokens", "events_bounds", "read_events", "set_events"]


def set_events(h: Handle, limit: int) -> None:
    """``Store.set_events``: keep a log of at most ``limit`` batches (0: no log)."""
    if limit < 0:
        raise ValueError(f"the event log's bound is a number of batches >= 0, found {limit}")

    def body(w: WriteTxn) -> None:
        eventlog.set_limit(w.txn, w.dbs.meta, w.dbs.events, limit)

    h.write(body)


def read_events(h: Handle, start: int, limit: int) -> list[tuple[int, str, bytes]]:
    """``Store.read_events``: up to ``limit`` batches from ``start`` on, in order."""
    txn = h.begin_read(False)
    try:
        return eventlog.read(txn, h.dbs.events, start, limit)
    finally:
        h.end_read(txn)


def events_bounds(h: Handle) -> tuple[int, int, int]:
    """``Store.events_bounds``: ``(first held, next, limit)``."""
    txn = h.begin_read(False)
    try:
        return eventlog.bounds(txn, h.dbs.meta, h.dbs.events)
    finally:
        h.end_read(txn)


def block_tokens(h: Handle, hashes: Iterable[Any]) -> list[tuple[int, np.ndarray] | None]:
    """``Store.block_tokens``: ``(parent, token ids)`` of each block kept with them."""
    keys = [BLOCK_KEY.pack(check_hash(x)) for x in hashes]
    if not h.created():
        return [None] * len(keys)
    txn = h.begin_read(False)
    try:
        out: list[tuple[int, np.ndarray] | None] = []
        for key in keys:
            value = txn.get(key, None, h.dbs.tokens)
            stored = value is not None and txn.get(key, None, h.dbs.blocks) is not None
            if not stored:
                out.append(None)  # not on this node's disk (kept only for the tier)
                continue
            parent, _flags, ids = unpack_tokens(value)
            out.append((parent, ids))
        return out
    finally:
        h.end_read(txn)
