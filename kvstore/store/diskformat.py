"""The block store's on-disk layout: every sub-database, key, struct and record, once.

Store format 1: named sub-databases of one LMDB environment (``<path>/data.mdb``).
Store format 2: the same, plus namespaces (models) other than ``default``; a store becomes
format 2 when its first other model is registered, so a release that knows only format 1
refuses it instead of evicting blocks it cannot see.

==========  =====================================================================
``meta``    ``format`` u32; ``geometry`` 4 x u32 (B, L, Hkv, D); u64 counters
            ``bytes``, ``tick``, ``evictions``, ``corrupt``; the journals of
            unfinished restores (``JOURNAL_PREFIX``, ``journal.py``); what was
            quarantined and not stored again (``QUARANTINE_PREFIX``).
``blocks``  u64 hash (big-endian, so key order is numeric) -> the verbatim
            single-block envelope (spec: "Export envelope", n_blocks = 1).
``index``   one key; every stored hash as a native u64 duplicate (DUPSORT, DUPFIXED,
            INTEGERDUP): the whole key set is read a page at a time.
``refs``    hash -> u32 number of sequence positions pinning the block.
``atime``   hash -> u64 tick of the block's last use (unpinned blocks only).
``lru``     (u64 tick, u64 hash) big-endian -> empty: oldest first, the eviction order.
``seqs``    sequence name (ASCII) -> sequence record (``SEQ_HEADER`` ... CRC-32C).
``pending`` hash -> ``PENDING_SINCE`` (when it joined; empty from earlier releases):
            blocks stored here and not yet uploaded to the object-store tier (kept
            only while the store runs with a tier; never evicted meanwhile).
``models``  model id (UTF-8) -> ``MODEL_VALUE``: the namespace's number and geometry.
``tokens``  hash -> ``TOKENS_HEADER`` (u64 parent, u32 flags) then B u32 token ids: the
            token ids of a block written with them (``codec.tokens``), checked against
            its name; ``flags`` say on which media it is announced (``ANNOUNCED_*``).
            Kept while the block is stored here, or announced in the tier.
``waiting`` parent hash -> (DUPSORT, DUPFIXED) the hashes of its stored children kept
            with token ids but not announced, waiting for it to be (``tokentxn``).
``events``  u64 sequence number (big-endian) -> ``EVENT_MODEL`` (u16 length) + model id
            + one KV event batch in vLLM's wire format (``kvstore.events.wire``): the
            bounded replay log, written in the transaction of the change it records,
            only while ``meta``'s ``events_limit`` is set (``store/eventlog.py``).
``keylog``  u64 LMDB transaction id (big-endian) -> the changes that transaction made to
            the models' ``index`` (``KEYLOG_SECTION`` per model, then its added and removed
            hashes): the bounded log by which a process brings its in-memory copy of a
            key set up to date (``store/keylog.py``); ``meta``'s ``keylog_floor`` is the
            highest transaction id trimmed from it.
``empty``   and ``empty-index``: never written (what a model not created yet reads).
==========  =====================================================================

Namespaces: the ``default`` model is number 0 and owns the sub-databases above, byte for
byte as in format 1 (its geometry is ``meta``'s). Model ``n`` > 0 owns its own ``blocks``,
``index``, ``refs``, ``atime``, ``seqs``, ``pending``, ``tokens`` and ``waiting``, named
``<name>@<n>`` (``blocks@3``), with the same keys and values: every data path is the one
of the default model over other handles.
``meta``, ``lru``, ``models``, ``events`` and ``keylog`` are shared: the LRU order is
store-wide (its value names the model of a non-default entry), the
``bytes``/``evictions``/``corrupt`` counters are store totals, and model ``n`` > 0 has its
own beside them (key ``bytes@`` + ``n`` as a big-endian u32, ``model_counter_key``); the
default model's are the totals minus the others'. A model's number is the next one after
``last_model``; its sub-databases are created before the write that registers it (``models``
entry and ``last_model`` in that write's transaction), so a refused first write registers
nothing and the next model reuses the empty sub-databases. A deleted model's sub-databases
are emptied and its number freed (``FREE_MODEL_PREFIX``): the next new model takes the
lowest free number first.

No other module spells a format string for these values.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import numpy as np

from ..codec.checksum import crc32c
from ..codec.geometry import Geometry
from ..codec.layout import NO_HASH, SUPPORTED_VERSIONS

STORE_FORMAT = 1  # a new store, and any store holding only the default model
STORE_FORMAT_MODELS = 2  # a store holding other models
STORE_FORMATS = (STORE_FORMAT, STORE_FORMAT_MODELS)

# Sub-database names; the index is DUPSORT | DUPFIXED | INTEGERDUP.
DB_META = b"meta"
DB_BLOCKS = b"blocks"
DB_INDEX = b"index"
DB_REFS = b"refs"
DB_ATIME = b"atime"
DB_LRU = b"lru"
DB_SEQS = b"seqs"
DB_PENDING = b"pending"
DB_MODELS = b"models"
DB_TOKENS = b"tokens"
DB_WAITING = b"waiting"  # DUPSORT | DUPFIXED
DB_EVENTS = b"events"
DB_KEYLOG = b"keylog"
# Two sub-databases never written: what a model not created yet reads (no blocks, no
# sequences) through the same code as any other.
DB_EMPTY = b"empty"
DB_EMPTY_INDEX = b"empty-index"
# The sub-databases every model has a copy of (model 0: the names above).
MODEL_DBS = (DB_BLOCKS, DB_INDEX, DB_REFS, DB_ATIME, DB_SEQS, DB_PENDING, DB_TOKENS, DB_WAITING)
# Every sub-database of a store holding only the default model.
SHARED_DBS = (
    *MODEL_DBS,
    DB_META,
    DB_LRU,
    DB_MODELS,
    DB_EMPTY,
    DB_EMPTY_INDEX,
    DB_EVENTS,
    DB_KEYLOG,
)


def max_dbs(models: int) -> int:
    """LMDB's ``max_dbs`` for an environment holding ``models`` models besides the default
    one: the shared sub-databases and one set per model, plus one model's more (the
    number a writer reserves before the registry refuses it). LMDB fixes it when the
    environment opens."""
    return len(SHARED_DBS) + len(MODEL_DBS) * (models + 1)


def free_model_key(number: int) -> bytes:
    """The ``meta`` key that frees model number ``number`` for reuse."""
    return FREE_MODEL_PREFIX + MODEL_NUMBER.pack(number)


# blocks/refs/atime key: the u64 block hash, big-endian so LMDB's key order is numeric.
BLOCK_KEY = struct.Struct(">Q")
# pending key: BLOCK_KEY, value PENDING_SINCE: u64 Unix milliseconds when the block joined
# the set (an empty value, written by earlier releases: unknown).
PENDING_SINCE = struct.Struct(">Q")
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
# Restore journal entries in meta (shared by every model): JOURNAL_PREFIX + token (8 random
# bytes) + kind + suffix.
# Kind JOURNAL_BLOCKS, suffix u32 big-endian batch number -> the u64 hashes (little-endian)
# the batch added. Kind JOURNAL_SEQUENCE, suffix the sequence key -> JOURNAL_CREATED, or
# JOURNAL_REPLACED + the sequence record the restore replaced.
JOURNAL_PREFIX = b"restore:"
JOURNAL_TOKEN_BYTES = 8
JOURNAL_BLOCKS = b"B"
JOURNAL_BATCH = struct.Struct(">I")
JOURNAL_SEQUENCE = b"S"
JOURNAL_CREATED = b"\x00"
JOURNAL_REPLACED = b"\x01"
JOURNAL_HASH_DTYPE = np.dtype("<u8")
# Kind JOURNAL_MODEL, no suffix -> the model id (UTF-8) the restore wrote into; absent in a
# journal written before models: the default model.
JOURNAL_MODEL = b"M"
# Quarantine records in meta (shared by every model): QUARANTINE_PREFIX + kind + the model's
# number (MODEL_NUMBER) + the key of what was removed -> QUARANTINED_AT, u64 Unix
# milliseconds. Kind QUARANTINE_BLOCK: a block that failed its CRC (key: BLOCK_KEY of its
# hash); kind QUARANTINE_SEQUENCE: a sequence record that did (key: the sequence's name).
# What the scrub reports and repairs until it is stored again (``quarantine.py``).
QUARANTINE_PREFIX = b"quarantine:"
QUARANTINE_BLOCK = b"B"
QUARANTINE_SEQUENCE = b"S"
QUARANTINED_AT = struct.Struct(">Q")
# The event log (``eventlog``): meta ``events_limit`` (u64, COUNTER) is the most batches
# the log keeps (absent or 0: no log is written); ``events_next`` (u64) the sequence number
# of the next batch (it only grows, whether the log is on or not).
META_EVENTS_LIMIT = b"events_limit"
META_EVENTS_NEXT = b"events_next"
EVENT_KEY = struct.Struct(">Q")
EVENT_MODEL = struct.Struct("<H")  # the model id's length, before the id and the batch
# The key log (``keylog``): key KEYLOG_KEY, the writing transaction's id; value one
# KEYLOG_SECTION (u32 model number, u32 flags, u32 added, u32 removed) per model whose index
# the transaction changed, each followed by its added then removed hashes (KEYLOG_HASH_DTYPE).
# Flag KEYLOG_RESET: the model's index was replaced wholesale (a reader reads it again).
# meta ``keylog_floor`` (u64, COUNTER): the highest transaction id trimmed from the log.
KEYLOG_KEY = struct.Struct(">Q")
KEYLOG_SECTION = struct.Struct("<IIII")
KEYLOG_HASH_DTYPE = np.dtype("<u8")
KEYLOG_RESET = 1
META_KEYLOG_FLOOR = b"keylog_floor"
# tokens value: u64 parent hash, u32 flags, then B u32 token ids (little-endian).
TOKENS_HEADER = struct.Struct("<QI")
TOKEN_PARENT_SIZE = 8  # the u64 parent at the value's start
TOKEN_ID_DTYPE = np.dtype("<u4")
ANNOUNCED_STORAGE = 1  # a BlockStored on this node's disk ("STORAGE") is in the stream
ANNOUNCED_TIER = 2  # a BlockStored on the object tier is in the stream
# Counters a model > 0 keeps beside the totals (``model_counter_key``).
MODEL_COUNTER_KEYS = (META_BYTES, META_EVICTIONS, META_CORRUPT)
META_LAST_MODEL = b"last_model"  # u64: the highest model number given
# u32: the models besides default the store admits (its own setting, whoever opens it;
# absent: protocol.MAX_MODELS).
META_MAX_MODELS = b"max_models"
META_MAX_MODELS_VALUE = struct.Struct("<I")
# The number of a deleted model, free for the next new one: FREE_MODEL_PREFIX +
# MODEL_NUMBER -> empty. Its sub-databases stay, emptied (other processes may hold their
# handles), and are reused by the model that takes the number.
FREE_MODEL_PREFIX = b"free_model:"
# models value: u32 model number, then its geometry (B, L, Hkv, D; zeros until adopted).
MODEL_VALUE = struct.Struct("<IIIII")
# A model number inside keys and the lru value (big-endian: numeric order).
MODEL_NUMBER = struct.Struct(">I")

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
    """The sub-database handles one model sees (``meta``, ``lru``, ``models``: shared)."""

    meta: Any
    blocks: Any
    index: Any
    refs: Any
    atime: Any
    lru: Any
    seqs: Any
    pending: Any
    models: Any = None
    number: int = 0  # the model's number (0: default; -1: a model not created yet)
    tokens: Any = None
    events: Any = None  # shared
    keylog: Any = None  # shared
    waiting: Any = None


def model_db_name(name: bytes, number: int) -> bytes:
    """The sub-database ``name`` (one of ``MODEL_DBS``) of model ``number``."""
    return name if number == 0 else b"%s@%d" % (name, number)


def model_counter_key(key: bytes, number: int) -> bytes:
    """The ``meta`` key of a per-model counter of model ``number`` > 0."""
    return key + b"@" + MODEL_NUMBER.pack(number)


def quarantine_key(kind: bytes, number: int, key: bytes) -> bytes:
    """The ``meta`` key of a quarantine record of model ``number``."""
    return QUARANTINE_PREFIX + kind + MODEL_NUMBER.pack(number) + key


def lru_value(number: int) -> bytes:
    """The ``lru`` value of a block of model ``number`` (empty for the default model)."""
    return b"" if number == 0 else MODEL_NUMBER.pack(number)


def lru_model(value: Any) -> int:
    """The model number an ``lru`` value names."""
    return 0 if not len(value) else int(MODEL_NUMBER.unpack(value)[0])


def pack_model(number: int, geometry: Geometry | None) -> bytes:
    """A ``models`` value."""
    return MODEL_VALUE.pack(number, *(geometry.as_tuple() if geometry else (0, 0, 0, 0)))


def model_number(value: Any) -> int:
    """A ``models`` value's model number alone (no ``Geometry`` built: every read
    transaction of a model other than default confirms its number)."""
    return int(MODEL_VALUE.unpack(value)[0])


def unpack_model(value: Any) -> tuple[int, Geometry | None]:
    """A ``models`` value as (model number, geometry or None)."""
    number, *g = MODEL_VALUE.unpack(value)
    return number, (Geometry(*g) if g[0] else None)


def tokens_dtype(block_tokens: int) -> np.dtype:
    """A ``tokens`` value as a numpy record (packed: ``TOKENS_HEADER``, then the ids)."""
    return np.dtype([("parent", "<u8"), ("flags", "<u4"), ("ids", TOKEN_ID_DTYPE, (block_tokens,))])


def pack_tokens(parent: int, flags: int, ids: Any) -> bytes:
    """A ``tokens`` value."""
    return TOKENS_HEADER.pack(parent, flags) + np.asarray(ids, dtype=TOKEN_ID_DTYPE).tobytes()


def unpack_tokens(value: Any) -> tuple[int, int, np.ndarray]:
    """A ``tokens`` value as (parent, flags, token ids as a ``<u4`` copy)."""
    parent, flags = TOKENS_HEADER.unpack_from(value, 0)
    ids = np.frombuffer(value, TOKEN_ID_DTYPE, offset=TOKENS_HEADER.size).copy()
    return int(parent), int(flags), ids


def tokens_record(value: Any) -> bytes:
    """A ``tokens`` value as a token record (``codec.tokens``: u64 parent, the ids), its
    flags left out."""
    mv = memoryview(value)
    return bytes(mv[:TOKEN_PARENT_SIZE]) + bytes(mv[TOKENS_HEADER.size :])


def tokens_flags(value: Any) -> int:
    """The flags of a ``tokens`` value."""
    return int(TOKENS_HEADER.unpack_from(value, 0)[1])


def pack_event(model: str, payload: bytes) -> bytes:
    """An ``events`` value: the model id and one encoded batch."""
    raw = model.encode("utf-8")
    return EVENT_MODEL.pack(len(raw)) + raw + payload


def unpack_event(value: Any) -> tuple[str, bytes]:
    """An ``events`` value as (model id, encoded batch)."""
    mv = memoryview(value)
    (n,) = EVENT_MODEL.unpack_from(mv, 0)
    at = EVENT_MODEL.size + n
    return bytes(mv[EVENT_MODEL.size : at]).decode("utf-8"), bytes(mv[at:])


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


def own_full_blocks(raw: Any) -> int:
    """How many full blocks a sequence record keeps itself (not pinned in the block space):
    its own records but a partial tail. Reads the header, the positions and the last hash
    only (no CRC check: a count for ``stats``); 0 for a record too short to say."""
    mv = memoryview(raw)
    if len(mv) < SEQ_HEADER.size:
        return 0
    n, m = SEQ_HEADER.unpack_from(mv, 0)[3:]
    at_positions = SEQ_HEADER.size + SEQ_HASH_DTYPE.itemsize * n
    if not m or len(mv) < at_positions + SEQ_POSITION_DTYPE.itemsize * m:
        return 0
    at_last = at_positions + SEQ_POSITION_DTYPE.itemsize * (m - 1)
    last = int(np.frombuffer(mv, SEQ_POSITION_DTYPE, 1, at_last)[0])
    last_hash = np.frombuffer(mv, SEQ_HASH_DTYPE, 1, at_positions - SEQ_HASH_DTYPE.itemsize)
    return m - int(last == n - 1 and int(last_hash[0]) == NO_HASH)


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
