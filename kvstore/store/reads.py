"""The read side of a model handle: ``get_many``/``get_buffers``, ``has`` and
``longest_prefix`` (over ``keyset``), ``read_through`` (from the tier), ``reader`` (the
zero-copy views of ``reader``), sequences, and the quarantine of a corrupt sequence record.

Functions over a ``state.Handle`` (``Store`` delegates to them). Reads never take the write
lock; a hit is buffered in process memory (``RecencyBuffer``) and persisted by the next
write or a background flush (``Handle.flush_soon``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from ..codec.assembly import crc_matches, envelope_version
from ..codec.envelope import transcode
from ..codec.geometry import Geometry
from ..codec.layout import SUPPORTED_VERSIONS, U64_MAX
from ..errors import StoreError, UnconvertibleError, UnsupportedVersionError
from .checks import check_hash, seq_key
from .diskformat import BLOCK_KEY, parse_sequence
from .keyset import hash_array
from .reader import KvSpec, Reader, ReadSnapshot, assemble_sequence, reader_consts
from .seqtxn import drop_corrupt_sequence, rebuild_refs
from .state import Handle, log
from .writetxn import WriteTxn

PROBE_MAX = 8  # a chain this short is looked up key by key: one LMDB lookup a key costs
# less than the array path's numpy calls (BENCHMARKS.md, sglang, seventeenth session)
_READ_THROUGH_FIRST = 16  # blocks fetched from the tier in a read-through's first round
_READ_THROUGH_BATCH = 128  # ... and at most per later round (each round doubles)


def transcode_stored(block_hash: int, data: bytes, version: int) -> bytes:
    """A stored block in format ``version``; what cannot be converted is the stored data's
    fault, not the request's.

    Raises:
        UnconvertibleError: a value is not finite, or does not fit the target format.
    """
    try:
        return transcode(data, version)
    except ValueError as exc:
        raise UnconvertibleError(
            f"block {block_hash:016x} cannot be converted to format {version}: {exc}"
        ) from None


class _ReadHandle:
    """A model handle as its readers see it (:class:`~kvstore.store.reader.ReadHandle`)."""

    __slots__ = ("_h",)

    def __init__(self, h: Handle) -> None:
        self._h = h

    @property
    def path(self) -> str:
        return self._h.env.path

    def open_snapshot(self) -> ReadSnapshot:
        h = self._h
        txn = h.begin_read(True)
        try:
            g = h.geometry_in(txn)
        except BaseException:
            h.end_read(txn)
            raise
        version_of, specs = _reader_consts(h, g) if g is not None else ({}, {})
        return ReadSnapshot(
            txn, g, version_of, specs, h.dbs.blocks, h.dbs.seqs, h.recency.touch, h.dbs.tokens
        )

    def close_snapshot(self, txn: Any, escaped: list[Any]) -> None:
        if escaped:
            self._h.env.lmdb.linger(txn, escaped)
        else:
            self._h.end_read(txn)

    def account(self, hits: int, misses: int, corrupt: list[int]) -> None:
        h = self._h
        h.hits += hits
        h.misses += misses
        if corrupt:
            h.quarantine(corrupt)
        h.flush_soon()


def _reader_consts(h: Handle, g: Geometry) -> tuple[dict[int, int], dict[int, KvSpec]]:
    cached = h.rconsts
    if cached is None or cached[0] is not g:  # identity: no dataclass hashing
        cached = h.rconsts = (g, *reader_consts(g))
    return cached[1], cached[2]


def reader(h: Handle) -> Reader:
    """``Store.reader``: a read transaction for zero-copy views."""
    h.check_usable()
    return Reader(_ReadHandle(h))


# --- blocks -------------------------------------------------------------------------------


def get_many(h: Handle, hashes: Iterable[int], version: int | None) -> list[bytes | None]:
    """``Store.get_many``: each block's envelope (CRC-verified, read through on a miss)."""
    if version is not None and version not in SUPPORTED_VERSIONS:
        raise UnsupportedVersionError(f"format version must be 1 or 2, found {version}")
    items = hashes.tolist() if isinstance(hashes, np.ndarray) else hashes
    hs = [check_hash(x) for x in items]
    txn = h.begin_read(False)
    try:
        get, db = txn.get, h.dbs.blocks
        values = [get(BLOCK_KEY.pack(x), None, db) if x else None for x in hs]
    finally:
        h.end_read(txn)
    out: list[bytes | None] = []
    corrupt: list[int] = []
    fetched: dict[int, bytes] = {}
    if h.tier is not None and None in values:
        fetched = h.tier.fetch([x for x, v in zip(hs, values) if v is None])
    for x, data in zip(hs, values):
        if data is not None and not crc_matches(data):
            corrupt.append(x)
            data = None
        if data is None:
            h.misses += 1
            data = fetched.get(x)
            if data is not None:
                h.tier_hits += 1
                if version is not None and envelope_version(data) != version:
                    data = transcode_stored(x, data, version)
        else:
            h.hits += 1
            h.recency.touch(x)
            if version is not None and envelope_version(data) != version:
                data = transcode_stored(x, data, version)
        if data is not None:
            h.served_bytes += len(data)
        out.append(data)
    if corrupt:
        h.quarantine(corrupt)
    h.flush_soon()
    return out


def get_from_tier(h: Handle, block_hash: int) -> bytes | None:
    """``Store.get_from_tier``: a block a local read just missed, from the tier."""
    if h.tier is None:
        return None
    data = h.tier.fetch([check_hash(block_hash)]).get(block_hash)
    if data is not None:
        h.tier_hits += 1
        h.served_bytes += len(data)
    return data


def get_buffers(h: Handle, hashes: Iterable[int], check_crc: bool = True) -> list[memoryview]:
    """``Store.get_buffers``: zero-copy envelopes of a chain's stored prefix (each
    CRC-checked unless the reader checks them itself: ``check_crc=False``)."""
    items = hashes.tolist() if isinstance(hashes, np.ndarray) else hashes
    hs = [check_hash(x) for x in items]
    corrupt: list[int] = []
    values = []
    hits = served = 0
    txn = h.begin_read(True)
    try:
        get, db, touch = txn.get, h.dbs.blocks, h.recency.touch
        for x in hs:
            data = get(BLOCK_KEY.pack(x), None, db) if x else None
            if data is not None and check_crc and not crc_matches(data):
                corrupt.append(x)
                data = None
            if data is None:
                h.misses += 1
                break
            hits += 1
            served += len(data)
            touch(x)
            values.append(data)
    except BaseException:
        h.end_read(txn)
        raise
    finally:
        h.hits += hits
        h.served_bytes += served
    out = h.env.lmdb.hold(txn, values)  # ends or hands over the transaction
    if corrupt:
        h.quarantine(corrupt)
    h.flush_soon()
    return out


def has(h: Handle, hashes: Iterable[int], tier: bool) -> np.ndarray:
    """``Store.has_mask``: whether each hash is stored (with ``tier``: or held by the
    tier), as a bool array."""
    queries = hash_array(hashes)
    if not queries.size:
        return np.zeros(0, dtype=bool)
    txn = h.begin_read(True)
    try:
        present = h.keys.has(txn, queries)
    finally:
        h.end_read(txn)
    if tier and h.tier is not None and not present.all():
        missing = np.flatnonzero(~present)
        present[missing] = h.tier.present(queries[missing].tolist())
    return present


def longest_prefix(h: Handle, hashes: Iterable[int], tier: bool) -> int:
    """``Store.longest_prefix``: how many leading hashes are stored."""
    if isinstance(hashes, list) and _short_chain(hashes):
        return _leading(h, hashes, tier)
    queries = hash_array(hashes)
    if not queries.size:
        return 0
    txn = h.begin_read(True)
    try:
        k = h.keys.longest_prefix(txn, queries)
    finally:
        h.end_read(txn)
    if tier and h.tier is not None and k < queries.size:
        k += h.tier.prefix(queries[k:].tolist())
    return k


def _short_chain(hashes: list[Any]) -> bool:
    """Whether ``hashes`` are 1 to ``PROBE_MAX`` ints in 0..2^64-1 (one alone, an
    engine's check of a first page, is tested without a generator)."""
    if len(hashes) == 1:
        first = hashes[0]
        return type(first) is int and 0 <= first <= U64_MAX
    if not 0 < len(hashes) <= PROBE_MAX:
        return False
    return all(type(x) is int and 0 <= x <= U64_MAX for x in hashes)


def _leading(h: Handle, hashes: list[int], tier: bool) -> int:
    """``longest_prefix`` of a few hashes (ints in 0..2^64-1): one lookup each until the
    first miss, no hash array (fewer calls than the array path's, up to ``PROBE_MAX``)."""
    txn = h.begin_read(True)
    try:
        k = h.keys.leading(txn, hashes)
    finally:
        h.end_read(txn)
    if tier and h.tier is not None and k < len(hashes):
        k += h.tier.prefix(hashes[k:])
    return k


def read_through(h: Handle, hashes: Iterable[int]) -> int:
    """``Store.read_through``: bring a chain's missing leading blocks in from the tier."""
    queries = hash_array(hashes)
    if h.tier is not None:
        h.tier.filler.flush()  # blocks read through by get are local first
    k = longest_prefix(h, queries, False)
    if h.tier is None:
        return k
    size = _READ_THROUGH_FIRST  # a chain usually ends soon after the local prefix
    while k < queries.size:
        batch = queries[k : k + size].tolist()
        size = min(2 * size, _READ_THROUGH_BATCH)
        here = has(h, batch, False)
        fetched = h.tier.fetch([x for x, ok in zip(batch, here) if not ok], wait=True)
        h.misses += len(fetched)  # local misses the tier answered (served from here next)
        h.tier_hits += len(fetched)
        n = 0
        while n < len(batch) and (here[n] or batch[n] in fetched):
            n += 1
        k += n
        if n < len(batch):
            break
    return k


# --- sequences ----------------------------------------------------------------------------


def get_sequence(h: Handle, name: str) -> bytes | None:
    """``Store.get_sequence``: the sequence's envelope; None when absent or damaged."""
    key = seq_key(name)
    corrupt: list[int] = []
    bad_record = False
    out = None
    txn = h.begin_read(True)
    try:
        raw = txn.get(key, None, h.dbs.seqs)
        geometry = h.geometry_in(txn)
        if raw is not None and geometry is not None:
            seq = parse_sequence(raw, geometry)
            if seq is None:
                bad_record = True
            else:
                out = assemble_sequence(txn, h.dbs.blocks, geometry, seq, name, h.env.path, corrupt)
    finally:
        h.end_read(txn)
    if corrupt:
        h.quarantine(corrupt)
    if bad_record:
        quarantine_sequence(h, key)
    return out


def sequences(h: Handle) -> list[str]:
    """``Store.sequences``: every sequence's name, sorted."""
    txn = h.begin_read(True)
    try:
        keys = txn.cursor(db=h.dbs.seqs).iternext(values=False)
        return [bytes(k).decode("ascii") for k in keys]
    finally:
        h.end_read(txn)


def quarantine_sequence(h: Handle, key: bytes) -> None:
    """Remove a sequence record that fails its CRC and recount every pin."""

    def body(w: WriteTxn) -> None:
        raw = w.txn.get(key, None, w.dbs.seqs)
        geometry = h.geometry_in(w.txn)
        if raw is not None and parse_sequence(raw, geometry) is None:
            drop_corrupt_sequence(w, key, len(raw))
            rebuild_refs(w, geometry)

    try:
        h.write(body)
    except StoreError as exc:
        log.error("%s: could not quarantine a corrupt sequence: %s", h.env.path, exc)
