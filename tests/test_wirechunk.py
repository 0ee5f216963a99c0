"""kvstore.transfer.wirechunk: the zero-copy KvChunk parser and writer agree with protobuf."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from kvstore.transfer._tlkv_v1 import kv_pb2
from kvstore.transfer.wirechunk import WireChunk, parse_chunk, serialize_chunk

FIELDS = ("block_hash", "n_tokens", "kv_format", "crc32c", "sequence")


def _same(raw: bytes) -> None:
    expected = kv_pb2.KvChunk.FromString(raw)
    got = parse_chunk(raw)
    for name in FIELDS:
        assert getattr(got, name) == getattr(expected, name), name
    assert bytes(got.payload) == expected.payload


@given(
    block_hash=st.integers(0, 2**64 - 1),
    n_tokens=st.integers(0, 2**32 - 1),
    kv_format=st.integers(0, 2**32 - 1),
    payload=st.binary(max_size=300),
    crc=st.integers(0, 2**32 - 1),
    sequence=st.text(max_size=20),
)
def test_agrees_with_protobuf(
    block_hash: int, n_tokens: int, kv_format: int, payload: bytes, crc: int, sequence: str
) -> None:
    message = kv_pb2.KvChunk(
        block_hash=block_hash,
        n_tokens=n_tokens,
        kv_format=kv_format,
        payload=payload,
        crc32c=crc,
        sequence=sequence,
    )
    _same(message.SerializeToString())


def test_payload_is_a_view_not_a_copy() -> None:
    raw = kv_pb2.KvChunk(payload=b"x" * 1000).SerializeToString()
    chunk = parse_chunk(raw)
    assert isinstance(chunk.payload, memoryview) and chunk.payload.obj is raw


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        # unknown fields of every wire type are skipped
        bytes([0x38, 0x05]) + bytes([0x41]) + b"\0" * 8 + bytes([0x4A, 0x02]) + b"ab",
        bytes([0x4D]) + b"\0" * 4,
        # fields repeated: the last wins; fields out of order
        bytes([0x10, 0x01, 0x10, 0x02, 0x22, 0x01]) + b"a" + bytes([0x22, 0x01]) + b"b",
        bytes([0x2D]) + b"\1\2\3\4" + bytes([0x09]) + b"\1" * 8,
        # a varint wider than 32 bits in a uint32 field is truncated
        bytes([0x10]) + b"\xff" * 9 + b"\x01",
        # a known field with an unexpected wire type is an unknown field
        bytes([0x08, 0x07]),
    ],
)
def test_wire_rules(raw: bytes) -> None:
    _same(raw)


@pytest.mark.parametrize(
    "raw",
    [
        bytes([0x22, 0x05]) + b"abc",  # payload shorter than its length
        bytes([0x09]) + b"\0" * 3,  # fixed64 cut short
        bytes([0x2D]) + b"\0",  # fixed32 cut short
        bytes([0x10, 0x80]),  # varint cut short
        bytes([0x0B]),  # a group (wire type 3)
        bytes([0x32, 0x01, 0xFF]),  # a string that is not UTF-8
    ],
)
def test_malformed_is_refused_like_protobuf(raw: bytes) -> None:
    with pytest.raises(DecodeError):
        kv_pb2.KvChunk.FromString(raw)
    with pytest.raises(ValueError):
        parse_chunk(raw)


@given(
    block_hash=st.integers(0, 2**64 - 1),
    n_tokens=st.integers(0, 2**32 - 1),
    kv_format=st.integers(0, 2**32 - 1),
    payload=st.binary(max_size=300),
    crc=st.integers(0, 2**32 - 1),
)
def test_serialize_writes_protobufs_bytes(
    block_hash: int, n_tokens: int, kv_format: int, payload: bytes, crc: int
) -> None:
    fields: dict[str, Any] = {
        "block_hash": block_hash,
        "n_tokens": n_tokens,
        "kv_format": kv_format,
        "payload": payload,
        "crc32c": crc,
    }
    expected = kv_pb2.KvChunk(**fields).SerializeToString()
    assert serialize_chunk(WireChunk(**fields)) == expected
