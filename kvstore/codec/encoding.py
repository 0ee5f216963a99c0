"""The envelope's writers: ``encode`` (blocks to an envelope), and ``split``, ``join`` and
``transcode`` (envelopes to envelopes, each input decoded by every reader rule first).

Spec: FORMAT.md, section 2 (layout). Every envelope is put together by
``assembly`` (header, records, CRC); payloads are numpy views where the input allows.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from ..errors import ShapeError, UnsupportedVersionError
from .assembly import assemble, from_records, pack_header
from .checksum import join_crc_into
from .decoding import check_fill, decode
from .geometry import Geometry
from .layout import (
    F16_DTYPE,
    HEADER_SIZE,
    RECORD,
    RECORD_SIZE,
    SCALE_DTYPE,
    SUPPORTED_VERSIONS,
    TRAILER_SIZE,
    U64_MAX,
    VERSION_V1,
)
from .numerics import all_finite_f16, as_array, quantize_e4m3, to_f16
from .views import Block

__all__ = ["encode", "encode_into", "join", "split", "transcode"]


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


def _parts(
    geometry: Geometry, blocks: Iterable[Block], version: int
) -> tuple[list[Any], int, list[int]]:
    """The envelope's parts before its CRC (header, then each block's record and payload
    parts), its block count, and the blocks whose payload parts came as they are from
    their kv object (their finite rule is checked on the bytes written)."""
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedVersionError(f"format version must be 1 or 2, found {version}")
    blocks = list(blocks)
    parts: list[Any] = [pack_header(version, geometry, len(blocks))]
    unchecked: list[int] = []
    for i, block in enumerate(blocks):
        if not 0 <= block.hash <= U64_MAX:
            raise ValueError(f"block {i}: hash must fit u64, found {block.hash}")
        check_fill(f"block {i}", block.hash, block.n_tokens, geometry.block_tokens)
        parts.append(RECORD.pack(block.hash, block.n_tokens))
        payload_parts = getattr(block.kv, "payload_parts", None)
        direct = payload_parts(version) if payload_parts is not None else None
        if direct is None:
            parts.extend(_encode_payload(geometry, block, version))
        else:
            unchecked.append(i)
            parts.extend(direct)
    return parts, len(blocks), unchecked


def _check_written(
    geometry: Geometry, version: int, data: Any, n_blocks: int, unchecked: list[int]
) -> None:
    """The written envelope's size, and the finite rule of the blocks in ``unchecked`` (the
    same rule as ``to_f16``, on the bytes just written)."""
    expected = geometry.envelope_bytes(n_blocks, version)
    if len(data) != expected:
        raise ShapeError(
            f"encode: the blocks' payloads total {len(data)} envelope bytes, expected "
            f"{expected} for geometry {geometry.as_tuple()}"
        )
    record_bytes = geometry.record_bytes(version)
    mv = memoryview(data)
    for i in unchecked:
        start = HEADER_SIZE + i * record_bytes + RECORD_SIZE
        if not all_finite_f16(mv[start : start - RECORD_SIZE + record_bytes]):
            raise ValueError(
                f"block {i}: kv values must be finite and within f16's range "
                f"(found NaN or Inf, or |x| > 65504 after rounding)"
            )


def encode(geometry: Geometry, blocks: Iterable[Block], version: int = VERSION_V1) -> bytes:
    """Encode blocks into one envelope of format ``version`` (1: f16, 2: E4M3 + scales).

    Raises:
        UnsupportedVersionError: ``version`` is not 1 or 2.
        FormatError: a block breaks the fill or hash rule.
        ShapeError: a block's kv does not have shape ``[L][2][Hkv][B][D]``.
        ValueError: a value is not finite or overflows f16 (v1).
    """
    parts, n_blocks, unchecked = _parts(geometry, blocks, version)
    data = assemble(parts)
    _check_written(geometry, version, data, n_blocks, unchecked)
    return data


def encode_into(
    out: Any, geometry: Geometry, blocks: Iterable[Block], version: int = VERSION_V1
) -> memoryview:
    """``encode`` into the writable buffer ``out``: the envelope, byte for byte
    ``encode``'s, as a view of ``out``'s first bytes (valid while ``out`` is not written).

    A writer that encodes often (an engine's saver) keeps one buffer: its pages stay
    mapped, where each new ``bytes`` of an envelope's size takes a page fault per 4 KiB
    page. The parts are copied and checksummed in one pass (``checksum.join_crc_into``).

    Raises:
        ValueError: ``out`` is read-only or smaller than the envelope, or overlaps a
            block's memory (nothing written); otherwise as ``encode`` (``out``'s first
            bytes are then undefined).
    """
    parts, n_blocks, unchecked = _parts(geometry, blocks, version)
    size = sum(memoryview(p).nbytes for p in parts)
    room = memoryview(out).cast("B")
    if room.readonly:
        raise ValueError("encode_into: out is read-only")
    if len(room) < size + TRAILER_SIZE:
        raise ValueError(
            f"encode_into: out holds {len(room)} bytes, the envelope {size + TRAILER_SIZE}"
        )
    data = room[: join_crc_into(parts, room)]
    _check_written(geometry, version, data, n_blocks, unchecked)
    return data


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
    return from_records(first.version, first.geometry, records)


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
