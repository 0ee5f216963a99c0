"""A store's link to its object-store tier: the pending set, read-through, tier queries.

A model handle (``state.Handle``, seen here as ``LinkedHandle``) calls in at a few points
(the handle stays the one owner of transactions):
a put's new blocks join the ``pending`` sub-database in its own write transaction
(``WriteTxn.pending``) and wake the :class:`~kvstore.tier.uploader.Uploader`; a local miss
of ``get``/``get_many``/``read_through`` fetches the objects concurrently, validates each
by every reader rule, the CRC, the store's geometry and the key's hash
(``tier.validate``), and inserts the good ones as ordinary evictable blocks (not
pending: the tier has them). A refused object is counted and logged, never stored or
served. The namespace's geometry object is created before its first block is uploaded,
and a store without a geometry yet reads it from there (``learned_geometry``).

The local copy of a read-through block is committed by a filler thread (``_Filler``), so
``get`` serves the validated bytes without waiting for a durable local write of a block
the tier holds anyway (a durable commit of a large read-through takes longer than fetching
it). ``read_through``, whose callers serve from LMDB's map, waits for it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from ..codec.assembly import crc_matches
from ..codec.envelope import Envelope
from ..codec.geometry import Geometry
from ..codec.layout import U64_MAX
from ..errors import EnvelopeError, StoreError
from ..tier import Tier, Uploader, check_block_object, namespace_of
from .diskformat import BLOCK_KEY, PENDING_SINCE, Dbs
from .writetxn import WriteTxn

log = logging.getLogger("tlkv.store")

QUERY_BATCH = 256  # hashes per round of HEADs when a prefix is looked up in the tier
GEOMETRY_RETRY = 1.0  # seconds before a tier without the namespace's geometry is asked again
# How long the caller that asks the tier for a namespace's geometry waits for the answer
# (a loaded machine's first request to a tier took over 2 s). The question goes on in the
# background past it, so a tier that accepts connections and never answers costs a request
# (and a worker's start-up) at most this, once per question.
GEOMETRY_WAIT = 10.0
FILL_QUEUE_BYTES = 512 << 20  # read-through bytes awaiting their local commit, at most

T = TypeVar("T")


class LinkedHandle(Protocol):
    """What a link needs of its model's handle (``state.Handle``)."""

    model: str
    dbs: Dbs

    @property
    def path(self) -> str: ...
    @property
    def allow_nonfinite(self) -> bool: ...
    @property
    def is_root(self) -> bool: ...
    def current_geometry(self) -> Geometry | None: ...
    def begin_read(self, buffers: bool) -> Any: ...
    def end_read(self, txn: Any) -> None: ...
    def write(self, body: Callable[[WriteTxn], T], need: int = 0, create: bool = False) -> T: ...
    def resolve(self, create: bool) -> None: ...
    def adopt_geometry(self, w: WriteTxn, geometry: Geometry) -> None: ...
    def quarantine(self, hashes: list[int]) -> None: ...


class _Filler:
    """Commits read-through blocks on a thread of its own, in batches; ``submit`` waits
    only while ``FILL_QUEUE_BYTES`` are queued already."""

    def __init__(self, insert: Callable[[list[Envelope]], None]) -> None:
        self._insert = insert
        self._cv = threading.Condition()
        self._queue: list[Envelope] = []
        self._bytes = 0
        self._busy = False
        self._stopping = False
        self._thread: threading.Thread | None = None

    def submit(self, envs: list[Envelope]) -> None:
        size = sum(len(e.data) for e in envs)
        with self._cv:
            self._cv.wait_for(lambda: self._bytes == 0 or self._bytes + size <= FILL_QUEUE_BYTES)
            self._queue.extend(envs)
            self._bytes += size
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="tlkv-tier-fill", daemon=True
                )
                self._thread.start()
            self._cv.notify_all()

    def flush(self) -> None:
        """Wait until every submitted block is committed (or given up)."""
        with self._cv:
            self._cv.wait_for(lambda: not self._queue and not self._busy)

    def close(self) -> None:
        self.flush()
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._stopping)
                if not self._queue:
                    return
                batch, self._queue, self._busy = self._queue, [], True
            try:
                self._insert(batch)
            except Exception as exc:  # the filler must outlive any one batch
                log.warning("read-through blocks not kept: %s: %s", type(exc).__name__, exc)
            finally:
                with self._cv:
                    self._bytes -= sum(len(e.data) for e in batch)
                    self._busy = False
                    self._cv.notify_all()


class TierLink:
    """The tier of one model's handle, and the uploader draining its pending set."""

    def __init__(self, handle: LinkedHandle, tier: Tier) -> None:
        self._handle = handle
        self.tier = tier
        # The store's model is its namespace in the tier (one Tier serves every model).
        self.namespace = namespace_of(handle.model)
        self.filler = _Filler(self._insert)
        self._geometry_written = False
        self._learned: Geometry | None = None
        self._asked_at = -GEOMETRY_RETRY
        self._asking: threading.Thread | None = None  # the geometry question in flight
        self._asking_until = 0.0  # when its callers stop waiting for it (monotonic)
        self._asking_lock = threading.Lock()
        self.uploader = Uploader(self, tier, handle.path, self.namespace)
        if handle.is_root:  # the processes of one store see one tier state
            tier.share_state(handle.path)

    def close(self) -> None:
        """Commit the read-through blocks in flight; stop the uploader (what is not
        uploaded stays pending for the next open)."""
        self.filler.close()
        self.uploader.stop()
        if self._handle.is_root:
            self.tier.stop_sharing()

    def wait_uploaded(self, timeout: float | None) -> bool:
        """``Store.wait_uploaded``: wait until the blocks read through are committed and
        none is pending upload; False on timeout."""
        self.filler.flush()
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.pending_count():
            self.uploader.wake()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self.uploader.wait_idle(0.05 if left is None else min(0.05, left))
        return True

    # --- the pending set (the uploader's source) ---------------------------------------------

    def pending_batch(
        self, max_blocks: int, max_bytes: int, after: int = -1
    ) -> list[tuple[int, bytes]]:
        """Pending blocks with hashes above ``after``, in hash order, copied from one
        snapshot; a block deleted meanwhile leaves the set, a corrupt one is quarantined
        (never uploaded). Nothing is handed out before the namespace's geometry object
        exists in the tier."""
        handle, dbs = self._handle, self._handle.dbs
        if not self._geometry_written:
            geometry = handle.current_geometry()
            if geometry is None or not self.tier.put_geometry(geometry, self.namespace):
                return []  # no block yet, or the tier failed: asked again on the next poll
            self._geometry_written = True
        out: list[tuple[int, bytes]] = []
        gone: list[int] = []
        corrupt: list[int] = []
        size = 0
        txn = handle.begin_read(False)
        try:
            cursor = txn.cursor(db=dbs.pending)
            if after >= U64_MAX or not (
                cursor.set_range(BLOCK_KEY.pack(after + 1)) if after >= 0 else cursor.first()
            ):
                return out
            for key in cursor.iternext(values=False):
                h = BLOCK_KEY.unpack(key)[0]
                value = txn.get(key, None, dbs.blocks)
                if value is None:
                    gone.append(h)
                elif not crc_matches(value):
                    corrupt.append(h)
                else:
                    out.append((h, value))
                    size += len(value)
                    if len(out) >= max_blocks or size >= max_bytes:
                        break
        finally:
            handle.end_read(txn)
        if gone:
            self.uploaded(gone)
        if corrupt:
            handle.quarantine(corrupt)
        return out

    def uploaded(self, hashes: list[int]) -> None:
        """Clear uploaded (or vanished) blocks from the pending set."""
        if not hashes:
            return

        def body(w: WriteTxn) -> None:
            for h in hashes:
                w.txn.delete(BLOCK_KEY.pack(h), db=w.dbs.pending)

        self._handle.write(body)

    def learned_geometry(self) -> Geometry | None:
        """The namespace's geometry from the tier, for a store that has none yet: read
        once it exists (kept), asked at most every ``GEOMETRY_RETRY`` seconds until then.

        The question runs in a thread of its own. Every caller (the one that asks, and
        any that come while it is in flight, such as the uploader) waits for its answer
        until ``GEOMETRY_WAIT`` seconds after it was asked, then gets None (no geometry
        known yet): a hung tier never stalls a request or a start-up for longer."""
        if self._learned is not None:
            return self._learned
        with self._asking_lock:
            asking = self._asking
            if asking is None or not asking.is_alive():
                if time.monotonic() - self._asked_at < GEOMETRY_RETRY:
                    return None
                self._asked_at = time.monotonic()
                self._asking_until = self._asked_at + GEOMETRY_WAIT
                asking = threading.Thread(
                    target=self._ask_geometry, name="tlkv-geometry", daemon=True
                )
                self._asking = asking
                asking.start()
        asking.join(max(0.0, self._asking_until - time.monotonic()))
        return self._learned

    def _ask_geometry(self) -> None:
        learned = self.tier.get_geometry(self.namespace)
        if learned is not None:
            self._learned = learned
        self._asked_at = time.monotonic()  # the next question waits GEOMETRY_RETRY from here

    def pending_count(self) -> int:
        """Blocks waiting for upload."""
        txn = self._handle.begin_read(False)
        try:
            return int(txn.stat(self._handle.dbs.pending)["entries"])
        finally:
            self._handle.end_read(txn)

    def backlog(self) -> tuple[int, int, float]:
        """The pending set: blocks, their bytes, and the age in seconds of the oldest
        (0 when empty or of unknown age); one read snapshot, a lookup per pending block."""
        handle, dbs = self._handle, self._handle.dbs
        blocks = size = 0
        oldest = None
        txn = handle.begin_read(True)
        try:
            for key, since in txn.cursor(db=dbs.pending):
                value = txn.get(key, None, dbs.blocks)
                blocks += 1
                size += 0 if value is None else len(value)
                if len(since) == PENDING_SINCE.size:
                    ms = PENDING_SINCE.unpack(since)[0]
                    oldest = ms if oldest is None else min(oldest, ms)
        finally:
            handle.end_read(txn)
        age = 0.0 if oldest is None else max(0.0, time.time() - oldest / 1000)
        return blocks, size, age

    # --- reads -----------------------------------------------------------------------------------

    def fetch(self, hashes: Sequence[int], *, wait: bool = False) -> dict[int, bytes]:
        """Read ``hashes`` through from the tier: the valid objects' bytes, queued for
        their local commit (committed when this returns with ``wait``)."""
        wanted = list(dict.fromkeys(h for h in hashes if h))
        if not wanted:
            return {}
        handle = self._handle
        geometry = handle.current_geometry()
        envs: list[Envelope] = []
        valid: dict[int, bytes] = {}
        for h, data in zip(wanted, self.tier.fetch(wanted, self.namespace)):
            if data is None:
                continue
            try:
                env = check_block_object(data, h, geometry, allow_nonfinite=handle.allow_nonfinite)
            except EnvelopeError as exc:
                self.tier.refused += 1
                log.warning("tier object of block %016x refused: %s", h, exc)
                continue
            geometry = geometry or env.geometry
            envs.append(env)
            valid[h] = data
        if not envs:
            return {}
        self.filler.submit(envs)
        if wait:
            self.filler.flush()
        self.tier.read_hits += len(envs)
        return valid

    def _insert(self, envs: list[Envelope]) -> None:
        """Store read-through blocks as ordinary evictable blocks (not pending); a model
        this store has not created yet is created by them."""
        handle = self._handle
        handle.resolve(create=True)

        def body(w: WriteTxn) -> None:
            w.pending = False  # the tier has them
            handle.adopt_geometry(w, envs[0].geometry)
            for env in envs:
                w.put_blocks(env)

        try:
            handle.write(body, sum(len(e.data) for e in envs), create=True)
        except (StoreError, EnvelopeError) as exc:  # served anyway: they were validated
            log.warning("%s: blocks read through from the tier not kept: %s", handle.path, exc)

    def present(self, hashes: Sequence[int]) -> list[bool]:
        """Whether each block has an object in the tier (concurrent HEADs)."""
        return self.tier.present(list(hashes), self.namespace)

    def prefix(self, hashes: Sequence[int]) -> int:
        """How many leading ``hashes`` have objects, asked ``QUERY_BATCH`` at a time."""
        n = 0
        for start in range(0, len(hashes), QUERY_BATCH):
            batch = hashes[start : start + QUERY_BATCH]
            found = self.present(batch)
            try:
                return n + found.index(False)
            except ValueError:
                n += len(batch)
        return n

    def info(self) -> dict[str, Any]:
        """The tier's state and counters (shared by the store's models), with this model's
        namespace and number of pending uploads."""
        blocks, size, age = self.backlog()
        return {
            **self.tier.info(),
            "namespace": self.namespace,
            "pending_uploads": blocks,
            "pending_bytes": size,
            "oldest_pending_seconds": age,
        }
