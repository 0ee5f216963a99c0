"""The envelope's reader rules: ``decode`` (every rule), ``check_header`` (the rules the 28
header bytes decide), ``check_crc`` (the CRC alone), ``check_finite`` (the stricter
finite-values rule), ``check_fill``, and ``plain_v1_blocks`` (the fast path of a reader
that checks the CRC while it copies).

Spec: FORMAT.md, section 3 (reader rules, in the order ``decode`` checks them).
``decode`` checks sizes before it trusts anything, then the CRC, then the structural rules,
and never allocates in proportion to the claimed block count before the length check.
Every error names the first rule that fails in that order, also when the caller skips the
CRC (a reader that checks it while copying): a later rule that fails makes ``decode`` and
``check_finite`` check the CRC before they raise, so a damaged envelope is reported as
damaged, in one call. Payload arrays are numpy views into the caller's buffer, never copies.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from ..errors import (
    BadMagicError,
    ChecksumError,
    EnvelopeError,
    FormatError,
    ShapeError,
    TruncatedError,
    UnsupportedVersionError,
)
from .assembly import pack_header
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
    VERSION_V1,
)
from .numerics import E4M3_NAN_MASK, SCALE_MAX, all_finite_f16
from .views import Envelope

__all__ = [
    "check_crc",
    "check_fill",
    "check_finite",
    "check_header",
    "decode",
    "plain_v1_blocks",
]


def check_fill(where: str, block_hash: int, n_tokens: int, block_tokens: int) -> None:
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
        _check_crc(mv)
    try:
        _fit(version, dtype, header_geometry, geometry, tuple(versions))
        env = Envelope(mv, version, header_geometry, n_blocks, alive)
        if n_blocks:
            _check_fills(env)
    except EnvelopeError:
        if not verify_crc:  # the CRC comes first: a damaged envelope is reported as such
            _check_crc(mv)
        raise
    return env


def _check_crc(mv: memoryview) -> None:
    body_end = len(mv) - TRAILER_SIZE
    (stored,) = TRAILER.unpack_from(mv, body_end)
    actual = crc32c(mv[:body_end])
    if stored != actual:
        raise ChecksumError(
            f"rule 'the CRC matches' failed at offset {body_end}: "
            f"expected {actual:#010x}, found {stored:#010x}"
        )


def check_crc(data: Any) -> None:
    """The rule "the CRC matches" alone, on an envelope whose length rules hold (one that
    ``decode`` took with ``verify_crc=False``).

    Raises:
        ChecksumError: the trailing CRC-32C is not the bytes' (naming both values).
        TruncatedError: fewer than 32 bytes.
    """
    mv = _as_bytes_view(data)
    if len(mv) < MIN_ENVELOPE_SIZE:
        raise TruncatedError(
            f"rule 'length is at least {MIN_ENVELOPE_SIZE}' failed: found {len(mv)} bytes"
        )
    _check_crc(mv)


def plain_v1_blocks(
    data: Any, geometry: Geometry, hashes: Sequence[int] | np.ndarray | None = None
) -> int | None:
    """How many blocks ``data`` holds when it is, by every reader rule but the CRC, a v1
    envelope of one or more full blocks of ``geometry`` -- whose hashes are the leading
    ``hashes``, in order, when given; None for anything else (``decode`` then names the
    rule that fails, or the block that is not the one asked for).

    The fast path of a reader that copies the payloads and checks the CRC in the same pass
    (an engine's fused load): the 28 header bytes are compared with the ones such an
    envelope has (magic, version, dtype, block count, ``geometry``), the length with the
    one they imply, and every record's ``n_tokens`` (``B``: any hash is then allowed) and
    hash are read as one strided array.
    """
    try:
        mv = _as_bytes_view(data)
    except (FormatError, TypeError):
        return None
    stride = geometry.record_bytes(VERSION_V1)
    n, extra = divmod(len(mv) - HEADER_SIZE - TRAILER_SIZE, stride)
    if extra or n < 1 or (hashes is not None and n > len(hashes)):
        return None
    if mv[:HEADER_SIZE] != _v1_header(geometry, n):
        return None
    if n == 1:
        block_hash, n_tokens = RECORD.unpack_from(mv, HEADER_SIZE)
        ok = n_tokens == geometry.block_tokens and (hashes is None or block_hash == hashes[0])
        return 1 if ok else None
    fills = _records_field(mv, n, stride, RECORD_NTOKENS_DTYPE, RECORD_NTOKENS_OFFSET)
    if not (fills == geometry.block_tokens).all():
        return None
    if hashes is not None:
        got = _records_field(mv, n, stride, RECORD_HASH_DTYPE, RECORD_HASH_OFFSET)
        if not (got == np.asarray(hashes[:n], dtype=np.uint64)).all():
            return None
    return n


@lru_cache(maxsize=256)
def _v1_header(geometry: Geometry, n_blocks: int) -> bytes:
    """The header of a v1 envelope of ``n_blocks`` blocks of ``geometry``."""
    return pack_header(VERSION_V1, geometry, n_blocks)


def _records_field(mv: memoryview, n: int, stride: int, dtype: str, offset: int) -> np.ndarray:
    """One field of every record as a strided view (no copy)."""
    field: np.ndarray = np.ndarray(
        (n,), dtype, buffer=mv, offset=HEADER_SIZE + offset, strides=(stride,)
    )
    return field


def _check_fills(env: Envelope) -> None:
    """Vectorized fill and hash rules over every record; the first offender is named."""
    b = env.geometry.block_tokens
    fills = env.fills
    hashes = env.hashes
    bad = (fills < 1) | (fills > b) | ((hashes != NO_HASH) & (fills != b))
    if bad.any():
        i = int(np.argmax(bad))
        offset = HEADER_SIZE + i * env.record_bytes
        check_fill(f"block {i} at offset {offset}", int(hashes[i]), int(fills[i]), b)


def check_finite(env: Envelope) -> None:
    """Refuse non-finite data (FORMAT.md rule 11, stricter than its reader rules 1-10, which
    allow any bits): v1, every filled f16 finite; v2, no E4M3 NaN code (S.1111.111) among the filled
    codes and every scale finite, > 0 and at most ``SCALE_MAX`` (so that every value,
    ``e4m3 * scale``, is finite in f32). Positions past a partial block's fill are not read.

    Raises:
        FormatError: naming the block, its offset, the layer, K or V, and the head.
        ChecksumError: a value is not finite and the CRC fails too (the CRC's rule is
            checked before this one).
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
        _check_crc(env.data)  # the CRC comes first: damaged bytes are reported as such
        raise FormatError(
            f"block {i} at offset {offset}: rule 'values are finite' failed: {what} in layer "
            f"{layer}, {'KV'[kv_]}, head {head}"
        )
