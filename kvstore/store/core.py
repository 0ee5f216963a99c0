"""The state of one ``Store`` handle and the transactions every part of its API runs in.

``StoreCore`` is the base of ``Store`` (``store``) and of the mixins that hold its API
(``reads``, ``writes``, ``models``, ``stats``): the handle's attributes, the usability
check (closed, forked), read transactions, the one write-transaction runner (pending read
hits persisted first, a model's registration claimed inside the write), finding the
handle's model, its geometry, and the background flush of pending hits.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from ..codec.geometry import Geometry
from ..errors import ShapeError, StoreError
from ..protocol import DEFAULT_MODEL
from .diskformat import META_GEOMETRY, META_GEOMETRY_VALUE, Dbs
from .eviction import RecencyBuffer
from .keyset import KeySet
from .lmdbenv import LmdbEnv
from .reader import KvSpec
from .registry import Reclaim, Registry, UnknownModel
from .writetxn import WriteTxn

if TYPE_CHECKING:
    from .store import Store
    from .tiered import TierLink

log = logging.getLogger("tlkv.store")

_FLUSH_INTERVAL = 5.0  # seconds: pending read hits are persisted at least this often

T = TypeVar("T")


class StoreCore:
    """A handle's state and transactions (the base of ``Store``; see ``Store.__init__``
    and ``Store._handle`` for what each attribute starts as)."""

    _path: str
    _capacity: int | None
    _sync: bool
    _allow_nonfinite: bool
    _closed: bool
    _forked: bool
    _pid: int
    _geometry: Geometry | None
    _recency: RecencyBuffer
    _flush_lock: threading.Lock
    _last_flush: float
    _pool: ThreadPoolExecutor | None
    _pool_lock: threading.Lock
    _rconsts: tuple[Geometry, dict[int, int], dict[int, KvSpec]] | None
    _lmdb: LmdbEnv
    _env: Any
    _dbs: Dbs
    _keys: KeySet
    _root: Store
    _pending: int | None  # a number this model claims by its first write
    _model: str
    _quota: int | None
    _registry: Registry
    # (model, quota) -> shared handle; (model, quota, geometry) -> a handle given the
    # geometry of a model that had none yet
    _handles: dict[tuple[Any, ...], Store]
    _handles_lock: threading.RLock
    _tier: TierLink | None
    hits: int
    misses: int
    # This process's figures for the service's metrics (``api.metrics``):
    tier_hits: int  # local misses answered from the object tier (read through)
    served_bytes: int  # envelope bytes handed out by get, get_many and get_buffers
    written_bytes: int  # block bytes written (puts, read-through copies, repairs)

    @property
    def path(self) -> str:
        """The environment's directory."""
        return self._path

    # --- transactions --------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed or self._root._closed:
            raise StoreError(f"the store {self._path} is closed")
        if self._forked or self._root._forked:
            raise StoreError(
                f"the store {self._path} was opened in process {self._pid}; "
                "open stores after fork, in the process that uses them"
            )

    def _begin_read(self, buffers: bool) -> Any:
        """A read transaction holding the map guard; end it with ``_end_read``."""
        self._check_usable()
        if self._dbs.number < 0 or self._pending is not None:  # created elsewhere since?
            self._resolve(create=False)
        return self._lmdb.begin_read(buffers)

    def _end_read(self, txn: Any) -> None:
        self._lmdb.end_read(txn)

    def _write(self, body: Callable[[WriteTxn], T], need: int = 0) -> T:
        """Run ``body`` in one write transaction, after persisting pending read hits.

        ``need``: the bytes the body writes (the map grows ahead of large writes).
        """
        self._check_usable()
        taken = self._recency.take()

        def run(txn: Any) -> tuple[T, WriteTxn]:
            w = WriteTxn(
                txn,
                self._dbs,
                self._capacity,
                self._helper_pool,
                self._path,
                quota=self._quota,
                dbs_of=self._registry.opened,
            )
            if self._pending is not None:
                self._registry.claim(txn, self._model, self._pending)
            if self._tier is not None:
                w.pending = w.keep_pending = True
            for h in taken:
                w.touch(h)
            result = body(w)
            w.save()
            return result, w

        while True:
            try:
                result, w = self._lmdb.write(run, need)
                break
            except UnknownModel as exc:  # evicting a model created by another process
                self._registry.dbs(exc.number)
            except Reclaim:
                self._resolve(create=True)
            except BaseException:
                self._recency.restore(taken)
                raise
        self._last_flush = time.monotonic()
        self._pending = None
        self.written_bytes += w.inserted
        for hook in w.after_commit:
            hook()
        return result

    def _helper_pool(self) -> ThreadPoolExecutor:
        root = self._root
        with root._pool_lock:
            if root._pool is None:
                root._pool = ThreadPoolExecutor(1, thread_name_prefix="tlkv-store-stage")
            return root._pool

    # --- the handle's model and geometry ---------------------------------------------------

    def _resolve(self, create: bool) -> None:
        """Find this handle's model and open its sub-databases; with ``create``, a model
        not registered yet gets the next free number, claimed by the write (``_claim``)."""
        if self._dbs.number >= 0 and self._pending is None:
            return
        registry = self._registry
        self._check_usable()
        txn = self._lmdb.begin_read(False)
        try:
            number, last = registry.lookup(txn, self._model)
            if number is None and create:
                registry.check_room(txn, self._model)
        finally:
            self._end_read(txn)
        if number is not None:
            self._pending = None
        elif create:
            number = self._pending = last + 1  # its sub-databases exist from now, empty
        else:
            pending = self._pending
            if pending is not None and pending <= last:  # another model took the number
                nothing = registry.nothing
                self._keys, self._dbs, self._pending = KeySet(nothing), nothing, None
            return
        dbs = registry.dbs(number)
        self._keys = KeySet(dbs)  # before _dbs: a concurrent read sees a consistent pair
        self._dbs = dbs

    def _created(self) -> bool:
        """Whether this handle's model exists (looked up again while it does not)."""
        if self._dbs.number < 0 or self._pending is not None:
            self._resolve(create=False)
        return self._dbs.number >= 0 and self._pending is None

    def _stored_geometry(self, txn: Any) -> Geometry | None:
        if self._model != DEFAULT_MODEL:
            return self._registry.geometry(txn, self._model)
        raw = txn.get(META_GEOMETRY, None, self._dbs.meta)
        return None if raw is None else Geometry(*META_GEOMETRY_VALUE.unpack(raw))

    def _geometry_in(self, txn: Any) -> Geometry | None:
        """The geometry, read from ``txn`` while this handle has none (another process may
        have adopted one)."""
        if self._geometry is None:
            self._geometry = self._stored_geometry(txn)
        return self._geometry

    def _adopt_geometry(self, w: WriteTxn, geometry: Geometry) -> None:
        if self._geometry is not None:
            return  # decode checked the envelope against it already
        stored = self._stored_geometry(w.txn)
        if stored is None and self._model != DEFAULT_MODEL:
            self._registry.set_geometry(w.txn, self._model, w.dbs.number, geometry)
        elif stored is None:
            w.txn.put(META_GEOMETRY, META_GEOMETRY_VALUE.pack(*geometry.as_tuple()), db=w.dbs.meta)
        elif stored != geometry:
            raise ShapeError(
                "rule 'block_tokens, n_layers, n_kv_heads, head_dim equal the receiving pool's' "
                f"failed: expected {stored.as_tuple()}, found {geometry.as_tuple()}"
            )

        def adopt() -> None:
            self._geometry = geometry

        w.after_commit.append(adopt)

    # --- pending read hits ------------------------------------------------------------------

    def _flush_soon(self) -> None:
        """Persist pending hits in a background thread when the last write is old."""
        if time.monotonic() - self._last_flush < _FLUSH_INTERVAL or not len(self._recency):
            return
        if not self._flush_lock.acquire(blocking=False):
            return
        self._last_flush = time.monotonic()

        def run() -> None:
            try:
                if not self._closed and not self._forked:
                    self._write(lambda w: None)
            except Exception as exc:  # a background flush must never take anything down
                log.warning("%s: background recency flush failed: %s", self._path, exc)
            finally:
                self._flush_lock.release()

        threading.Thread(target=run, name="tlkv-store-flush", daemon=True).start()
