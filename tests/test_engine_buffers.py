"""kvstore.engines._buffers: a receive buffer is lent to one taker at a
time, used again once given back, and kept within its bounds."""

from __future__ import annotations

from kvstore.engines._buffers import KeptBuffers


def test_a_reserved_buffer_is_mapped_and_lent_first() -> None:
    bufs = KeptBuffers(keep=2, keep_bytes=1 << 20)
    bufs.reserve(1 << 16)
    a = bufs.take(1 << 15)
    assert a.nbytes == 1 << 16 and not a.any()  # written once at reserve: its pages mapped
    bufs.give(a)
    bufs.reserve(2 << 20)  # over keep_bytes: not kept
    assert bufs.take(1 << 16) is a
    bufs.reserve(0)
    assert bufs.take(1).nbytes == 1


def test_receive_buffers_are_used_again_within_their_bounds() -> None:
    bufs = KeptBuffers(keep=2, keep_bytes=1000)
    a = bufs.take(100)
    assert a.nbytes >= 100
    bufs.give(a)
    b = bufs.take(50)
    assert b is a  # the same memory: its pages stay mapped
    c = bufs.take(100)
    assert c is not a  # lent out: never handed to two takers
    bufs.give(b)
    bufs.give(c)
    big = bufs.take(5000)
    bufs.give(big)  # over keep_bytes: not kept
    assert bufs.take(5000) is not big
    d = bufs.take(900)
    bufs.give(d)  # the pool is full (a, c): the larger one replaces the smaller
    assert bufs.take(900) is d
