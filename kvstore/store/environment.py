"""The shared half of an open store: one ``Environment`` per open LMDB environment.

Everything a store's model handles (``state.Handle``) share: the LMDB environment
(``lmdbenv``), the model registry, the handles this process opened, the helper pool, the
fork guard, the capacity, sync and finite settings, and the tier. Opening it records or
checks the store format and the default model's geometry.
"""

from __future__ import annotations

import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ..codec.geometry import Geometry
from ..errors import ShapeError, StoreError
from ..tier import Tier
from .diskformat import (
    META_FORMAT,
    META_FORMAT_VALUE,
    META_GEOMETRY,
    META_GEOMETRY_VALUE,
    STORE_FORMAT,
    STORE_FORMATS,
    Dbs,
)
from .keyset import KeySet
from .lmdbenv import MAP_ALIGN, LmdbEnv
from .registry import Registry

if TYPE_CHECKING:
    from .state import Handle

_INITIAL_MAP_SIZE = 64 << 20  # LMDB map of a new store without a capacity; grows by doubling

_open_envs: weakref.WeakSet[Environment] = weakref.WeakSet()


def _mark_forked() -> None:
    for env in list(_open_envs):
        env.forked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_mark_forked)


class Environment:
    """One open LMDB environment of the store and what its model handles share.

    Opens (or creates) the environment, records or checks the store format and the default
    model's geometry (``geometry``: the one found or given). Arguments as ``Store``'s.
    """

    def __init__(
        self,
        path: str,
        *,
        geometry: Geometry | None,
        capacity: int | None,
        sync: bool,
        map_bytes: int | None,
        allow_nonfinite: bool,
        max_models: int | None,
        preallocate: int = 0,
    ) -> None:
        self.path = path
        self.capacity = capacity
        self.sync = sync
        self.allow_nonfinite = allow_nonfinite
        self.closed = True
        self.forked = False
        self.pid = os.getpid()
        self.pool: ThreadPoolExecutor | None = None
        self.pool_lock = threading.Lock()
        self.tier: Tier | None = None
        self.geometry: Geometry | None = None  # the default model's, as opened
        initial = _INITIAL_MAP_SIZE if map_bytes is None else map_bytes
        map_size = initial
        if capacity is not None:
            map_size = max(map_size, -(-(2 * capacity) // MAP_ALIGN) * MAP_ALIGN)
        self.lmdb = LmdbEnv(
            path, map_size=map_size, sync=sync, grow_floor=initial, preallocate=preallocate
        )

        def check(txn: Any, dbs: Dbs) -> None:
            self._check_meta(txn, dbs, geometry)
            if max_models is not None:  # the opener sets the store's limit
                Registry(self.lmdb, dbs, dbs, path).set_max_models(txn, max_models)

        try:
            self.dbs = self.lmdb.open(check)
        except BaseException:
            self.lmdb.env.close()
            raise
        self.keys = KeySet(self.dbs)  # the default model's
        assert self.lmdb.nothing is not None
        self.registry = Registry(self.lmdb, self.dbs, self.lmdb.nothing, path)
        # (model, quota) -> shared handle; (model, quota, geometry) -> a handle given the
        # geometry of a model that had none yet
        self.handles: dict[tuple[Any, ...], Handle] = {}
        self.handles_lock = threading.RLock()
        self.root: Handle | None = None  # the default model's handle, whose life is ours
        self.closed = False
        _open_envs.add(self)

    def _check_meta(self, txn: Any, dbs: Dbs, geometry: Geometry | None) -> None:
        """Record or check the store format and the geometry (in the opening transaction)."""
        fmt = txn.get(META_FORMAT, None, dbs.meta)
        if fmt is None:
            txn.put(META_FORMAT, META_FORMAT_VALUE.pack(STORE_FORMAT), db=dbs.meta)
        elif META_FORMAT_VALUE.unpack(fmt)[0] not in STORE_FORMATS:
            raise StoreError(
                f"{self.path}: store format {META_FORMAT_VALUE.unpack(fmt)[0]} is not "
                f"supported (expected one of {STORE_FORMATS})"
            )
        raw = txn.get(META_GEOMETRY, None, dbs.meta)
        stored = None if raw is None else Geometry(*META_GEOMETRY_VALUE.unpack(raw))
        if stored is not None and geometry is not None and stored != geometry:
            raise ShapeError(
                f"the store in {self.path} holds geometry {stored.as_tuple()}, "
                f"opened with {geometry.as_tuple()}"
            )
        if stored is None and geometry is not None:
            txn.put(META_GEOMETRY, META_GEOMETRY_VALUE.pack(*geometry.as_tuple()), db=dbs.meta)
        self.geometry = stored or geometry

    def helper_pool(self) -> ThreadPoolExecutor:
        """The thread that stages large blocks while LMDB copies (``writetxn``)."""
        with self.pool_lock:
            if self.pool is None:
                self.pool = ThreadPoolExecutor(1, thread_name_prefix="tlkv-store-stage")
            return self.pool

    def take_handles(self) -> list[Handle]:
        """Every model handle opened, forgotten (the store closes)."""
        with self.handles_lock:
            handles = list(self.handles.values())
            self.handles.clear()
        return handles

    def close(self) -> None:
        """Close LMDB (syncing first without ``sync``) and the helper pool."""
        self.lmdb.close(sync=not self.sync)
        self.closed = True
        with self.pool_lock:
            if self.pool is not None:
                self.pool.shutdown()
                self.pool = None
        _open_envs.discard(self)
