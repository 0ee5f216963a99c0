"""``KvChunk`` messages without copying payloads: PushKv's requests and FetchKv's responses.

The generated ``KvChunk.FromString`` copies each 2 MiB payload into protobuf's arena, and
reading ``chunk.payload`` copies it again into a new ``bytes`` (holding the GIL). The
server's PushKv and ``TransferClient.fetch`` register :func:`parse_chunk` as their
deserializer instead: the payload becomes a ``memoryview``
into the message bytes gRPC hands over (the store, or the joined envelope, copies it
once). The parser follows protobuf's wire rules for proto3 (the fields of
``api/proto/tl/kv/v1/kv.proto``): fields in any order, the last occurrence wins, unknown
fields and fields of an unexpected wire type are skipped, uint32 varints are truncated to
32 bits; a message that does not parse raises ``ValueError``, which gRPC answers like a
protobuf decode error. The server's FetchKv writes its chunks with
:func:`serialize_chunk` (one copy of the payload instead of protobuf's two).
"""

from __future__ import annotations

import struct

_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF


class WireChunk:
    """A parsed ``KvChunk``: the generated message's fields, ``payload`` a memoryview,
    ``token_ids`` a list (tlkv's extension fields 7 and 8: a full block's parent hash and
    token ids)."""

    __slots__ = (
        "block_hash",
        "crc32c",
        "kv_format",
        "n_tokens",
        "parent_hash",
        "payload",
        "sequence",
        "token_ids",
    )

    def __init__(
        self,
        block_hash: int = 0,
        n_tokens: int = 0,
        kv_format: int = 0,
        payload: bytes | memoryview = b"",
        crc32c: int = 0,
        sequence: str = "",
        parent_hash: int = 0,
        token_ids: list[int] | None = None,
    ) -> None:
        self.block_hash = block_hash
        self.n_tokens = n_tokens
        self.kv_format = kv_format
        self.payload = memoryview(payload)
        self.crc32c = crc32c
        self.sequence = sequence
        self.parent_hash = parent_hash
        self.token_ids = [] if token_ids is None else token_ids


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("KvChunk: truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result & _MASK64, pos
        shift += 7
        if shift >= 70:
            raise ValueError("KvChunk: varint longer than 10 bytes")


def parse_chunk(raw: bytes) -> WireChunk:
    """A ``KvChunk`` from its serialized bytes, the payload not copied.

    Raises:
        ValueError: the bytes are not a well-formed message.
    """
    chunk = WireChunk()
    view = memoryview(raw)
    end = len(raw)
    pos = 0
    while pos < end:
        key, pos = _varint(raw, pos)
        field, wire = key >> 3, key & 7
        if field == 0:
            raise ValueError("KvChunk: field number 0")
        if wire == _VARINT:
            value, pos = _varint(raw, pos)
            if field == 2:
                chunk.n_tokens = value & _MASK32
            elif field == 3:
                chunk.kv_format = value & _MASK32
            elif field == 8:  # a repeated uint32 sent unpacked
                chunk.token_ids.append(value & _MASK32)
        elif wire == _I64:
            if pos + 8 > end:
                raise ValueError("KvChunk: truncated fixed64")
            if field == 1:
                (chunk.block_hash,) = _U64.unpack_from(raw, pos)
            elif field == 7:
                (chunk.parent_hash,) = _U64.unpack_from(raw, pos)
            pos += 8
        elif wire == _I32:
            if pos + 4 > end:
                raise ValueError("KvChunk: truncated fixed32")
            if field == 5:
                (chunk.crc32c,) = _U32.unpack_from(raw, pos)
            pos += 4
        elif wire == _LEN:
            length, pos = _varint(raw, pos)
            if pos + length > end:
                raise ValueError("KvChunk: truncated length-delimited field")
            if field == 4:
                chunk.payload = view[pos : pos + length]
            elif field == 6:
                chunk.sequence = bytes(view[pos : pos + length]).decode("utf-8")
            elif field == 8:  # packed repeated uint32
                at, stop = pos, pos + length
                while at < stop:
                    value, at = _varint(raw, at)
                    chunk.token_ids.append(value & _MASK32)
                if at != stop:
                    raise ValueError("KvChunk: packed token_ids overrun their length")
            pos += length
        else:  # groups (3, 4) are not proto3; 6 and 7 are not wire types
            raise ValueError(f"KvChunk: unsupported wire type {wire}")
    return chunk


def _varint_bytes(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_TAG_HASH = bytes([1 << 3 | _I64])
_TAG_NTOKENS = bytes([2 << 3 | _VARINT])
_TAG_FORMAT = bytes([3 << 3 | _VARINT])
_TAG_PAYLOAD = bytes([4 << 3 | _LEN])
_TAG_CRC = bytes([5 << 3 | _I32])
_TAG_PARENT = bytes([7 << 3 | _I64])
_TAG_TOKENS = bytes([8 << 3 | _LEN])


def serialize_chunk(chunk: WireChunk) -> bytes:
    """The serialized ``KvChunk`` (without ``sequence``), the bytes protobuf would write,
    with one copy of the payload (protobuf's message and serializer copy it twice)."""
    parts: list[bytes | memoryview] = []
    if chunk.block_hash:
        parts += [_TAG_HASH, _U64.pack(chunk.block_hash)]
    if chunk.n_tokens:
        parts += [_TAG_NTOKENS, _varint_bytes(chunk.n_tokens)]
    if chunk.kv_format:
        parts += [_TAG_FORMAT, _varint_bytes(chunk.kv_format)]
    if len(chunk.payload):
        parts += [_TAG_PAYLOAD, _varint_bytes(len(chunk.payload)), chunk.payload]
    if chunk.crc32c:
        parts += [_TAG_CRC, _U32.pack(chunk.crc32c)]
    if chunk.parent_hash:
        parts += [_TAG_PARENT, _U64.pack(chunk.parent_hash)]
    if chunk.token_ids:
        packed = b"".join(_varint_bytes(t) for t in chunk.token_ids)
        parts += [_TAG_TOKENS, _varint_bytes(len(packed)), packed]
    return b"".join(parts)
