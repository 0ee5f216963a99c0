"""The state of an open store: a ``Handle`` per model on its one ``Environment``.

``Environment`` (``environment``) is what one LMDB environment shares, one object per
open store. ``Handle`` is one model on it: its sub-databases and key set, its geometry, its
quota, its pending read hits (recency), its counters and its link to the tier; it runs
every transaction of the API (``reads``, ``writes``, ``models`` and ``stats`` are
functions over a handle), and ``Store`` (``store``) presents one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ..codec.assembly import crc_matches
from ..codec.geometry import Geometry
from ..errors import ShapeError, StoreError
from ..protocol import DEFAULT_MODEL, is_model_id
from ..tier import Tier
from .diskformat import META_GEOMETRY, META_GEOMETRY_VALUE, Dbs
from .environment import Environment
from .eviction import RecencyBuffer
from .keyset import KeySet
from .reader import KvSpec
from .registry import Reclaim, Stale, UnknownModel
from .tiered import TierLink
from .writetxn import WriteTxn

log = logging.getLogger("tlkv.store")

_FLUSH_INTERVAL = 5.0  # seconds: pending read hits are persisted at least this often

T = TypeVar("T")


class Handle:
    """One model of an ``Environment``: its sub-databases, key set, geometry, quota,
    recency and tier link, this process's counters of it, and its transactions."""

    __slots__ = (
        "closed",
        "confirmed",
        "dbs",
        "env",
        "facade",
        "flush_lock",
        "geometry",
        "hits",
        "keys",
        "last_flush",
        "misses",
        "model",
        "pending",
        "quota",
        "rconsts",
        "recency",
        "served_bytes",
        "tier",
        "tier_hits",
        "written_bytes",
    )

    def __init__(self, env: Environment, model: str, quota: int | None) -> None:
        self.env = env
        self.model = model
        self.quota = quota
        self.closed = False
        self.geometry: Geometry | None = None
        self.recency = RecencyBuffer()
        self.flush_lock = threading.Lock()
        self.last_flush = time.monotonic()
        self.rconsts: tuple[Geometry, dict[int, int], dict[int, KvSpec]] | None = None
        self.pending: int | None = None  # a number this model claims by its first write
        # The sub-databases whose registration was last confirmed, and in which snapshot.
        self.confirmed: tuple[Dbs | None, int] = (None, -1)
        self.hits = self.misses = 0
        # This process's figures for the service's metrics (``api.metrics``):
        self.tier_hits = 0  # local misses answered from the object tier (read through)
        self.served_bytes = 0  # envelope bytes handed out by get, get_many and get_buffers
        self.written_bytes = 0  # block bytes written (puts, read-through copies, repairs)
        self.facade: object | None = None  # the ``Store`` presenting this handle, once made
        self.tier: TierLink | None = None
        if model == DEFAULT_MODEL:
            self.dbs, self.keys = env.dbs, env.keys
        else:
            self.dbs = env.registry.nothing
            self.keys = KeySet(self.dbs)
            self.resolve(create=False)

    def link_tier(self) -> None:
        """Start this model's link to the environment's tier (its own namespace there); a
        model whose id breaks today's model-id rule (kept from before it) has none."""
        if self.env.tier is not None:
            if not is_model_id(self.model):
                log.warning(
                    "%s: model %r breaks the model-id rule and has no tier namespace: it is "
                    "served without the tier; delete it (tlkv delete-model) and write again",
                    self.env.path,
                    self.model,
                )
                return
            self.tier = TierLink(self, self.env.tier)

    @property
    def path(self) -> str:
        return self.env.path

    @property
    def allow_nonfinite(self) -> bool:
        return self.env.allow_nonfinite

    @property
    def is_root(self) -> bool:
        """Whether this is the store's own handle (the model ``default`` without a quota),
        whose life is the environment's."""
        return self.env.root is self

    # --- transactions --------------------------------------------------------------------

    def check_usable(self) -> None:
        env = self.env
        if self.closed or env.closed:
            raise StoreError(f"the store {env.path} is closed")
        if env.forked:
            raise StoreError(
                f"the store {env.path} was opened in process {env.pid}; "
                "open stores after fork, in the process that uses them"
            )

    def begin_read(self, buffers: bool) -> Any:
        """A read transaction holding the map guard; end it with ``end_read``.

        A model other than default is confirmed in it: one deleted since this handle
        resolved it (perhaps made again, under another number) is looked up again, so a
        handle never reads another model's sub-databases."""
        self.check_usable()
        if self.dbs.number < 0 or self.pending is not None:  # created elsewhere since?
            self.resolve(create=False)
        lmdb = self.env.lmdb
        txn = lmdb.begin_read(buffers)
        dbs = self.dbs
        if dbs.number > 0:
            # A snapshot is immutable: the registration confirmed in one (its transaction
            # id) holds in every transaction of that id, and is not looked up again.
            tid = txn.id()
            confirmed = self.confirmed
            if confirmed[0] is not dbs or confirmed[1] != tid:
                registry = self.env.registry
                if registry.holds(txn, self.model, dbs.number):
                    self.confirmed = (dbs, tid)
                elif self.pending != dbs.number or registry.lookup(txn, self.model) != (
                    None,
                    dbs.number,
                ):
                    lmdb.end_read(txn)
                    self.forget_number()
                    self.resolve(create=False)
                    txn = lmdb.begin_read(buffers)
                # else: the number this handle reserved for its first write, still free in
                # this snapshot (so its sub-databases hold nothing): kept for that write
        return txn

    def end_read(self, txn: Any) -> None:
        self.env.lmdb.end_read(txn)

    def write(self, body: Callable[[WriteTxn], T], need: int = 0, create: bool = False) -> T:
        """Run ``body`` in one write transaction, after persisting pending read hits.

        ``need``: the bytes the body writes (the map grows ahead of large writes).
        ``create``: the write creates the model if it does not exist (a put); otherwise a
        model deleted meanwhile is written as one not created yet (nothing to change).
        """
        self.check_usable()
        env = self.env
        taken = self.recency.take()

        def run(txn: Any) -> tuple[T, WriteTxn]:
            dbs, pending = self.dbs, self.pending
            if create and (dbs.number < 0 or (pending is not None and pending != dbs.number)):
                raise Reclaim()  # forgotten by another thread since resolve: resolve again
            w = WriteTxn(
                txn,
                dbs,
                env.capacity,
                env.helper_pool,
                env.path,
                quota=self.quota,
                dbs_of=env.registry.opened,
                model_name=lambda n: (
                    self.model if n == w.dbs.number else env.registry.name_of(txn, n)
                ),
            )
            if pending is not None:
                env.registry.claim(txn, self.model, pending)
            elif dbs.number > 0 and not env.registry.holds(txn, self.model, dbs.number):
                raise Stale()
            if self.tier is not None:
                w.pending = w.keep_pending = True
            for h in taken:
                w.touch(h)
            result = body(w)
            w.save()
            return result, w

        while True:
            try:
                result, w = env.lmdb.write(run, need)
                break
            except UnknownModel as exc:  # evicting a model created by another process
                env.registry.dbs(exc.number)
            except Reclaim:
                self.resolve(create=True)
            except Stale:  # deleted since this handle resolved it
                self.forget_number()
                self.resolve(create=create)
            except BaseException:
                self.recency.restore(taken)
                raise
        self.last_flush = time.monotonic()
        self.pending = None
        self.written_bytes += w.inserted
        for hook in w.after_commit:
            hook()
        return result

    def quarantine(self, hashes: list[int]) -> None:
        """Remove blocks that fail their CRC (checked again inside the write transaction)."""

        def body(w: WriteTxn) -> None:
            for h in dict.fromkeys(hashes):
                w.quarantine(h, lambda value: not crc_matches(value))

        try:
            self.write(body)
        except StoreError as exc:
            log.error("%s: could not quarantine corrupt blocks: %s", self.env.path, exc)

    # --- the model and its geometry ------------------------------------------------------

    def resolve(self, create: bool) -> None:
        """Find this handle's model and open its sub-databases; with ``create``, a model
        not registered yet gets the next free number, claimed by the write (``write``)."""
        if self.dbs.number >= 0 and self.pending is None:
            return
        registry = self.env.registry
        self.check_usable()
        txn = self.env.lmdb.begin_read(False)
        try:
            number, new = registry.lookup(txn, self.model)
            if number is None and create:
                registry.check_room(txn, self.model)
        finally:
            self.end_read(txn)
        if number is not None:
            self.pending = None
        elif create:
            number = self.pending = new  # its sub-databases exist from now, empty
        else:
            if self.pending is not None and self.pending != new:  # another model took it
                self.forget_number()
            return
        dbs = registry.dbs(number)
        self.keys = KeySet(dbs)  # before dbs: a concurrent read sees a consistent pair
        self.dbs = dbs

    def forget_number(self) -> None:
        """Make this handle one of a model not created yet (its model was deleted): its
        geometry and key set go with its number."""
        nothing = self.env.registry.nothing
        self.keys, self.dbs, self.pending = KeySet(nothing), nothing, None
        self.geometry = None
        self.rconsts = None
        self.recency.take()  # hits of blocks that went with it

    def created(self) -> bool:
        """Whether this handle's model exists (looked up again while it does not)."""
        if self.dbs.number < 0 or self.pending is not None:
            self.resolve(create=False)
        return self.dbs.number >= 0 and self.pending is None

    def _stored_geometry(self, txn: Any) -> Geometry | None:
        if self.model != DEFAULT_MODEL:
            return self.env.registry.geometry(txn, self.model)
        raw = txn.get(META_GEOMETRY, None, self.dbs.meta)
        return None if raw is None else Geometry(*META_GEOMETRY_VALUE.unpack(raw))

    def geometry_in(self, txn: Any) -> Geometry | None:
        """The geometry, read from ``txn`` while this handle has none (another process may
        have adopted one)."""
        if self.geometry is None:
            self.geometry = self._stored_geometry(txn)
        return self.geometry

    def current_geometry(self) -> Geometry | None:
        """The geometry (``Store.geometry``): read again while there is none, and with a
        tier, until then the one of the model's namespace in the tier, if any."""
        if self.geometry is None and not self.closed:
            txn = self.begin_read(False)
            try:
                self.geometry_in(txn)
            finally:
                self.end_read(txn)
            if self.geometry is None and self.tier is not None:
                return self.tier.learned_geometry()
        return self.geometry

    def adopt_geometry(self, w: WriteTxn, geometry: Geometry) -> None:
        """Record ``geometry`` as the model's in ``w`` if it has none; refuse another."""
        if self.geometry is not None:
            return  # decode checked the envelope against it already
        stored = self._stored_geometry(w.txn)
        if stored is None and self.model != DEFAULT_MODEL:
            self.env.registry.set_geometry(w.txn, self.model, w.dbs.number, geometry)
        elif stored is None:
            w.txn.put(META_GEOMETRY, META_GEOMETRY_VALUE.pack(*geometry.as_tuple()), db=w.dbs.meta)
        elif stored != geometry:
            raise ShapeError(
                "rule 'block_tokens, n_layers, n_kv_heads, head_dim equal the receiving pool's' "
                f"failed: expected {stored.as_tuple()}, found {geometry.as_tuple()}"
            )

        def adopt() -> None:
            self.geometry = geometry

        w.after_commit.append(adopt)

    # --- pending read hits, and closing ---------------------------------------------------

    def flush_soon(self) -> None:
        """Persist pending hits in a background thread when the last write is old."""
        if time.monotonic() - self.last_flush < _FLUSH_INTERVAL or not len(self.recency):
            return
        if not self.flush_lock.acquire(blocking=False):
            return
        self.last_flush = time.monotonic()

        def run() -> None:
            try:
                if not self.closed and not self.env.forked:
                    self.write(lambda w: None)
            except Exception as exc:  # a background flush must never take anything down
                log.warning("%s: background recency flush failed: %s", self.env.path, exc)
            finally:
                self.flush_lock.release()

        threading.Thread(target=run, name="tlkv-store-flush", daemon=True).start()

    def _persist_recency(self) -> None:
        if len(self.recency):
            try:
                self.write(lambda w: None)
            except StoreError as exc:
                log.warning("%s: could not persist recency on close: %s", self.env.path, exc)

    def close(self) -> None:
        """Persist pending recency and stop the tier link; the store's own handle also
        closes every model handle and the environment."""
        env = self.env
        if self.closed or (self.is_root and env.closed):
            return
        if env.forked:
            self.closed = True  # the parent's environment is not ours to close
            return
        if self.tier is not None:
            self.tier.close()
        if not self.is_root:
            with self.flush_lock:
                if not env.closed:
                    self._persist_recency()
                self.closed = True
            return
        for handle in env.take_handles():
            handle.close()
        with self.flush_lock:
            self._persist_recency()
            env.close()
            self.closed = True


def open_root(
    path: str,
    *,
    geometry: Geometry | None,
    capacity: int | None,
    sync: bool,
    map_bytes: int | None,
    allow_nonfinite: bool,
    max_models: int | None,
    tier: Tier | str | None,
    tier_endpoint: str | None,
    preallocate: int = 0,
) -> Handle:
    """Open the environment in ``path`` and its default model's handle, with the tier if
    one is given (arguments as ``Store``'s)."""
    env = Environment(
        path,
        geometry=geometry,
        capacity=capacity,
        sync=sync,
        map_bytes=map_bytes,
        allow_nonfinite=allow_nonfinite,
        max_models=max_models,
        preallocate=preallocate,
    )
    root = env.root = Handle(env, DEFAULT_MODEL, None)
    root.geometry = env.geometry
    if tier is not None:
        try:
            env.tier = tier if isinstance(tier, Tier) else Tier(tier, endpoint=tier_endpoint)
            root.link_tier()
        except BaseException:
            root.close()  # a bad tier URL leaves nothing open
            raise
    return root
