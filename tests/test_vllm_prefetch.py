"""kvstore.engines._vllm_prefetch without vLLM: a fetch ahead starts only for an engine
whose worker is in this process, is handed over once and only for the blocks asked for,
is dropped when not taken, and stays within its byte bound."""

from __future__ import annotations

import threading

import pytest

from kvstore.engines._vllm_prefetch import Prefetches


def test_nothing_is_fetched_ahead_without_a_worker_of_the_engine_here() -> None:
    p = Prefetches()
    ran = threading.Event()
    assert not p.start("e1", "r1", [1, 2], 10, ran.set)
    p.add_worker("e2")  # another engine's worker
    assert not p.start("e1", "r1", [1, 2], 10, ran.set)
    assert not ran.wait(0.2) and p.held() == (0, 0)
    assert p.take("e1", "r1", [1, 2]) is None


def test_a_fetch_ahead_is_handed_over_once_for_exactly_its_blocks() -> None:
    p = Prefetches()
    p.add_worker("e")
    assert p.start("e", "r", [1, 2, 3], 300, lambda: b"answer")
    assert p.held() == (1, 300)
    assert p.take("e", "other", [1, 2, 3]) is None  # another request's
    future = p.take("e", "r", [1, 2, 3])
    assert future is not None and future.result(5) == b"answer"
    assert p.take("e", "r", [1, 2, 3]) is None and p.held() == (0, 0)
    assert p.start("e", "r", [1, 2, 3], 300, lambda: b"answer")
    assert p.take("e", "r", [1, 2]) is None  # other blocks planned: the worker fetches
    assert p.held() == (0, 0)


def test_a_new_plan_replaces_the_fetch_and_drop_forgets_it() -> None:
    p = Prefetches()
    p.add_worker("e")
    assert p.start("e", "r", [1], 100, lambda: "first")
    assert p.start("e", "r", [1, 2], 200, lambda: "second")
    assert p.held() == (1, 200)
    future = p.take("e", "r", [1, 2])
    assert future is not None and future.result(5) == "second"
    assert p.start("e", "r", [1], 100, lambda: "x")
    p.drop("e", "r")
    p.drop("e", "r")  # twice is fine
    assert p.held() == (0, 0) and p.take("e", "r", [1]) is None


def test_the_byte_bound_holds_and_frees_as_fetches_are_taken() -> None:
    p = Prefetches(max_bytes=1000)
    p.add_worker("e")
    assert p.start("e", "a", [1], 600, lambda: 1)
    assert not p.start("e", "b", [2], 600, lambda: 2)  # 1200 > 1000: the worker fetches
    assert p.start("e", "c", [3], 400, lambda: 3)
    assert p.held() == (2, 1000)
    assert p.take("e", "a", [1]) is not None
    assert p.start("e", "b", [2], 600, lambda: 2)


def test_a_failed_fetch_reaches_the_worker_as_its_exception() -> None:
    p = Prefetches()
    p.add_worker("e")

    def fail() -> bytes:
        raise ConnectionError("server down")

    assert p.start("e", "r", [1], 10, fail)
    future = p.take("e", "r", [1])
    assert future is not None
    with pytest.raises(ConnectionError, match="server down"):
        future.result(5)


def test_workers_are_counted_per_engine() -> None:
    p = Prefetches()
    p.add_worker("e")
    p.add_worker("e")
    p.remove_worker("e")
    assert p.worker_here("e")
    p.remove_worker("e")
    assert not p.worker_here("e")
    assert not p.start("e", "r", [1], 1, lambda: 0)


def test_receive_buffers_are_used_again_within_their_bounds() -> None:
    from kvstore.engines._vllm_prefetch import ReceiveBuffers

    bufs = ReceiveBuffers(keep=2, keep_bytes=1000)
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
