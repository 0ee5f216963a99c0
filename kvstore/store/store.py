"""The persistent block store: one LMDB environment of content-addressed KV blocks.

Owns ``Store`` and its life cycle: opening (format, geometry, the map size, undoing the
restores a killed process left unfinished), the handles on models, closing, and the link
to a tier. Its API is split by job into mixins over ``core.StoreCore`` (a handle's state
and transactions): ``reads`` (get, has, longest_prefix, views, sequences), ``writes``
(put, import, restore journals, delete), ``models`` and ``stats``. The on-disk layout is
declared in ``diskformat``, the write transaction in ``writetxn``, zero-copy readers in
``reader``; the codec (``envelope``) validates every envelope, and a block is stored as
its verbatim single-block envelope.

Choices:

- ``bytes``/``capacity_bytes`` count stored values: block envelopes plus sequence records
  (which hold a sequence's partial tail). Capacity is a per-handle setting.
- ``hits``/``misses`` count this process's reads since it opened the store; the other
  ``stats()`` are persisted.
- A block failing its CRC is removed from the block space and counted; sequences keep
  their reference, and ``get_sequence`` returns None until a block with that hash is put
  again. A sequence record failing its own CRC is removed and every pin recounted.
- Models (namespaces): ``Store.model(id)`` is a handle on one model's blocks and
  sequences, with this whole API; the ``Store`` itself is the model ``default``. A
  model is created by its first write (reads of a model not created yet find nothing),
  its geometry fixed by its first put. Capacity and the LRU order are store-wide; a
  handle's ``quota_bytes`` bounds its model's bytes (evicting its own blocks first).
- Recency: reads record hits in process memory; the next write transaction, a background
  flush at most every ``core._FLUSH_INTERVAL`` seconds, or ``close`` persists them (LRU order
  is approximate across processes and survives reopening).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ..codec.geometry import Geometry
from ..errors import ShapeError, StoreError
from ..protocol import DEFAULT_MODEL, MAX_MODELS, MAX_MODELS_LIMIT
from .checks import check_bound
from .core import StoreCore
from .diskformat import (
    META_FORMAT,
    META_FORMAT_VALUE,
    META_GEOMETRY,
    META_GEOMETRY_VALUE,
    STORE_FORMAT,
    STORE_FORMATS,
    Dbs,
)
from .eviction import RecencyBuffer
from .journal import RestoreJournal, journal_model, pending, remove_orphan_locks, rollback
from .keyset import KeySet
from .lmdbenv import MAP_ALIGN, LmdbEnv
from .models import StoreModels
from .reader import Reader
from .reads import StoreReads, transcode_stored
from .registry import Registry
from .results import PutReport, PutResult
from .stats import StoreStats
from .writes import StoreWrites
from .writetxn import WriteTxn

if TYPE_CHECKING:  # imported when a store gets a tier: obstore and asyncio load only then
    from ..tier import Tier

__all__ = ["PutReport", "PutResult", "Reader", "Store", "transcode_stored"]

log = logging.getLogger("tlkv.store")

_INITIAL_MAP_SIZE = 64 << 20  # LMDB map of a new store without a capacity; grows by doubling

_open_stores: weakref.WeakSet[Store] = weakref.WeakSet()


def _mark_forked() -> None:
    for store in list(_open_stores):
        store._forked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_mark_forked)


class Store(StoreModels, StoreReads, StoreWrites, StoreStats, StoreCore):
    """A persistent, content-addressed store of KV blocks in one LMDB environment.

    Args:
        path: directory of the environment (created if missing).
        geometry: the store's block geometry; a new store without one adopts the geometry
            of its first successful put.
        capacity_bytes: bound on the stored bytes (block envelopes + sequence records);
            a put beyond it first evicts least-recently-used unpinned blocks. None: the
            store grows until the disk is full (then ``StoreFullError``).
        sync: True: a write returns once LMDB has fsynced its commit (durable; a commit of
            8 MiB or more starts the disk while LMDB still copies, ``writebehind``). False
            (LMDB's MDB_NOSYNC): a commit survives a crash of the process, but an OS crash
            or power loss may undo the latest ones and, on a filesystem that does not
            preserve write order, may corrupt the environment (LMDB's documented risk);
            ``close`` syncs. Use it only for a cache that can be rebuilt.
        map_bytes: the initial size of LMDB's memory map (default 64 MiB, or twice the
            capacity); it grows on demand by at least doubling, invisibly to the user.
        allow_nonfinite: False (default): a put, sequence or restore holding a NaN or an
            infinity (v1 f16, v2 E4M3 NaN codes) or a v2 scale that is not finite, > 0 and
            at most ``numerics.SCALE_MAX`` is refused (``FormatError``); True stores such
            envelopes verbatim, as the spec's reader rules allow, and a transcoding ``get``
            of one raises ``UnconvertibleError``.
        tier: a shared object-store tier behind the store (``s3://bucket/prefix``,
            ``file:///path``, or a :class:`~kvstore.tier.Tier`): new blocks are uploaded
            in the background (a persistent pending set; pending blocks are never
            evicted), and a local miss of ``get``/``get_many``/``read_through`` reads the
            block through from it, validated, into the store.
        tier_endpoint: the S3-compatible server of a ``tier`` URL (default: the
            ``AWS_ENDPOINT_URL`` environment variable, else AWS).
        max_models: the models besides ``default`` this store admits (0 to
            ``protocol.MAX_MODELS_LIMIT``, default 200): a write that would create one
            more raises ``ModelLimitError``. Checked in the write that registers a model,
            so every process sharing the store holds to its own setting; a store holding
            more already (registered under a higher setting) opens and serves them all.

    Raises:
        ShapeError: the store exists with another geometry.
        StoreError: the directory holds something else, or another store format.

    Open a store in the process that uses it (after fork): a ``Store`` used in a forked
    child raises ``StoreError``. Several processes may open the same path and read and
    write concurrently. Threads may share a ``Store``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        geometry: Geometry | None = None,
        capacity_bytes: int | None = None,
        sync: bool = True,
        map_bytes: int | None = None,
        allow_nonfinite: bool = False,
        tier: str | Tier | None = None,
        tier_endpoint: str | None = None,
        max_models: int = MAX_MODELS,
    ) -> None:
        if (
            isinstance(max_models, bool)
            or not isinstance(max_models, int)
            or not 0 <= max_models <= MAX_MODELS_LIMIT
        ):
            raise ValueError(
                f"max_models must be an int in 0..{MAX_MODELS_LIMIT}, found {max_models!r}"
            )
        if map_bytes is not None and (
            isinstance(map_bytes, bool) or not isinstance(map_bytes, int)
        ):
            raise TypeError(f"map_bytes must be an int, found {type(map_bytes).__name__}")
        if map_bytes is not None and map_bytes <= 0:
            raise ValueError(f"map_bytes must be > 0, found {map_bytes}")
        if geometry is not None and not isinstance(geometry, Geometry):
            raise TypeError(f"geometry must be a Geometry, found {type(geometry).__name__}")
        check_bound("capacity_bytes", capacity_bytes)
        self._path = os.fspath(path)
        self._capacity = capacity_bytes
        self._sync = bool(sync)
        self._allow_nonfinite = bool(allow_nonfinite)
        self._closed = True
        self._forked = False
        self._geometry = None
        self._recency = RecencyBuffer()
        self._flush_lock = threading.Lock()
        self._last_flush = time.monotonic()
        self._pool = None
        self._pool_lock = threading.Lock()
        self._rconsts = None
        self.hits = 0
        self.misses = 0
        self.tier_hits = self.served_bytes = self.written_bytes = 0
        initial = _INITIAL_MAP_SIZE if map_bytes is None else map_bytes
        map_size = initial
        if capacity_bytes is not None:
            map_size = max(map_size, -(-(2 * capacity_bytes) // MAP_ALIGN) * MAP_ALIGN)
        self._lmdb = LmdbEnv(
            self._path,
            map_size=map_size,
            sync=self._sync,
            grow_floor=initial,
            max_models=max_models,
        )
        self._env = self._lmdb.env
        try:
            self._dbs = self._lmdb.open(lambda txn, dbs: self._check_meta(txn, dbs, geometry))
        except BaseException:
            self._env.close()
            raise
        self._keys = KeySet(self._dbs)
        self._root = self
        self._pending = None
        self._model = DEFAULT_MODEL
        self._quota = None
        assert self._lmdb.nothing is not None
        self._registry = Registry(self._lmdb, self._dbs, self._lmdb.nothing, self._path, max_models)
        self._handles = {}
        self._handles_lock = threading.RLock()
        self._closed = False
        self._pid = os.getpid()
        _open_stores.add(self)
        self._tier = None
        if tier is not None:
            from ..tier import Tier
            from .tiered import TierLink

            try:
                if not isinstance(tier, Tier):
                    tier = Tier(tier, endpoint=tier_endpoint)
                self._tier = TierLink(self, tier)
            except BaseException:
                self.close()  # a bad tier URL leaves nothing open
                raise
        self._roll_back_killed_restores()
        if self._tier is not None:
            for model in self.models():  # every model's uploads resume (their handles)
                self.model(model)

    def _check_meta(self, txn: Any, dbs: Dbs, geometry: Geometry | None) -> None:
        """Record or check the store format and the geometry (in the opening transaction)."""
        fmt = txn.get(META_FORMAT, None, dbs.meta)
        if fmt is None:
            txn.put(META_FORMAT, META_FORMAT_VALUE.pack(STORE_FORMAT), db=dbs.meta)
        elif META_FORMAT_VALUE.unpack(fmt)[0] not in STORE_FORMATS:
            raise StoreError(
                f"{self._path}: store format {META_FORMAT_VALUE.unpack(fmt)[0]} is not "
                f"supported (expected one of {STORE_FORMATS})"
            )
        raw = txn.get(META_GEOMETRY, None, dbs.meta)
        stored = None if raw is None else Geometry(*META_GEOMETRY_VALUE.unpack(raw))
        if stored is not None and geometry is not None and stored != geometry:
            raise ShapeError(
                f"the store in {self._path} holds geometry {stored.as_tuple()}, "
                f"opened with {geometry.as_tuple()}"
            )
        if stored is None and geometry is not None:
            txn.put(META_GEOMETRY, META_GEOMETRY_VALUE.pack(*geometry.as_tuple()), db=dbs.meta)
        self._geometry = stored or geometry

    def _roll_back_killed_restores(self) -> None:
        """Undo the restores whose process died before they finished (``journal``)."""
        txn = self._begin_read(False)
        try:
            tokens = [
                (t, journal_model(txn, self._dbs.meta, t)) for t in pending(txn, self._dbs.meta)
            ]
        finally:
            self._end_read(txn)
        if remove_orphan_locks(self._path, {t for t, _ in tokens}):
            log.warning("%s: removed the lock files of restores killed before writing", self._path)
        for token, model in tokens:
            claimed = RestoreJournal.claim(self._path, token)
            if claimed is None:
                continue  # its restore still runs
            handle = self.model(model)

            def undo(w: WriteTxn, token: bytes = token, handle: Store = handle) -> tuple[int, int]:
                return rollback(w, token, handle._geometry_in(w.txn))

            try:
                removed, seqs = handle._write(undo)
            except StoreError as exc:  # the next open tries again
                log.warning("%s: could not undo an unfinished restore: %s", self._path, exc)
                continue
            finally:
                claimed.release()
            if removed or seqs:
                log.warning(
                    "%s: undid a restore that did not finish: %d blocks removed, %d sequences "
                    "dropped or put back",
                    self._path,
                    removed,
                    seqs,
                )

    @classmethod
    def _handle(cls, root: Store, model_id: str, quota: int | None) -> Store:
        """A handle on one model sharing ``root``'s environment (every attribute
        ``__init__`` sets, set here too)."""
        h = cls.__new__(cls)
        for name in (
            "_path", "_capacity", "_sync", "_allow_nonfinite", "_lmdb", "_env", "_pid",
            "_pool_lock", "_registry", "_handles", "_handles_lock",
        ):  # fmt: skip
            setattr(h, name, getattr(root, name))
        h._root = root
        h._model = model_id
        h._quota = quota
        h._closed = h._forked = False
        h._geometry = None
        h._recency = RecencyBuffer()
        h._flush_lock = threading.Lock()
        h._last_flush = time.monotonic()
        h._pool = None
        h._rconsts = None
        h._pending = None
        h.hits = h.misses = 0
        h.tier_hits = h.served_bytes = h.written_bytes = 0
        if model_id == DEFAULT_MODEL:
            h._dbs, h._keys = root._dbs, root._keys
        else:
            h._dbs, h._keys = root._registry.nothing, KeySet(root._registry.nothing)
            h._resolve(create=False)
        h._tier = None
        if root._tier is not None:  # the model's own namespace of the root's tier
            h._tier = type(root._tier)(h, root._tier.tier)
        _open_stores.add(h)
        return h

    # --- properties and life cycle -----------------------------------------------------

    @property
    def geometry(self) -> Geometry | None:
        """The store's block geometry (None until given or adopted by a first put); with a
        tier, until then the geometry of its namespace in the tier, if any (which a put or
        a read-through then adopts)."""
        if self._geometry is None and not self._closed:
            txn = self._begin_read(False)
            try:
                self._geometry_in(txn)
            finally:
                self._end_read(txn)
            if self._geometry is None and self._tier is not None:
                return self._tier.learned_geometry()
        return self._geometry

    @property
    def map_bytes(self) -> int:
        """The size of LMDB's memory map now (it grows on demand)."""
        return int(self._env.info()["map_size"])

    @property
    def capacity_bytes(self) -> int | None:
        """The capacity this handle enforces (None: unbounded)."""
        return self._capacity

    def close(self) -> None:
        """Persist pending recency, wait for this process's open readers, close LMDB (a
        model's handle: persist its recency; the store stays open)."""
        if self._closed:
            return
        if self._forked:
            self._closed = True  # the parent's environment is not ours to close
            return
        if self._tier is not None:
            self._tier.close()
        if self._root is not self:
            with self._flush_lock:
                if len(self._recency) and not self._root._closed:
                    try:
                        self._write(lambda w: None)
                    except StoreError as exc:
                        log.warning("%s: could not persist recency on close: %s", self._path, exc)
                self._closed = True
            _open_stores.discard(self)
            return
        with self._handles_lock:
            handles = list(self._handles.values())
            self._handles.clear()
        for handle in handles:
            handle.close()
        with self._flush_lock:
            if len(self._recency):
                try:
                    self._write(lambda w: None)
                except StoreError as exc:
                    log.warning("%s: could not persist recency on close: %s", self._path, exc)
            self._lmdb.close(sync=not self._sync)
            self._closed = True
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None
        _open_stores.discard(self)

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed or self._root._closed else "open"
        model = "" if self._model == DEFAULT_MODEL else f", model={self._model!r}"
        return f"Store({self._path!r}{model}, geometry={self._geometry}, {state})"

    def open_handles(self) -> list[Store]:
        """This store and the model handles this process has open (each model's read and
        write counters live on its handles)."""
        root = self._root
        with root._handles_lock:
            return [root, *root._handles.values()]

    # --- the tier ----------------------------------------------------------------------

    @property
    def tier(self) -> Tier | None:
        """The object-store tier behind the store (None without one)."""
        return None if self._tier is None else self._tier.tier

    def tier_info(self) -> dict[str, Any] | None:
        """The tier's URL, state, counters and pending uploads (None without a tier)."""
        return None if self._tier is None else self._tier.info()

    def wait_uploaded(self, timeout: float | None = None) -> bool:
        """Wait until the blocks read through are committed here and no block is pending
        upload to the tier; False on timeout."""
        if self._tier is None:
            return True
        self._tier.filler.flush()
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._tier.pending_count():
            self._tier.uploader.wake()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._tier.uploader.wait_idle(0.05 if left is None else min(0.05, left))
        return True
