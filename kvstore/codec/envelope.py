"""Sans-IO codec of the export envelope: encode, decode (every reader rule), split, join, transcode.

Spec: FORMAT.md, sections 2 (layout) and 3 (reader rules, in the order ``decode`` checks them).
``decode`` checks sizes before it trusts anything, then the CRC, then the structural rules,
and never allocates in proportion to the claimed block count before the length check.
Payload arrays are numpy views into the caller's buffer, never copies.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import (
    BadMagicError,
    ChecksumError,
    FormatError,
    ShapeError,
    TruncatedError,
    UnsupportedVersionError,
)
from .assembly import assemble, pack_header
from .checksum import crc32c
from .geometry import Geometry
from .layout import (
    DTYPE_FOR_VERSION,
    F16_DTYPE,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MIN_ENVELOPE_SIZE,
    NO_HASH,
    RECORD,
    RECORD_HASH_DTYPE,
    RECORD_HASH_OFFSET,
    RECORD_NTOKENS_DTYPE,
    RECORD_NTOKENS_OFFSET,
    RECORD_SIZE,
    SCALE_DTYPE,
    SUPPORTED_VERSIONS,
    TRAILER,
    TRAILER_SIZE,
    U64_MAX,
    VERSION_V1,
    VERSION_V2,
)
from .numerics import (
    E4M3_NAN_MASK,
    SCALE_MAX,
    all_finite_f16,
    as_array,
    dequantize_e4m3,
    quantize_e4m3,
    to_f16,
)

__all__ = [
    "Block",
    "BlockView",
    "Envelope",
    "check_finite",
    "check_header",
    "decode",
    "encode",
    "join",
    "split",
    "transcode",
]


@dataclass(frozen=True)
class Block:
    """One block to encode: its chained hash (0 for a partial block), fill and KV.

    ``kv`` is a float array (f16, bf16, f32 or f64; any strides; a numpy array, a CPU torch
    tensor or anything with ``__array__``) of shape ``[L][2][Hkv][B][D]`` (axis 1: 0 = K,
    1 = V); only positions ``< n_tokens`` are read. It may also be a lazy window with a
    ``payload_parts(version)`` method returning the v1 payload as buffers in order, or
    None (``kvstore.kvlayout.LayerSlices``): ``encode`` then joins those, checked.
    """

    hash: int
    n_tokens: int
    kv: Any


def _check_fill(where: str, block_hash: int, n_tokens: int, block_tokens: int) -> None:
    """The rule "Every n_tokens is in 1..B, and a non-zero block_hash has n_tokens == B"."""
    if not 1 <= n_tokens <= block_tokens:
        raise FormatError(
            f"{where}: rule 'n_tokens in 1..B' failed: expected 1..{block_tokens}, found {n_tokens}"
        )
    if block_hash != NO_HASH and n_tokens != block_tokens:
        raise FormatError(
            f"{where}: rule 'a non-zero block_hash has n_tokens == B' failed: "
            f"hash {block_hash:016x} with n_tokens {n_tokens}, expected {block_tokens}"
        )


class BlockView:
    """A read-only view of one block record inside a decoded envelope (no copy).

    ``kv`` is the f16 array ``[L][2][Hkv][B][D]`` (v1) or the uint8 E4M3 codes (v2);
    ``scales`` the f32 ``[L][2][Hkv]`` scales (v2 only). ``raw`` is the whole record.
    When ``alive`` is given (the store's readers), every access checks it first and
    raises once the memory behind the view may no longer be valid.
    """

    __slots__ = ("_alive", "_geometry", "_payload", "_version", "hash", "n_tokens", "raw_record")

    def __init__(
        self,
        record: memoryview,
        geometry: Geometry,
        version: int,
        alive: Callable[[], None] | None = None,
    ) -> None:
        self.raw_record = record
        self.hash, self.n_tokens = RECORD.unpack_from(record, 0)
        self._payload = record[RECORD_SIZE:]
        self._geometry = geometry
        self._version = version
        self._alive = alive

    def _check(self) -> None:
        if self._alive is not None:
            self._alive()

    @property
    def version(self) -> int:
        """Format version of the payload (1 = f16, 2 = E4M3 + scales)."""
        return self._version

    @property
    def geometry(self) -> Geometry:
        """Geometry of the block."""
        return self._geometry

    @property
    def raw(self) -> memoryview:
        """The whole block record (hash, n_tokens, payload) as a memoryview."""
        self._check()
        return self.raw_record

    @property
    def kv(self) -> np.ndarray:
        """Read-only payload view: f16 (v1) or uint8 codes (v2), ``[L][2][Hkv][B][D]``."""
        self._check()
        g = self._geometry
        dtype = F16_DTYPE if self._version == VERSION_V1 else np.uint8
        arr = np.frombuffer(self._payload, dtype=dtype, count=g.elements).reshape(g.kv_shape)
        arr.flags.writeable = False
        return arr

    @property
    def scales(self) -> np.ndarray | None:
        """v2: read-only f32 scales ``[L][2][Hkv]``; v1: None."""
        self._check()
        if self._version != VERSION_V2:
            return None
        g = self._geometry
        arr = np.frombuffer(self._payload, dtype=SCALE_DTYPE, count=g.n_slabs, offset=g.elements)
        arr = arr.reshape(g.n_layers, 2, g.n_kv_heads)
        arr.flags.writeable = False
        return arr

    @property
    def k(self) -> np.ndarray:
        """Keys: ``kv[:, 0]``, shape ``[L][Hkv][B][D]``."""
        return self.kv[:, 0]

    @property
    def v(self) -> np.ndarray:
        """Values: ``kv[:, 1]``, shape ``[L][Hkv][B][D]``."""
        return self.kv[:, 1]

    def to_float32(self) -> np.ndarray:
        """The block's values in f32 (v2: ``e4m3_to_f32(byte) * scale``), a new array."""
        kv = self.kv
        if self._version == VERSION_V1:
            return kv.astype(np.float32)
        scales = self.scales
        assert scales is not None
        return dequantize_e4m3(kv, scales)

    def __repr__(self) -> str:
        return (
            f"BlockView(hash={self.hash:016x}, n_tokens={self.n_tokens}, version={self._version})"
        )


class Envelope(Sequence[BlockView]):
    """A decoded, validated envelope over the caller's buffer; indexing gives ``BlockView``s."""

    def __init__(
        self,
        data: memoryview,
        version: int,
        geometry: Geometry,
        n_blocks: int,
        alive: Callable[[], None] | None = None,
    ) -> None:
        self.data = data
        self.version = version
        self.geometry = geometry
        self.record_bytes = geometry.record_bytes(version)
        self._n = n_blocks
        self._alive = alive

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._n))]
        if index < 0:
            index += self._n
        if not 0 <= index < self._n:
            raise IndexError(f"block index {index} out of range for {self._n} blocks")
        return BlockView(self.record(index), self.geometry, self.version, self._alive)

    def __iter__(self) -> Iterator[BlockView]:
        for i in range(self._n):
            yield self[i]

    def record(self, index: int) -> memoryview:
        """Memoryview of block record ``index`` (hash, n_tokens, payload)."""
        start = HEADER_SIZE + index * self.record_bytes
        return self.data[start : start + self.record_bytes]

    def single(self, index: int) -> bytes:
        """Block ``index`` as a single-block envelope (its own header and CRC)."""
        return _from_records(self.version, self.geometry, [self.record(index)])

    def _field(self, dtype: str, offset: int) -> np.ndarray:
        field: np.ndarray = np.ndarray(
            shape=(self._n,),
            dtype=dtype,
            buffer=self.data,
            offset=HEADER_SIZE + offset,
            strides=(self.record_bytes,),
        )
        return field

    @property
    def hashes(self) -> np.ndarray:
        """Every block's hash as a strided ``<u8`` view (no copy)."""
        return self._field(RECORD_HASH_DTYPE, RECORD_HASH_OFFSET)

    @property
    def fills(self) -> np.ndarray:
        """Every block's n_tokens as a strided ``<u4`` view (no copy)."""
        return self._field(RECORD_NTOKENS_DTYPE, RECORD_NTOKENS_OFFSET)

    def __repr__(self) -> str:
        return f"Envelope(version={self.version}, geometry={self.geometry}, n_blocks={self._n})"


def _as_bytes_view(data: Any) -> memoryview:
    mv = data if isinstance(data, memoryview) else memoryview(data)
    if not mv.c_contiguous:  # e.g. a strided numpy slice: no byte offsets to read
        raise FormatError("envelope buffer must be C-contiguous")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def _parse_header(mv: memoryview, length: int) -> tuple[int, int, int, tuple[int, ...]]:
    """Length and magic checks, then the header fields; nothing allocated per block."""
    if length < MIN_ENVELOPE_SIZE:
        raise TruncatedError(
            f"rule 'length is at least {MIN_ENVELOPE_SIZE}' failed: found {length} bytes"
        )
    magic, version, dtype, n_blocks, *dims = HEADER.unpack_from(mv, 0)
    if magic != MAGIC:
        raise BadMagicError(f"rule 'magic is TLKV' failed at offset 0: found {bytes(magic)!r}")
    return version, dtype, n_blocks, tuple(dims)


def _frame(
    mv: memoryview, length: int | None, versions: Iterable[int]
) -> tuple[int, int, int, Geometry, int]:
    """The rules that frame the envelope: length >= 32, magic, a known version, dimensions
    > 0 and, when ``length`` is given, the exact length. Returns the header's version,
    dtype, n_blocks, geometry and the length it implies."""
    version, dtype, n_blocks, dims = _parse_header(
        mv, MIN_ENVELOPE_SIZE if length is None else length
    )
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedVersionError(
            f"rule 'version is one this reader supports' failed: expected one of "
            f"{sorted(set(versions))}, found {version}"
        )
    if min(dims) == 0:
        raise FormatError(f"rule 'dimensions are > 0' failed: found B,L,H,D = {dims}")
    header_geometry = Geometry(*dims)
    expected = header_geometry.envelope_bytes(n_blocks, version)  # Python ints: no allocation
    if length is not None and length != expected:
        raise TruncatedError(
            f"rule 'length equals 28 + n * (12 + P) + 4' failed: expected {expected} bytes "
            f"for n_blocks={n_blocks}, version={version}, geometry={dims}, found {length}"
        )
    return version, dtype, n_blocks, header_geometry, expected


def _fit(
    version: int,
    dtype: int,
    header_geometry: Geometry,
    geometry: Geometry | None,
    accepted: tuple[int, ...],
) -> None:
    """The rules that fit the envelope to the reader: its versions, the dtype, the geometry."""
    if version not in accepted:
        raise UnsupportedVersionError(
            f"rule 'version is one this reader supports' failed: expected one of "
            f"{sorted(accepted)}, found {version}"
        )
    if dtype != DTYPE_FOR_VERSION[version]:
        raise FormatError(
            f"rule 'dtype is the version's' failed at offset 6: expected "
            f"{DTYPE_FOR_VERSION[version]} for version {version}, found {dtype}"
        )
    if geometry is not None and header_geometry != geometry:
        raise ShapeError(
            f"rule 'block_tokens, n_layers, n_kv_heads, head_dim equal the receiving pool's' "
            f"failed: expected {geometry.as_tuple()}, found {header_geometry.as_tuple()}"
        )


def check_header(
    head: Any,
    length: int | None = None,
    geometry: Geometry | None = None,
    versions: Iterable[int] = SUPPORTED_VERSIONS,
) -> int:
    """Every reader rule the 28 header bytes decide, before the rest of the envelope arrives.

    The rules of :func:`decode` but the CRC and the fills: magic, version (known and in
    ``versions``), dtype, dimensions, ``geometry`` when given, and -- when ``length``, the
    envelope's announced size, is given -- the exact length. A receiver calls it on the
    first bytes of a body to refuse it before reading (or buffering) the rest.

    Args:
        head: at least the first 28 bytes of the envelope (more are ignored).
        length: the whole envelope's size when known (e.g. a Content-Length).

    Returns:
        The envelope's size ``28 + n * (12 + P) + 4`` by its header.

    Raises:
        TruncatedError: fewer than 28 bytes, or ``length`` is not the size the header implies.
        BadMagicError, FormatError, UnsupportedVersionError, ShapeError: as :func:`decode`.
    """
    mv = _as_bytes_view(head)
    if len(mv) < HEADER_SIZE:
        raise TruncatedError(
            f"rule 'length is at least {MIN_ENVELOPE_SIZE}' failed: found {len(mv)} bytes"
        )
    version, dtype, _n, header_geometry, expected = _frame(mv, length, versions)
    _fit(version, dtype, header_geometry, geometry, tuple(versions))
    return expected


def decode(
    data: Any,
    geometry: Geometry | None = None,
    versions: Iterable[int] = SUPPORTED_VERSIONS,
    *,
    verify_crc: bool = True,
    alive: Callable[[], None] | None = None,
) -> Envelope:
    """Validate an envelope by every reader rule and return zero-copy views into ``data``.

    Order of checks: length >= 32, magic, a known version, the exact length
    ``28 + n * (12 + P) + 4``, the CRC-32C, version in ``versions``, the version's dtype,
    the geometry (when given), then every block's fill and hash rule.

    Args:
        data: the envelope (bytes, bytearray, memoryview or any C-contiguous buffer).
        geometry: the reader's geometry; the header must equal it.
        versions: format versions this reader accepts.
        verify_crc: False skips the CRC (only for bytes verified before, e.g. by the store).
        alive: optional liveness check called on every view access (the store's readers).

    Raises:
        TruncatedError, BadMagicError, ChecksumError, FormatError: a format rule failed.
        UnsupportedVersionError: the version is not in ``versions``.
        ShapeError: the header's geometry differs from ``geometry``.
    """
    mv = _as_bytes_view(data)
    version, dtype, n_blocks, header_geometry, _ = _frame(mv, len(mv), versions)
    if verify_crc:
        body_end = len(mv) - TRAILER_SIZE
        (stored,) = TRAILER.unpack_from(mv, body_end)
        actual = crc32c(mv[:body_end])
        if stored != actual:
            raise ChecksumError(
                f"rule 'the CRC matches' failed at offset {body_end}: "
                f"expected {actual:#010x}, found {stored:#010x}"
            )
    _fit(version, dtype, header_geometry, geometry, tuple(versions))
    env = Envelope(mv, version, header_geometry, n_blocks, alive)
    if n_blocks:
        _check_fills(env)
    return env


def _check_fills(env: Envelope) -> None:
    """Vectorized fill and hash rules over every record; the first offender is named."""
    b = env.geometry.block_tokens
    fills = env.fills
    hashes = env.hashes
    bad = (fills < 1) | (fills > b) | ((hashes != NO_HASH) & (fills != b))
    if bad.any():
        i = int(np.argmax(bad))
        offset = HEADER_SIZE + i * env.record_bytes
        _check_fill(f"block {i} at offset {offset}", int(hashes[i]), int(fills[i]), b)


def check_finite(env: Envelope) -> None:
    """Refuse non-finite data (FORMAT.md rule 11, stricter than its reader rules 1-10, which
    allow any bits): v1, every filled f16 finite; v2, no E4M3 NaN code (S.1111.111) among the filled
    codes and every scale finite, > 0 and at most ``SCALE_MAX`` (so that every value,
    ``e4m3 * scale``, is finite in f32). Positions past a partial block's fill are not read.

    Raises:
        FormatError: naming the block, its offset, the layer, K or V, and the head.
    """
    if not len(env):
        return
    g = env.geometry
    fills = env.fills.tolist()
    b = g.block_tokens
    for i, n in enumerate(fills):
        payload = env.record(i)[RECORD_SIZE:]
        if env.version == VERSION_V1:
            if n == b and all_finite_f16(payload):
                continue
            kv = np.frombuffer(payload, dtype=F16_DTYPE, count=g.elements).reshape(g.kv_shape)
            bad = ~np.isfinite(kv[..., :n, :]).all(axis=(-2, -1))
            what = "a NaN or infinite f16 value"
        else:
            codes = np.frombuffer(payload, dtype=np.uint8, count=g.elements).reshape(g.kv_shape)
            nan = ((codes[..., :n, :] & E4M3_NAN_MASK) == E4M3_NAN_MASK).any(axis=(-2, -1))
            scales = np.frombuffer(payload, dtype=SCALE_DTYPE, count=g.n_slabs, offset=g.elements)
            scales = scales.reshape(g.n_layers, 2, g.n_kv_heads)
            with np.errstate(invalid="ignore"):
                bad_scale = ~((scales > 0) & (scales <= SCALE_MAX))  # NaN compares false
            if not (nan.any() or bad_scale.any()):
                continue
            bad = nan | bad_scale
            layer, kv_, head = (int(x[0]) for x in np.nonzero(bad))
            what = (
                f"scale {float(scales[layer, kv_, head])!r} (must be finite, > 0 and "
                f"<= {float(SCALE_MAX):.4g})"
                if bad_scale[layer, kv_, head]
                else "an E4M3 NaN code"
            )
        if not bad.any():
            continue
        layer, kv_, head = (int(x[0]) for x in np.nonzero(bad))
        offset = HEADER_SIZE + i * env.record_bytes
        raise FormatError(
            f"block {i} at offset {offset}: rule 'values are finite' failed: {what} in layer "
            f"{layer}, {'KV'[kv_]}, head {head}"
        )


# --- writing -----------------------------------------------------------------------------


def _encode_payload(geometry: Geometry, block: Block, version: int) -> list[Any]:
    """Payload parts of one block (views where possible, copies only where needed)."""
    kv = as_array(block.kv)
    if kv.shape != geometry.kv_shape:
        raise ShapeError(
            f"block {block.hash:016x}: kv shape expected {geometry.kv_shape}, found {kv.shape}"
        )
    n, b = block.n_tokens, geometry.block_tokens
    if version == VERSION_V1:
        filled = kv if n == b else kv[..., :n, :]
        f16 = to_f16(filled)
        if n == b:
            return [f16]
        full = np.zeros(geometry.kv_shape, dtype=F16_DTYPE)
        full[..., :n, :] = f16
        return [full]
    slabs = kv.reshape(geometry.n_slabs, b * geometry.head_dim)
    codes, scales = quantize_e4m3(slabs, n * geometry.head_dim)
    return [codes, scales.astype(SCALE_DTYPE, copy=False)]


def encode(geometry: Geometry, blocks: Iterable[Block], version: int = VERSION_V1) -> bytes:
    """Encode blocks into one envelope of format ``version`` (1: f16, 2: E4M3 + scales).

    Raises:
        UnsupportedVersionError: ``version`` is not 1 or 2.
        FormatError: a block breaks the fill or hash rule.
        ShapeError: a block's kv does not have shape ``[L][2][Hkv][B][D]``.
        ValueError: a value is not finite or overflows f16 (v1).
    """
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedVersionError(f"format version must be 1 or 2, found {version}")
    blocks = list(blocks)
    parts: list[Any] = [pack_header(version, geometry, len(blocks))]
    unchecked: list[int] = []  # blocks whose payload parts came from their kv object
    for i, block in enumerate(blocks):
        if not 0 <= block.hash <= U64_MAX:
            raise ValueError(f"block {i}: hash must fit u64, found {block.hash}")
        _check_fill(f"block {i}", block.hash, block.n_tokens, geometry.block_tokens)
        parts.append(RECORD.pack(block.hash, block.n_tokens))
        payload_parts = getattr(block.kv, "payload_parts", None)
        direct = payload_parts(version) if payload_parts is not None else None
        if direct is None:
            parts.extend(_encode_payload(geometry, block, version))
        else:
            unchecked.append(i)
            parts.extend(direct)
    data = assemble(parts)
    if len(data) != geometry.envelope_bytes(len(blocks), version):
        raise ShapeError(
            f"encode: the blocks' payloads total {len(data)} envelope bytes, expected "
            f"{geometry.envelope_bytes(len(blocks), version)} for geometry {geometry.as_tuple()}"
        )
    record_bytes = geometry.record_bytes(version)
    mv = memoryview(data)
    for i in unchecked:  # the same rule as to_f16, on the bytes just written
        start = HEADER_SIZE + i * record_bytes + RECORD_SIZE
        if not all_finite_f16(mv[start : start - RECORD_SIZE + record_bytes]):
            raise ValueError(
                f"block {i}: kv values must be finite and within f16's range "
                f"(found NaN or Inf, or |x| > 65504 after rounding)"
            )
    return data


def _from_records(version: int, geometry: Geometry, records: Sequence[Any]) -> bytes:
    return assemble([pack_header(version, geometry, len(records)), *records])


def split(data: Any) -> list[bytes]:
    """Split an envelope into single-block envelopes, each with its own CRC."""
    env = decode(data)
    if len(env) == 1:
        return [bytes(env.data)]
    return [env.single(i) for i in range(len(env))]


def join(envelopes: Iterable[Any]) -> bytes:
    """Join envelopes (same geometry and version) into one, blocks in order.

    Raises:
        ValueError: no envelopes were given.
        ShapeError: geometries differ.  UnsupportedVersionError: versions differ.
    """
    decoded = [decode(e) for e in envelopes]
    if not decoded:
        raise ValueError("join needs at least one envelope (the geometry comes from them)")
    first = decoded[0]
    records: list[memoryview] = []
    for i, env in enumerate(decoded):
        if env.geometry != first.geometry:
            raise ShapeError(
                f"join: envelope {i} geometry {env.geometry.as_tuple()} differs from "
                f"{first.geometry.as_tuple()}"
            )
        if env.version != first.version:
            raise UnsupportedVersionError(
                f"join: envelope {i} version {env.version} differs from {first.version}"
            )
        records.extend(env.record(j) for j in range(len(env)))
    return _from_records(first.version, first.geometry, records)


def transcode(data: Any, version: int) -> bytes:
    """Re-encode an envelope in format ``version`` (v1 -> v2 quantizes, v2 -> v1 to f16).

    Raises:
        ValueError: v2 -> v1 with a value that overflows f16.
    """
    env = decode(data)
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedVersionError(f"format version must be 1 or 2, found {version}")
    if env.version == version:
        return bytes(env.data)
    blocks = [Block(bv.hash, bv.n_tokens, bv.to_float32()) for bv in env]
    return encode(env.geometry, blocks, version)
