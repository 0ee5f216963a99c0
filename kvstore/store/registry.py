"""The models of one environment: their numbers and geometries in the ``models``
sub-database, the registration of a new one, the removal of one, and the sub-database
handles this process opened for each (``diskformat`` owns the layout; ``Store`` the
handles users hold).

A new model's number is reserved outside any write (the lowest freed by a deleted model,
else the next after ``last_model``: its empty sub-databases are created in a transaction
of their own, as LMDB requires) and claimed inside the write that first stores into it
(``claim``), so a refused first write registers nothing; another writer taking the number
first makes the claim fail with ``Reclaim`` and the writer reserves again.

The limit on models (``max_models``, besides the default one) belongs to the store: it is
kept in ``meta`` (``META_MAX_MODELS``, set by whoever opens the store with a value) and
read in every check, so every process and worker holds to the same one. It is checked
twice: before a number is reserved (so a refused model opens no sub-databases) and in the
write that registers it (against the count every process sees).
"""

from __future__ import annotations

import threading
from typing import Any

from ..codec.geometry import Geometry
from ..errors import ModelLimitError
from ..protocol import DEFAULT_MODEL, MAX_MODELS
from .diskformat import (
    COUNTER,
    FREE_MODEL_PREFIX,
    META_FORMAT,
    META_FORMAT_VALUE,
    META_LAST_MODEL,
    META_MAX_MODELS,
    META_MAX_MODELS_VALUE,
    MODEL_NUMBER,
    STORE_FORMAT_MODELS,
    Dbs,
    counter,
    free_model_key,
    model_number,
    pack_model,
    unpack_model,
)
from .lmdbenv import LmdbEnv


class Reclaim(Exception):
    """A model's reserved number was taken, or the model registered, by another writer."""


class Stale(Exception):
    """A handle's model is no longer registered under its number (deleted, perhaps made
    again) in the transaction that would use it."""


class UnknownModel(Exception):
    """A write met a model this process has not opened yet (open it, then retry)."""

    def __init__(self, number: int) -> None:
        super().__init__(number)
        self.number = number


def _key(model: str) -> bytes:
    return model.encode("utf-8")


class Registry:
    """The ``models`` sub-database of one environment, and the handles opened for each."""

    def __init__(self, lmdb: LmdbEnv, default: Dbs, nothing: Dbs, path: str) -> None:
        self._lmdb = lmdb
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
        """``model``'s number (None when not registered) and the number a new model would
        take: the lowest freed by a deleted model, else the next after the highest given."""
        raw = txn.get(_key(model), None, self._shared.models)
        cursor = txn.cursor(db=self._shared.meta)
        if cursor.set_range(FREE_MODEL_PREFIX) and bytes(cursor.key()).startswith(
            FREE_MODEL_PREFIX
        ):
            new = int(MODEL_NUMBER.unpack(bytes(cursor.key())[len(FREE_MODEL_PREFIX) :])[0])
        else:
            new = counter(txn.get(META_LAST_MODEL, None, self._shared.meta)) + 1
        return (None if raw is None else model_number(raw)), new

    def holds(self, txn: Any, model: str, number: int) -> bool:
        """Whether ``model`` is registered under ``number`` in ``txn``."""
        raw = txn.get(_key(model), None, self._shared.models)
        return raw is not None and model_number(raw) == number

    def max_models(self, txn: Any) -> int:
        """The models besides default the store admits (its ``META_MAX_MODELS``)."""
        raw = txn.get(META_MAX_MODELS, None, self._shared.meta)
        return MAX_MODELS if raw is None else int(META_MAX_MODELS_VALUE.unpack(raw)[0])

    def set_max_models(self, txn: Any, limit: int) -> None:
        """Record the store's limit on models (in a write transaction), when it differs."""
        value = META_MAX_MODELS_VALUE.pack(limit)
        if txn.get(META_MAX_MODELS, None, self._shared.meta) != value:
            txn.put(META_MAX_MODELS, value, db=self._shared.meta)

    def name_of(self, txn: Any, number: int) -> str:
        """The id of the model numbered ``number`` (its number as text if none has it)."""
        if number == 0:
            return DEFAULT_MODEL
        for key, value in txn.cursor(db=self._shared.models):
            if model_number(value) == number:
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
        limit = self.max_models(txn)
        if held >= limit:
            raise ModelLimitError(
                f"rule 'a store holds at most {limit} models besides default "
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
            if model_number(raw) != number:
                raise Reclaim()
            return
        self.check_room(txn, model)
        if txn.get(free_model_key(number), None, meta) is not None:
            txn.delete(free_model_key(number), db=meta)
        elif counter(txn.get(META_LAST_MODEL, None, meta)) + 1 == number:
            txn.put(META_LAST_MODEL, COUNTER.pack(number), db=meta)
        else:
            raise Reclaim()
        txn.put(_key(model), pack_model(number, None), db=models)
        txn.put(META_FORMAT, META_FORMAT_VALUE.pack(STORE_FORMAT_MODELS), db=meta)

    def release(self, txn: Any, model: str, number: int) -> None:
        """Unregister ``model`` and free its number (in the write that deletes it)."""
        txn.delete(_key(model), db=self._shared.models)
        txn.put(free_model_key(number), b"", db=self._shared.meta)
