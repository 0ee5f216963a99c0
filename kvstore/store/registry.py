"""The models of one environment: their numbers and geometries in the ``models``
sub-database, the registration of a new one, and the sub-database handles this process
opened for each (``diskformat`` owns the layout; ``Store`` the handles users hold).

A new model's number is reserved outside any write (the next after ``last_model``: its
empty sub-databases are created in a transaction of their own, as LMDB requires) and
claimed inside the write that first stores into it (``claim``), so a refused first write
registers nothing; another writer taking the number first makes the claim fail with
``Reclaim`` and the writer reserves again.

The limit on models (``max_models``, besides the default one) is checked twice: before a
number is reserved (so a refused model opens no sub-databases) and in the write that
registers it (so every process and worker enforces it against the same count).
"""

from __future__ import annotations

import threading
from typing import Any

from ..codec.geometry import Geometry
from ..errors import ModelLimitError
from ..protocol import DEFAULT_MODEL
from .diskformat import (
    COUNTER,
    META_FORMAT,
    META_FORMAT_VALUE,
    META_LAST_MODEL,
    STORE_FORMAT_MODELS,
    Dbs,
    counter,
    pack_model,
    unpack_model,
)
from .lmdbenv import LmdbEnv


class Reclaim(Exception):
    """A model's reserved number was taken, or the model registered, by another writer."""


class UnknownModel(Exception):
    """A write met a model this process has not opened yet (open it, then retry)."""

    def __init__(self, number: int) -> None:
        super().__init__(number)
        self.number = number


def _key(model: str) -> bytes:
    return model.encode("utf-8")


class Registry:
    """The ``models`` sub-database of one environment, and the handles opened for each."""

    def __init__(
        self, lmdb: LmdbEnv, default: Dbs, nothing: Dbs, path: str, max_models: int
    ) -> None:
        self._lmdb = lmdb
        self.max_models = max_models
        self._shared = default
        self.nothing = nothing  # what a model not created yet reads
        self._path = path
        self._opened: dict[int, Dbs] = {0: default}
        self._lock = threading.Lock()

    def dbs(self, number: int) -> Dbs:
        """Model ``number``'s sub-database handles, opened (created) once per process."""
        dbs = self._opened.get(number)
        if dbs is None:
            with self._lock:
                dbs = self._opened.get(number)
                if dbs is None:
                    dbs = self._opened[number] = self._lmdb.open_model(self._shared, number)
        return dbs

    def opened(self, number: int) -> Dbs:
        """The handles of a model this process opened already.

        Raises:
            UnknownModel: it did not (inside a write transaction, which cannot open them).
        """
        dbs = self._opened.get(number)
        if dbs is None:
            raise UnknownModel(number)
        return dbs

    def lookup(self, txn: Any, model: str) -> tuple[int | None, int]:
        """``model``'s number (None when not registered) and the highest number given."""
        raw = txn.get(_key(model), None, self._shared.models)
        last = counter(txn.get(META_LAST_MODEL, None, self._shared.meta))
        return (None if raw is None else unpack_model(raw)[0]), last

    def name_of(self, txn: Any, number: int) -> str:
        """The id of the model numbered ``number`` (its number as text if none has it)."""
        if number == 0:
            return DEFAULT_MODEL
        for key, value in txn.cursor(db=self._shared.models):
            if unpack_model(value)[0] == number:
                return bytes(key).decode("utf-8")
        return str(number)

    def exists(self, txn: Any, model: str) -> bool:
        """Whether ``model`` is registered."""
        return txn.get(_key(model), None, self._shared.models) is not None

    def names(self, txn: Any) -> list[str]:
        """Every registered model id, in key order."""
        keys = txn.cursor(db=self._shared.models).iternext(values=False)
        return [bytes(k).decode("utf-8") for k in keys]

    def geometry(self, txn: Any, model: str) -> Geometry | None:
        """A registered model's geometry (None until its first put, or unregistered)."""
        raw = txn.get(_key(model), None, self._shared.models)
        return None if raw is None else unpack_model(raw)[1]

    def set_geometry(self, txn: Any, model: str, number: int, geometry: Geometry) -> None:
        """Record the geometry a model adopts with its first put."""
        txn.put(_key(model), pack_model(number, geometry), db=self._shared.models)

    def check_room(self, txn: Any, model: str) -> None:
        """Refuse registering ``model`` when the store holds ``max_models`` models already.

        Raises:
            ModelLimitError: it does.
        """
        held = int(txn.stat(self._shared.models)["entries"])
        if held >= self.max_models:
            raise ModelLimitError(
                f"rule 'a store holds at most {self.max_models} models besides default "
                f"(--max-models)' failed: {self._path} holds {held}, so the model "
                f"{model!r} is not created"
            )

    def claim(self, txn: Any, model: str, number: int) -> None:
        """Register ``model`` under its reserved ``number`` in the write ``txn``.

        Raises:
            Reclaim: another writer registered the model, or took the number, first.
            ModelLimitError: the store holds ``max_models`` models already.
        """
        meta, models = self._shared.meta, self._shared.models
        raw = txn.get(_key(model), None, models)
        if raw is not None:
            if unpack_model(raw)[0] != number:
                raise Reclaim()
            return
        if counter(txn.get(META_LAST_MODEL, None, meta)) + 1 != number:
            raise Reclaim()
        self.check_room(txn, model)
        txn.put(META_LAST_MODEL, COUNTER.pack(number), db=meta)
        txn.put(_key(model), pack_model(number, None), db=models)
        txn.put(META_FORMAT, META_FORMAT_VALUE.pack(STORE_FORMAT_MODELS), db=meta)
