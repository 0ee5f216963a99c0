"""CRC-32C: the check value, continuation, every buffer type, agreement with a reference."""

from __future__ import annotations

import mmap

import crc32c as crc32c_pkg
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import crc32c
from kvstore.codec import checksum


def test_check_value() -> None:
    assert crc32c(b"123456789") == 0xE3069283


def test_spec_envelope_crc() -> None:
    body = bytes.fromhex(
        "544c4b56010001000100000002000000010000000100000002000000"
        "66937b02c1b01aa902000000"
        "003c0040004200440038 00bc00000034".replace(" ", "")
    )
    assert crc32c(body) == 0x4F0B541C


def test_buffer_types(buffer_type: type) -> None:
    data = bytes(range(256)) * 3
    assert crc32c(buffer_type(data)) == crc32c_pkg.crc32c(data)


def test_numpy_and_mmap() -> None:
    arr = np.arange(1000, dtype=np.float16)
    assert crc32c(arr) == crc32c_pkg.crc32c(arr.tobytes())
    with mmap.mmap(-1, 4096) as m:
        m.write(b"x" * 4096)
        assert crc32c(m) == crc32c_pkg.crc32c(b"x" * 4096)


def test_non_contiguous_is_refused() -> None:
    arr = np.arange(100, dtype=np.uint8)[::2]
    with pytest.raises((BufferError, ValueError)):
        crc32c(arr)


@settings(max_examples=200, deadline=None)
@given(a=st.binary(max_size=3000), b=st.binary(max_size=3000))
def test_continuation_and_reference(a: bytes, b: bytes) -> None:
    assert crc32c(a + b) == crc32c_pkg.crc32c(a + b)
    assert crc32c(b, crc32c(a)) == crc32c(a + b)


def test_large_unaligned_slices() -> None:
    data = np.random.default_rng(1).integers(0, 256, (1 << 20) + 13, dtype=np.uint8).tobytes()
    mv = memoryview(data)
    for start in (0, 1, 3, 7):
        assert crc32c(mv[start:]) == crc32c_pkg.crc32c(data[start:])


def test_kernel_is_named_and_is_the_one_used(monkeypatch: pytest.MonkeyPatch) -> None:
    native = pytest.importorskip("kvstore.codec._native")
    if native.crc32c_kernel() != checksum.PORTABLE_KERNEL:
        assert native.crc32c_kernel() == checksum.KERNEL
        assert checksum._crc32c is native.crc32c
    assert checksum.KERNEL in {*native.crc32c_kernels(), "crc32c-package"}


def test_kernel_choice_without_a_hardware_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    class Portable:
        crc32c = staticmethod(crc32c_pkg.crc32c)

        @staticmethod
        def crc32c_kernel() -> str:
            return checksum.PORTABLE_KERNEL

    monkeypatch.setattr(checksum, "_native", Portable)
    monkeypatch.setattr(crc32c_pkg, "hardware_based", True)
    assert checksum._choose() == (crc32c_pkg.crc32c, "crc32c-package")
    monkeypatch.setattr(crc32c_pkg, "hardware_based", False)
    assert checksum._choose() == (Portable.crc32c, "slicing-by-8")
    monkeypatch.setattr(checksum, "_native", None)
    monkeypatch.setattr(crc32c_pkg, "hardware_based", True)
    assert checksum._choose() == (crc32c_pkg.crc32c, "crc32c-package")


@pytest.mark.parametrize("sizes", [[], [0], [28, 12, 4096], [28, 12, 100_003, 5]])
def test_join_crc_into_writes_join_crcs_bytes_and_nothing_past_them(
    sizes: list[int], join: str
) -> None:
    rng = np.random.default_rng(sum(sizes) + 1)
    arr = rng.integers(0, 256, (3, 40), dtype=np.uint8)
    parts = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes] + [arr[:, ::3]]
    want = checksum.join_crc(parts)
    out = bytearray(b"\xab") * (len(want) + 5)
    assert checksum.join_crc_into(parts, out) == len(want)
    assert bytes(out[: len(want)]) == want and out[len(want) :] == b"\xab" * 5
    into_array = np.zeros(len(want), np.uint8)  # exactly the size, a numpy buffer
    assert checksum.join_crc_into(parts, into_array) == len(want)
    assert into_array.tobytes() == want


def test_join_crc_into_refuses_a_short_read_only_or_overlapping_out(join: str) -> None:
    parts = [b"head", np.arange(100, dtype=np.uint8)[::2]]
    short = bytearray(b"\xab") * 57  # 54 bytes and their CRC need 58
    with pytest.raises(ValueError, match="out holds 57 bytes, the parts and their CRC 58"):
        checksum.join_crc_into(parts, short)
    assert short == b"\xab" * 57
    with pytest.raises(BufferError):
        checksum.join_crc_into(parts, bytes(100))
    shared = np.arange(200, dtype=np.uint8)
    before = shared.copy()
    # 10 bytes after b"head": the result is out's first 18 bytes; a part reaching into them
    for part in (shared[5:15], shared[::7], shared[17:7:-1]):  # inside, strided, reversed
        with pytest.raises(ValueError, match="part 1 overlaps out"):
            checksum.join_crc_into([b"head", part], shared)
        assert np.array_equal(shared, before)
    assert checksum.join_crc_into([b"head", shared[180:190]], shared) == 18  # past them: fine
    assert shared[:18].tobytes() == checksum.join_crc([b"head", before[180:190]])


@pytest.mark.parametrize("sizes", [[], [0], [28, 12, 4096], [28, 12, 100_003, 5]])
def test_join_crc_native_and_fallback(sizes: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(sum(sizes))
    parts = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    joined = b"".join(parts)
    want = joined + crc32c_pkg.crc32c(joined).to_bytes(4, "little")
    assert checksum.join_crc(parts) == want
    monkeypatch.setattr(checksum, "_native", None)  # the pure-Python path
    assert checksum.join_crc(parts) == want
