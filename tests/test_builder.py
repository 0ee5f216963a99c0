"""kvstore.codec.builder: BytesBuilder (compiled and portable) fills one bytes object."""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.codec import builder
from kvstore.codec.checksum import crc32c

try:
    from kvstore.codec import _native
except ImportError:  # pragma: no cover - only where the build had no compiler
    _native = None  # type: ignore[assignment]

IMPLS: list[Any] = [builder.PyBytesBuilder]
if _native is not None:
    IMPLS.append(_native.BytesBuilder)


@pytest.fixture(params=IMPLS, ids=lambda c: c.__module__)
def impl(request: pytest.FixtureRequest) -> Any:
    return request.param


def test_the_compiled_builder_is_used_when_built() -> None:
    if _native is None:  # pragma: no cover
        pytest.skip("no compiled module in this build")
    assert builder.BytesBuilder is _native.BytesBuilder


@pytest.mark.parametrize("capacity", [0, 1, 7, 1 << 20])
@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_appends_patches_and_finishes(impl: Any, capacity: int, kind: Any) -> None:
    big = np.random.default_rng(1).integers(0, 256, 300_000, dtype=np.uint8)
    b = impl(capacity)
    assert len(b) == 0
    assert b.write(kind(b"head")) == 4
    assert b.write(big) == 4 + big.size  # a large part (copied without the GIL)
    assert b.write(kind(b"")) == 4 + big.size
    b.write(kind(b"tail"))
    b.write_at(1, kind(b"EA"))
    b.write_at(4, big[:5][::-1].copy())
    assert len(b) == 8 + big.size
    out = b.finish()
    assert type(out) is bytes
    assert out == b"hEAd" + bytes(big[:5][::-1]) + big[5:].tobytes() + b"tail"
    assert hash(out) == hash(bytes(out))  # an ordinary bytes object


def test_finish_gives_the_only_reference(impl: Any) -> None:
    b = impl(1 << 16)
    b.write(b"x" * 100)
    out = b.finish()
    assert out == b"x" * 100
    assert sys.getrefcount(out) == 2  # `out` and getrefcount's argument


def test_spent_and_refused(impl: Any) -> None:
    with pytest.raises(ValueError, match="capacity"):
        impl(-1)
    b = impl(4)
    b.write(b"ab")
    for offset, data in [(-1, b"a"), (1, b"xy"), (3, b"")]:
        with pytest.raises(ValueError, match="not within"):
            b.write_at(offset, data)
    with pytest.raises((BufferError, TypeError, ValueError)):  # as the exporter refuses
        b.write(np.zeros((4, 4))[:, 0])  # not C-contiguous
    assert len(b) == 2
    assert b.finish() == b"ab"
    for call in (lambda: b.write(b"x"), lambda: b.write_at(0, b""), b.finish):
        with pytest.raises(ValueError, match="finished"):
            call()
    assert impl().finish() == b""


def test_concurrent_copies_are_refused_not_raced() -> None:
    if _native is None:  # pragma: no cover
        pytest.skip("no compiled module in this build")
    b = _native.BytesBuilder(0)
    part = np.ones(64 << 20, dtype=np.uint8)
    refused: list[BaseException] = []
    done = threading.Event()

    def other() -> None:
        while not done.is_set():
            try:
                b.write(b"!")
            except RuntimeError as exc:
                refused.append(exc)

    t = threading.Thread(target=other)
    t.start()
    try:
        for _ in range(8):
            b.write(part)
    finally:
        done.set()
        t.join()
    out = b.finish()
    # every write either landed whole or was refused; the big parts are intact
    assert len(out) == 8 * part.size + out.count(b"!")
    assert out.replace(b"!", b"") == b"\x01" * (8 * part.size)
    assert all("in use by another thread" in str(e) for e in refused)


@given(st.lists(st.binary(max_size=300), max_size=20), st.integers(0, 2000))
def test_same_bytes_as_a_join(parts: list[bytes], capacity: int) -> None:
    for impl in IMPLS:
        b = impl(capacity)
        for p in parts:
            b.write(p)
        assert b.finish() == b"".join(parts)


@given(
    st.lists(st.binary(max_size=300), max_size=20),
    st.integers(0, 2000),
    st.integers(0, 2**32 - 1),
)
def test_write_crc_appends_and_checksums_like_crc32c(
    parts: list[bytes], capacity: int, seed: int
) -> None:
    for impl in IMPLS:
        b = impl(capacity)
        crc = seed
        for p in parts:
            crc = b.write_crc(p, crc)
        assert b.finish() == b"".join(parts)
        assert crc == crc32c(b"".join(parts), seed)


def test_write_crc_of_large_parts(impl: Any) -> None:
    rng = np.random.default_rng(2)
    parts = [rng.integers(0, 256, n, dtype=np.uint8) for n in (1 << 20, 3, (1 << 17) + 5)]
    b = impl(1000)
    b.write(b"head")
    crcs = [b.write_crc(p) for p in parts]  # each from 0 (the default)
    assert crcs == [crc32c(p) for p in parts]
    assert b.write_crc(parts[0], crcs[0]) == crc32c(parts[0].tobytes() * 2)
    assert b.finish() == b"head" + b"".join(p.tobytes() for p in parts) + parts[0].tobytes()
    spent = impl()
    spent.finish()
    with pytest.raises(ValueError, match="finished"):
        spent.write_crc(b"x")


@pytest.mark.parametrize("capacity", [0, 10, 1 << 20])
def test_a_view_is_filled_in_place_then_counted(impl: Any, capacity: int) -> None:
    big = np.random.default_rng(3).integers(0, 256, 300_000, dtype=np.uint8)
    b = impl(capacity)
    b.write(b"head")
    view = b.view(big.size)  # a large view: its pages populated first (compiled)
    assert len(view) == big.size and not view.readonly
    view[:] = big.data
    del view
    assert len(b) == 4  # not counted until advanced
    assert b.advance(big.size) == 4 + big.size
    with b.view(3) as small:
        small[:] = b"abc"
    assert b.advance(2) == 6 + big.size  # a part of the room: the rest is not written
    b.write(b"tail")
    out = b.finish()
    assert type(out) is bytes
    assert out == b"head" + big.tobytes() + b"ab" + b"tail"
    assert hash(out) == hash(bytes(out))


def test_a_held_view_blocks_what_would_move_the_bytes(impl: Any) -> None:
    b = impl(4)
    b.write(b"ab")
    view = b.view(2)
    view[:] = b"cd"
    with pytest.raises(BufferError):
        b.write(b"x" * 100)  # would grow the object under the view
    with pytest.raises(BufferError):
        b.finish()
    part = view[1:]  # a slice of the view is an export too
    view.release()
    with pytest.raises(BufferError):
        b.finish()
    part.release()
    assert b.advance(2) == 4
    assert b.finish() == b"abcd"


def test_view_and_advance_refuse_what_is_out_of_range(impl: Any) -> None:
    b = impl(8)
    with pytest.raises(ValueError, match="n must be >= 0"):
        b.view(-1)
    b.view(3).release()
    for n in (-1, 1 << 20):
        with pytest.raises(ValueError, match="not within"):
            b.advance(n)
    assert len(b) == 0
    assert b.finish() == b""
    for call in (lambda: b.view(1), lambda: b.advance(0)):
        with pytest.raises(ValueError, match="finished"):
            call()
