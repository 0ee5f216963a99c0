"""The ``Store``'s models (namespaces) API: ``model`` (a handle per model, kept by the
store), ``model_id``, ``quota_bytes``, ``models`` and ``has_model``.

``registry`` owns the models on disk (numbers, geometries, registration); a handle is
built by ``Store._handle`` beside ``Store.__init__``, which sets the same attributes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..codec.geometry import Geometry
from ..errors import ShapeError
from ..protocol import DEFAULT_MODEL, check_model_id
from ..tier import namespace_of
from .checks import check_bound
from .core import StoreCore

if TYPE_CHECKING:
    from .store import Store


class StoreModels(StoreCore):
    """The models API of a ``Store`` handle (a mixin of ``Store``)."""

    def model(
        self,
        model_id: str,
        *,
        geometry: Geometry | None = None,
        quota_bytes: int | None = None,
    ) -> Store:
        """A handle on the model (namespace) ``model_id`` of this store, with this whole API.

        Its blocks, sequences, geometry and stats are its own: the same hash in two models
        is two blocks. The model is created by its first write; until then reads find
        nothing. The handle lives as long as the store (``close`` of the store closes it).

        Args:
            model_id: 1-200 characters of ``[A-Za-z0-9._:@/+-]``; ``"default"`` is the
                store's own model (the only one of stores made before models).
            geometry: the model's geometry (checked like ``Store``'s).
            quota_bytes: bound on this model's stored bytes, enforced by this handle: a
                put beyond it first evicts the model's own least-recently-used blocks.

        Raises:
            ValueError: a bad model id.  ShapeError: the model holds another geometry.
        """
        root = self._root
        root._check_usable()
        model_id = check_model_id(model_id)
        check_bound("quota_bytes", quota_bytes)
        if geometry is not None and not isinstance(geometry, Geometry):
            raise TypeError(f"geometry must be a Geometry, found {type(geometry).__name__}")
        if model_id == DEFAULT_MODEL and quota_bytes is None:
            handle = root
        else:
            with root._handles_lock:
                handle = root._handles.get((model_id, quota_bytes))  # type: ignore[assignment]
                if handle is None or handle._closed:
                    handle = root._handles[(model_id, quota_bytes)] = root._handle(
                        root, model_id, quota_bytes
                    )
        stored = handle.geometry
        if geometry is not None and stored is not None and stored != geometry:
            raise ShapeError(
                f"the model {model_id!r} in {self._path} holds geometry {stored.as_tuple()}, "
                f"opened with {geometry.as_tuple()}"
            )
        if geometry is not None and stored is None:
            # Its own geometry, not the shared handle's; kept with the others, so that
            # asking again reuses it and closing the store closes it (and its tier link).
            key = (model_id, quota_bytes, geometry)
            with root._handles_lock:
                handle = root._handles.get(key)  # type: ignore[assignment]
                if handle is None or handle._closed:
                    handle = root._handles[key] = root._handle(root, model_id, quota_bytes)
                    handle._geometry = geometry
        return handle

    @property
    def model_id(self) -> str:
        """The model this handle reads and writes (``"default"`` for the store itself)."""
        return self._model

    @property
    def quota_bytes(self) -> int | None:
        """The bound this handle keeps its model's bytes under (None: only the capacity)."""
        return self._quota

    def models(self) -> list[str]:
        """Every model of the store, sorted (``"default"`` always among them)."""
        txn = self._begin_read(True)
        try:
            return sorted({DEFAULT_MODEL, *self._registry.names(txn)})
        finally:
            self._end_read(txn)

    def has_model(self, model_id: str) -> bool:
        """Whether ``model_id`` exists (``"default"`` always does): here, or with a tier,
        as a namespace of the tier (its geometry object is there: another node created
        it, and this store reads its blocks through)."""
        if model_id == DEFAULT_MODEL:
            return True
        check_model_id(model_id)
        txn = self._begin_read(False)
        try:
            if self._registry.exists(txn, model_id):
                return True
        finally:
            self._end_read(txn)
        link = self._tier
        return link is not None and link.tier.get_geometry(namespace_of(model_id)) is not None
