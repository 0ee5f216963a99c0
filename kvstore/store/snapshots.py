"""Read snapshots that outlive the call that read them: the zero-copy bookkeeping of one
LMDB environment (``lmdbenv.LmdbEnv`` owns one ``Snapshots``).

Two kinds, both read transactions kept open while memory exported from LMDB's map is
still referenced outside the store:

- *lingering*: a reader closed while zero-copy arrays made inside it live on. The
  transaction ends at the first ``reap`` after they die.
- *held* (``hold``): bodies an HTTP transport sends after the call that read them has
  returned. The transaction ends at once when the last buffer exported from it is
  released, in whichever thread releases it (a weak reference on the exporting array).

Neither holds the map guard, so a remap first waits (bounded, ``drain``) for the held
ones to end while ``refusing`` keeps new holds from starting: values read meanwhile are
copied instead. Lingering ones pin the map (``pinned``): a remap is refused under them.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lmdb
import numpy as np


class _Held:
    """A read transaction kept open for the buffers exported from it."""

    __slots__ = ("live", "refs", "since", "txn")

    def __init__(self, txn: Any, live: int) -> None:
        self.txn = txn
        self.live = live
        self.since = time.monotonic()
        self.refs: list[weakref.ref[Any]] = []


class Snapshots:
    """The lingering and held read transactions of one environment in this process."""

    def __init__(self) -> None:
        self._lingering: list[tuple[Any, list[weakref.ref[Any]]]] = []
        self._linger_lock = threading.Lock()
        self._held: set[_Held] = set()
        # Reentrant: an array's last reference may die in a garbage collection that runs
        # while this thread holds the lock, and its callback takes the lock too.
        self._held_cond = threading.Condition(threading.RLock())
        self._refusing = 0

    @property
    def any_lingering(self) -> bool:
        """Whether a lingering transaction may be left to reap (read without the lock)."""
        return bool(self._lingering)

    @property
    def any_held(self) -> bool:
        """Whether a transaction is held for a zero-copy body (read without the lock)."""
        return bool(self._held)

    def linger(self, txn: Any, refs: list[weakref.ref[Any]]) -> None:
        """Keep ``txn`` open while any of ``refs`` lives (ended by a later ``reap``)."""
        with self._linger_lock:
            self._lingering.append((txn, refs))

    def hold(self, txn: Any, values: list[Any]) -> list[memoryview] | None:
        """One read-only memoryview per buffer of ``values`` (the same memory, each
        exported through an array of its own); ``txn`` ends when every one of them, and
        everything made from them, is released. None while a remap is pending, or for
        no values (a hold nothing releases would never end): the caller copies the values
        and ends ``txn`` itself."""
        if self._refusing or not values:
            return None
        held = _Held(txn, len(values))
        cond = self._held_cond

        def released(_ref: Any) -> None:
            with cond:
                held.live -= 1
                if held.live:
                    return
                self._held.discard(held)
                try:
                    held.txn.abort()
                except lmdb.Error:  # the environment was closed under it: ended already
                    pass
                finally:
                    cond.notify_all()

        out = []
        for value in values:
            owner = np.frombuffer(value, np.uint8)
            held.refs.append(weakref.ref(owner, released))
            out.append(owner.data)
        with cond:
            self._held.add(held)
        return out

    def lingering(self) -> int:
        """Read transactions of closed readers kept open for arrays that outlived them."""
        with self._linger_lock:
            return len(self._lingering)

    def held(self) -> tuple[int, float]:
        """How many read transactions are held for zero-copy bodies, and the age in
        seconds of the oldest (0 when none)."""
        with self._held_cond:
            if not self._held:
                return 0, 0.0
            held = list(self._held)
            return len(held), time.monotonic() - min(h.since for h in held)

    @contextmanager
    def refusing(self) -> Iterator[None]:
        """While inside, ``hold`` copies instead of holding (a remap is pending)."""
        with self._held_cond:
            self._refusing += 1
        try:
            yield
        finally:
            with self._held_cond:
                self._refusing -= 1

    def drain(self, deadline: float) -> None:
        """Wait (until the monotonic ``deadline``) for the held transactions to end."""
        with self._held_cond:
            while self._held:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._held_cond.wait(left)

    def reap(self) -> int:
        """End the lingering transactions whose arrays are gone; how many remain."""
        with self._linger_lock:
            keep = []
            for txn, refs in self._lingering:
                if any(r() is not None for r in refs):
                    keep.append((txn, refs))
                else:
                    txn.abort()
            self._lingering = keep
            return len(keep)

    def pinned(self) -> int:
        """Lingering and held transactions left after reaping (and collecting cycles)."""
        if (not self._lingering or not self.reap()) and not self._held:
            return 0
        gc.collect()
        return self.reap() + len(self._held)
