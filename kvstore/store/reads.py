"""The ``Store``'s read API: ``get``/``get_many``/``get_buffers``, ``has`` and
``longest_prefix`` (over ``keyset``), ``read_through`` (from the tier), ``reader`` (the
zero-copy views of ``reader``), sequences, and the quarantine of what a read finds corrupt.

Reads never take the write lock; a hit is buffered in process memory (``RecencyBuffer``)
and persisted by the next write or a background flush (``core``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from ..codec.assembly import crc_matches, envelope_version
from ..codec.envelope import transcode
from ..codec.geometry import Geometry
from ..codec.layout import SUPPORTED_VERSIONS
from ..errors import StoreError, UnconvertibleError, UnsupportedVersionError
from .checks import check_hash, seq_key
from .core import StoreCore, log
from .diskformat import BLOCK_KEY, parse_sequence
from .keyset import hash_array
from .reader import KvSpec, Reader, ReadSnapshot, assemble_sequence, reader_consts
from .writetxn import WriteTxn

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
    """A store as its readers see it (:class:`~kvstore.store.reader.ReadHandle`)."""

    __slots__ = ("_store",)

    def __init__(self, store: StoreReads) -> None:
        self._store = store

    @property
    def path(self) -> str:
        return self._store.path

    def open_snapshot(self) -> ReadSnapshot:
        return self._store._open_snapshot()

    def close_snapshot(self, txn: Any, escaped: list[Any]) -> None:
        self._store._close_snapshot(txn, escaped)

    def account(self, hits: int, misses: int, corrupt: list[int]) -> None:
        self._store._account(hits, misses, corrupt)


class StoreReads(StoreCore):
    """The read API of a ``Store`` handle (a mixin of ``Store``)."""

    # --- the read side's handle (Reader sees only this) -------------------------------------

    def _open_snapshot(self) -> ReadSnapshot:
        txn = self._begin_read(True)
        try:
            g = self._geometry_in(txn)
        except BaseException:
            self._end_read(txn)
            raise
        version_of, specs = self._reader_consts(g) if g is not None else ({}, {})
        return ReadSnapshot(
            txn, g, version_of, specs, self._dbs.blocks, self._dbs.seqs, self._recency.touch
        )

    def _close_snapshot(self, txn: Any, escaped: list[Any]) -> None:
        if escaped:
            self._lmdb.linger(txn, escaped)
        else:
            self._end_read(txn)

    def _account(self, hits: int, misses: int, corrupt: list[int]) -> None:
        self.hits += hits
        self.misses += misses
        if corrupt:
            self._quarantine(corrupt)
        self._flush_soon()

    def _reader_consts(self, g: Geometry) -> tuple[dict[int, int], dict[int, KvSpec]]:
        cached = self._rconsts
        if cached is None or cached[0] is not g:  # identity: no dataclass hashing
            cached = self._rconsts = (g, *reader_consts(g))
        return cached[1], cached[2]

    # --- reads ---------------------------------------------------------------------------

    def get(self, block_hash: int, *, version: int | None = None) -> bytes | None:
        """The block's single-block envelope, CRC-verified; None when absent or corrupt
        (a corrupt block is quarantined). With ``version`` differing from the stored
        format, the block is transcoded on the way out."""
        return self.get_many([block_hash], version=version)[0]

    def get_many(self, hashes: Iterable[int], *, version: int | None = None) -> list[bytes | None]:
        """``get`` of every hash, in one read transaction."""
        if version is not None and version not in SUPPORTED_VERSIONS:
            raise UnsupportedVersionError(f"format version must be 1 or 2, found {version}")
        items = hashes.tolist() if isinstance(hashes, np.ndarray) else hashes
        hs = [check_hash(h) for h in items]
        txn = self._begin_read(False)
        try:
            get, db = txn.get, self._dbs.blocks
            values = [get(BLOCK_KEY.pack(h), None, db) if h else None for h in hs]
        finally:
            self._end_read(txn)
        out: list[bytes | None] = []
        corrupt: list[int] = []
        fetched: dict[int, bytes] = {}
        if self._tier is not None and None in values:
            fetched = self._tier.fetch([h for h, v in zip(hs, values) if v is None])
        for h, data in zip(hs, values):
            if data is not None and not crc_matches(data):
                corrupt.append(h)
                data = None
            if data is None:
                self.misses += 1
                data = fetched.get(h)
                if data is not None:
                    self.tier_hits += 1
                    if version is not None and envelope_version(data) != version:
                        data = transcode_stored(h, data, version)
            else:
                self.hits += 1
                self._recency.touch(h)
                if version is not None and envelope_version(data) != version:
                    data = transcode_stored(h, data, version)
            if data is not None:
                self.served_bytes += len(data)
            out.append(data)
        if corrupt:
            self._quarantine(corrupt)
        self._flush_soon()
        return out

    def get_from_tier(self, block_hash: int) -> bytes | None:
        """The block a local read just missed (``get_buffers``), read through from the tier,
        validated (None without a tier or a valid copy there): counted as that lookup's
        tier hit, not as another lookup."""
        if self._tier is None:
            return None
        data = self._tier.fetch([check_hash(block_hash)]).get(block_hash)
        if data is not None:
            self.tier_hits += 1
            self.served_bytes += len(data)
        return data

    def get_buffers(self, hashes: Iterable[int]) -> list[memoryview]:
        """Zero-copy ``get_many`` of a chain's prefix: the stored envelopes of the leading
        hashes, each CRC-verified, up to the first one absent or corrupt, from one read
        snapshot, as read-only memoryviews straight over LMDB's map.

        For handing to something that releases them later (an HTTP transport): the
        snapshot stays open until every returned memoryview, and everything made from
        them, is released, and ends at once then. Keep them only as long as needed: an
        open snapshot keeps its pages from being reused, and a remap of the map waits
        for it (``LmdbEnv.hold``). While a remap is pending they are copies.
        """
        items = hashes.tolist() if isinstance(hashes, np.ndarray) else hashes
        hs = [check_hash(h) for h in items]
        corrupt: list[int] = []
        values = []
        txn = self._begin_read(True)
        try:
            get, db, touch = txn.get, self._dbs.blocks, self._recency.touch
            for h in hs:
                data = get(BLOCK_KEY.pack(h), None, db) if h else None
                if data is not None and not crc_matches(data):
                    corrupt.append(h)
                    data = None
                if data is None:
                    self.misses += 1
                    break
                self.hits += 1
                self.served_bytes += len(data)
                touch(h)
                values.append(data)
        except BaseException:
            self._end_read(txn)
            raise
        out = self._lmdb.hold(txn, values)  # ends or hands over the transaction
        if corrupt:
            self._quarantine(corrupt)
        self._flush_soon()
        return out

    def lingering_snapshots(self) -> int:
        """Snapshots of closed readers this process keeps open because zero-copy arrays
        taken from them are still referenced (their pages are not reused meanwhile)."""
        return self._lmdb.lingering_snapshots()

    def held_snapshots(self) -> tuple[int, float]:
        """Read snapshots held open for buffers of ``get_buffers`` in this process, and
        the age in seconds of the oldest (0 when none)."""
        return self._lmdb.held_snapshots()

    def set_loop_thread(self, ident: int | None) -> None:
        """Name the thread whose event loop releases ``get_buffers``' buffers: a remap it
        needs while some are held raises ``StoreError`` instead of waiting for them."""
        self._lmdb.loop_thread = ident

    def has(self, hashes: Iterable[int], *, tier: bool = False) -> list[bool]:
        """Whether each hash is stored; ``hashes`` are ints or a numpy integer array.

        One read transaction, no write lock. Large queries are answered from a sorted copy
        of the stored hashes, re-read (a page of hashes per LMDB call) only after a write.
        ``tier``: a hash absent here counts as present when the store's tier holds it
        (concurrent HEADs; nothing is read through).

        Raises:
            ValueError: a hash is not an integer in 0..2^64-1.
        """
        queries = hash_array(hashes)
        if not queries.size:
            return []
        txn = self._begin_read(True)
        try:
            present = self._keys.has(txn, queries)
        finally:
            self._end_read(txn)
        if tier and self._tier is not None and not all(present):
            missing = [i for i, here in enumerate(present) if not here]
            remote = self._tier.present(queries[missing].tolist())
            for i, there in zip(missing, remote):
                present[i] = there
        return present

    def longest_prefix(self, hashes: Iterable[int], *, tier: bool = False) -> int:
        """How many leading hashes are stored (the cached prefix of a chain); no write lock.

        ``tier``: the prefix continues through blocks the store's tier holds (HEADs).

        Raises:
            ValueError: a hash is not an integer in 0..2^64-1.
        """
        queries = hash_array(hashes)
        if not queries.size:
            return 0
        txn = self._begin_read(True)
        try:
            k = self._keys.longest_prefix(txn, queries)
        finally:
            self._end_read(txn)
        if tier and self._tier is not None and k < queries.size:
            k += self._tier.prefix(queries[k:].tolist())
        return k

    def read_through(self, hashes: Iterable[int]) -> int:
        """Bring the leading blocks of a chain that are missing here in from the tier
        (validated, stored as evictable blocks), stopping at the first the tier lacks;
        returns the length of the prefix now stored. Without a tier: ``longest_prefix``.

        Raises:
            ValueError: a hash is not an integer in 0..2^64-1.
        """
        queries = hash_array(hashes)
        if self._tier is not None:
            self._tier.filler.flush()  # blocks read through by get are local first
        k = self.longest_prefix(queries)
        if self._tier is None:
            return k
        size = _READ_THROUGH_FIRST  # a chain usually ends soon after the local prefix
        while k < queries.size:
            batch = queries[k : k + size].tolist()
            size = min(2 * size, _READ_THROUGH_BATCH)
            here = self.has(batch)
            fetched = self._tier.fetch([h for h, ok in zip(batch, here) if not ok], wait=True)
            self.misses += len(fetched)  # local misses the tier answered (served from here next)
            self.tier_hits += len(fetched)
            n = 0
            while n < len(batch) and (here[n] or batch[n] in fetched):
                n += 1
            k += n
            if n < len(batch):
                break
        return k

    def reader(self) -> Reader:
        """A read transaction for zero-copy views: ``with store.reader() as r: r.view(h)``.

        Views, memoryviews and arrays from it are valid only inside the ``with`` block;
        a resize of LMDB's map (a write in this process) waits until it closes.
        """
        self._check_usable()
        return Reader(_ReadHandle(self))

    def get_sequence(self, name: str) -> bytes | None:
        """The sequence's envelope, byte-identical to the canonical one put; None when
        absent or damaged (a block quarantined as corrupt and not put again)."""
        key = seq_key(name)
        corrupt: list[int] = []
        bad_record = False
        out = None
        txn = self._begin_read(True)
        try:
            raw = txn.get(key, None, self._dbs.seqs)
            geometry = self._geometry_in(txn)
            if raw is not None and geometry is not None:
                seq = parse_sequence(raw, geometry)
                if seq is None:
                    bad_record = True
                else:
                    out = assemble_sequence(
                        txn, self._dbs.blocks, geometry, seq, name, self._path, corrupt
                    )
        finally:
            self._end_read(txn)
        if corrupt:
            self._quarantine(corrupt)
        if bad_record:
            self._quarantine_sequence(key)
        return out

    def sequences(self) -> list[str]:
        """Names of every sequence, sorted."""
        txn = self._begin_read(True)
        try:
            keys = txn.cursor(db=self._dbs.seqs).iternext(values=False)
            return [bytes(k).decode("ascii") for k in keys]
        finally:
            self._end_read(txn)

    # --- what a read finds corrupt -----------------------------------------------------

    def _quarantine(self, hashes: list[int]) -> None:
        """Remove blocks that fail their CRC (checked again inside the write transaction)."""

        def body(w: WriteTxn) -> None:
            for h in dict.fromkeys(hashes):
                w.quarantine(h, lambda value: not crc_matches(value))

        try:
            self._write(body)
        except StoreError as exc:
            log.error("%s: could not quarantine corrupt blocks: %s", self._path, exc)

    def _quarantine_sequence(self, key: bytes) -> None:
        def body(w: WriteTxn) -> None:
            raw = w.txn.get(key, None, w.dbs.seqs)
            geometry = self._geometry_in(w.txn)
            if raw is not None and parse_sequence(raw, geometry) is None:
                w.drop_corrupt_sequence(key, len(raw))
                w.rebuild_refs(geometry)

        try:
            self._write(body)
        except StoreError as exc:
            log.error("%s: could not quarantine a corrupt sequence: %s", self._path, exc)
