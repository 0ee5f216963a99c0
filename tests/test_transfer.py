"""kvstore.transfer without a server: the chunk rules, the CRC shortcut, status mapping,
and the checked-in generated modules against a fresh generation."""

from __future__ import annotations

import sys
from typing import Any

import grpc
import pytest
from conftest import SMALL, make_envelope
from http_server import REPO

from kvstore import Geometry, crc32c, decode, encode, join, split
from kvstore.codec.assembly import record_of
from kvstore.codec.builder import BytesBuilder, PyBytesBuilder
from kvstore.errors import (
    BadMagicError,
    ChecksumError,
    FormatError,
    InvalidRequestError,
    NotFoundError,
    ShapeError,
    StoreFullError,
    TlkvError,
    TooLargeError,
    TruncatedError,
    UnauthorizedError,
    UnsupportedVersionError,
)
from kvstore.transfer import (
    ERROR_KIND_KEY,
    MAX_CHUNK_PAYLOAD,
    FetchChecks,
    WireChunk,
    check_chunk,
    envelope_crc_to_chunk_crc,
    error_from_status,
    grpc_status_of,
    join_checked,
)

V1 = split(make_envelope(SMALL, 8, version=1))[0]
V2 = split(make_envelope(SMALL, 8, version=2))[1]
TAIL = split(make_envelope(SMALL, 6, version=1))[1]


def fields(payload: bytes) -> dict[str, Any]:
    env = decode(payload)
    return {
        "block_hash": env[0].hash,
        "n_tokens": env[0].n_tokens,
        "kv_format": env.version,
        "payload": payload,
        "crc": crc32c(payload),
    }


def flipped(data: bytes, at: int) -> bytes:
    out = bytearray(data)
    out[at] ^= 1
    return bytes(out)


@pytest.mark.parametrize("payload", [V1, V2, TAIL], ids=["v1", "v2", "tail"])
@pytest.mark.parametrize("wrap", [bytes, bytearray, memoryview])
def test_valid_chunks(payload: bytes, wrap: type) -> None:
    f = fields(payload)
    f["payload"] = wrap(payload)
    env = check_chunk(**f, geometry=SMALL)
    assert len(env) == 1 and env[0].hash == f["block_hash"]
    assert envelope_crc_to_chunk_crc(payload) == crc32c(payload) == 0x48674BC7


def _invalid() -> list[tuple[str, dict[str, Any], dict[str, Any], type[Exception]]]:
    damaged = flipped(V1, 60)
    two = encode(SMALL, [], 1)
    big = b"\0" * (MAX_CHUNK_PAYLOAD + 1)
    return [
        ("crc field", fields(V1), {"crc": crc32c(V1) ^ 1}, FormatError),
        (
            "damaged payload",
            fields(V1),
            {"payload": damaged, "crc": crc32c(damaged)},
            ChecksumError,
        ),
        (
            "bad magic",
            fields(V1),
            {"payload": b"X" + V1[1:], "crc": crc32c(b"X" + V1[1:])},
            BadMagicError,
        ),
        ("short", fields(V1), {"payload": V1[:10], "crc": crc32c(V1[:10])}, TruncatedError),
        ("empty", fields(V1), {"payload": b"", "crc": 0}, TruncatedError),
        ("hash", fields(V1), {"block_hash": 7}, FormatError),
        ("n_tokens", fields(V1), {"n_tokens": 3}, FormatError),
        ("kv_format disagrees", fields(V1), {"kv_format": 2}, FormatError),
        ("kv_format 0", fields(V1), {"kv_format": 0}, FormatError),
        ("kv_format unknown", fields(V1), {"kv_format": 9}, UnsupportedVersionError),
        ("zero blocks", fields(V1), {"payload": two, "crc": crc32c(two)}, InvalidRequestError),
        ("over 4 MiB", fields(V1), {"payload": big, "crc": crc32c(big)}, TooLargeError),
    ]


@pytest.mark.parametrize("case", _invalid(), ids=lambda c: c[0])
def test_invalid_chunks(case: tuple[str, dict[str, Any], dict[str, Any], type[Exception]]) -> None:
    _, base, override, error = case
    with pytest.raises(error):
        check_chunk(**{**base, **override}, geometry=SMALL)


def test_reader_rules_of_the_receiving_side() -> None:
    with pytest.raises(ShapeError):
        check_chunk(**fields(V1), geometry=Geometry(4, 1, 2, 8))
    with pytest.raises(UnsupportedVersionError):  # the payload's version, kv_format agreeing
        check_chunk(**fields(V2), geometry=SMALL, versions=(1,))
    with pytest.raises(UnsupportedVersionError):  # the field alone, before any other rule
        check_chunk(**{**fields(V1), "kv_format": 2, "crc": 0}, geometry=SMALL, versions=(1,))


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (FormatError("x"), grpc.StatusCode.DATA_LOSS),
        (ChecksumError("x"), grpc.StatusCode.DATA_LOSS),
        (ShapeError("x"), grpc.StatusCode.DATA_LOSS),
        (UnsupportedVersionError("x"), grpc.StatusCode.FAILED_PRECONDITION),
        (NotFoundError("x"), grpc.StatusCode.FAILED_PRECONDITION),
        (InvalidRequestError("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (ValueError("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (TooLargeError("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (StoreFullError("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (UnauthorizedError("x"), grpc.StatusCode.UNAUTHENTICATED),
        (RuntimeError("x"), grpc.StatusCode.INTERNAL),
    ],
)
def test_status_of_errors(error: Exception, code: grpc.StatusCode) -> None:
    assert grpc_status_of(error) == code


class _Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, trailing: tuple[tuple[str, str], ...] = ()) -> None:
        self._code, self._trailing = code, trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "why"

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailing


def test_errors_from_status() -> None:
    err = error_from_status(_Failed(grpc.StatusCode.DATA_LOSS, ((ERROR_KIND_KEY, "shape"),)))
    assert type(err) is ShapeError and str(err) == "why"
    assert type(error_from_status(_Failed(grpc.StatusCode.DATA_LOSS))) is FormatError
    failed = _Failed(grpc.StatusCode.FAILED_PRECONDITION, ((ERROR_KIND_KEY, "not_found"),))
    assert type(error_from_status(failed)) is NotFoundError
    assert type(error_from_status(_Failed(grpc.StatusCode.UNAVAILABLE))).__name__ == "ServiceError"


def test_generated_modules_match_a_fresh_generation() -> None:
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import gen_proto
    finally:
        sys.path.remove(str(REPO / "tools"))
    fresh = gen_proto.generate()
    assert {p.rsplit("/", 1)[0] for p in fresh} == {
        "kvstore/transfer/_tlkv_v1",
        "kvstore/transfer/_tlkv_models_v1",
    }
    for path, text in fresh.items():
        assert (REPO / path).read_text(encoding="utf-8") == text, path


@pytest.mark.parametrize("version", [1, 2])
def test_join_checked_is_join(version: int) -> None:
    parts = split(make_envelope(SMALL, 11, version=version))
    assert join_checked(parts) == join(parts)
    assert join_checked(parts[:1]) == parts[0]


# --- FetchChecks: the client's checks of a FetchKv stream ------------------------------

BUILDERS: list[Any] = list(dict.fromkeys([PyBytesBuilder, BytesBuilder]))
STREAM_V1 = split(make_envelope(SMALL, 16, version=1, seed=3))
STREAM_V2 = split(make_envelope(SMALL, 16, version=2, seed=4))


def wire(payload: bytes, /, **override: Any) -> WireChunk:
    f = fields(payload)
    f["crc32c"] = f.pop("crc")
    return WireChunk(**{**f, **override})


@pytest.mark.parametrize("builder", BUILDERS, ids=lambda c: c.__module__)
@pytest.mark.parametrize("stream", [STREAM_V1, STREAM_V2], ids=["v1", "v2"])
def test_fetch_checks_append_copies_records_and_their_crcs(
    builder: Any, stream: list[bytes]
) -> None:
    checks = FetchChecks()
    first = checks.check(wire(stream[0]))
    assert (first.version, first.geometry, checks.count) == (decode(stream[0]).version, SMALL, 1)
    out = builder(0)
    crcs = [checks.append(wire(p), out) for p in stream[1:]]
    assert checks.count == len(stream)
    assert out.finish() == b"".join(bytes(record_of(p)) for p in stream[1:])
    assert crcs == [crc32c(record_of(p)) for p in stream[1:]]


def _same_failure(stream: list[bytes], bad: WireChunk) -> None:
    """``append`` (one pass: copy + CRC) refuses ``bad`` as ``check_chunk`` does."""
    with pytest.raises(TlkvError) as whole:
        check_chunk(
            bad.block_hash, bad.n_tokens, bad.kv_format, bad.payload, bad.crc32c, geometry=SMALL
        )
    checks = FetchChecks()
    checks.check(wire(stream[0]))
    out = BUILDERS[-1](0)
    with pytest.raises(type(whole.value)) as fused:
        checks.append(bad, out)
    assert str(fused.value) == str(whole.value)
    assert checks.count == 1


@pytest.mark.parametrize("stream", [STREAM_V1, STREAM_V2], ids=["v1", "v2"])
def test_fetch_checks_refuse_every_single_byte_corruption(stream: list[bytes]) -> None:
    good = stream[1]
    for at in range(len(good)):
        for payload_crc in ("sent", "recomputed"):
            damaged = bytearray(good)
            damaged[at] ^= 0x5A
            crc = crc32c(good) if payload_crc == "sent" else crc32c(damaged)
            _same_failure(stream, wire(good, payload=bytes(damaged), crc32c=crc))


@pytest.mark.parametrize(
    "override",
    [
        {"crc32c": 0x48674BC7 ^ 1},
        {"block_hash": 7},
        {"n_tokens": 3},
        {"kv_format": 0},
        {"kv_format": 9},
    ],
    ids=["crc", "hash", "n_tokens", "kv_format 0", "kv_format 9"],
)
def test_fetch_checks_refuse_disagreeing_fields(override: dict[str, Any]) -> None:
    _same_failure(STREAM_V1, wire(STREAM_V1[1], **override))


def test_fetch_checks_hold_a_stream_to_one_format() -> None:
    checks = FetchChecks()
    checks.check(wire(STREAM_V1[0]))
    with pytest.raises(FormatError, match="the stream's first was v1"):
        checks.append(wire(STREAM_V2[1]), BUILDERS[-1](0))
    asked = FetchChecks(kv_format=2)
    with pytest.raises(FormatError, match="asked for format v2"):
        asked.check(wire(STREAM_V1[0]))
    other = split(make_envelope(Geometry(4, 1, 2, 8), 8, seed=5))[1]
    with pytest.raises(ShapeError):
        checks.append(wire(other), BUILDERS[-1](0))
