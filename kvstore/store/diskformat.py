"""The block store's on-disk layout: every sub-database, key, struct and record, once.

Store format 1: named sub-databases of one LMDB environment (``<path>/data.mdb``).

==========  =====================================================================
``meta``    ``format`` u32; ``geometry`` 4 x u32 (B, L, Hkv, D); u64 counters
            ``bytes``, ``tick``, ``evictions``, ``corrupt``.
``blocks``  u64 hash (big-endian, so key order is numeric) -> the verbatim
            single-block envelope (spec: "Export envelope", n_blocks = 1).
``index``   one key; every stored hash as a native u64 duplicate (DUPSORT, DUPFIXED,
            INTEGERDUP): the whole key set is read a page at a time.
``refs``    hash -> u32 number of sequence positions pinning the block.
``atime``   hash -> u64 tick of the block's last use (unpinned blocks only).
``lru``     (u64 tick, u64 hash) big-endian -> empty: oldest first, the eviction order.
``seqs``    sequence name (ASCII) -> sequence record (``SEQ_HEADER`` ... CRC-32C).
``pending`` hash -> empty: blocks stored here and not yet uploaded to the object-store
            tier (kept only while the store runs with a tier; never evicted meanwhile).
==========  =====================================================================

No other module spells a format string for these values.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import numpy as np

from ..codec.checksum import crc32c
from ..codec.geometry import Geometry
from ..codec.layout import NO_HASH, SUPPORTED_VERSIONS

STORE_FORMAT = 1

# Sub-database names; the index is DUPSORT | DUPFIXED | INTEGERDUP.
DB_META = b"meta"
DB_BLOCKS = b"blocks"
DB_INDEX = b"index"
DB_REFS = b"refs"
DB_ATIME = b"atime"
DB_LRU = b"lru"
DB_SEQS = b"seqs"
DB_PENDING = b"pending"

# blocks/refs/atime key: the u64 block hash, big-endian so LMDB's key order is numeric.
BLOCK_KEY = struct.Struct(">Q")
# pending key: BLOCK_KEY, value PENDING_VALUE (empty).
PENDING_VALUE = b""
# lru key: (u64 tick, u64 hash), big-endian, value empty: a cursor walks oldest first.
LRU_KEY = struct.Struct(">QQ")
# index: the one key INDEX_KEY holding every stored hash as a native-endian u64 duplicate.
INDEX_KEY = b"h"
INDEX_VALUE = struct.Struct("=Q")
INDEX_DTYPE = np.dtype("=u8")  # INDEX_VALUE, as numpy reads it
# refs value: u32 number of sequence positions referencing the block.
REFCOUNT = struct.Struct("<I")
# atime value and every meta counter: u64.
COUNTER = struct.Struct("<Q")
# meta values: the store format (u32) and the geometry (B, L, Hkv, D as u32).
META_FORMAT_VALUE = struct.Struct("<I")
META_GEOMETRY_VALUE = struct.Struct("<IIII")
META_FORMAT = b"format"
META_GEOMETRY = b"geometry"
META_BYTES = b"bytes"
META_TICK = b"tick"
META_EVICTIONS = b"evictions"
META_CORRUPT = b"corrupt"
COUNTER_KEYS = (META_BYTES, META_TICK, META_EVICTIONS, META_CORRUPT)

# Sequence record: header (magic, record format, envelope version, n blocks, m own
# records), n u64 hashes (0 at the partial tail), m u32 ascending positions of the
# records kept in the record itself (the partial tail, and any full block whose stored
# copy differs from the sequence's bytes), those m block records (12 + P bytes each, as
# in the envelope), then a u32 CRC-32C of every byte before it.
SEQ_MAGIC = b"TLSQ"
SEQ_FORMAT = 1
SEQ_HEADER = struct.Struct("<4sHHII")
SEQ_HASH_DTYPE = np.dtype("<u8")
SEQ_POSITION_DTYPE = np.dtype("<u4")
SEQ_TRAILER = struct.Struct("<I")


class Dbs(NamedTuple):
    """The environment's sub-database handles."""

    meta: Any
    blocks: Any
    index: Any
    refs: Any
    atime: Any
    lru: Any
    seqs: Any
    pending: Any


def counter(value: Any) -> int:
    """A u64 counter value (0 when absent)."""
    return 0 if value is None else int(COUNTER.unpack(value)[0])


class SequenceRecord(NamedTuple):
    """A parsed sequence record (``records`` is a view into the raw value)."""

    version: int
    hashes: list[int]
    own: dict[int, int]  # position -> index of the record kept in the sequence record
    records: memoryview
    record_bytes: int

    def referenced(self) -> list[int]:
        """Hashes served from the block space (each pinned once per position)."""
        own = self.own
        return [h for i, h in enumerate(self.hashes) if h != NO_HASH and i not in own]

    def own_record(self, position: int) -> memoryview:
        """The block record kept for ``position`` (which must be in ``own``)."""
        j = self.own[position]
        return self.records[j * self.record_bytes : (j + 1) * self.record_bytes]


def pack_sequence(version: int, hashes: list[int], own: list[int], records: list[Any]) -> bytes:
    """A sequence record: ``records[j]`` is the block record at position ``own[j]``."""
    parts: list[Any] = [
        SEQ_HEADER.pack(SEQ_MAGIC, SEQ_FORMAT, version, len(hashes), len(own)),
        np.asarray(hashes, dtype=SEQ_HASH_DTYPE).tobytes(),
        np.asarray(own, dtype=SEQ_POSITION_DTYPE).tobytes(),
        *records,
    ]
    crc = 0
    for part in parts:
        crc = crc32c(part, crc)
    parts.append(SEQ_TRAILER.pack(crc))
    return b"".join(parts)


def parse_sequence(raw: Any, geometry: Geometry | None) -> SequenceRecord | None:
    """A sequence record, or None when it fails its CRC or its structure."""
    mv = memoryview(raw)
    end = len(mv) - SEQ_TRAILER.size
    if end < SEQ_HEADER.size or SEQ_TRAILER.unpack_from(mv, end)[0] != crc32c(mv[:end]):
        return None
    magic, fmt, version, n, m = SEQ_HEADER.unpack_from(mv, 0)
    if magic != SEQ_MAGIC or fmt != SEQ_FORMAT or version not in SUPPORTED_VERSIONS:
        return None
    if geometry is None:
        return None
    size = geometry.record_bytes(version)
    at_positions = SEQ_HEADER.size + SEQ_HASH_DTYPE.itemsize * n
    at_records = at_positions + SEQ_POSITION_DTYPE.itemsize * m
    if at_records + m * size != end:
        return None
    hashes = np.frombuffer(mv, SEQ_HASH_DTYPE, n, SEQ_HEADER.size).tolist()
    positions = np.frombuffer(mv, SEQ_POSITION_DTYPE, m, at_positions).tolist()
    own = {p: j for j, p in enumerate(positions)}
    return SequenceRecord(version, hashes, own, mv[at_records:end], size)
