"""The key log: what each write transaction changed in the models' key sets, written in
that transaction.

A process answers ``has``/``longest_prefix`` from an in-memory copy of a model's stored
hashes (``keyset``). Reading a million hashes again after every write by any process would
cost tens of milliseconds; instead every write transaction that adds or removes blocks
records its net change under its own LMDB transaction id, in the same commit. A reader
whose copy is of transaction ``a`` and whose snapshot is transaction ``b`` reads the
records in ``(a, b]`` -- exactly the commits between the two snapshots, whichever process
made them -- and applies them. The log keeps the last ``KEEP_RECORDS`` records; ``meta``'s
``keylog_floor`` says how far it was trimmed, and a copy older than that is read again.

Sub-database, keys and values: ``diskformat`` (``keylog``, ``KEYLOG_*``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .diskformat import (
    COUNTER,
    KEYLOG_HASH_DTYPE,
    KEYLOG_KEY,
    KEYLOG_RESET,
    KEYLOG_SECTION,
    META_KEYLOG_FLOOR,
    counter,
)

KEEP_RECORDS = 4096  # records kept (each one commit that changed a key set)
TRIM_BATCH = 256  # the log is trimmed this many records at a time, past KEEP_RECORDS
# A commit changing more hashes of a model than this records a reset instead (a restore
# of a large archive): readers read that key set again, which costs less than applying it.
MAX_RECORDED = 1 << 16


class KeyChanges:
    """The net changes one write transaction makes to each model's key set."""

    __slots__ = ("_added", "_removed", "_reset")

    def __init__(self) -> None:
        self._added: dict[int, set[int]] = {}
        self._removed: dict[int, set[int]] = {}
        self._reset: set[int] = set()

    def added(self, model: int, h: int) -> None:
        """Block ``h`` of ``model`` joined the key set."""
        removed = self._removed.get(model)
        if removed is not None and h in removed:
            removed.discard(h)  # removed and stored again: no net change
        else:
            self._added.setdefault(model, set()).add(h)

    def removed(self, model: int, h: int) -> None:
        """Block ``h`` of ``model`` left the key set."""
        added = self._added.get(model)
        if added is not None and h in added:
            added.discard(h)
        else:
            self._removed.setdefault(model, set()).add(h)

    def reset(self, model: int) -> None:
        """``model``'s key set was replaced wholesale (its sub-databases emptied)."""
        self._reset.add(model)

    def write(self, txn: Any, keylog: Any, meta: Any) -> None:
        """Record the changes under ``txn``'s id and trim the log (before the commit)."""
        parts: list[bytes] = []
        for model in sorted(set(self._added) | set(self._removed) | self._reset):
            add = self._added.get(model, ())
            rem = self._removed.get(model, ())
            if model in self._reset or len(add) + len(rem) > MAX_RECORDED:
                parts.append(KEYLOG_SECTION.pack(model, KEYLOG_RESET, 0, 0))
            elif add or rem:
                parts.append(KEYLOG_SECTION.pack(model, 0, len(add), len(rem)))
                parts.append(np.fromiter(add, KEYLOG_HASH_DTYPE, len(add)).tobytes())
                parts.append(np.fromiter(rem, KEYLOG_HASH_DTYPE, len(rem)).tobytes())
        if not parts:
            return
        txn.put(KEYLOG_KEY.pack(txn.id()), b"".join(parts), db=keylog)
        if txn.stat(keylog)["entries"] > KEEP_RECORDS + TRIM_BATCH:
            cursor = txn.cursor(db=keylog)
            floor = 0
            cursor.first()
            for _ in range(TRIM_BATCH):
                floor = KEYLOG_KEY.unpack(cursor.key())[0]
                cursor.delete()
            txn.put(META_KEYLOG_FLOOR, COUNTER.pack(floor), db=meta)


def changes_since(
    txn: Any, keylog: Any, meta: Any, model: int, since: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """The net change of ``model``'s key set from transaction ``since`` to ``txn``'s
    snapshot: (added, removed) as sorted uint64 arrays -- hashes absent then and present
    now, and present then and absent now. None when the log cannot say (trimmed past
    ``since``, or a reset of the model in between)."""
    if since < counter(txn.get(META_KEYLOG_FLOOR, None, meta)):
        return None
    cursor = txn.cursor(db=keylog)
    parts: list[np.ndarray] = []
    kinds: list[np.ndarray] = []
    if cursor.set_range(KEYLOG_KEY.pack(since + 1)):
        for value in cursor.iternext(keys=False):
            raw = memoryview(value)
            at = 0
            while at < len(raw):
                number, flags, n_add, n_rem = KEYLOG_SECTION.unpack_from(raw, at)
                at += KEYLOG_SECTION.size
                if number == model:
                    if flags & KEYLOG_RESET:
                        return None
                    parts.append(np.frombuffer(raw, KEYLOG_HASH_DTYPE, n_add + n_rem, at))
                    kinds.append(np.arange(n_add + n_rem) < n_add)
                at += (n_add + n_rem) * KEYLOG_HASH_DTYPE.itemsize
    if not parts:
        empty = np.zeros(0, np.uint64)
        return empty, empty
    return net_change(np.concatenate(parts).astype(np.uint64), np.concatenate(kinds))


def net_change(hashes: np.ndarray, is_add: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The net effect of changes in commit order (``hashes[i]`` added when ``is_add[i]``,
    else removed), each one valid where it happened: a hash first added was absent before,
    one first removed was present; what it is after its last change decides the rest."""
    order = np.argsort(hashes, kind="stable")  # commit order kept within each hash
    sorted_hashes = hashes[order]
    kinds = is_add[order]
    starts = np.flatnonzero(np.r_[True, sorted_hashes[1:] != sorted_hashes[:-1]])
    ends = np.r_[starts[1:], sorted_hashes.size] - 1
    first, last = kinds[starts], kinds[ends]
    unique = sorted_hashes[starts]
    return unique[first & last], unique[~first & ~last]
