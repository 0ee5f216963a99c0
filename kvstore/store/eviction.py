"""The eviction policy: least recently used first, and the hits that feed it.

``LruOrder`` keeps the order inside one write transaction: every unpinned stored block has
one tick in ``atime`` and the matching ``(tick, hash)`` key in ``lru`` (oldest first);
pinned blocks have neither, so they are never chosen. The write path calls ``add``,
``remove`` and ``touch`` as blocks come, go and are pinned, and ``evict`` when it needs
room; what a block's removal means for the other sub-databases stays with the caller.

``RecencyBuffer`` collects read hits without the write lock (one C call: ``dict.setdefault``);
the store's next write transaction (or a background flush every few seconds, or ``close``)
replays them into the order in first-hit order. Approximate LRU: hits a process has not
flushed yet are invisible to other processes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from .diskformat import BLOCK_KEY, COUNTER, LRU_KEY, lru_model, lru_value


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


class LruOrder:
    """The LRU order of one write transaction (``atime`` and ``lru`` sub-databases).

    The order is store-wide: ``lru`` holds every model's blocks, each entry naming its
    model; ``add``, ``remove`` and ``touch`` act on the blocks of ``model`` (whose
    ``atime`` is ``atime_db``), ``evict_any`` on any model's (``atime_of`` maps a model
    number to its ``atime``).
    """

    def __init__(
        self,
        txn: Any,
        atime_db: Any,
        lru_db: Any,
        tick: int,
        model: int = 0,
        atime_of: Callable[[int], Any] | None = None,
    ) -> None:
        self._txn = txn
        self._atime = atime_db
        self._lru = lru_db
        self.tick = tick  # the newest tick given; saved by the caller with its counters
        self._model = model
        # A model not created yet (-1) holds no block: nothing of it is ever added.
        self._tag = lru_value(model) if model >= 0 else None
        self._atime_of = atime_of

    def add(self, hk: bytes, h: int) -> None:
        """Give an unpinned block the newest tick."""
        assert self._tag is not None, "a block added to a model not created yet"
        self.tick += 1
        self._txn.put(hk, COUNTER.pack(self.tick), db=self._atime)
        self._txn.put(LRU_KEY.pack(self.tick, h), self._tag, db=self._lru)

    def remove(self, hk: bytes, h: int) -> bool:
        """Drop a block's recency; False when it had none (pinned or absent)."""
        raw = self._txn.get(hk, None, self._atime)
        if raw is None:
            return False
        self._txn.delete(LRU_KEY.pack(COUNTER.unpack(raw)[0], h), db=self._lru)
        self._txn.delete(hk, db=self._atime)
        return True

    def touch(self, h: int) -> None:
        """A use: move an unpinned block to the newest end."""
        hk = BLOCK_KEY.pack(h)
        if self.remove(hk, h):
            self.add(hk, h)

    def evict(
        self,
        protect: set[int],
        enough: Callable[[], bool],
        keep: Callable[[int, int], bool] | None = None,
    ) -> Iterator[int]:
        """Victims of this order's model oldest first, skipping ``protect``, until
        ``enough()`` holds; each one's recency is gone when it is yielded (the caller
        removes the block itself)."""
        for _model, h in self.evict_any(protect, enough, only=self._model, keep=keep):
            yield h

    def evict_any(
        self,
        protect: set[int],
        enough: Callable[[], bool],
        only: int | None = None,
        keep: Callable[[int, int], bool] | None = None,
    ) -> Iterator[tuple[int, int]]:
        """``(model, hash)`` victims of every model (or of model ``only``) oldest first;
        ``protect`` holds hashes of this order's model that must stay, and ``keep(model,
        hash)`` says which others must (blocks pending upload to a tier)."""
        cur = self._txn.cursor(db=self._lru)
        ok = cur.first()
        while ok and not enough():
            key = bytes(cur.key())
            h = LRU_KEY.unpack(key)[1]
            model = lru_model(cur.value())
            if (
                (only is not None and model != only)
                or (model == self._model and h in protect)
                or (keep is not None and keep(model, h))
            ):
                ok = cur.next()
                continue
            atime = self._atime if model == self._model else self._atime_of(model)  # type: ignore[misc]
            cur.delete()
            self._txn.delete(BLOCK_KEY.pack(h), db=atime)
            yield model, h
            ok = cur.set_range(key)
