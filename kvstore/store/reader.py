"""The block store's read side: zero-copy readers and sequence assembly.

Everything a ``Reader`` hands out points into LMDB's memory map and lives only as long
as its read transaction: views check a liveness hook on every access and raise
``ViewClosedError`` afterwards; raw memoryviews are released on exit.

Arrays a caller takes from a view (``bv.kv``, ``np.frombuffer(r.envelope(h))``) cannot
be revoked. Every export of stored memory therefore goes through a numpy array the
reader registers (a view's ``kv``, the array behind an exported memoryview). If any is
still referenced when the reader closes (checked by weak reference), its read
transaction stays open (its pages are not reused) until they are gone, and the map is
not remapped meanwhile (see ``LmdbEnv.linger``). Such an array never reads freed
or reused memory.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator
from functools import lru_cache
from types import TracebackType
from typing import Any, NamedTuple, Protocol

import numpy as np

from ..codec.assembly import (
    EnvelopeStream,
    crc_matches,
    envelope_version,
    single_block,
)
from ..codec.envelope import BlockView, decode
from ..codec.geometry import Geometry
from ..codec.layout import (
    F16_DTYPE,
    HEADER_SIZE,
    NO_HASH,
    RECORD,
    RECORD_SIZE,
    SUPPORTED_VERSIONS,
    TRAILER_SIZE,
    VERSION_V1,
)
from ..errors import EnvelopeError, StoreError, ViewClosedError
from .diskformat import BLOCK_KEY, SequenceRecord, parse_sequence, tokens_record

log = logging.getLogger("tlkv.store")

KvSpec = tuple[tuple[int, ...], np.dtype[Any]]


@lru_cache(maxsize=32)
def reader_consts(geometry: Geometry) -> tuple[dict[int, int], dict[int, KvSpec]]:
    """Stored length -> version (when the two lengths differ, as they nearly always do)
    and version -> (kv shape, kv dtype)."""
    lengths = {v: geometry.envelope_bytes(1, v) for v in SUPPORTED_VERSIONS}
    version_of = {n: v for v, n in lengths.items()} if len(set(lengths.values())) > 1 else {}
    specs: dict[int, KvSpec] = {
        v: (geometry.kv_shape, np.dtype(F16_DTYPE if v == VERSION_V1 else np.uint8))
        for v in SUPPORTED_VERSIONS
    }
    return version_of, specs


def assemble_sequence(
    txn: Any,
    blocks_db: Any,
    geometry: Geometry,
    seq: SequenceRecord,
    name: str,
    path: str,
    corrupt: list[int],
) -> bytes | None:
    """A sequence's whole envelope, byte-identical to the one put.

    Every block read from the block space is CRC-checked; the output CRC is combined from
    the records' CRCs (no second pass). None when a block is missing or corrupt (its hash
    is appended to ``corrupt`` for quarantine).
    """
    c = single_block(geometry, seq.version)
    out = EnvelopeStream(seq.version, geometry, len(seq.hashes))
    parts: list[Any] = [out.header]
    for i, h in enumerate(seq.hashes):
        if i in seq.own:
            parts.append(out.add(seq.own_record(i)))
            continue
        value = txn.get(BLOCK_KEY.pack(h), None, blocks_db)
        if value is None or len(value) != c.single_len:
            log.warning(
                "%s: sequence %r: block %016x is missing (quarantined as corrupt?); "
                "the sequence is served again once that block is put",
                path,
                name,
                h,
            )
            return None
        if not crc_matches(value):
            corrupt.append(h)
            return None
        if envelope_version(value) != seq.version:
            log.warning(
                "%s: sequence %r: block %016x was put again in another format version",
                path,
                name,
                h,
            )
            return None
        parts.append(out.add_checked_single(value))
    parts.append(out.trailer())
    return b"".join(parts)


_ndarray = np.ndarray
_PAYLOAD_OFFSET = HEADER_SIZE + RECORD_SIZE  # of a single-block envelope


class _StoredView(BlockView):
    """A ``BlockView`` over a stored single-block envelope; every field is read on demand.

    Construction parses nothing (the hot path of ``Reader.view``). Arrays and memoryviews
    it hands out are registered with its reader (``kv`` is built once, in one
    ``np.ndarray`` call over LMDB's read-only buffer, so it is read-only too); the view
    keeps none of them itself, so a view kept past its reader pins nothing (and raises).
    """

    __slots__ = ("_kv_slot", "_reader", "_spec", "_value")

    def __init__(  # no super().__init__: it would parse eagerly
        self,
        value: memoryview,
        reader: Reader,
        geometry: Geometry,
        version: int,
        spec: KvSpec,
    ) -> None:
        self._alive: Callable[[], None] = reader._alive
        self._value = value
        self._reader = reader
        self._kv_slot = -1
        self._geometry = geometry
        self._version = version
        self._spec = spec

    @property
    def raw_record(self) -> memoryview:  # type: ignore[override]
        """The block record (hash, n_tokens, payload)."""
        self._alive()
        return self._reader._export(self._value)[HEADER_SIZE:-TRAILER_SIZE]

    @property
    def hash(self) -> int:  # type: ignore[override]
        """The block's hash."""
        self._alive()
        return int(RECORD.unpack_from(self._value, HEADER_SIZE)[0])

    @property
    def n_tokens(self) -> int:  # type: ignore[override]
        """The block's fill."""
        self._alive()
        return int(RECORD.unpack_from(self._value, HEADER_SIZE)[1])

    @property
    def _payload(self) -> memoryview:  # type: ignore[override]
        self._alive()
        return self._reader._export(self._value)[HEADER_SIZE + RECORD_SIZE : -TRAILER_SIZE]

    @property
    def kv(self) -> np.ndarray:
        """Read-only payload view: f16 (v1) or uint8 codes (v2), ``[L][2][Hkv][B][D]``."""
        reader = self._reader
        if reader._txn is None:
            reader._alive()  # raises
        kvs = reader._arrays
        slot = self._kv_slot
        if slot < 0:
            kv = _ndarray(*self._spec, self._value, _PAYLOAD_OFFSET)
            self._kv_slot = len(kvs)
            kvs.append(kv)
            return kv
        return kvs[slot]

    def __repr__(self) -> str:
        try:
            return super().__repr__()
        except ViewClosedError:
            return "BlockView(<reader closed>)"


class SequenceParts(NamedTuple):
    """A stored sequence as parts (``Reader.iter_sequence_parts``): the hashes of its full
    blocks (None: the record fails its CRC), its partial tail as a single-block envelope
    (or None), and ``(position, single-block envelope)`` of each full block it keeps in
    its own record (the block space holds that hash in another format version or with
    other bytes); the others are served from the block space."""

    name: str
    hashes: list[int] | None
    tail: bytes | None
    own: list[tuple[int, bytes]]


class ReadSnapshot(NamedTuple):
    """One read transaction of a store and what reading it needs."""

    txn: Any
    geometry: Geometry | None
    version_of: dict[int, int]  # single-block envelope length -> its format version
    specs: dict[int, KvSpec]  # format version -> how its kv array lies in a record
    blocks_db: Any
    seqs_db: Any
    touch: Callable[[int], Any]  # records a hit for the LRU order
    tokens_db: Any = None  # the token ids kept per block (``diskformat``)


class ReadHandle(Protocol):
    """All a :class:`Reader` may use of its store."""

    @property
    def path(self) -> str: ...

    def open_snapshot(self) -> ReadSnapshot:
        """Begin a read transaction (holding the map guard)."""
        ...

    def close_snapshot(self, txn: Any, escaped: list[Any]) -> None:
        """End ``txn``, or keep it open while the ``escaped`` arrays (weak refs) live."""
        ...

    def account(self, hits: int, misses: int, corrupt: list[int]) -> None:
        """Add a closed reader's hits and misses; quarantine the corrupt blocks it met."""
        ...


class Reader:
    """A read transaction giving zero-copy access to stored blocks (``store.reader()``).

    Everything it returns points into LMDB's memory map and is valid only inside the
    ``with`` block: afterwards a ``BlockView`` raises ``ViewClosedError`` and a returned
    memoryview raises ``ValueError`` (released). Arrays taken from a view (``bv.kv``) are
    numpy views too: copy them (``.copy()``) to keep them past the block; one kept anyway
    keeps this reader's snapshot open until it is freed (see the module docstring). One
    thread per reader; its hits and misses reach ``stats()`` when it closes.
    """

    def __init__(self, store: ReadHandle) -> None:
        self._store = store
        self._txn: Any = None
        self._used = False
        self._issued: list[memoryview] = []  # memoryviews handed out: released on exit
        # Every array handed out over stored memory (views' kv, the arrays behind exported
        # memoryviews): anything the caller derives from them references them. Plain
        # arrays are not tracked by the cyclic GC, so many views per reader stay cheap.
        self._arrays: list[np.ndarray] = []
        self._corrupt: list[int] = []
        self._geometry: Geometry | None = None
        self._version_of: dict[int, int] = {}
        self._specs: dict[int, KvSpec] = {}
        self.hits = 0  # this reader's; added to the store's counters when it closes
        self.misses = 0

    def __enter__(self) -> Reader:
        if self._used:
            raise StoreError("a Reader is single-use; call store.reader() again")
        self._used = True
        snap = self._store.open_snapshot()
        self._txn = snap.txn
        self._geometry = snap.geometry
        self._version_of, self._specs = snap.version_of, snap.specs
        self._get = snap.txn.get
        self._blocks, self._seqs = snap.blocks_db, snap.seqs_db
        self._tokens = snap.tokens_db
        self._touch = snap.touch
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        txn, self._txn = self._txn, None
        if txn is None:
            return
        refs = [weakref.ref(array) for array in self._arrays]
        self._arrays.clear()
        for mv in self._issued:
            with contextlib.suppress(BufferError):  # an array made from it holds it
                mv.release()
        self._issued.clear()
        # With this reader's own references gone, an array still alive is held by
        # something the caller kept (derived from a view's kv, raw or an envelope).
        escaped = [ref for ref in refs if ref() is not None]
        if escaped:
            log.warning(
                "%s: %d zero-copy array(s) outlived their reader; its snapshot stays open "
                "until they are freed (copy what you keep past `with store.reader()`)",
                self._store.path,
                len(escaped),
            )
        self._store.close_snapshot(txn, escaped)
        self._store.account(self.hits, self.misses, self._corrupt)

    def _alive(self) -> None:
        if self._txn is None:
            raise ViewClosedError(
                "this zero-copy view outlived its reader: views are valid only inside "
                "`with store.reader()`; copy what you keep (bytes(), .copy())"
            )

    def _lookup(self, block_hash: int) -> memoryview | None:
        if self._txn is None:
            self._alive()
        try:
            value: memoryview | None = self._get(BLOCK_KEY.pack(block_hash), None, self._blocks)
        except Exception as exc:  # struct.error: not a u64
            raise ValueError(f"a block hash must fit u64, found {block_hash!r}") from exc
        if value is None:
            self.misses += 1
        else:
            self.hits += 1
            self._touch(block_hash)
        return value

    def view(self, block_hash: int, *, verify: bool = False) -> BlockView | None:
        """A zero-copy, read-only ``BlockView`` of a stored block, or None when absent.

        ``verify=True`` checks the CRC first; a failing block reads as absent and is
        quarantined when the reader closes.
        """
        if self._txn is None:
            self._alive()
        try:  # _lookup, inlined: this is the latency-critical path
            value = self._get(BLOCK_KEY.pack(block_hash), None, self._blocks)
        except Exception as exc:  # struct.error: not a u64
            raise ValueError(f"a block hash must fit u64, found {block_hash!r}") from exc
        if value is None:
            self.misses += 1
            return None
        self.hits += 1
        self._touch(block_hash)
        if verify:
            try:
                version = decode(value, self._geometry).version  # every rule, the CRC too
            except EnvelopeError:
                self._corrupt.append(int(block_hash))
                self.hits -= 1
                self.misses += 1
                return None
        else:
            version = self._version_of.get(len(value)) or envelope_version(value)
        return _StoredView(value, self, self._geometry, version, self._specs[version])  # type: ignore[arg-type]

    def _export(self, value: memoryview) -> memoryview:
        """A read-only memoryview of ``value`` through a watched array (see the module)."""
        array = np.frombuffer(value, np.uint8)
        self._arrays.append(array)
        mv = array.data
        self._issued.append(mv)
        return mv

    def envelope(self, block_hash: int) -> memoryview | None:
        """The stored single-block envelope as a read-only memoryview (unverified), or None."""
        value = self._lookup(block_hash)
        return None if value is None else self._export(value)

    def iter_blocks(self) -> Iterator[tuple[int, memoryview]]:
        """Every stored ``(hash, envelope memoryview)`` in hash order, unverified (decode
        them with the CRC when exporting)."""
        self._alive()
        for key, value in self._txn.cursor(db=self._blocks):
            yield BLOCK_KEY.unpack(key)[0], self._export(value)

    def token_record(self, block_hash: int) -> bytes | None:
        """The stored block's token record (FORMAT.md 6: u64 parent, B u32 token ids), or
        None when it was stored without its token ids."""
        self._alive()
        key = BLOCK_KEY.pack(block_hash)
        if self._tokens is None or self._get(key, None, self._blocks) is None:
            return None
        value = self._get(key, None, self._tokens)
        return None if value is None else bytes(tokens_record(value))

    def has_tokens(self) -> bool:
        """Whether any token ids are kept (of a stored block or of one in the tier)."""
        self._alive()
        return self._tokens is not None and bool(self._txn.stat(self._tokens)["entries"])

    def _records(self) -> Iterator[tuple[str, SequenceRecord | None]]:
        self._alive()
        for key, raw in self._txn.cursor(db=self._seqs):
            yield bytes(key).decode("ascii"), parse_sequence(raw, self._geometry)

    def iter_sequences(self) -> Iterator[tuple[str, bytes]]:
        """Every sequence as ``(name, envelope)`` in name order, as ``get_sequence``
        returns it; a damaged sequence is skipped with a warning."""
        path = self._store.path
        for name, seq in self._records():
            envelope = None
            if seq is not None and self._geometry is not None:
                envelope = assemble_sequence(
                    self._txn, self._blocks, self._geometry, seq, name, path, self._corrupt
                )
            if envelope is None:
                log.warning("%s: sequence %r is damaged; skipped", path, name)
                continue
            yield name, envelope

    def iter_sequence_records(self) -> Iterator[tuple[str, list[int] | None, Any]]:
        """Every sequence by reference, in name order: ``(name, hashes, tail)``.

        ``hashes`` are its full blocks (all served from the block space) and ``tail`` its
        partial last block as a single-block envelope, or None. A sequence that keeps its
        own copy of a full block (the block space holds that hash in another format
        version or with other bytes) cannot be described by reference: it is reported as
        ``(name, None, reason)``; ``iter_sequence_parts`` has its own blocks too. A record
        that fails its CRC is skipped with a warning.
        """
        for seq in self.iter_sequence_parts():
            if seq.hashes is None:
                continue
            if seq.own:
                h = seq.hashes[seq.own[0][0]]
                yield (
                    seq.name,
                    None,
                    f"keeps its own copy of block {h:016x} (another version or bytes)",
                )
                continue
            yield seq.name, seq.hashes, seq.tail

    def iter_sequence_parts(self) -> Iterator[SequenceParts]:
        """Every sequence in name order, as what it references and what it keeps itself.

        A record that fails its CRC is yielded with ``hashes`` None (and logged).
        """
        for name, seq in self._records():
            if seq is None or self._geometry is None:
                log.warning("%s: sequence %r fails its CRC", self._store.path, name)
                yield SequenceParts(name, None, None, [])
                continue
            single = single_block(self._geometry, seq.version)
            last = len(seq.hashes) - 1
            hashes, tail = seq.hashes, None
            if last in seq.own and seq.hashes[last] == NO_HASH:  # the partial tail
                tail = single.envelope(seq.own_record(last))
                hashes = hashes[:-1]
            own = [
                (i, single.envelope(seq.own_record(i))) for i in sorted(seq.own) if i < len(hashes)
            ]
            yield SequenceParts(name, hashes, tail, own)
