"""``has`` and ``longest_prefix`` of many hashes without a B-tree lookup per hash.

A per-key LMDB lookup costs about half a microsecond from Python, so 8,192 of them miss
a 2 ms budget. Instead the stored hashes are read from the ``index`` sub-database (a
page of sorted u64 duplicates per call) into a sorted array, cached per LMDB transaction
id -- a snapshot id, so the copy is exact for every reader of that snapshot, in any
process -- and queries become one ``searchsorted``. After a write the copy is re-read
only when that is cheaper than per-key lookups would be.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .diskformat import BLOCK_KEY, INDEX_DTYPE, INDEX_KEY, INDEX_VALUE, Dbs

# Reading one index entry costs about 1/16 of a per-key lookup (or less).
SCAN_PER_LOOKUP = 16
_PREFIX_CHUNK = 1024


def hash_array(hashes: Any) -> np.ndarray:
    """Hashes (ints or a numpy integer array) as a 1-D uint64 array.

    Raises:
        ValueError: a value is not an integer in 0..2^64-1.
    """
    if isinstance(hashes, np.ndarray):
        if hashes.ndim != 1 or hashes.dtype.kind not in "iu":
            raise ValueError(
                f"hashes must be a 1-D integer array, found {hashes.dtype} of shape {hashes.shape}"
            )
        if hashes.dtype.kind == "i" and hashes.size and int(hashes.min()) < 0:
            raise ValueError(f"a block hash must fit u64, found {int(hashes.min())}")
        return hashes.astype(np.uint64, copy=False)
    try:
        return np.asarray(hashes if isinstance(hashes, list) else list(hashes), dtype=np.uint64)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"block hashes must be integers in 0..2^64-1: {exc}") from None


def _in_sorted(present: np.ndarray, queries: np.ndarray) -> np.ndarray:
    if not present.size:
        return np.zeros(queries.shape, dtype=bool)
    at = np.searchsorted(present, queries)
    np.minimum(at, present.size - 1, out=at)
    return present[at] == queries


class KeySet:
    """The stored hashes of the latest snapshot this process looked at."""

    def __init__(self, dbs: Dbs) -> None:
        self._dbs = dbs
        self._cached: tuple[int, np.ndarray] | None = None  # (txn id, sorted hashes)

    def _present(self, txn: Any, n_queries: int) -> np.ndarray | None:
        """The snapshot's sorted hashes, or None when re-reading them would cost more than
        ``n_queries`` per-key lookups."""
        tid = txn.id()
        cached = self._cached
        if cached is not None and cached[0] == tid:
            return cached[1]
        if txn.stat(self._dbs.index)["entries"] > n_queries * SCAN_PER_LOOKUP:
            return None
        cur = txn.cursor(db=self._dbs.index)
        step = len(INDEX_KEY) + INDEX_VALUE.size
        try:  # packed (key, value) pairs, one LMDB call per page of duplicates
            raw = cur.getmulti(
                [INDEX_KEY], dupdata=True, dupfixed_bytes=INDEX_VALUE.size, keyfixed=True
            )
        except TypeError:  # py-lmdb without getmulti(keyfixed=...)
            values = cur.iternext_dup(keys=False) if cur.set_key(INDEX_KEY) else ()
            raw = b"".join(INDEX_KEY + bytes(v) for v in values)
        count = len(raw) // step
        present = np.array(  # an owned copy: LMDB's buffer dies with the transaction
            np.ndarray((count,), INDEX_DTYPE, raw, len(INDEX_KEY), (step,)) if count else (),
            dtype=np.uint64,
        )
        if present.size > 1 and not bool((present[1:] > present[:-1]).all()):
            present.sort()  # INTEGERDUP keeps them sorted; checking is cheap
        self._cached = (tid, present)
        return present

    def _probe(self, txn: Any, queries: np.ndarray, stop_at_miss: bool) -> list[bool]:
        set_key = txn.cursor(db=self._dbs.blocks).set_key
        pack = BLOCK_KEY.pack
        out: list[bool] = []
        for h in queries.tolist():
            found = bool(h) and set_key(pack(h))
            out.append(found)
            if stop_at_miss and not found:
                break
        return out

    def has(self, txn: Any, queries: np.ndarray) -> np.ndarray:
        """Whether each hash is stored in ``txn``'s snapshot (a bool array)."""
        present = self._present(txn, queries.size)
        if present is None:
            return np.array(self._probe(txn, queries, stop_at_miss=False), dtype=bool)
        return _in_sorted(present, queries)

    def longest_prefix(self, txn: Any, queries: np.ndarray) -> int:
        """How many leading hashes are stored in ``txn``'s snapshot."""
        if not queries.size:
            return 0
        present = self._present(txn, queries.size)
        if present is None:
            found = self._probe(txn, queries, stop_at_miss=True)
            return len(found) - (not found[-1])
        for start in range(0, queries.size, _PREFIX_CHUNK):
            chunk = _in_sorted(present, queries[start : start + _PREFIX_CHUNK])
            if not chunk.all():
                return start + int(np.argmin(chunk))
        return int(queries.size)
