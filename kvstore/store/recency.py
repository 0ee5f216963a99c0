"""In-process buffer of read hits, flushed into the store's LRU order by the next write.

Reads must not take LMDB's write lock, so a hit only records the hash in an ordered dict
(one C call: ``dict.setdefault``); the store's next write transaction (or a background
flush every few seconds, or ``close``) assigns fresh ticks in first-hit order. Only hits
on stored blocks are recorded, so the buffer never outgrows the store's block count.
Approximate LRU: hits a process has not flushed yet are invisible to other processes.
"""

from __future__ import annotations

import threading


class RecencyBuffer:
    """Hashes hit since the last flush, in first-hit order."""

    def __init__(self) -> None:
        self._hits: dict[int, None] = {}
        self._lock = threading.Lock()
        # The hot path: a bound C method, valid for the buffer's lifetime.
        self.touch = self._hits.setdefault

    def __len__(self) -> int:
        return len(self._hits)

    def discard(self, block_hash: int) -> None:
        """Forget ``block_hash`` (deleted)."""
        self._hits.pop(block_hash, None)

    def take(self) -> list[int]:
        """Remove and return every pending hash, oldest first."""
        with self._lock:
            taken = list(self._hits)
            for h in taken:  # not clear(): a concurrent touch must not be lost
                self._hits.pop(h, None)
        return taken

    def restore(self, taken: list[int]) -> None:
        """Put back hashes whose flush did not commit (they count as older hits)."""
        if not taken:
            return
        with self._lock:
            newer = list(self._hits)
            self._hits.clear()
            for h in taken:
                self._hits[h] = None
            for h in newer:
                self._hits[h] = None
