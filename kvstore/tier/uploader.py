"""The background uploader: drains a store's persistent pending set into the tier.

One daemon thread per store handle takes a batch of pending blocks (at most
``BATCH_BLOCKS`` blocks and ``BATCH_BYTES`` bytes, copied out of one read snapshot),
creates their objects ``Tier.concurrency`` at a time, and clears the uploaded ones from
the pending set. Failures back off (the tier's own backoff, 0.5 s doubling to 30 s) and
the blocks stay pending, so a restart resumes them. Among processes sharing one store
directory only the holder of an advisory lock file uploads (the others would race it to
the same objects).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, Protocol

from .tier import Tier

log = logging.getLogger("tlkv.tier")

BATCH_BLOCKS = 256
BATCH_BYTES = 256 << 20
IDLE_POLL = 1.0  # seconds between looks at the pending set when nothing woke the uploader
LOCK_FILE = "tier-uploader.lock"


class PendingSource(Protocol):
    """What the uploader needs from a store."""

    def pending_batch(self, max_blocks: int, max_bytes: int) -> list[tuple[int, bytes]]:
        """Pending blocks ``(hash, envelope)``, copied; blocks gone meanwhile are dropped."""
        ...

    def uploaded(self, hashes: list[int]) -> None:
        """Clear ``hashes`` from the pending set."""
        ...


class Uploader:
    """Drains ``source`` into ``tier`` on a daemon thread until :meth:`stop`."""

    def __init__(self, source: PendingSource, tier: Tier, lock_dir: str) -> None:
        self._source = source
        self._tier = tier
        self._lock_path = os.path.join(lock_dir, LOCK_FILE)
        self._lock_fd = -1
        self._wake = threading.Event()
        self._stopping = False
        self._idle = threading.Event()
        self.thread = threading.Thread(target=self._run, name="tlkv-tier-upload", daemon=True)
        self.thread.start()

    def wake(self) -> None:
        """Look at the pending set now (a put queued blocks)."""
        self._idle.clear()
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after the batch in flight (what is left stays pending) and release the lock."""
        self._stopping = True
        self._wake.set()
        self.thread.join(timeout)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # closing releases the flock
            self._lock_fd = -1

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until the pending set was found empty; False on timeout."""
        return self._idle.wait(timeout)

    def _own_lock(self) -> bool:
        if self._lock_fd >= 0:
            return True
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._lock_fd = fd
        return True

    def _sleep(self, seconds: float) -> None:
        self._wake.wait(seconds)
        self._wake.clear()

    def _run(self) -> None:
        while not self._stopping:
            try:
                self._step(self._sleep)
            except Exception as exc:  # the uploader must outlive any one failure
                log.warning("tier uploader: %s: %s", type(exc).__name__, exc)
                self._sleep(IDLE_POLL)

    def _step(self, sleep: Callable[[float], None]) -> None:
        if not self._own_lock():
            sleep(IDLE_POLL)
            return
        if not self._tier.available():
            sleep(self._tier.retry_in())
            return
        batch: list[tuple[int, Any]] = self._source.pending_batch(BATCH_BLOCKS, BATCH_BYTES)
        if not batch:
            self._idle.set()
            sleep(IDLE_POLL)
            return
        self._idle.clear()
        done = self._tier.upload(batch)
        self._source.uploaded([h for (h, _), ok in zip(batch, done) if ok])
        if not all(done):
            sleep(max(self._tier.retry_in(), 0.1))
