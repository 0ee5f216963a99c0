"""``has`` and ``longest_prefix`` of many hashes without a B-tree lookup per hash.

A per-key LMDB lookup costs about half a microsecond from Python on a small store and
over a microsecond on a store of a million blocks (a random leaf page per key), so 8,192
of them miss a 2 ms budget. Instead each process keeps a copy of a model's stored hashes
in memory -- a sorted array, plus the sorted hashes added and removed since -- tagged with
the LMDB transaction id it is exact for, and a query is a ``searchsorted`` in each. A
reader at a later snapshot brings the copy forward with the key log (``keylog``: every
commit's net change, whichever process made it) and checks the result against the
index's entry count; where the log cannot say, the copy is read again from the ``index``
sub-database (a page of sorted u64 duplicates per LMDB call) once that is cheaper than
the per-key lookups this process has made since it had none.
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

import numpy as np

from ..codec.hashing import exact_u64_array
from .diskformat import BLOCK_KEY, INDEX_DTYPE, INDEX_KEY, INDEX_VALUE, Dbs
from .keylog import changes_since

# A process reads the whole key set once its per-key lookups add up to 1/128 of it: an
# entry read costs ~1/40 of a lookup on a warm map, and the lookups of a process that just
# opened a large store fault its pages in (a million blocks: 8,192 lookups 12 ms warm,
# ~100 ms cold, the whole read 35-140 ms); every later call is answered from the copy.
SCAN_PER_LOOKUP = 128
_PREFIX_CHUNK = 1024
_BUCKETS_ABOVE = 1 << 14  # stored hashes from which a copy keeps bucket starts
_MAX_BUCKET = 64  # the widest bucket searched in step (wider: a whole-array search)


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
    items = hashes if isinstance(hashes, (list, tuple)) else list(hashes)
    exact = exact_u64_array(items)  # exact ints, the usual case: one compiled pass
    if exact is not None:
        return exact
    try:  # numpy integers, bools; a float or a string is refused, never truncated
        return np.asarray([operator.index(x) for x in items], dtype=np.uint64)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"block hashes must be integers in 0..2^64-1: {exc}") from None


def _in_sorted(present: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """Whether each query is in the sorted array ``present``."""
    if not present.size:
        return np.zeros(queries.shape, dtype=bool)
    at = np.searchsorted(present, queries)
    np.minimum(at, present.size - 1, out=at)
    return present[at] == queries


def _buckets(base: np.ndarray) -> np.ndarray | None:
    """Where each bucket of ``base`` starts, a bucket being the hashes of equal top
    ``k`` bits (about 8 hashes each; one more entry: the end); None for a small base."""
    if base.size < _BUCKETS_ABOVE:
        return None
    k = base.size.bit_length() - 3
    edges = np.arange(1 << k, dtype=np.uint64) << np.uint64(64 - k)
    return np.append(np.searchsorted(base, edges), base.size).astype(np.intp)


def _in_buckets(base: np.ndarray, starts: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """``_in_sorted(base, queries)`` through the bucket starts of ``base``: a binary search
    inside each query's bucket, all queries in step. Block hashes are spread evenly, so a
    bucket is a cache line or two: one or two cache misses per query instead of one per
    level of a search of the whole array (3-4x faster on a million hashes). Hashes
    crowded into a few buckets fall back to the whole-array search."""
    k = (starts.size - 1).bit_length() - 1
    bucket = (queries >> np.uint64(64 - k)).astype(np.intp)
    lo = starts[bucket]
    hi = starts[bucket + 1]
    width = int((hi - lo).max()) if queries.size else 0
    if width > _MAX_BUCKET:
        return _in_sorted(base, queries)
    last = base.size - 1
    for _ in range(width.bit_length()):
        mid = (lo + hi) >> 1
        right = base[np.minimum(mid, last)] < queries
        lo = np.where(right, mid + 1, lo)
        hi = np.where(right, hi, mid)
    return base[np.minimum(lo, last)] == queries


class _Copy(NamedTuple):
    """A model's stored hashes at transaction ``tid``: ``base`` without ``removed`` (a
    subset of it), with ``added`` (disjoint from it); all three sorted."""

    tid: int
    base: np.ndarray
    added: np.ndarray
    removed: np.ndarray
    starts: np.ndarray | None  # _buckets(base)

    @property
    def size(self) -> int:
        return int(self.base.size - self.removed.size + self.added.size)

    def contains(self, queries: np.ndarray) -> np.ndarray:
        if self.starts is not None:
            found = _in_buckets(self.base, self.starts, queries)
        else:
            found = _in_sorted(self.base, queries)
        if self.removed.size:
            found &= ~_in_sorted(self.removed, queries)
        if self.added.size:
            found |= _in_sorted(self.added, queries)
        return found

    def advanced(self, tid: int, added: np.ndarray, removed: np.ndarray) -> _Copy:
        """This copy after a net change (``added`` absent here, ``removed`` present)."""
        back = _in_sorted(self.removed, added)  # removed before, stored again
        keep_removed = self.removed[~_in_sorted(added[back], self.removed)]
        new_added = np.union1d(self.added, added[~back])
        gone = _in_sorted(new_added, removed)  # added since the base, removed again
        new_added = new_added[~_in_sorted(removed[gone], new_added)]
        new_removed = np.union1d(keep_removed, removed[~gone])
        if new_added.size + new_removed.size <= max(_MERGE_AT, self.base.size // 16):
            return _Copy(tid, self.base, new_added, new_removed, self.starts)
        keep = np.ones(self.base.size, dtype=bool)
        keep[np.searchsorted(self.base, new_removed)] = False
        base = self.base[keep]
        base = np.insert(base, np.searchsorted(base, new_added), new_added)
        return _Copy(tid, base, _EMPTY, _EMPTY, _buckets(base))


_EMPTY = np.zeros(0, np.uint64)
_MERGE_AT = 4096  # changes kept beside the base before they are merged into it


class KeySet:
    """The stored hashes of one model, as this process last saw them."""

    def __init__(self, dbs: Dbs) -> None:
        self._dbs = dbs
        self._copy: _Copy | None = None
        self._probed = 0  # hashes looked up one by one since the last full read

    def _present(self, txn: Any, n_queries: int) -> _Copy | None:
        """The snapshot's stored hashes, or None when reading them again would cost more
        than the per-key lookups made since the last read (``n_queries`` more now)."""
        tid = txn.id()
        copy = self._copy
        if copy is not None and copy.tid == tid:
            return copy
        dbs = self._dbs
        entries = txn.stat(dbs.index)["entries"]
        if copy is not None and copy.tid < tid and dbs.keylog is not None:
            changes = changes_since(txn, dbs.keylog, dbs.meta, dbs.number, copy.tid)
            if changes is not None:
                new = copy.advanced(tid, *changes)
                # A writer that keeps no key log (an earlier release) changes the count.
                if new.size == entries:
                    self._keep(new)
                    return new
        self._probed += n_queries
        if entries > self._probed * SCAN_PER_LOOKUP:
            return None
        self._probed = 0
        base = self._read(txn)
        new = _Copy(tid, base, _EMPTY, _EMPTY, _buckets(base))
        self._keep(new)
        return new

    def _keep(self, new: _Copy) -> None:
        copy = self._copy  # threads race here harmlessly: each copy is exact for its tid
        if copy is None or new.tid >= copy.tid:
            self._copy = new

    def _read(self, txn: Any) -> np.ndarray:
        """Every stored hash of ``txn``'s snapshot, sorted (an owned array)."""
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
        return present

    def _probe(self, txn: Any, queries: np.ndarray) -> list[bool]:
        set_key = txn.cursor(db=self._dbs.blocks).set_key
        pack = BLOCK_KEY.pack
        return [bool(h) and set_key(pack(h)) for h in queries.tolist()]

    def has(self, txn: Any, queries: np.ndarray) -> np.ndarray:
        """Whether each hash is stored in ``txn``'s snapshot (a bool array)."""
        present = self._present(txn, queries.size)
        if present is None:
            return np.array(self._probe(txn, queries), dtype=bool)
        return present.contains(queries)

    def holds(self, txn: Any, block_hash: int) -> bool:
        """Whether the one hash ``block_hash`` (an int in 0..2^64-1) is stored in
        ``txn``'s snapshot: one lookup, without the copy of the key set."""
        return self.leading(txn, [block_hash]) == 1

    def leading(self, txn: Any, hashes: list[int]) -> int:
        """How many leading ``hashes`` (ints in 0..2^64-1) are stored in ``txn``'s
        snapshot: one cursor, one positioning a hash until the first miss, without the
        copy of the key set. A cursor's ``set_key`` does not hand the value over, so its
        cost does not grow with the block's size as ``txn.get``'s does (BENCHMARKS.md,
        sglang)."""
        set_key = txn.cursor(db=self._dbs.blocks).set_key
        pack = BLOCK_KEY.pack
        k = 0
        for block_hash in hashes:
            if not block_hash or not set_key(pack(block_hash)):
                break
            k += 1
        return k

    def longest_prefix(self, txn: Any, queries: np.ndarray) -> int:
        """How many leading hashes are stored in ``txn``'s snapshot."""
        if not queries.size:
            return 0
        # A chain not held from its first block (a new prompt) is answered by one lookup,
        # before the copy of the key set is brought to this snapshot.
        if not self.holds(txn, int(queries[0])):
            return 0
        if queries.size == 1:  # asked about one block (an engine's check of a first page)
            return 1
        present = self._present(txn, queries.size)
        if present is None:
            return self.leading(txn, queries.tolist())
        start = 0
        for end in (_PREFIX_CHUNK, queries.size):  # a chain's prefix often ends early
            chunk = present.contains(queries[start:end])
            if not chunk.all():
                return start + int(np.argmin(chunk))
            start = end
            if start >= queries.size:
                break
        return int(queries.size)
