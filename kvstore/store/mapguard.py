"""Process-local coordination of LMDB transactions with map resizes.

``Environment.set_mapsize`` remaps the database file: every transaction of this process
must have ended first, or zero-copy buffers would point into unmapped memory. Every
transaction the store opens holds the guard *shared*; a resize takes it *exclusively*,
waiting for the others to finish and holding new ones back (writer preference).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import StoreError


class _Depth(threading.local):
    depth = 0  # transactions this thread holds (a class default: no AttributeError path)


class MapGuard:
    """A shared/exclusive gate with per-thread accounting (to refuse self-deadlock).

    The shared side is the hot path (every read): one plain lock round trip, no
    condition variable unless a resize is pending.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._active = 0
        self._resizing = False
        self._local = _Depth()

    def _depth(self) -> int:
        return self._local.depth

    def acquire(self) -> None:
        """Enter shared: wait while a resize is pending or running."""
        local = self._local
        depth = local.depth
        lock = self._lock
        lock.acquire()  # explicit calls: measurably cheaper than `with` on this hot path
        try:
            # A thread already inside keeps going, or a pending resize would deadlock on it.
            while self._resizing and not depth:
                self._cond.wait()
            self._active += 1
        finally:
            lock.release()
        local.depth = depth + 1

    def release(self) -> None:
        """Leave shared."""
        self._local.depth -= 1
        lock = self._lock
        lock.acquire()
        self._active -= 1
        if self._resizing and not self._active:
            self._cond.notify_all()
        lock.release()

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
            while self._active:
                self._cond.wait()
        try:
            yield
        finally:
            with self._lock:
                self._resizing = False
                self._cond.notify_all()
