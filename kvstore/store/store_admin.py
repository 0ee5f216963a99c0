"""The administrative half of ``Store``'s API: its models, the KV event log, restores,
counters and the tier. ``store.Store`` inherits it and adds the reads, the writes and the
life cycle.

As in ``store``, each method is a short delegate, with its docstring, to the module that
does the work over the store's model handle (``state.Handle``): ``models``, ``kvevents``,
``restores``, ``stats`` and the handle's tier link.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar, cast

from ..codec.geometry import Geometry
from ..tier import Tier
from . import kvevents as _kvevents
from . import models as _models
from . import restores as _restores
from . import stats as _stats
from .journal import RestoreJournal
from .state import Handle

__all__ = ["StoreAdmin"]

_S = TypeVar("_S", bound="StoreAdmin")


class StoreAdmin:
    """Models, the KV event log, restores, counters and the tier of one store handle
    (``Store``'s base: use ``Store``)."""

    _h: Handle

    @classmethod
    def _of(cls: type[_S], h: Handle) -> _S:
        """The store object presenting the handle ``h`` (one per handle)."""
        if h.facade is None:
            store = cls.__new__(cls)
            store._h = h
            h.facade = store
        return cast(_S, h.facade)

    def open_handles(self: _S) -> list[_S]:
        """This store and the model handles this process has open (each model's read and
        write counters live on its handles)."""
        return [type(self)._of(h) for h in _models.open_handles(self._h)]

    # --- models ------------------------------------------------------------------------

    def model(
        self: _S,
        model_id: str,
        *,
        geometry: Geometry | None = None,
        quota_bytes: int | None = None,
    ) -> _S:
        """A handle on the model (namespace) ``model_id`` of this store, with this whole API.

        Its blocks, sequences, geometry and stats are its own: the same hash in two models
        is two blocks. The model is created by its first write; until then reads find
        nothing. The handle lives as long as the store (``close`` of the store closes it).

        Args:
            model_id: 1-200 characters of ``[A-Za-z0-9._:@/+-]``, not ``.`` or ``..``
                (``protocol.check_model_id``); ``"default"`` is the
                store's own model (the only one of stores made before models).
            geometry: the model's geometry (checked like ``Store``'s).
            quota_bytes: bound on this model's stored bytes, enforced by this handle: a
                put beyond it first evicts the model's own least-recently-used blocks.

        Raises:
            ValueError: a bad model id.  ShapeError: the model holds another geometry.
        """
        return type(self)._of(_models.model_handle(self._h, model_id, geometry, quota_bytes))

    @property
    def model_id(self) -> str:
        """The model this handle reads and writes (``"default"`` for the store itself)."""
        return self._h.model

    @property
    def quota_bytes(self) -> int | None:
        """The bound this handle keeps its model's bytes under (None: only the capacity)."""
        return self._h.quota

    def models(self) -> list[str]:
        """Every model of the store, sorted (``"default"`` always among them)."""
        return _models.models(self._h)

    @property
    def max_models(self) -> int:
        """The models besides ``default`` the store admits (its own limit)."""
        return _models.max_models(self._h)

    def delete_model(self, model_id: str) -> dict[str, int] | None:
        """Delete a model with every block, sequence and counter of it, in one transaction;
        what it held (``blocks``, ``bytes``, ``sequences``), or None when there is no such
        model. Handles on it (here or in other processes) then find it not created yet; a
        put through one creates it again. A model registered before today's model-id
        rule (``.``, ``..``) is deleted by its id too. The tier's objects stay.

        Raises:
            InvalidRequestError: ``model_id`` is ``"default"`` (the store itself).
            ValueError: a bad model id (not a model of the store).
        """
        return _models.delete_model(self._h, model_id)

    def has_model(self, model_id: str) -> bool:
        """Whether ``model_id`` exists (``"default"`` always does): here, or with a tier,
        as a namespace of the tier (its geometry object is there: another node created
        it, and this store reads its blocks through)."""
        return _models.has_model(self._h, model_id)

    # --- the KV event log ---------------------------------------------------------------

    def set_events(self, limit: int) -> None:
        """Keep the KV event log (``docs/events.md``), its oldest batches dropped beyond
        ``limit``; 0 turns it off (emptied). A setting of the store, for every process."""
        _kvevents.set_events(self._h, limit)

    def read_events(self, start: int = 0, limit: int = 1024) -> list[tuple[int, str, bytes]]:
        """Up to ``limit`` logged ``(seq, model id, payload)`` from ``start`` on, in order
        (payload: ``msgpack(KVEventBatch)``, ``kvstore.events.wire``)."""
        return _kvevents.read_events(self._h, start, limit)

    def events_bounds(self) -> tuple[int, int, int]:
        """``(first, next, limit)``: the log holds ``first .. next - 1``; bound 0 is off."""
        return _kvevents.events_bounds(self._h)

    # --- restores ----------------------------------------------------------------------

    def begin_restore(self) -> RestoreJournal:
        """A journal for one restore's ``import_batch`` calls, to pass to ``end_restore``:
        until then, a process that opens the store after the restore's died undoes it."""
        return _restores.begin_restore(self._h)

    def end_restore(self, journal: RestoreJournal, *, keep: bool) -> None:
        """Finish a restore: ``keep`` what it imported (one commit), or undo it.

        Raises:
            StoreError: the commit failed; the journal stays, and the next process to open
                the store undoes the restore.
        """
        _restores.end_restore(self._h, journal, keep)

    def keep_restores(self, journals: Iterable[RestoreJournal]) -> None:
        """Keep several restores (one per model of an archive) in one commit: all of them
        become whole, or none does (then ``end_restore(keep=False)`` each, or let the next
        process to open the store undo them).

        Raises:
            StoreError: the commit failed; the journals stay (not released).
        """
        _restores.keep_restores(self._h, journals)

    # --- counters ----------------------------------------------------------------------

    def total_bytes(self) -> int:
        """The bytes stored by every model together (what ``capacity_bytes`` bounds)."""
        return _stats.total_bytes(self._h)

    def stats(self) -> _stats.StoreStats:
        """blocks, bytes, capacity_bytes, pinned_blocks, sequences, hits, misses, evictions,
        corrupt (hits and misses: this process's reads since it opened the store;
        pinned_blocks: the stored blocks sequences reference, plus the full blocks
        sequences keep in their own records, once per sequence keeping one)."""
        return _stats.stats(self._h)

    # --- the tier ----------------------------------------------------------------------

    @property
    def tier(self) -> Tier | None:
        """The object-store tier behind the store (None without one)."""
        link = self._h.tier
        return None if link is None else link.tier

    def tier_info(self) -> dict[str, Any] | None:
        """The tier's URL, state, counters and pending uploads (None without a tier)."""
        link = self._h.tier
        return None if link is None else link.info()

    def wait_uploaded(self, timeout: float | None = None) -> bool:
        """Wait until the blocks read through are committed here and no block is pending
        upload to the tier; False on timeout."""
        link = self._h.tier
        return True if link is None else link.wait_uploaded(timeout)
