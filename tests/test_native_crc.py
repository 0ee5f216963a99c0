"""The compiled CRC-32C kernels (kvstore.codec._native) against the ``crc32c`` package and
the bytewise oracle (``crc_oracle``): check values, every length to 5000 and every offset
for each kernel, large unaligned buffers, continuation, buffer types, bad arguments, and
threads running with the GIL released."""

from __future__ import annotations

import array
import mmap
import threading

import crc32c as crc32c_pkg
import numpy as np
import pytest
from crc_oracle import crc32c_oracle
from hypothesis import given, settings
from hypothesis import strategies as st

native = pytest.importorskip("kvstore.codec._native")

U32_MAX = (1 << 32) - 1


# ---------------------------------------------------------------------------- crc32c


def test_crc32c_check_values() -> None:
    assert native.crc32c(b"123456789") == 0xE3069283
    assert native.crc32c(b"") == 0
    assert native.crc32c(b"", 0xDEADBEEF) == 0xDEADBEEF
    assert native.crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4: 32 bytes of zeros
    assert native.crc32c(b"\xff" * 32) == 0x62A8AB43  # RFC 3720 B.4: 32 bytes of 0xFF


def test_crc32c_every_length_to_5000(rand_bytes: bytes) -> None:
    # Covers the serial path, the switch to the fused path and every tail length.
    for n in range(5001):
        off = n % 13
        data = rand_bytes[off : off + n]
        assert native.crc32c(data) == crc32c_pkg.crc32c(data), n
    for n in range(0, 5001, 17):
        data = rand_bytes[:n]
        assert native.crc32c(data, 0x9ABCDEF0) == crc32c_pkg.crc32c(data, 0x9ABCDEF0), n


KERNELS = native.crc32c_kernels()


def test_crc32c_kernels_dispatch() -> None:
    assert KERNELS and KERNELS[-1] == "slicing-by-8"  # the portable one is always there
    assert native.crc32c_kernel() == KERNELS[0]  # the best this CPU can run is the one used
    assert len(set(KERNELS)) == len(KERNELS)
    known = ["vpclmulqdq-avx512", "vpclmulqdq-avx2", "sse4.2-pclmul", "slicing-by-8"]
    assert [k for k in known if k in KERNELS] == KERNELS  # best first


@pytest.mark.parametrize("kernel", KERNELS)
def test_crc32c_every_kernel_small_lengths_and_offsets(kernel: str, rand_bytes: bytes) -> None:
    for off in range(9):
        for n in range(301):
            data = rand_bytes[off : off + n]
            assert native.crc32c_with(kernel, data) == crc32c_oracle(data), (off, n)
    for n in range(0, 301, 7):
        data = rand_bytes[5 : 5 + n]
        want = crc32c_oracle(data, 0x9ABCDEF0)
        assert native.crc32c_with(kernel, data, 0x9ABCDEF0) == want, n


@pytest.mark.parametrize("kernel", KERNELS)
def test_crc32c_every_kernel_to_5000(kernel: str, rand_bytes: bytes) -> None:
    # Every length through the switch to the wide/fused paths and every tail after them.
    for n in range(301, 5001):
        off = n % 61
        data = rand_bytes[off : off + n]
        assert native.crc32c_with(kernel, data) == crc32c_pkg.crc32c(data), n
    data = rand_bytes[3:4100]
    assert native.crc32c_with(kernel, data, 7) == crc32c_oracle(data, 7)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(
    "n", [1024, 1279, 1280, 1281, 65537, (2 << 20) + 1, (2 << 20) + 63, (3 << 20) + 1]
)
@pytest.mark.parametrize("off", [0, 1, 31, 63])
def test_crc32c_every_kernel_large(kernel: str, rand_bytes: bytes, n: int, off: int) -> None:
    view = memoryview(rand_bytes)[off : off + n]
    assert len(view) == n
    assert native.crc32c_with(kernel, view) == crc32c_pkg.crc32c(view)
    assert native.crc32c_with(kernel, view, 12345) == crc32c_pkg.crc32c(view, 12345)


@pytest.mark.parametrize("kernel", KERNELS)
def test_crc32c_every_kernel_large_against_python(kernel: str, rand_bytes: bytes) -> None:
    data = rand_bytes[7 : 7 + (256 << 10) + 77]  # the Python oracle runs at ~5 MB/s
    assert native.crc32c_with(kernel, data, 99) == crc32c_oracle(data, 99)
    a, b = data[:100_003], data[100_003:]
    assert native.crc32c_with(kernel, b, native.crc32c_with(kernel, a)) == crc32c_oracle(data)


def test_crc32c_with_bad_arguments() -> None:
    with pytest.raises(ValueError, match="no usable"):
        native.crc32c_with("no-such-kernel", b"x")
    with pytest.raises(TypeError):
        native.crc32c_with(1, b"x")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        native.crc32c_with()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        native.crc32c_with(KERNELS[0])  # type: ignore[call-arg]
    with pytest.raises((BufferError, ValueError)):
        native.crc32c_with(KERNELS[0], np.arange(100, dtype=np.uint8)[::2])


@pytest.mark.parametrize(
    "n",
    [
        1 << 20,
        (1 << 20) + 1,
        (1 << 20) + 7,
        (1 << 20) + 135,
        (1 << 20) - 3,
        65535,
        65536,
        65537,
        136 * 2048,  # exactly one full fused pass
        136 * 2048 + 1,
        136 * 2048 - 1,
        136 * 4096 + 255,
        2 << 20,
        (3 << 20) + 5,
    ],
)
@pytest.mark.parametrize("off", [0, 1, 3, 8, 13])
def test_crc32c_large_unaligned(rand_bytes: bytes, n: int, off: int) -> None:
    view = memoryview(rand_bytes)[off : off + n]
    assert len(view) == n
    assert native.crc32c(view) == crc32c_pkg.crc32c(view)
    assert native.crc32c(view, 12345) == crc32c_pkg.crc32c(view, 12345)


@settings(max_examples=300, deadline=None)
@given(a=st.binary(max_size=3000), b=st.binary(max_size=3000), crc=st.integers(0, U32_MAX))
def test_crc32c_continuation(a: bytes, b: bytes, crc: int) -> None:
    assert native.crc32c(b, native.crc32c(a)) == native.crc32c(a + b)
    assert native.crc32c(b, native.crc32c(a, crc)) == native.crc32c(a + b, crc)
    assert native.crc32c(a + b, crc) == crc32c_pkg.crc32c(a + b, crc)


def test_crc32c_continuation_large(rand_bytes: bytes) -> None:
    data = rand_bytes[: 2 << 20]
    whole = native.crc32c(data)
    for cut in (0, 1, 255, 4096, 300_001, len(data) - 1, len(data)):
        assert native.crc32c(data[cut:], native.crc32c(data[:cut])) == whole


@pytest.mark.parametrize("crc", [-1, 1 << 32, (1 << 32) + 5, (1 << 64) + 7, -(1 << 40)])
def test_crc32c_initial_value_is_taken_mod_2_32_like_the_package(crc: int) -> None:
    assert native.crc32c(b"hello", crc) == crc32c_pkg.crc32c(b"hello", crc)
    assert native.crc32c(b"hello", crc) == native.crc32c(b"hello", crc % (1 << 32))


def test_crc32c_buffer_types(rand_bytes: bytes, tmp_path) -> None:
    data = rand_bytes[:100_003]
    want = crc32c_pkg.crc32c(data)
    arr = np.frombuffer(data[:100_000], dtype=np.uint8)
    inputs = [
        data,
        bytearray(data),
        memoryview(data),
        memoryview(bytearray(data)),
        np.frombuffer(data, dtype=np.uint8),
    ]
    for obj in inputs:
        assert native.crc32c(obj) == want
    # Multi-byte items and 2-D C-contiguous arrays are hashed as their raw bytes.
    want_100k = crc32c_pkg.crc32c(data[:100_000])
    assert native.crc32c(arr.view(np.float32)) == want_100k
    assert native.crc32c(arr.view(np.uint16).reshape(500, 100)) == want_100k
    assert native.crc32c(array.array("B", data)) == want
    path = tmp_path / "blob"
    path.write_bytes(data)
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        assert native.crc32c(mm) == want


def test_crc32c_non_contiguous_raises() -> None:
    base = np.arange(4096, dtype=np.uint8)
    for obj in (
        memoryview(bytes(range(256)))[::2],
        base[::2],
        base.reshape(64, 64)[:, :10],
        np.asfortranarray(base.reshape(64, 64)),
    ):
        with pytest.raises((BufferError, ValueError)):
            native.crc32c(obj)


def test_crc32c_bad_arguments() -> None:
    with pytest.raises(TypeError):
        native.crc32c("text")
    with pytest.raises(TypeError):
        native.crc32c(b"x", 1.5)
    with pytest.raises(TypeError):
        native.crc32c()
    with pytest.raises(TypeError):
        native.crc32c(b"x", 0, 0)


def test_crc32c_threads_with_gil_released(rand_bytes: bytes) -> None:
    data = rand_bytes[: 1 << 20]
    want = crc32c_pkg.crc32c(data)
    results: list[int] = []

    def work() -> None:
        for _ in range(20):
            results.append(native.crc32c(data))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [want] * 80
