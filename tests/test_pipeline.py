"""kvstore.pipeline.OrderedPipeline: order, bounds, cancellation, errors."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvstore.pipeline import OrderedPipeline


def _square_after(i: int, seconds: float) -> int:
    time.sleep(seconds)
    return i * i


def test_results_come_back_in_submission_order() -> None:
    with ThreadPoolExecutor(4) as pool, OrderedPipeline[int](pool) as p:
        for i in range(20):  # later tasks finish first
            p.submit(i, lambda i=i: _square_after(i, (20 - i) / 2000))
        assert [p.take() for _ in range(20)] == [(i, i * i) for i in range(20)]
        assert len(p) == 0


def test_max_pending_bounds_the_count() -> None:
    with ThreadPoolExecutor(2) as pool, OrderedPipeline[None](pool, max_pending=3) as p:
        assert p.has_room()
        for i in range(3):
            p.submit(i, lambda: None)
        assert not p.has_room() and len(p) == 3
        p.take()
        assert p.has_room()


def test_max_weight_bounds_weighted_tasks_only() -> None:
    with ThreadPoolExecutor(2) as pool, OrderedPipeline[None](pool, max_weight=2) as p:
        p.submit(0, lambda: None, weight=1)
        assert p.has_room(1)
        p.submit(1, lambda: None, weight=1)
        assert not p.has_room(1)  # two weighed in flight
        assert p.has_room(0)  # unweighted work is never held back by the weight
        p.take()
        assert p.has_room(1)


def test_an_empty_pipeline_always_has_room() -> None:
    with ThreadPoolExecutor(1) as pool:
        p = OrderedPipeline[None](pool, max_pending=0, max_weight=0)
        assert p.has_room(10)


def test_exit_cancels_what_did_not_start_and_waits_for_what_runs() -> None:
    started = threading.Event()
    release = threading.Event()
    ran: list[int] = []

    def task(i: int) -> None:
        started.set()
        release.wait(5)
        ran.append(i)

    with ThreadPoolExecutor(1) as pool:
        with OrderedPipeline[None](pool) as p:
            for i in range(5):
                p.submit(i, task, i)
            assert started.wait(5)
            threading.Timer(0.05, release.set).start()
        assert ran == [0]  # the running one finished before exit returned; the rest never ran


def test_a_task_error_is_raised_by_take() -> None:
    def boom() -> None:
        raise ValueError("boom")

    with ThreadPoolExecutor(1) as pool, OrderedPipeline[None](pool) as p:
        p.submit("t", boom)
        with pytest.raises(ValueError, match="boom"):
            p.take()
