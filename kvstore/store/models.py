"""Models (namespaces) of a store: the handle per model and quota (kept by the
environment), the list of models, whether one exists, and deleting one.

Functions over a ``state.Handle`` (``Store`` delegates to them); ``registry`` owns the
models on disk (numbers, geometries, registration). A model registered before today's
model-id rule (``.`` or ``..``, which no tier namespace can name) still opens, without
the tier, and can be deleted.
"""

from __future__ import annotations

from typing import Any

from ..codec.geometry import Geometry
from ..errors import InvalidRequestError, ShapeError
from ..protocol import DEFAULT_MODEL, check_model_id, is_model_id
from ..tier import namespace_of
from .checks import check_bound
from .diskformat import (
    COUNTER,
    LRU_KEY,
    MODEL_COUNTER_KEYS,
    MODEL_DBS,
    QUARANTINE_BLOCK,
    QUARANTINE_SEQUENCE,
    counter,
    model_counter_key,
    quarantine_key,
)
from .environment import Environment
from .state import Handle, log
from .writetxn import WriteTxn


def _cached(
    env: Environment, model_id: str, quota: int | None, geometry: Geometry | None = None
) -> Handle:
    """The open handle kept for ``model_id`` and ``quota`` (and a ``geometry`` the model
    has not yet), or a new one kept there, with its tier link."""
    key = (model_id, quota) if geometry is None else (model_id, quota, geometry)
    with env.handles_lock:
        handle = env.handles.get(key)
        if handle is None or handle.closed:
            handle = Handle(env, model_id, quota)
            if geometry is not None:
                handle.geometry = geometry
            handle.link_tier()
            env.handles[key] = handle
        return handle


def model_handle(
    h: Handle, model_id: str, geometry: Geometry | None, quota_bytes: int | None
) -> Handle:
    """``Store.model``: the handle on ``model_id`` (with ``quota_bytes``) of ``h``'s store."""
    env = h.env
    root = env.root
    assert root is not None
    root.check_usable()
    if not is_model_id(model_id) and not _registered(h, model_id):
        check_model_id(model_id)  # raises: only a model made before the rule may break it
    check_bound("quota_bytes", quota_bytes)
    if geometry is not None and not isinstance(geometry, Geometry):
        raise TypeError(f"geometry must be a Geometry, found {type(geometry).__name__}")
    if model_id == DEFAULT_MODEL and quota_bytes is None:
        handle = root
    else:
        handle = _cached(env, model_id, quota_bytes)
    stored = handle.current_geometry()
    if geometry is not None and stored is not None and stored != geometry:
        raise ShapeError(
            f"the model {model_id!r} in {env.path} holds geometry {stored.as_tuple()}, "
            f"opened with {geometry.as_tuple()}"
        )
    if geometry is not None and stored is None:
        # Its own geometry, not the shared handle's; kept with the others, so that
        # asking again reuses it and closing the store closes it (and its tier link).
        handle = _cached(env, model_id, quota_bytes, geometry)
    return handle


def open_handles(h: Handle) -> list[Handle]:
    """``Store.open_handles``: the store's own handle and the model handles opened."""
    env = h.env
    assert env.root is not None
    with env.handles_lock:
        return [env.root, *env.handles.values()]


def models(h: Handle) -> list[str]:
    """``Store.models``: every model of the store, sorted."""
    txn = h.begin_read(True)
    try:
        return sorted({DEFAULT_MODEL, *h.env.registry.names(txn)})
    finally:
        h.end_read(txn)


# Ids the model-id rule admitted before it refused them: a store may still hold them.
_OLD_IDS = frozenset({".", ".."})


def _registered(h: Handle, model_id: Any) -> bool:
    """Whether ``model_id`` is registered in ``h``'s store (checked for valid ids, and for
    ``_OLD_IDS``: anything else is no model)."""
    if not isinstance(model_id, str) or not (is_model_id(model_id) or model_id in _OLD_IDS):
        return False
    txn = h.begin_read(False)
    try:
        return h.env.registry.exists(txn, model_id)
    finally:
        h.end_read(txn)


def max_models(h: Handle) -> int:
    """``Store.max_models``: the store's limit on models besides default."""
    txn = h.begin_read(False)
    try:
        return h.env.registry.max_models(txn)
    finally:
        h.end_read(txn)


def has_model(h: Handle, model_id: str) -> bool:
    """``Store.has_model``: whether ``model_id`` exists, here or as a tier namespace."""
    if model_id == DEFAULT_MODEL:
        return True
    if not is_model_id(model_id) and _registered(h, model_id):
        return True
    check_model_id(model_id)
    txn = h.begin_read(False)
    try:
        if h.env.registry.exists(txn, model_id):
            return True
    finally:
        h.end_read(txn)
    link = h.tier
    return link is not None and link.tier.get_geometry(namespace_of(model_id)) is not None


def delete_model(h: Handle, model_id: str) -> dict[str, int] | None:
    """``Store.delete_model``: remove a model with its blocks, sequences, counters and
    quarantine records, in one write transaction; what it held (``blocks``, ``bytes``,
    ``sequences``), or None when there is no such model.

    Its sub-databases are emptied, not dropped (another process may hold their handles),
    and its number freed for the next new model; handles on it, here and in other
    processes, read it from then on as a model not created yet (``Handle.begin_read``),
    and a put through one creates it again. The KV event log announces AllBlocksCleared
    for it. The tier's objects of its namespace stay.
    """
    if model_id == DEFAULT_MODEL:
        raise InvalidRequestError(
            "the model 'default' is the store itself and is not deleted: delete its blocks "
            "and sequences instead"
        )
    if not isinstance(model_id, str) or not _registered(h, model_id):
        if not is_model_id(model_id):
            check_model_id(model_id)  # raises: names the rule
        return None
    env = h.env
    handle = Handle(env, model_id, None)  # this store's view of the model, for its write
    number = handle.dbs.number
    if number <= 0:
        return None  # deleted meanwhile
    dbs = handle.dbs

    def body(w: WriteTxn) -> dict[str, int] | None:
        txn = w.txn
        if not env.registry.holds(txn, model_id, number):
            return None
        held = {
            "blocks": int(txn.stat(dbs.blocks)["entries"]),
            "bytes": counter(
                txn.get(model_counter_key(MODEL_COUNTER_KEYS[0], number), None, dbs.meta)
            ),
            "sequences": int(txn.stat(dbs.seqs)["entries"]),
        }
        ticks = [(bytes(k), bytes(v)) for k, v in txn.cursor(db=dbs.atime)]
        for hk, tick in ticks:  # its blocks leave the store-wide LRU order
            txn.delete(LRU_KEY.pack(COUNTER.unpack(tick)[0], int.from_bytes(hk, "big")), db=dbs.lru)
        totals = [
            counter(txn.get(model_counter_key(k, number), None, dbs.meta))
            for k in MODEL_COUNTER_KEYS
        ]
        w.bytes -= totals[0]  # the totals keep only the other models' share
        w.evictions -= totals[1]
        w.corrupt -= totals[2]
        for key in MODEL_COUNTER_KEYS:
            txn.delete(model_counter_key(key, number), db=dbs.meta)
        for kind in (QUARANTINE_BLOCK, QUARANTINE_SEQUENCE):
            prefix = quarantine_key(kind, number, b"")
            cursor = txn.cursor(db=dbs.meta)
            found = cursor.set_range(prefix)
            while found and bytes(cursor.key()).startswith(prefix):
                found = cursor.delete()
        for name in MODEL_DBS:
            txn.drop(getattr(dbs, name.decode()), delete=False)
        w.key_changes.reset(number)  # every process reads the model's key set again
        w.events.cleared(number)  # routers drop the model's blocks (AllBlocksCleared)
        env.registry.release(txn, model_id, number)
        return held

    held = handle.write(body)
    if held is not None:
        with env.handles_lock:
            for other in env.handles.values():
                if other.model == model_id:
                    other.forget_number()
        log.info(
            "%s: model %r deleted (%d blocks, %d bytes)",
            env.path,
            model_id,
            held["blocks"],
            held["bytes"],
        )
    return held
