"""join_crc / join_crc_into in kvstore.codec._native: parts joined in C order with their
CRC-32C, against ``b"".join`` and independent CRCs (the ``crc32c`` package and the bytewise
oracle), with every kernel, contiguous and strided parts."""

from __future__ import annotations

import struct

import crc32c as crc32c_pkg
import numpy as np
import pytest
from crc_oracle import crc32c_oracle
from hypothesis import given, settings
from hypothesis import strategies as st

native = pytest.importorskip("kvstore.codec._native")

KERNELS = native.crc32c_kernels()


@pytest.mark.parametrize("kernel", [None, *KERNELS])
def test_join_crc_every_kernel(kernel: str | None, rand_bytes: bytes) -> None:
    mv = memoryview(rand_bytes)
    cases: list[list[object]] = [
        [],
        [b""],
        [b"", b"", b"abc"],
        [mv[1:29], mv[3:15], mv[7 : 7 + (2 << 20)]],  # an envelope's header, record, payload
        [mv[5 : 5 + n] for n in (1, 63, 64, 65, 255, 256, 1023, 1024, 1025, 4097)],
        [mv[:300_001], bytearray(rand_bytes[:77]), np.arange(1000, dtype=np.float16)],
        [mv[9 : 9 + (3 << 20) + 1]],
    ]
    for parts in cases:
        joined = b"".join(bytes(memoryview(p).cast("B")) for p in parts)  # type: ignore[arg-type]
        out = native.join_crc(parts, kernel)
        assert type(out) is bytes
        assert out == joined + struct.pack("<I", crc32c_pkg.crc32c(joined)), [len(p) for p in parts]  # type: ignore[arg-type]
        room = bytearray(len(out) + 3)
        assert native.join_crc_into(parts, room, kernel) == len(out)
        assert room == out + bytes(3)
    small = [mv[3:50], mv[60:1500]]
    joined = bytes(mv[3:50]) + bytes(mv[60:1500])
    assert native.join_crc(small, kernel)[-4:] == struct.pack("<I", crc32c_oracle(joined))
    assert native.join_crc(tuple(small), kernel) == native.join_crc(small, kernel)


def test_join_crc_bad_arguments() -> None:
    with pytest.raises(TypeError):
        native.join_crc(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        native.join_crc([b"ok", 5])
    strided = np.arange(100, dtype=np.uint8)[::2]  # read in C order, like a contiguous copy
    assert native.join_crc([b"ok", strided]) == native.join_crc([b"ok", strided.copy()])
    with pytest.raises(ValueError, match="no usable"):
        native.join_crc([b"x"], "no-such-kernel")
    with pytest.raises(TypeError):
        native.join_crc()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        native.join_crc_into([b"ok"])  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        native.join_crc_into([b"ok", 5], bytearray(10))
    with pytest.raises(ValueError, match="no usable"):
        native.join_crc_into([b"x"], bytearray(5), "no-such-kernel")
    with pytest.raises((BufferError, ValueError)):  # numpy's exporter raises ValueError
        native.join_crc_into([b"x"], np.zeros((4, 4), np.uint8)[:, ::2])  # not contiguous


def _join_oracle(parts: list[object]) -> bytes:
    body = b"".join(np.ascontiguousarray(p).tobytes() for p in parts)  # type: ignore[call-overload]
    return body + struct.pack("<I", crc32c_pkg.crc32c(body))


@settings(max_examples=200, deadline=None)
@given(
    shape=st.lists(st.integers(0, 5), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from(["<f2", "<f4", "u1"]),
)
def test_join_crc_of_strided_views_is_the_c_order_join_and_its_crc(
    shape: list[int], seed: int, dtype: str
) -> None:
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 255, size=shape).astype(dtype)
    views = [arr, arr.T, arr[::-1], arr[..., ::2], np.moveaxis(arr, 0, -1)]
    parts = [b"head", *views, bytearray(b"x" * (seed % 7)), memoryview(b"tail")]
    assert native.join_crc(parts) == _join_oracle(parts)
    room = bytearray(len(_join_oracle(parts)))
    assert native.join_crc_into(parts, room) == len(room) and room == _join_oracle(parts)


@pytest.mark.parametrize("kernel", KERNELS)
def test_join_crc_of_short_strided_runs_checksums_them_a_chunk_at_a_time(kernel: str) -> None:
    """Runs under 4 KiB are copied back to back and checksummed 32 KiB at a time, or a
    transposed tile (up to 256 KiB) at a time, read in the source's order: SGLang's
    layer_first and page_first pages seen as [L][2][H][B][D] (256-byte rows), tiles of rows
    that do not divide the chunk (100 and 4080 bytes), single strided bytes over several
    chunks, a transposed pair too large for a tile, and 4 KiB runs (one fused call per run)
    give the C-order join and its CRC with every kernel."""
    rng = np.random.default_rng(7)
    layer_first = rng.integers(0, 2**16, size=(2, 4, 16, 8, 128), dtype=np.uint16)
    page_first = rng.integers(0, 2**16, size=(2, 16, 4, 8, 128), dtype=np.uint16)
    rows = rng.integers(0, 255, size=(700, 3, 100), dtype=np.uint8)
    wide = rng.integers(0, 255, size=(3, 9, 4080), dtype=np.uint8)
    large = rng.integers(0, 255, size=(300, 10, 100), dtype=np.uint8)  # a 300 KB pair
    runs = rng.integers(0, 255, size=(2, 5, 4096), dtype=np.uint8)
    parts = [
        b"h" * 28,
        layer_first.transpose(1, 0, 3, 2, 4),  # [2][L][B][H][D] as [L][2][H][B][D]
        b"r" * 12,
        page_first.transpose(2, 0, 3, 1, 4),  # [2][B][L][H][D] as [L][2][H][B][D]
        rows.transpose(1, 0, 2),
        rows[:, :, ::2],
        wide.transpose(1, 0, 2),
        large.transpose(1, 0, 2),
        runs.transpose(1, 0, 2),
        b"t",
    ]
    want = _join_oracle(parts)
    assert native.join_crc(parts, kernel) == want
    room = bytearray(len(want) + 3)
    assert native.join_crc_into(parts, room, kernel) == len(want) and room[: len(want)] == want


def test_join_crc_of_large_parts_streams_the_same_bytes() -> None:
    # Above 8 MiB the copy uses streaming stores: same bytes, any alignment.
    rng = np.random.default_rng(1)
    big = rng.integers(0, 255, size=(8, 4096, 300), dtype=np.uint8)
    parts = [b"\x01" * 13, big[:, 17:4001], big[3], b"\x02" * 3]
    assert native.join_crc(parts) == _join_oracle(parts)
    room = np.empty(len(_join_oracle(parts)), np.uint8)
    assert native.join_crc_into(parts, room) == room.nbytes
    assert room.tobytes() == _join_oracle(parts)
    assert native.join_crc([]) == struct.pack("<I", 0)


def test_join_crc_refuses_what_is_not_a_buffer() -> None:
    with pytest.raises(TypeError):
        native.join_crc([b"ok", 3])
    with pytest.raises(TypeError):
        native.join_crc(5)
