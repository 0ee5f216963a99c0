"""Envelope codec: the spec's worked example byte for byte, every reader rule, round trips,
corruption, split/join/transcode."""

from __future__ import annotations

import struct
import time

import numpy as np
import pytest
from conftest import SMALL, make_blocks, make_envelope
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import (
    Block,
    ChecksumError,
    EnvelopeError,
    FormatError,
    Geometry,
    ShapeError,
    UnsupportedVersionError,
    crc32c,
    decode,
    encode,
    join,
    split,
    transcode,
)
from kvstore.codec import encode_into
from kvstore.codec.decoding import check_crc, check_finite, plain_v1_blocks
from kvstore.codec.layout import NO_HASH
from kvstore.errors import BadMagicError, TruncatedError

# Spec "Worked example (v1)": the 60-byte envelope, byte for byte.
SPEC_GEOMETRY = Geometry(block_tokens=2, n_layers=1, n_kv_heads=1, head_dim=2)
SPEC_ENVELOPE = bytes.fromhex(
    "544c4b56010001000100000002000000"  # magic, version 1, dtype 1, n_blocks 1, block_tokens 2
    "010000000100000002000000"  # n_layers 1, n_kv_heads 1, head_dim 2
    "66937b02c1b01aa902000000"  # block_hash 0xA91AB0C1027B9366, n_tokens 2
    "003c004000420044"  # K: f16 1.0 2.0 3.0 4.0
    "003800bc00000034"  # V: f16 0.5 -1.0 0.0 0.25
    "1c540b4f"  # crc32c 0x4F0B541C
)
SPEC_KV = np.array([[[[[1, 2], [3, 4]]], [[[0.5, -1], [0, 0.25]]]]], dtype=np.float32)


def test_spec_worked_example_encodes_byte_for_byte() -> None:
    out = encode(SPEC_GEOMETRY, [Block(0xA91AB0C1027B9366, 2, SPEC_KV)])
    assert len(out) == 60 == SPEC_GEOMETRY.envelope_bytes(1)
    assert out == SPEC_ENVELOPE


def test_spec_worked_example_decodes(buffer_type: type) -> None:
    env = decode(buffer_type(SPEC_ENVELOPE), SPEC_GEOMETRY, versions=(1,))
    assert env.version == 1 and env.geometry == SPEC_GEOMETRY and len(env) == 1
    bv = env[0]
    assert bv.hash == 0xA91AB0C1027B9366 and bv.n_tokens == 2
    assert bv.kv.dtype == np.float16 and bv.kv.shape == (1, 2, 1, 2, 2)
    assert bv.k.tolist() == [[[[1.0, 2.0], [3.0, 4.0]]]]
    assert bv.v.tolist() == [[[[0.5, -1.0], [0.0, 0.25]]]]
    assert bv.scales is None
    assert bytes(bv.raw) == SPEC_ENVELOPE[28:56]


def test_spec_f16_one_is_3c00() -> None:
    assert np.float16(1.0).tobytes() == b"\x00\x3c"


def test_geometry_sizes() -> None:
    g = Geometry(16, 32, 8, 128)
    assert g.payload_bytes(1) == 32 * 2 * 8 * 16 * 128 * 2 == 2 * 1024 * 1024
    assert g.payload_bytes(2) == 32 * 2 * 8 * (16 * 128 + 4)
    assert g.envelope_bytes(3, 2) == 28 + 3 * (12 + g.payload_bytes(2)) + 4
    assert g.envelope_bytes(0) == 32


@pytest.mark.parametrize("dims", [(0, 1, 1, 1), (1, 0, 1, 1), (1, 1, -1, 1), (1, 1, 1, 2**32)])
def test_geometry_is_validated(dims: tuple[int, int, int, int]) -> None:
    with pytest.raises(ValueError):
        Geometry(*dims)


# --- reader rules: one named failing case each, with a valid CRC -------------------------


def _recrc(buf: bytes | bytearray) -> bytes:
    body = bytes(buf[:-4])
    return body + struct.pack("<I", crc32c(body))


def _patch(offset: int, fmt: str, value: int, base: bytes = SPEC_ENVELOPE) -> bytes:
    buf = bytearray(base)
    struct.pack_into(fmt, buf, offset, value)
    return _recrc(buf)


V2_ENVELOPE = transcode(SPEC_ENVELOPE, 2)

RULE_CASES = [
    ("length below 32", SPEC_ENVELOPE[:31], {}, TruncatedError),
    (
        "length not 28+n(12+P)+4 (extra byte)",
        _recrc(SPEC_ENVELOPE[:-4] + b"\0" + b"\0" * 4),
        {},
        TruncatedError,
    ),
    ("length not 28+n(12+P)+4 (n_blocks 2)", _patch(8, "<I", 2), {}, TruncatedError),
    ("huge n_blocks", _patch(8, "<I", 2**32 - 1), {}, TruncatedError),
    ("magic", _recrc(b"TLKX" + SPEC_ENVELOPE[4:]), {}, BadMagicError),
    ("crc", SPEC_ENVELOPE[:-1] + bytes([SPEC_ENVELOPE[-1] ^ 1]), {}, ChecksumError),
    ("unknown version 3", _patch(4, "<H", 3), {}, UnsupportedVersionError),
    ("v2 refused by a v1-only reader", V2_ENVELOPE, {"versions": (1,)}, UnsupportedVersionError),
    ("dtype of v1 must be 1", _patch(6, "<H", 3), {}, FormatError),
    ("dtype of v2 must be 3", _patch(6, "<H", 1, V2_ENVELOPE), {}, FormatError),
    (
        "zero dimension",
        _recrc(SPEC_ENVELOPE[:8] + struct.pack("<5I", 0, 0, 1, 1, 2) + b"\0" * 4),
        {},
        FormatError,
    ),
    ("block_tokens differs", SPEC_ENVELOPE, {"geometry": Geometry(4, 1, 1, 1)}, ShapeError),
    ("head_dim differs", SPEC_ENVELOPE, {"geometry": Geometry(2, 1, 1, 4)}, ShapeError),
    ("n_tokens 0", _patch(36, "<I", 0), {}, FormatError),
    ("n_tokens > B", _patch(36, "<I", 3), {}, FormatError),
    ("non-zero hash on a partial block", _patch(36, "<I", 1), {}, FormatError),
]


EACH_RULE_CASE = pytest.mark.parametrize(
    ("data", "kwargs", "error"),
    [case[1:] for case in RULE_CASES],
    ids=[case[0] for case in RULE_CASES],
)


@EACH_RULE_CASE
def test_reader_rule_violations(data: bytes, kwargs: dict, error: type[Exception]) -> None:
    with pytest.raises(error) as info:
        decode(data, **kwargs)
    message = str(info.value)  # names the rule, and what was found (and expected)
    assert "rule '" in message and "failed" in message
    assert "found" in message or "expected" in message


@EACH_RULE_CASE
def test_a_reader_skipping_the_crc_is_told_the_same_first_rule(
    data: bytes, kwargs: dict, error: type[Exception]
) -> None:
    """``decode(..., verify_crc=False)`` names the rule a full decode names, in one call:
    with the CRC right, the same rule (the CRC case passes: it was skipped); with the CRC
    damaged too, the CRC whenever its rule comes first."""
    if error is ChecksumError:
        decode(data, verify_crc=False, **kwargs)
        return
    with pytest.raises(error):
        decode(data, verify_crc=False, **kwargs)
    damaged = bytearray(data)
    damaged[-1] ^= 0x01
    with pytest.raises(EnvelopeError) as full:
        decode(bytes(damaged), **kwargs)
    with pytest.raises(EnvelopeError) as skipped:
        decode(bytes(damaged), verify_crc=False, **kwargs)
    assert type(skipped.value) is type(full.value)
    assert str(skipped.value) == str(full.value)


@EACH_RULE_CASE
def test_plain_v1_blocks_takes_no_envelope_a_rule_refuses(
    data: bytes, kwargs: dict, error: type[Exception]
) -> None:
    """The fused loads' fast path admits none of the table's envelopes but the one whose
    only fault is its CRC (which the fused copy checks)."""
    geometry = kwargs.get("geometry", SPEC_GEOMETRY)
    expected = 1 if error is ChecksumError else None
    assert plain_v1_blocks(data, geometry) == expected
    assert plain_v1_blocks(data, geometry, [0xA91AB0C1027B9366]) == expected


def test_plain_v1_blocks_counts_full_v1_blocks_of_the_hashes_asked_for(
    buffer_type: type,
) -> None:
    g = Geometry(4, 2, 1, 8)
    kv = np.ones(g.kv_shape, np.float16)
    asked = [7, 8, 9]
    prefix = encode(g, [Block(7, 4, kv), Block(8, 4, kv)])
    assert plain_v1_blocks(buffer_type(prefix), g, asked) == 2
    assert plain_v1_blocks(buffer_type(prefix), g) == 2
    assert plain_v1_blocks(prefix, g, asked[:2]) == 2
    assert plain_v1_blocks(encode(g, [Block(7, 4, kv)]), g, asked) == 1
    assert plain_v1_blocks(encode(g, [Block(7, 4, kv)]), g, [8]) is None  # not the one asked
    others = [
        encode(g, [Block(7, 4, kv), Block(9, 4, kv)]),  # a block that was not asked for
        encode(g, [Block(8, 4, kv), Block(7, 4, kv)]),  # out of order
        encode(g, [Block(7, 4, kv), Block(NO_HASH, 3, kv)]),  # a partial block
        encode(g, [Block(NO_HASH, 3, kv)]),
        transcode(prefix, 2),
        encode(Geometry(4, 2, 2, 4), [Block(7, 4, np.ones((2, 2, 2, 4, 4), np.float16))]),
        prefix[:-1],
        prefix + b"\0",
        encode(g, [Block(7, 4, kv)] * 4),  # more blocks than asked for
        encode(g, []),  # no block
        b"",
    ]
    for env in others:
        assert plain_v1_blocks(env, g, asked) is None
    assert plain_v1_blocks(prefix, g, []) is None
    strided = np.frombuffer(prefix + prefix, np.uint8)[::2]
    assert plain_v1_blocks(strided, g) is None  # not C-contiguous: decode refuses it


def test_a_non_finite_value_in_a_damaged_envelope_is_reported_as_damaged() -> None:
    good = encode(SMALL, [Block(5, SMALL.block_tokens, np.ones(SMALL.kv_shape))])
    data = bytearray(good)
    data[40:42] = np.float16(np.inf).tobytes()  # the first payload value (28 + 12)
    data = bytearray(_recrc(data))
    with pytest.raises(FormatError, match="values are finite"):
        check_finite(decode(bytes(data)))
    data[-1] ^= 0x01
    with pytest.raises(ChecksumError):
        check_finite(decode(bytes(data), verify_crc=False))
    with pytest.raises(ChecksumError, match="the CRC matches"):
        check_crc(data)
    check_crc(good)
    with pytest.raises(TruncatedError):
        check_crc(b"TLKV")


def test_partial_block_with_zero_hash_is_valid() -> None:
    buf = bytearray(SPEC_ENVELOPE)
    struct.pack_into("<QI", buf, 28, 0, 1)
    env = decode(_recrc(buf))
    assert env[0].hash == 0 and env[0].n_tokens == 1


def test_errors_are_value_errors_and_envelope_errors() -> None:
    for cls in (FormatError, TruncatedError, ChecksumError, ShapeError, UnsupportedVersionError):
        assert issubclass(cls, EnvelopeError) and issubclass(cls, ValueError)


def test_huge_claimed_block_count_is_rejected_fast() -> None:
    data = _patch(8, "<I", 2**32 - 1, make_envelope(Geometry(16, 32, 8, 128), 16))
    t0 = time.perf_counter()
    for _ in range(100):
        with pytest.raises(TruncatedError):
            decode(data)
    assert (time.perf_counter() - t0) / 100 < 0.01  # microseconds in practice; generous bound


def test_zero_block_envelope_is_32_bytes() -> None:
    out = encode(SMALL, [])
    assert len(out) == 32
    assert len(decode(out)) == 0


# --- writing rules -------------------------------------------------------------------


def test_positions_past_fill_are_zero_bytes() -> None:
    blocks = make_blocks(SMALL, 3)  # one partial block with 3 of 4 positions
    for version in (1, 2):
        env = decode(encode(SMALL, blocks, version))
        kv = env[0].kv.view(np.uint8) if version == 1 else env[0].kv
        assert not kv[..., 3:, :].any()


def test_input_past_fill_is_not_read() -> None:
    blocks = make_blocks(SMALL, 3)
    kv = blocks[0].kv.copy()
    kv[..., 3:, :] = np.nan
    for version in (1, 2):
        assert encode(SMALL, [Block(0, 3, kv)], version) == encode(SMALL, blocks, version)


# --- property tests ------------------------------------------------------------------

geometries = st.builds(
    Geometry, st.integers(1, 6), st.integers(1, 3), st.integers(1, 3), st.integers(1, 8)
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    geometry=geometries,
    n_tokens=st.integers(0, 30),
    version=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**32 - 1),
    scale=st.sampled_from([0.0, 1e-3, 1.0, 300.0]),
    dtype=st.sampled_from([np.float16, np.float32, np.float64]),
)
def test_round_trip(
    geometry: Geometry, n_tokens: int, version: int, seed: int, scale: float, dtype: type
) -> None:
    blocks = make_blocks(geometry, n_tokens, seed, dtype, scale)
    data = encode(geometry, blocks, version)
    assert len(data) == geometry.envelope_bytes(len(blocks), version)
    assert bytes(encode_into(bytearray(len(data)), geometry, blocks, version)) == data
    env = decode(data, geometry)
    assert len(env) == len(blocks)
    for bv, block in zip(env, blocks):
        assert (bv.hash, bv.n_tokens) == (block.hash, block.n_tokens)
        n = block.n_tokens
        x = np.asarray(block.kv)[..., :n, :].astype(np.float32)
        got = bv.to_float32()
        assert not got[..., n:, :].any()
        if version == 1:
            assert np.array_equal(
                got[..., :n, :],
                np.asarray(block.kv)[..., :n, :].astype(np.float16).astype(np.float32),
            )
        else:
            assert bv.scales is not None
            s = bv.scales[..., None, None]
            # E4M3: 3 mantissa bits -> relative error <= 2^-4; subnormal step 2^-9 * scale.
            bound = np.maximum(np.abs(x) * 2.0**-4, s * 2.0**-10) * (1 + 1e-6)
            assert (np.abs(got[..., :n, :] - x) <= bound).all()
    # Split, join and transcode are inverse-consistent.
    if blocks:
        parts = split(data)
        assert len(parts) == len(blocks)
        assert all(len(p) == geometry.envelope_bytes(1, version) for p in parts)
        assert join(parts) == data
        other = 3 - version
        back = transcode(transcode(data, other), version)
        assert len(back) == len(data)
        if version == 2:
            assert transcode(data, 1) == encode(
                geometry, [Block(b.hash, b.n_tokens, b.to_float32()) for b in env], 1
            )


@settings(max_examples=300, deadline=None)
@given(
    version=st.sampled_from([1, 2]),
    position=st.integers(0, 10_000),
    xor=st.integers(1, 255),
)
def test_every_single_byte_corruption_is_rejected(version: int, position: int, xor: int) -> None:
    data = bytearray(make_envelope(SMALL, 6, version))
    data[position % len(data)] ^= xor
    with pytest.raises(EnvelopeError):
        decode(bytes(data))


@pytest.mark.parametrize("version", [1, 2])
def test_exhaustive_byte_flips_and_truncations(version: int) -> None:
    data = make_envelope(Geometry(2, 1, 2, 2), 3, version)
    for i in range(len(data)):
        for xor in (0x01, 0x80, 0xFF):
            bad = bytearray(data)
            bad[i] ^= xor
            with pytest.raises(EnvelopeError):
                decode(bad)
    for cut in range(len(data)):
        with pytest.raises(EnvelopeError):
            decode(data[:cut])
    with pytest.raises(EnvelopeError):
        decode(data + b"\0")


def test_decoded_views_are_read_only_and_zero_copy(buffer_type: type) -> None:
    raw = bytearray(make_envelope(SMALL, 8))
    env = decode(raw if buffer_type is bytearray else buffer_type(raw))
    kv = env[1].kv
    with pytest.raises(ValueError):
        kv[0, 0, 0, 0, 0] = 1
    if buffer_type is not bytes:  # a view into the caller's bytearray sees its changes
        raw[28 + 12 + SMALL.record_bytes()] ^= 0xFF
        assert kv.view(np.uint8).reshape(-1)[0] == raw[28 + 12 + SMALL.record_bytes()]


def test_non_contiguous_buffers_are_refused_with_a_format_error() -> None:
    raw = np.frombuffer(make_envelope(SMALL, 2), dtype=np.uint8)
    strided = np.repeat(raw, 2)[::2]  # the same bytes, not contiguous
    assert strided.tobytes() == raw.tobytes() and not strided.flags.c_contiguous
    for data in (strided, strided.data, np.stack([raw, raw], axis=1)[:, 0]):
        with pytest.raises(FormatError, match="C-contiguous"):
            decode(data)
    assert decode(np.ascontiguousarray(strided)).hashes.tolist() == decode(raw).hashes.tolist()


def test_envelope_indexing() -> None:
    env = decode(make_envelope(SMALL, 10))
    assert len(env) == 3 and [b.n_tokens for b in env] == [4, 4, 2]
    assert env[-1].n_tokens == 2 and len(env[0:2]) == 2
    assert env.hashes.tolist() == [b.hash for b in env]
    with pytest.raises(IndexError):
        env[3]


def test_join_refuses_mixed_geometry_and_version() -> None:
    a = make_envelope(SMALL, 4)
    with pytest.raises(ShapeError):
        join([a, make_envelope(Geometry(4, 1, 1, 1), 4)])
    with pytest.raises(UnsupportedVersionError):
        join([a, make_envelope(SMALL, 4, 2)])
    with pytest.raises(ValueError):
        join([])


def test_transcode_v2_to_v1_overflow_is_refused() -> None:
    kv = np.full(SMALL.kv_shape, 1e6, dtype=np.float32)
    with pytest.raises(ValueError):
        transcode(encode(SMALL, [Block(0, 4, kv)], 2), 1)
