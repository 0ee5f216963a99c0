"""The block store's write side: one LMDB write transaction and every change it makes.

``WriteTxn`` keeps the store's invariants inside a transaction: a block is in ``blocks``
and ``index`` together; an unpinned block has one ``atime`` tick and the matching
``lru`` entry, a pinned one has neither; ``refs`` counts the sequence positions served
from the block space; the ``bytes`` counter is the size of every stored value.

A transaction writes one model's sub-databases (``dbs``); capacity eviction may remove
any model's blocks (the LRU order is store-wide), a quota's only its own model's. Each
change is counted in the store totals and, for a model other than the default, in that
model's own counters too (``diskformat``).

Every removal of a block (eviction, delete, quarantine, a restore undone) also drops its
token ids and, when it was announced on the node's disk, notes a ``BlockRemoved`` on the
transaction's ``events`` (``eventlog``), written with the commit; ``tokentxn`` keeps the
token ids a put brings and announces its blocks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..codec.assembly import SingleBlock, single_block, stored_crc
from ..codec.checksum import crc32c, join_crc_into
from ..codec.envelope import Envelope
from ..codec.layout import (
    HEADER_SIZE,
    NO_HASH,
    TRAILER_SIZE,
)
from ..codec.tokens import BlockTokens
from ..errors import StoreFullError
from ..pipeline import OrderedPipeline
from .diskformat import (
    BLOCK_KEY,
    COUNTER,
    COUNTER_KEYS,
    INDEX_KEY,
    INDEX_VALUE,
    META_BYTES,
    MODEL_COUNTER_KEYS,
    PENDING_SINCE,
    QUARANTINE_BLOCK,
    QUARANTINED_AT,
    REFCOUNT,
    Dbs,
    counter,
    model_counter_key,
    quarantine_key,
)
from .eventlog import EventLog
from .eviction import LruOrder
from .keylog import KeyChanges
from .tokentxn import forget_tokens, keep_tokens

log = logging.getLogger("tlkv.store")

# Blocks at least this large are staged by a helper thread while LMDB copies the last one.
PIPELINE_MIN_RECORD = 256 << 10


class CrcMismatch(Exception):
    """An envelope's CRC failed while it was being written (the transaction aborts)."""

    def __init__(self, envelope: Envelope) -> None:
        super().__init__("CRC mismatch")
        self.envelope = envelope


class _Staging:
    """A reusable single-block envelope under construction: header, record and CRC."""

    __slots__ = ("buf", "consts")

    def __init__(self, consts: SingleBlock) -> None:
        self.consts = consts
        self.buf = bytearray(consts.single_len)

    def fill(self, record: memoryview) -> int:
        """Write the one-block envelope of ``record``, copied and checksummed in one pass
        (``join_crc_into``, without the GIL); returns the record's own CRC-32C."""
        join_crc_into((self.consts.header1, record), self.buf)
        return self.consts.record_crc(self.buf)


class WriteTxn:
    """One write transaction: the block-space operations and the counters they change."""

    def __init__(
        self,
        txn: Any,
        dbs: Dbs,
        capacity: int | None,
        pool: Callable[[], ThreadPoolExecutor],
        path: str,
        *,
        quota: int | None = None,
        dbs_of: Callable[[int], Dbs] | None = None,
        model_name: Callable[[int], str] = str,
    ) -> None:
        self.txn = txn
        self.dbs = dbs
        self.capacity = capacity
        self.quota = quota
        self._dbs_of = dbs_of
        self._pool = pool
        self.path = path
        self._loaded = tuple(counter(txn.get(key, None, dbs.meta)) for key in COUNTER_KEYS)
        self.bytes, tick, self.evictions, self.corrupt = self._loaded
        self.lru = LruOrder(txn, dbs.atime, dbs.lru, tick, dbs.number, self._atime_of)
        self.protect: set[int] = set()  # hashes this transaction must not evict
        # While the store has a tier: new blocks join their model's pending-upload set
        # (``pending``: False for blocks read through from the tier), and no model's
        # pending blocks are evicted (``keep_pending``).
        self.pending = False
        self.keep_pending = False
        self.inserted = 0  # bytes of the block values this transaction wrote
        self.after_commit: list[Callable[[], None]] = []
        # model number -> changes of its (bytes, evictions, corrupt) in this transaction
        self._deltas: dict[int, list[int]] = {}
        self.events = EventLog(txn, dbs.meta, dbs.events, model_name)
        self.key_changes = KeyChanges()  # written to the key log with the commit

    def _atime_of(self, model: int) -> Any:
        return self._other(model).atime

    def _other(self, model: int) -> Dbs:
        if model == self.dbs.number:
            return self.dbs
        if self._dbs_of is None:
            raise KeyError(model)
        return self._dbs_of(model)

    def count(self, model: int, field: int, amount: int) -> None:
        """Note a change of a model's bytes (0), evictions (1) or corrupt (2) counter."""
        deltas = self._deltas.get(model)
        if deltas is None:
            deltas = self._deltas[model] = [0, 0, 0]
        deltas[field] += amount

    def model_bytes(self) -> int:
        """The bytes stored by this transaction's model, as of now."""
        model = self.dbs.number
        if model:
            key = model_counter_key(META_BYTES, model)
            return counter(self.txn.get(key, None, self.dbs.meta)) + self._delta(model, 0)
        others = sum(d[0] for m, d in self._deltas.items() if m)  # the total minus those
        prefix = META_BYTES + b"@"
        cur = self.txn.cursor(db=self.dbs.meta)
        ok = cur.set_range(prefix)
        while ok and bytes(cur.key()).startswith(prefix):
            others += counter(cur.value())
            ok = cur.next()
        return self.bytes - others

    def _delta(self, model: int, field: int) -> int:
        deltas = self._deltas.get(model)
        return 0 if deltas is None else deltas[field]

    def save(self) -> None:
        """Write back the counters that changed, the event batches and the key log
        record (before commit)."""
        self.events.write()
        if self.dbs.keylog is not None:
            self.key_changes.write(self.txn, self.dbs.keylog, self.dbs.meta)
        values = (self.bytes, self.lru.tick, self.evictions, self.corrupt)
        for key, old, new in zip(COUNTER_KEYS, self._loaded, values):
            if old != new:
                self.txn.put(key, COUNTER.pack(new), db=self.dbs.meta)
        for model, deltas in self._deltas.items():
            if not model:
                continue  # the default model's counters are the totals minus the others'
            for base, amount in zip(MODEL_COUNTER_KEYS, deltas):
                if amount:
                    key = model_counter_key(base, model)
                    value = counter(self.txn.get(key, None, self.dbs.meta)) + amount
                    self.txn.put(key, COUNTER.pack(value), db=self.dbs.meta)

    def touch(self, h: int) -> None:
        """A use of a stored block (the eviction policy's input)."""
        self.lru.touch(h)

    # --- blocks ---------------------------------------------------------------------------

    def insert_block(self, h: int, value: Any) -> None:
        hk = BLOCK_KEY.pack(h)
        self.txn.put(hk, value, db=self.dbs.blocks)
        self.txn.put(INDEX_KEY, INDEX_VALUE.pack(h), db=self.dbs.index)
        self.key_changes.added(self.dbs.number, h)
        self.bytes += len(value)
        self.inserted += len(value)
        self.count(self.dbs.number, 0, len(value))
        if self.txn.get(hk, None, self.dbs.refs) is None:
            self.lru.add(hk, h)
        if self.pending:
            self.txn.put(hk, PENDING_SINCE.pack(int(time.time() * 1000)), db=self.dbs.pending)

    def remove_block(self, hk: bytes, h: int, size: int) -> None:
        self.txn.delete(hk, db=self.dbs.blocks)
        self.txn.delete(hk, db=self.dbs.pending)
        self.txn.delete(INDEX_KEY, INDEX_VALUE.pack(h), db=self.dbs.index)
        self.key_changes.removed(self.dbs.number, h)
        self.lru.remove(hk, h)
        self.bytes -= size
        self.count(self.dbs.number, 0, -size)
        forget_tokens(self, self.dbs, hk, h)

    def pin(self, h: int, count: int) -> None:
        hk = BLOCK_KEY.pack(h)
        raw = self.txn.get(hk, None, self.dbs.refs)
        old = 0 if raw is None else REFCOUNT.unpack(raw)[0]
        self.txn.put(hk, REFCOUNT.pack(old + count), db=self.dbs.refs)
        if old == 0:
            self.lru.remove(hk, h)

    def unpin(self, h: int, count: int) -> None:
        hk = BLOCK_KEY.pack(h)
        raw = self.txn.get(hk, None, self.dbs.refs)
        left = (0 if raw is None else REFCOUNT.unpack(raw)[0]) - count
        if left > 0:
            self.txn.put(hk, REFCOUNT.pack(left), db=self.dbs.refs)
            return
        self.txn.delete(hk, db=self.dbs.refs)
        if self.txn.get(hk, None, self.dbs.blocks) is not None:
            self.lru.add(hk, h)  # unpinned blocks re-enter the LRU as recently used

    def make_room(self, need: int) -> None:
        """Evict least-recently-used unpinned blocks until ``need`` more bytes fit: this
        model's until its quota holds them, then any model's until the capacity does.

        Raises:
            StoreFullError: they cannot fit even after evicting every evictable block
                (the transaction is aborted: nothing is evicted either).
        """
        quota = self.quota
        if quota is not None:
            used = [self.model_bytes()]  # a cell: the predicate reads it as victims go
            if used[0] + need > quota:
                victims = self.lru.evict_any(
                    self.protect,
                    lambda: used[0] + need <= quota,
                    only=self.dbs.number,
                    keep=self._keep_pending(),
                )
                for m, h in victims:
                    used[0] -= self._evict(m, h)
                if used[0] + need > quota:
                    raise StoreFullError(
                        f"a write of {need} bytes does not fit in this model's "
                        f"quota_bytes={quota}: {used[0]} bytes stay stored (pinned by "
                        "sequences or part of this write) after evicting every other block "
                        "of the model; nothing was stored"
                    )
        cap = self.capacity
        if cap is None or self.bytes + need <= cap:
            return
        for m, h in self.lru.evict_any(
            self.protect, lambda: self.bytes + need <= cap, keep=self._keep_pending()
        ):
            self._evict(m, h)
        if self.bytes + need > cap:
            raise StoreFullError(
                f"a write of {need} bytes does not fit in capacity_bytes={cap}: "
                f"{self.bytes} bytes stay stored (pinned by sequences, pending upload to the "
                "tier, or part of this write) "
                "after evicting every other block; nothing was stored"
            )

    def _keep_pending(self) -> Callable[[int, int], bool] | None:
        """Eviction's test of the blocks pending upload (None without a tier)."""
        if not self.keep_pending:
            return None
        get = self.txn.get

        def pending(model: int, h: int) -> bool:
            return get(BLOCK_KEY.pack(h), None, self._other(model).pending) is not None

        return pending

    def _evict(self, model: int, h: int) -> int:
        """Remove an LRU victim of ``model`` (its recency is gone already); its size."""
        txn, dbs = self.txn, self._other(model)
        hk = BLOCK_KEY.pack(h)
        value = txn.get(hk, None, dbs.blocks)
        if value is None:
            return 0
        size = len(value)  # before any write moves pages
        txn.delete(hk, db=dbs.blocks)
        txn.delete(hk, db=dbs.pending)  # a store opened without its tier may evict them
        txn.delete(INDEX_KEY, INDEX_VALUE.pack(h), db=dbs.index)
        self.key_changes.removed(model, h)
        self.bytes -= size
        self.evictions += 1
        self.count(model, 0, -size)
        self.count(model, 1, 1)
        forget_tokens(self, dbs, hk, h, to_tier=self.keep_pending)
        return size

    def quarantine(self, h: int, still_bad: Callable[[Any], bool]) -> bool:
        """Remove a block that fails its CRC (if it still does); count and log it."""
        hk = BLOCK_KEY.pack(h)
        value = self.txn.get(hk, None, self.dbs.blocks)
        if value is None or not still_bad(value):
            return False  # gone already, or put again since
        self.remove_block(hk, h, len(value))
        self.corrupt += 1
        self.count(self.dbs.number, 2, 1)
        self.note_quarantined(QUARANTINE_BLOCK, hk)
        log.warning(
            "%s: block %016x failed its CRC-32C; quarantined (removed from the block space, "
            "counted in stats()['corrupt'])",
            self.path,
            h,
        )
        return True

    def note_quarantined(self, kind: bytes, key: bytes) -> None:
        """Record what was just quarantined, for the scrub to report and repair."""
        at = QUARANTINED_AT.pack(int(time.time() * 1000))
        self.txn.put(quarantine_key(kind, self.dbs.number, key), at, db=self.dbs.meta)

    # --- writing envelopes ----------------------------------------------------------------

    def write_records(self, env: Envelope, hashes: list[int], new: list[bool]) -> None:
        """Store the marked records as single-block envelopes; check the CRC in the same pass.

        The envelope's CRC is verified by combining every record's CRC, so each record is
        read once (from its staging copy for stored blocks); a mismatch raises
        ``CrcMismatch`` and the transaction aborts. Large blocks are staged by a helper
        thread while LMDB copies the previous one (copy and CRC run without the GIL).
        """
        mv = env.data
        end = len(mv) - TRAILER_SIZE
        expected = stored_crc(mv)
        if len(env) == 1:  # the envelope is the value: no copy
            if crc32c(mv[:end]) != expected:
                raise CrcMismatch(env)
            if new[0]:
                self.insert_block(hashes[0], mv)
            return
        c = single_block(env.geometry, env.version)
        total = crc32c(mv[:HEADER_SIZE])
        if c.record_bytes >= PIPELINE_MIN_RECORD and sum(new) > 1:
            total = self._write_pipelined(env, hashes, new, c, total)
        else:
            staging = _Staging(c) if any(new) else None
            for i in range(len(env)):
                record = env.record(i)
                if staging is not None and new[i]:
                    crc = staging.fill(record)
                    self.insert_block(hashes[i], staging.buf)
                else:
                    crc = crc32c(record)
                total = c.shift(total) ^ crc
        if total != expected:
            raise CrcMismatch(env)

    def _write_pipelined(
        self, env: Envelope, hashes: list[int], new: list[bool], c: SingleBlock, total: int
    ) -> int:
        """``write_records`` with a helper thread filling the next of two staging buffers."""
        stagings = (_Staging(c), _Staging(c))
        n, nxt, turn = len(env), 0, 0
        # A staging buffer weighs 1: both may be filling while neither is inserted yet.
        with OrderedPipeline[int](self._pool(), max_weight=len(stagings)) as pipeline:
            while True:
                while nxt < n and pipeline.has_room(int(new[nxt])):
                    record = env.record(nxt)
                    if new[nxt]:
                        staging = stagings[turn]
                        turn ^= 1
                        pipeline.submit((nxt, staging), staging.fill, record, weight=1)
                    else:
                        pipeline.submit((nxt, None), crc32c, record)
                    nxt += 1
                if not len(pipeline):
                    return total
                (i, staging), crc = pipeline.take()
                total = c.shift(total) ^ crc
                if staging is not None:
                    self.insert_block(hashes[i], staging.buf)

    def put_blocks(
        self, env: Envelope, tokens: BlockTokens | None = None
    ) -> tuple[list[int], list[int], int]:
        """Store every new full block of ``env``; keep and announce their token ids
        (``tokens``, verified: one row per full block; ``tokentxn``).

        Returns ``(stored, duplicate, partial)``: the hashes written by this transaction,
        the hashes already present (or repeated within ``env``), in envelope order, and
        the number of partial blocks.
        """
        txn, blocks = self.txn, self.dbs.blocks
        hashes = env.hashes.tolist()
        new = [False] * len(hashes)
        seen: set[int] = set()
        stored: list[int] = []
        duplicate: list[int] = []
        partial = 0
        for i, h in enumerate(hashes):
            if h == NO_HASH:
                partial += 1
                continue
            if h in seen:
                duplicate.append(h)
                continue
            seen.add(h)
            if txn.get(BLOCK_KEY.pack(h), None, blocks) is None:
                new[i] = True
                stored.append(h)
            else:
                duplicate.append(h)
                self.touch(h)  # a re-put is a use: keep it over older blocks
        self.protect |= seen
        self.make_room(len(stored) * single_block(env.geometry, env.version).single_len)
        self.write_records(env, hashes, new)
        keep_tokens(self, hashes, new, tokens)
        return stored, duplicate, partial
