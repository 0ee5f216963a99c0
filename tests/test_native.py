"""The compiled kernels in kvstore.codec._native against independent oracles.

fnv1a64/fnv_chain against the tiny pure-Python loops below (not kvstore.codec.hashing, so a
shared mistake cannot hide); u64_list against ``struct``; f16_finite against
``np.isfinite``. crc32c (test_native_crc) and join_crc (test_native_join) have modules of
their own.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

native = pytest.importorskip("kvstore.codec._native")

FNV_BASIS = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
U64 = (1 << 64) - 1
U32_MAX = (1 << 32) - 1


def fnv1a64_oracle(data: bytes, h: int = FNV_BASIS) -> int:
    for byte in data:
        h = ((h ^ byte) * FNV_PRIME) & U64
    return h


def fnv_chain_oracle(tokens: list[int], block_tokens: int, parent: int = 0) -> list[int]:
    out = []
    for i in range(len(tokens) // block_tokens):
        block = tokens[i * block_tokens : (i + 1) * block_tokens]
        parent = fnv1a64_oracle(struct.pack("<Q", parent) + struct.pack(f"<{len(block)}I", *block))
        parent = parent or 1
        out.append(parent)
    return out


def chain(tokens: object, block_tokens: int, parent: int = 0) -> list[int]:
    return np.frombuffer(native.fnv_chain(tokens, block_tokens, parent), dtype="<u8").tolist()


# ---------------------------------------------------------------------------- fnv1a64


def test_fnv1a64_values() -> None:
    assert native.fnv1a64(b"a") == 0xAF63DC4C8601EC8C
    assert native.fnv1a64(b"") == FNV_BASIS
    assert native.fnv1a64(b"", 5) == 5
    assert native.fnv1a64(b"", 0) == 0  # no 0 -> 1 replacement here


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=600), h=st.integers(0, U64))
def test_fnv1a64_matches_oracle(data: bytes, h: int) -> None:
    assert native.fnv1a64(data) == fnv1a64_oracle(data)
    assert native.fnv1a64(data, h) == fnv1a64_oracle(data, h)
    cut = len(data) // 3
    assert native.fnv1a64(data[cut:], native.fnv1a64(data[:cut], h)) == native.fnv1a64(data, h)


def test_fnv1a64_large_and_buffer_types(rand_bytes: bytes) -> None:
    data = rand_bytes[:40_000]  # above the GIL-release threshold
    want = fnv1a64_oracle(data)
    for obj in (data, bytearray(data), memoryview(data), np.frombuffer(data, np.uint8)):
        assert native.fnv1a64(obj) == want


def test_fnv1a64_bad_arguments() -> None:
    for h in (-1, 1 << 64):
        with pytest.raises(ValueError):
            native.fnv1a64(b"x", h)
    with pytest.raises((BufferError, ValueError)):
        native.fnv1a64(memoryview(b"abcdef")[::2])


# ---------------------------------------------------------------------------- fnv_chain


def test_fnv_chain_spec_example() -> None:
    toks = np.array([1, 2, 3, 4, 5], dtype="<u4")
    assert chain(toks, 2) == [0xA91AB0C1027B9366, 0x03DF829571605C60]
    raw = native.fnv_chain(toks, 2)
    assert isinstance(raw, bytes)
    assert raw == struct.pack("<2Q", 0xA91AB0C1027B9366, 0x03DF829571605C60)
    # Continuing from the first hash gives the second.
    assert chain(toks[2:], 2, 0xA91AB0C1027B9366) == [0x03DF829571605C60]


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(
        st.one_of(st.integers(0, U32_MAX), st.sampled_from([0, 1, U32_MAX, U32_MAX - 1])),
        max_size=200,
    ),
    block_tokens=st.integers(1, 20),
    parent=st.one_of(st.integers(0, U64), st.sampled_from([0, 1, U64])),
)
def test_fnv_chain_matches_oracle(tokens: list[int], block_tokens: int, parent: int) -> None:
    want = fnv_chain_oracle(tokens, block_tokens, parent)
    arr = np.array(tokens, dtype="<u4")
    assert chain(arr, block_tokens, parent) == want
    assert chain(arr.tobytes(), block_tokens, parent) == want
    assert chain(bytearray(arr.tobytes()), block_tokens, parent) == want
    if parent == 0:
        assert chain(arr, block_tokens) == want


def test_fnv_chain_large_matches_oracle() -> None:
    toks = np.random.default_rng(7).integers(0, 1 << 32, 131_072 + 5, dtype=np.uint64)
    arr = toks.astype("<u4")
    got = chain(arr, 16, 0x1234)
    assert len(got) == 131_072 // 16
    # The oracle is slow: spot-check the first blocks and a chained suffix.
    assert got[:50] == fnv_chain_oracle(arr[:800].tolist(), 16, 0x1234)
    assert got[-3:] == fnv_chain_oracle(arr[-5 - 48 : -5].tolist(), 16, got[-4])


def test_fnv_chain_partial_and_empty() -> None:
    toks = np.arange(10, dtype="<u4")
    assert native.fnv_chain(toks, 11) == b""
    assert native.fnv_chain(toks, 1 << 62) == b""
    assert native.fnv_chain(b"", 4) == b""
    assert chain(toks, 3) == fnv_chain_oracle(list(range(10)), 3)
    assert chain(toks, 10) == fnv_chain_oracle(list(range(10)), 10)


def test_fnv_chain_bad_arguments() -> None:
    toks = np.arange(8, dtype="<u4")
    for b in (0, -1):
        with pytest.raises(ValueError):
            native.fnv_chain(toks, b)
    with pytest.raises(ValueError):
        native.fnv_chain(b"\x00" * 6, 1)  # not a whole number of u32
    for parent in (-1, 1 << 64):
        with pytest.raises(ValueError):
            native.fnv_chain(toks, 2, parent)
    with pytest.raises((BufferError, ValueError)):
        native.fnv_chain(np.arange(16, dtype="<u4")[::2], 2)
    with pytest.raises(TypeError):
        native.fnv_chain(toks)


def chain_list(tokens: list[int] | tuple[int, ...], *args: int) -> list[int] | None:
    out = native.fnv_chain_list(tokens, *args)
    return None if out is None else list(struct.unpack(f"<{len(out) // 8}Q", out))


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, U32_MAX), max_size=200),
    block_tokens=st.integers(1, 20),
    parent=st.one_of(st.integers(0, U64), st.sampled_from([0, 1, U64])),
)
def test_fnv_chain_list_matches_oracle(tokens: list[int], block_tokens: int, parent: int) -> None:
    want = fnv_chain_oracle(tokens, block_tokens, parent)
    assert chain_list(tokens, block_tokens, parent) == want
    assert chain_list(tuple(tokens), block_tokens, parent) == want
    if parent == 0:
        assert chain_list(tokens, block_tokens) == want


def test_fnv_chain_list_large_equals_buffer_kernel() -> None:
    toks = np.random.default_rng(8).integers(0, 1 << 32, 131_072 + 5, dtype=np.uint64)
    assert native.fnv_chain_list(toks.tolist(), 16, 7) == native.fnv_chain(
        toks.astype("<u4"), 16, 7
    )


@pytest.mark.parametrize(
    "bad", [-1, 1 << 32, 1 << 64, -(1 << 70), True, 1.0, np.uint32(1), "1", None, [1]]
)
@pytest.mark.parametrize("where", [0, 5, 9])  # a full block, the last full one, the tail
def test_fnv_chain_list_declines_anything_but_u32_ints(bad: object, where: int) -> None:
    toks: list[object] = list(range(10))
    toks[where] = bad
    assert native.fnv_chain_list(toks, 3) is None
    assert native.fnv_chain_list(tuple(toks), 3) is None


def test_fnv_chain_list_bad_arguments() -> None:
    for b in (0, -1):
        with pytest.raises(ValueError):
            native.fnv_chain_list([1, 2], b)
    for parent in (-1, 1 << 64):
        with pytest.raises(ValueError):
            native.fnv_chain_list([1, 2], 2, parent)
    for not_a_list in (np.arange(4), range(4), b"1234", iter([1, 2])):
        with pytest.raises(TypeError):
            native.fnv_chain_list(not_a_list, 2)  # type: ignore[arg-type]
    assert native.fnv_chain_list([], 4) == b""
    assert native.fnv_chain_list([1, 2, 3], 1 << 62) == b""


# ------------------------------------------------------------------------------ u64_list


@settings(max_examples=200, deadline=None)
@given(hashes=st.lists(st.one_of(st.integers(0, U64), st.sampled_from([0, 1, U64])), max_size=300))
def test_u64_list_is_the_little_endian_u64_array(hashes: list[int]) -> None:
    want = struct.pack(f"<{len(hashes)}Q", *hashes)
    assert native.u64_list(hashes) == want
    assert native.u64_list(tuple(hashes)) == want


@pytest.mark.parametrize(
    "bad",
    [-1, 1 << 64, -(1 << 70), True, False, 1.0, np.uint64(1), "1", "00000000000000ff", None, [1]],
)
@pytest.mark.parametrize("where", [0, 4, 9])
def test_u64_list_declines_anything_but_u64_ints(bad: object, where: int) -> None:
    items: list[object] = list(range(10))
    items[where] = bad
    assert native.u64_list(items) is None
    assert native.u64_list(tuple(items)) is None


def test_u64_list_bad_arguments() -> None:
    for not_a_list in (np.arange(4), range(4), b"1234", iter([1, 2]), {1}):
        with pytest.raises(TypeError):
            native.u64_list(not_a_list)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        native.u64_list()  # type: ignore[call-arg]
    assert native.u64_list([]) == b""


# ---------------------------------------------------------------------------- f16_finite


def np_finite(arr: np.ndarray) -> bool:
    return bool(np.isfinite(arr.view(np.float16)).all())


def test_f16_finite_every_bit_pattern() -> None:
    patterns = np.arange(1 << 16, dtype=np.uint16)
    expect = np.isfinite(patterns.view(np.float16))
    got = np.array([native.f16_finite(p.tobytes()) for p in patterns])
    assert (got == expect).all()
    assert native.f16_finite(patterns[expect]) is True
    assert native.f16_finite(patterns) is False


SPECIALS = [np.inf, -np.inf, np.nan, -np.nan]
SPECIAL_BITS = [0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFFFF, 0x7FFF]


@settings(max_examples=400, deadline=None)
@given(
    n=st.integers(0, 3000),
    seed=st.integers(0, 2**32 - 1),
    n_bad=st.integers(0, 3),
    bad_last=st.booleans(),
)
def test_f16_finite_matches_numpy(n: int, seed: int, n_bad: int, bad_last: bool) -> None:
    rng = np.random.default_rng(seed)
    arr = (rng.standard_normal(n) * 1000).astype(np.float16)
    bits = arr.view(np.uint16)
    if n:
        for _ in range(n_bad):
            bits[rng.integers(0, n)] = rng.choice(SPECIAL_BITS)
        if bad_last:
            bits[-1] = rng.choice(SPECIAL_BITS)
    assert native.f16_finite(arr) is np_finite(arr)
    assert native.f16_finite(arr.tobytes()) is np_finite(arr)


@pytest.mark.parametrize("n", [1, 63, 64, 65, 2047, 2048, 2049, 32_768, 1 << 20, (1 << 20) + 3])
def test_f16_finite_positions(n: int) -> None:
    # Non-finite values at the edges of every processing unit (8 B words, 128 B vector
    # steps, 4 KiB chunks) and of the array, in arrays both below and above the GIL
    # threshold.
    base = np.full(n, 65504.0, dtype=np.float16)  # largest finite value
    assert native.f16_finite(base) is True
    positions = {0, n - 1, n // 2}
    for edge in (4, 64, 2048):
        for k in range(1, min(n // edge, 4) + 1):
            positions |= {edge * k - 1, edge * k}
    for pos in sorted(p for p in positions if 0 <= p < n):
        for value in SPECIALS:
            arr = base.copy()
            arr[pos] = value
            assert native.f16_finite(arr) is False, (n, pos, value)


def test_f16_finite_buffer_types_and_errors() -> None:
    arr = np.linspace(-10, 10, 1001, dtype=np.float16)
    assert native.f16_finite(arr) is True
    assert native.f16_finite(memoryview(arr.tobytes())) is True
    assert native.f16_finite(bytearray(arr.tobytes())) is True
    assert native.f16_finite(arr.reshape(7, 143)) is True
    assert native.f16_finite(b"") is True
    with pytest.raises(ValueError):
        native.f16_finite(b"\x00\x00\x00")
    with pytest.raises((BufferError, ValueError)):
        native.f16_finite(arr[::2])
    with pytest.raises((BufferError, ValueError)):
        native.f16_finite(np.asfortranarray(arr[:1000].reshape(10, 100)))


def test_docstrings() -> None:
    for name in (
        "crc32c",
        "crc32c_kernel",
        "crc32c_kernels",
        "crc32c_with",
        "join_crc",
        "join_crc_into",
        "fnv1a64",
        "fnv_chain",
        "fnv_chain_list",
        "u64_list",
        "f16_finite",
    ):
        assert getattr(native, name).__doc__
