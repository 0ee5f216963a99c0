"""Models (namespaces) of a store: the handle per model and quota (kept by the
environment), the list of models, and whether one exists.

Functions over a ``state.Handle`` (``Store`` delegates to them); ``registry`` owns the
models on disk (numbers, geometries, registration).
"""

from __future__ import annotations

from ..codec.geometry import Geometry
from ..errors import ShapeError
from ..protocol import DEFAULT_MODEL, check_model_id
from ..tier import namespace_of
from .checks import check_bound
from .state import Environment, Handle


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
    model_id = check_model_id(model_id)
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


def has_model(h: Handle, model_id: str) -> bool:
    """``Store.has_model``: whether ``model_id`` exists, here or as a tier namespace."""
    if model_id == DEFAULT_MODEL:
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
