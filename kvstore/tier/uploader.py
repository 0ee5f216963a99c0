"""The background uploader: drains a store's persistent pending set into the tier.

One daemon thread per store handle keeps the tier busy: it copies pending blocks out of a
read snapshot (walking the set in key order from where it left off, so blocks in flight
are not read again) and starts their conditional creates, keeping ``Tier.concurrency``
requests running and as many blocks ready behind them (at most ``MAX_READY_BYTES``
copied and not yet sent); as uploads end it clears them from the pending set, in one
write transaction per ``COMMIT_EVERY`` blocks or ``COMMIT_INTERVAL`` seconds. Failures
back off (the tier's own backoff, 0.5 s doubling to 30 s) and the blocks stay pending, so
a restart resumes them (one uploaded but not yet cleared is created again: the
conditional put finds it and it is cleared). Among processes sharing one store directory
only the holder of an advisory lock file uploads.
"""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import threading
import time
from typing import Protocol

from .tier import Tier

log = logging.getLogger("tlkv.tier")

MAX_READY_BYTES = 128 << 20  # copied blocks queued behind the requests in flight
COMMIT_EVERY = 32  # uploaded blocks cleared from the pending set per write transaction
COMMIT_INTERVAL = 0.25  # seconds: uploaded blocks are cleared at least this often
IDLE_POLL = 1.0  # seconds between looks at the pending set when nothing woke the uploader
LOCK_FILE = "tier-uploader.lock"


class PendingSource(Protocol):
    """What the uploader needs from a store."""

    def pending_batch(
        self, max_blocks: int, max_bytes: int, after: int = -1
    ) -> list[tuple[int, bytes]]:
        """Pending blocks ``(hash, envelope)`` with hashes above ``after``, in hash order,
        copied; blocks gone meanwhile are dropped from the set."""
        ...

    def uploaded(self, hashes: list[int]) -> None:
        """Clear ``hashes`` from the pending set."""
        ...


class Uploader:
    """Drains ``source`` into ``tier`` on a daemon thread until :meth:`stop`."""

    def __init__(
        self, source: PendingSource, tier: Tier, lock_dir: str, namespace: str | None = None
    ) -> None:
        self._source = source
        self._tier = tier
        self._namespace = namespace  # None: the tier's own
        # One uploader per store directory and namespace, across processes.
        name = LOCK_FILE if namespace in (None, tier.namespace) else f"{LOCK_FILE}.{namespace}"
        self._lock_path = os.path.join(lock_dir, name)
        self._lock_fd = -1
        self._wake = threading.Event()
        self._stopping = False
        self._idle = threading.Event()
        self._results: queue.SimpleQueue[tuple[int, bool]] = queue.SimpleQueue()
        self._inflight: dict[int, int] = {}  # hash -> bytes, started and not ended
        self._done: list[int] = []  # uploaded, not yet cleared from the pending set
        self._last_commit = time.monotonic()
        self._after = -1  # the pending set is walked in key order from here
        self.thread = threading.Thread(target=self._run, name="tlkv-tier-upload", daemon=True)
        self.thread.start()

    def wake(self) -> None:
        """Look at the pending set now (a put queued blocks)."""
        self._idle.clear()
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop (uploads in flight end first; what is left stays pending), release the lock."""
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

    def _ended(self, block_hash: int, ok: bool) -> None:  # on the tier's I/O thread
        self._results.put((block_hash, ok))
        self._wake.set()

    def _run(self) -> None:
        while not self._stopping:
            try:
                self._step()
            except Exception as exc:  # the uploader must outlive any one failure
                log.warning("tier uploader: %s: %s", type(exc).__name__, exc)
                self._sleep(IDLE_POLL)
        while self._inflight:  # let started requests end, then record what they did
            self._collect(block=True)
        self._commit(force=True)

    def _collect(self, block: bool) -> bool:
        """Take ended uploads; True when one failed."""
        failed = False
        try:
            item = self._results.get(timeout=1.0) if block else self._results.get_nowait()
            while True:
                h, ok = item
                self._inflight.pop(h, None)
                if ok:
                    self._done.append(h)
                else:
                    failed = True
                item = self._results.get_nowait()
        except queue.Empty:
            pass
        return failed

    def _commit(self, force: bool = False) -> None:
        due = time.monotonic() - self._last_commit >= COMMIT_INTERVAL
        if self._done and (force or due or len(self._done) >= COMMIT_EVERY):
            done, self._done = self._done, []
            self._source.uploaded(done)
            self._last_commit = time.monotonic()

    def _start_more(self) -> bool:
        """Start uploads up to the bounds; False when the pending set had nothing new."""
        tier = self._tier
        room = 2 * tier.client.concurrency - len(self._inflight)
        room_bytes = MAX_READY_BYTES - sum(self._inflight.values())
        if room <= 0 or room_bytes <= 0:
            return True
        batch = self._source.pending_batch(room, room_bytes, self._after)
        if not batch and self._after >= 0:  # wrap around to the start of the set
            self._after = -1
            batch = self._source.pending_batch(room, room_bytes, self._after)
        # Neither in flight nor uploaded and waiting to be cleared from the set (after a
        # wrap-around the walk meets those again: they would be sent twice).
        done = set(self._done)
        fresh = [(h, data) for h, data in batch if h not in self._inflight and h not in done]
        for h, data in fresh:
            self._inflight[h] = len(data)
            tier.submit_upload(h, data, self._ended, self._namespace)
        if batch:
            self._after = batch[-1][0]
        return bool(fresh)

    def _step(self) -> None:
        if not self._own_lock():
            self._sleep(IDLE_POLL)
            return
        failed = self._collect(block=False)
        self._commit()
        if failed or not self._tier.available():
            self._commit(force=True)
            self._sleep(max(self._tier.retry_in(), 0.1))
            return
        started = self._start_more()
        if not self._inflight and not started:
            self._commit(force=True)
            if not self._done:
                self._idle.set()
            self._sleep(IDLE_POLL)
            return
        self._idle.clear()
        self._sleep(COMMIT_INTERVAL)
