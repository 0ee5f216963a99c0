"""Waiting in tests on a real condition, with a deadline, instead of a fixed sleep.

``wait_until`` polls a predicate until it holds and fails the test, naming what it waited
for, once ``timeout`` seconds pass; ``async_wait_until`` does the same inside an asyncio
loop, yielding to it between looks. ``parked_on`` tells whether some thread waits on a
``threading.Condition`` (a lock or a resize that blocks shows there).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

INTERVAL = 0.005  # seconds between two looks


def wait_until(predicate: Callable[[], object], what: str, timeout: float = 10.0) -> None:
    """Return once ``predicate()`` is true; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            raise AssertionError(f"waited {timeout} s for {what}")
        time.sleep(INTERVAL)


async def async_wait_until(
    predicate: Callable[[], object], what: str, timeout: float = 10.0
) -> None:
    """``wait_until`` inside a running loop: its callbacks and timers run between looks."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            raise AssertionError(f"waited {timeout} s for {what}")
        await asyncio.sleep(INTERVAL)


def parked_on(cond: threading.Condition, n: int = 1) -> bool:
    """Whether at least ``n`` threads wait on ``cond`` (CPython keeps one lock per waiting
    thread in ``Condition._waiters``)."""
    return len(cond._waiters) >= n  # type: ignore[attr-defined]
