"""Bounded, ordered work on a thread pool: the one shape of every parallel data path.

The store's large-block writer (stage the next block while LMDB copies this one), the
archive's frame reader (decompress ahead) and frame writer (compress behind) all submit
tasks to a pool, take the results back in submission order, and bound what is in flight
by a count and/or a weight (bytes, staging buffers). The pure-C work they run (CRC, copy,
zstd) releases the GIL, so the threads overlap for real.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future, wait
from types import TracebackType
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class OrderedPipeline(Generic[T]):
    """Tasks submitted with a tag, results taken back oldest first.

    Args:
        pool: runs the tasks.
        max_pending: at most this many tasks in flight (None: no bound).
        max_weight: a task may start while the weight in flight is below this (None: no
            bound); a task of weight 0 is never held back by it.

    Used as a context manager, leaving the block cancels what was not taken and waits for
    what already runs (its buffers are then free to reuse).
    """

    def __init__(
        self,
        pool: Executor,
        *,
        max_pending: int | None = None,
        max_weight: int | None = None,
    ) -> None:
        self._pool = pool
        self._max_pending = max_pending
        self._max_weight = max_weight
        self._pending: deque[tuple[Any, int, Future[T]]] = deque()
        self._weight = 0

    def __len__(self) -> int:
        return len(self._pending)

    def has_room(self, weight: int = 0) -> bool:
        """Whether a task of ``weight`` may start now (always, when nothing is in flight)."""
        if not self._pending:
            return True
        if self._max_pending is not None and len(self._pending) >= self._max_pending:
            return False
        return not (weight and self._max_weight is not None and self._weight >= self._max_weight)

    def submit(self, tag: Any, fn: Callable[..., T], *args: Any, weight: int = 0) -> None:
        """Start ``fn(*args)``; its result comes back with ``tag``."""
        self._pending.append((tag, weight, self._pool.submit(fn, *args)))
        self._weight += weight

    def take(self) -> tuple[Any, T]:
        """The oldest task's ``(tag, result)``, waiting for it (its exception is raised)."""
        tag, weight, fut = self._pending.popleft()
        self._weight -= weight
        return tag, fut.result()

    def cancel(self) -> None:
        """Cancel every task not started; wait for those running."""
        futures = [fut for _, _, fut in self._pending]
        for fut in futures:
            fut.cancel()
        wait(futures)
        self._pending.clear()
        self._weight = 0

    def __enter__(self) -> OrderedPipeline[T]:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cancel()
