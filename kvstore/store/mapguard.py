"""Process-local coordination of LMDB transactions with map resizes.

``Environment.set_mapsize`` remaps the database file: every transaction of this process
must have ended first, or zero-copy buffers would point into unmapped memory. Every
transaction the store opens holds the guard *shared*; a resize takes it *exclusively*,
waiting for the others to finish and holding new ones back (writer preference).
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..errors import StoreError


class _Count:
    """One thread's count of the transactions it holds under one guard."""

    __slots__ = ("__weakref__", "n")

    def __init__(self) -> None:
        self.n = 0


class _ThreadCount(threading.local):
    """This thread's ``_Count``, made and registered with its guard on first use (a
    thread that ends takes its count out of the guard's registry with it)."""

    def __init__(self, register: Callable[[_Count], None]) -> None:
        self.count = _Count()
        register(self.count)


class MapGuard:
    """A shared/exclusive gate with per-thread accounting (to refuse self-deadlock).

    The shared side is the hot path (every read) and takes no lock: a thread counts its
    own transactions, then looks for a pending resize; a resize marks itself pending,
    then waits until the threads' counts add up to zero. Each side writes its own mark
    before it reads the other's, so one of them always sees the other (the interpreter
    runs one thread's bytecode at a time: its lock orders every store and load). A
    reader that finds a resize pending steps back out (its count restored, the resize
    woken) and waits under the lock until it is done. An interpreter running without
    its global lock takes the guard's lock on the shared side too.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._resizing = False
        self._counts: weakref.WeakSet[_Count] = weakref.WeakSet()
        self._counts_lock = threading.Lock()  # taken alone, or inside ``_lock``
        self._local = _ThreadCount(self._register)
        if not getattr(sys, "_is_gil_enabled", lambda: True)():
            self.acquire = self._acquire_locked  # type: ignore[method-assign]
            self.release = self._release_locked  # type: ignore[method-assign]

    def _register(self, count: _Count) -> None:
        with self._counts_lock:
            self._counts.add(count)

    def _active(self) -> int:
        """Transactions held by all threads."""
        with self._counts_lock:
            return sum(c.n for c in self._counts)

    def _depth(self) -> int:
        return self._local.count.n

    def acquire(self) -> None:
        """Enter shared: wait while a resize is pending or running."""
        count = self._local.count
        depth = count.n
        count.n = depth + 1
        # A thread already inside keeps going, or a pending resize would deadlock on it.
        if self._resizing and not depth:
            self._wait_out_resize(count)

    def _wait_out_resize(self, count: _Count) -> None:
        with self._lock:
            while self._resizing:
                count.n = 0
                self._cond.notify_all()  # the resize may be waiting for this count
                self._cond.wait()
            count.n = 1

    def release(self) -> None:
        """Leave shared."""
        self._local.count.n -= 1
        if self._resizing:
            with self._lock:
                self._cond.notify_all()

    def _acquire_locked(self) -> None:
        count = self._local.count
        with self._lock:
            while self._resizing and not count.n:
                self._cond.wait()
            count.n += 1

    def _release_locked(self) -> None:
        count = self._local.count
        with self._lock:
            count.n -= 1
            if self._resizing:
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """``with guard.exclusive():`` around a remap; no transaction of this process is open.

        Raises:
            StoreError: this very thread holds a transaction (a reader), so waiting would
                never end.
        """
        if self._depth():
            raise StoreError(
                "this thread holds an open reader (`with store.reader()`), so the LMDB map "
                "cannot be resized or closed now; leave the reader block first"
            )
        with self._lock:
            while self._resizing:
                self._cond.wait()
            self._resizing = True
            while self._active():
                self._cond.wait()
        try:
            yield
        finally:
            with self._lock:
                self._resizing = False
                self._cond.notify_all()
