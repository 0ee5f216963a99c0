"""A model handle's counters: ``stats`` (per model, as its handle sees them) and
``total_bytes`` (every model together).

The counters live in ``meta`` (``diskformat``): store-wide totals, plus each model's own
beside them for models > 0; the default model's are the totals minus every other model's.
``hits`` and ``misses`` are this process's, kept on the handle. Functions over a
``state.Handle`` (``Store`` delegates to them).
"""

from __future__ import annotations

from typing import Any, TypedDict

from .diskformat import (
    COUNTER_KEYS,
    META_BYTES,
    META_CORRUPT,
    META_EVICTIONS,
    MODEL_COUNTER_KEYS,
    counter,
    model_counter_key,
    own_full_blocks,
)
from .state import Handle


class StoreStats(TypedDict):
    """What ``Store.stats`` answers (see its docstring)."""

    blocks: int
    bytes: int
    capacity_bytes: int | None
    pinned_blocks: int
    sequences: int
    hits: int
    misses: int
    evictions: int
    corrupt: int


def _counters(h: Handle, txn: Any) -> dict[bytes, int]:
    """The meta counters as ``h``'s model sees them (``COUNTER_KEYS``)."""
    meta = h.dbs.meta
    counters = {key: counter(txn.get(key, None, meta)) for key in COUNTER_KEYS}
    number = h.dbs.number
    if number < 0:
        return dict.fromkeys(counters, 0)
    for key in MODEL_COUNTER_KEYS:
        if number > 0:
            counters[key] = counter(txn.get(model_counter_key(key, number), None, meta))
            continue
        prefix = key + b"@"  # the default model's: the totals minus every other model's
        cur = txn.cursor(db=meta)
        ok = cur.set_range(prefix)
        while ok and bytes(cur.key()).startswith(prefix):
            counters[key] -= counter(cur.value())
            ok = cur.next()
    return counters


def total_bytes(h: Handle) -> int:
    """``Store.total_bytes``: the bytes stored by every model together."""
    txn = h.begin_read(False)
    try:
        return counter(txn.get(META_BYTES, None, h.dbs.meta))
    finally:
        h.end_read(txn)


def stats(h: Handle) -> StoreStats:
    """``Store.stats``: the model's counters as ``h`` sees them."""
    txn = h.begin_read(True)
    dbs = h.dbs
    try:
        counters = _counters(h, txn)
        pinned = txn.stat(dbs.refs)["entries"]
        if counters[META_CORRUPT]:  # a quarantined block may still be referenced
            refs = txn.cursor(db=dbs.refs).iternext(values=False)
            pinned = sum(txn.get(k, None, dbs.blocks) is not None for k in refs)
        # Full blocks a sequence keeps in its own record (stored in another version or
        # with other bytes in the block space) are pinned by it too.
        records = txn.cursor(db=dbs.seqs).iternext(keys=False)
        pinned += sum(own_full_blocks(raw) for raw in records)
        return {
            "blocks": txn.stat(dbs.blocks)["entries"],
            "bytes": counters[META_BYTES],
            "capacity_bytes": h.env.capacity,
            "pinned_blocks": pinned,
            "sequences": txn.stat(dbs.seqs)["entries"],
            "hits": h.hits,
            "misses": h.misses,
            "evictions": counters[META_EVICTIONS],
            "corrupt": counters[META_CORRUPT],
        }
    finally:
        h.end_read(txn)
