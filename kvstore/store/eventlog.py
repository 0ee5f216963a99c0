"""The KV event log: what a write transaction tells routers, written in that transaction.

Every change that a router must hear of (a block with token ids stored, a block removed,
a model cleared) is noted on the transaction's ``EventLog`` while it runs; just before the
commit, ``write`` turns each model's notes into one batch in vLLM's wire format
(``kvstore.events.wire``) under the next sequence number of the store and trims the log
to its bound. The batch commits with the change, or not at all: the sequence number is
allocated by LMDB's one writer, so the processes and workers sharing a store write one
stream with no gap and no repeat, and it survives any crash of a process (``kill -9``).
``api.kvevents`` publishes the log; ``read`` serves its publisher and the replay socket.

Nothing is written while ``meta``'s ``events_limit`` is absent or 0 (``set_limit``:
``Store(events=...)``, ``tlkv serve --kv-events-endpoint``); the sequence number only
grows either way. Sub-database and keys: ``diskformat`` (``events``, ``EVENT_KEY``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..events.wire import (
    MEDIUM_STORAGE,
    MEDIUM_TIER,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    encode_batch,
)
from .diskformat import (
    COUNTER,
    EVENT_KEY,
    META_EVENTS_LIMIT,
    META_EVENTS_NEXT,
    counter,
    pack_event,
    unpack_event,
)

Event = BlockStored | BlockRemoved | AllBlocksCleared

# Default bound of the log (batches): a router that was away for this many batches or
# fewer catches up by replay. At ~100-600 bytes per batch, tens of MiB of the store.
DEFAULT_EVENTS_LIMIT = 100_000


class EventLog:
    """The events of one write transaction, per model number, in the order they happen.

    Args:
        txn: the write transaction.
        meta: the ``meta`` sub-database.
        events: the ``events`` sub-database.
        model_name: the model id of a model number (read in ``txn``).
    """

    def __init__(self, txn: Any, meta: Any, events: Any, model_name: Callable[[int], str]):
        self._txn = txn
        self._meta = meta
        self._db = events
        self._model_name = model_name
        self._names: dict[int, str] = {}  # ids resolved early: a model deleted in txn
        self.limit = counter(txn.get(META_EVENTS_LIMIT, None, meta))
        self._batches: dict[int, list[Event]] = {}
        # per model: blocks that left the disk for the tier, announced after its events
        self._to_tier: dict[int, list[tuple[int, int, np.ndarray]]] = {}

    def _events(self, model: int) -> list[Event]:
        batch = self._batches.get(model)
        if batch is None:
            batch = self._batches[model] = []
        return batch

    def stored(
        self, model: int, hashes: list[int], parent: int, ids: np.ndarray, medium: str
    ) -> None:
        """A chain of ``hashes`` from ``parent`` (0: none) is on ``medium``; ``ids`` holds
        their token ids, one row per block."""
        if not hashes:
            return
        self._events(model).append(
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=parent or None,
                token_ids=ids.reshape(-1).tolist(),
                block_size=int(ids.shape[1]),
                lora_id=None,
                medium=medium,
                lora_name=None,
            )
        )

    def removed(self, model: int, block_hash: int, medium: str = MEDIUM_STORAGE) -> None:
        """A block is no longer on ``medium`` (joined to the last event when it is a removal
        on the same medium)."""
        events = self._events(model)
        last = events[-1] if events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(block_hash)
        else:
            events.append(BlockRemoved(block_hashes=[block_hash], medium=medium))

    def to_tier(self, model: int, block_hash: int, parent: int, ids: np.ndarray) -> None:
        """A block left the disk and is only in the object tier now: announced on
        ``MEDIUM_TIER`` after the model's other events, chained runs as one event."""
        self._to_tier.setdefault(model, []).append((block_hash, parent, ids))

    def cleared(self, model: int) -> None:
        """Every block of the model is gone (called while the model is still registered:
        its id is read now, for a model the transaction deletes)."""
        self._names[model] = self._model_name(model)
        self._batches[model] = [AllBlocksCleared()]
        self._to_tier.pop(model, None)

    def _flush_tier(self) -> None:
        for model, blocks in self._to_tier.items():
            run: list[int] = []
            rows: list[np.ndarray] = []
            parent = 0
            for h, p, ids in [*blocks, (0, -1, blocks[0][2])]:  # a sentinel ends the last run
                if run and p != run[-1]:
                    self.stored(model, run, parent, np.stack(rows), MEDIUM_TIER)
                    run, rows = [], []
                if p < 0:
                    break
                if not run:
                    parent = p
                run.append(h)
                rows.append(ids)
        self._to_tier.clear()

    def write(self) -> bool:
        """Append one batch per model to the log (the next sequence numbers), and trim it
        to ``limit`` batches; nothing while the log is off. Whether it wrote any."""
        self._flush_tier()
        if not self.limit or not any(self._batches.values()):
            self._batches.clear()
            return False
        txn, meta = self._txn, self._meta
        seq = counter(txn.get(META_EVENTS_NEXT, None, meta))
        ts = time.time()
        for model, events in self._batches.items():
            if not events:
                continue
            name = self._names.get(model) or self._model_name(model)
            value = pack_event(name, encode_batch(ts, events))
            txn.put(EVENT_KEY.pack(seq), value, db=self._db)
            seq += 1
        txn.put(META_EVENTS_NEXT, COUNTER.pack(seq), db=meta)
        self._trim(seq - self.limit)
        self._batches.clear()
        return True

    def _trim(self, below: int) -> None:
        """Delete the batches numbered below ``below`` (the oldest, a few at a time)."""
        if below <= 0:
            return
        cursor = self._txn.cursor(db=self._db)
        ok = cursor.first()
        while ok:
            key = cursor.key()
            if len(key) != EVENT_KEY.size or EVENT_KEY.unpack(key)[0] >= below:
                return
            ok = cursor.delete()


def set_limit(txn: Any, meta: Any, events: Any, limit: int) -> None:
    """Turn the log on with a bound of ``limit`` batches (trimming it now), or off (0:
    the log is emptied; the next sequence number stays)."""
    if limit:
        txn.put(META_EVENTS_LIMIT, COUNTER.pack(limit), db=meta)
        log = EventLog(txn, meta, events, str)
        log._trim(counter(txn.get(META_EVENTS_NEXT, None, meta)) - limit)
    else:
        txn.delete(META_EVENTS_LIMIT, db=meta)
        txn.drop(events, delete=False)


def read(txn: Any, events: Any, start: int, limit: int) -> list[tuple[int, str, bytes]]:
    """Up to ``limit`` batches numbered ``start`` or above, in order: ``(seq, model id,
    payload)``."""
    out: list[tuple[int, str, bytes]] = []
    cursor = txn.cursor(db=events)
    ok = cursor.set_range(EVENT_KEY.pack(start))
    while ok and len(out) < limit:
        model, payload = unpack_event(cursor.value())
        out.append((EVENT_KEY.unpack(cursor.key())[0], model, payload))
        ok = cursor.next()
    return out


def bounds(txn: Any, meta: Any, events: Any) -> tuple[int, int, int]:
    """``(first seq held, next seq, limit)``: the log holds ``first .. next - 1``."""
    nxt = counter(txn.get(META_EVENTS_NEXT, None, meta))
    cursor = txn.cursor(db=events)
    first = EVENT_KEY.unpack(cursor.key())[0] if cursor.first() else nxt
    return first, nxt, counter(txn.get(META_EVENTS_LIMIT, None, meta))
