"""Write-behind for durable commits: the disk starts while LMDB's commit still copies.

A durable LMDB commit first copies every dirty page into the page cache (one large
``writev``; for a 64-block put, 128 MiB) and only then calls ``fdatasync``, so the disk
is idle during the copy and the copy waits for nothing. While a large commit runs, a
helper thread asks the kernel every ``INTERVAL`` seconds to start writing the file's
dirty pages (``sync_file_range(SYNC_FILE_RANGE_WRITE)``: asynchronous), so the copy and
the disk overlap. Durability does not depend on it: LMDB's own ``fdatasync`` and meta
page write still decide when a commit is durable. Linux only; elsewhere (or without the
compiled ``kvstore.fileio._syscalls``) ``during`` does nothing.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

from ..fileio import start_writeback, writeback_available

log = logging.getLogger("tlkv.store")

INTERVAL = 0.002  # seconds between writeback requests during a commit
MIN_BYTES = 8 << 20  # smaller commits copy in ~1 ms: nothing to overlap


class _Requester:
    """The helper thread's state; it owns the file descriptor and closes it on exit.

    It holds no reference to its ``WriteBehind``, so a store dropped without ``close``
    is still collected, and a finalizer stops the thread.
    """

    def __init__(self, fd: int, path: str) -> None:
        self.fd, self.path = fd, path
        self.active = threading.Event()
        self.stopping = False
        self.requests = 0

    def run(self) -> None:
        try:
            while True:
                self.active.wait()
                if self.stopping:
                    return
                try:
                    start_writeback(self.fd)
                    self.requests += 1
                except OSError as exc:  # never takes a commit down: fdatasync decides
                    log.debug("%s: sync_file_range failed: %s", self.path, exc)
                time.sleep(INTERVAL)
        finally:
            os.close(self.fd)

    def stop(self) -> None:
        self.stopping = True
        self.active.set()  # wake it so it sees stopping


class WriteBehind:
    """Starts the kernel writing ``path`` (LMDB's data file) during large commits.

    ``enabled=False`` (commits that do not sync) makes ``during`` do nothing. The helper
    thread and its file descriptor are made on the first large commit.
    """

    def __init__(self, path: str, *, enabled: bool = True) -> None:
        self._path = path
        self._off = not enabled or not writeback_available()
        self._requester: _Requester | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def thread(self) -> threading.Thread | None:
        """The helper thread (None until the first large commit; for tests and diagnostics)."""
        return self._thread

    @property
    def requests(self) -> int:
        """Writeback requests made so far (for tests and diagnostics)."""
        return 0 if self._requester is None else self._requester.requests

    @contextmanager
    def during(self, nbytes: int) -> Iterator[None]:
        """Write behind while the block runs, if it commits at least ``MIN_BYTES``."""
        requester = self._start() if nbytes >= MIN_BYTES else None
        if requester is None:
            yield
            return
        requester.active.set()
        try:
            yield
        finally:
            requester.active.clear()

    def close(self) -> None:
        """Stop the helper thread (its descriptor closes with it); later commits skip it."""
        with self._lock:
            self._off = True
            requester, thread = self._requester, self._thread
        if requester is not None:
            requester.stop()
        if thread is not None and thread.is_alive():
            thread.join()

    def _start(self) -> _Requester | None:
        """The running requester, started on first use; None if write-behind is off."""
        if self._off:
            return None
        if self._requester is not None:
            return self._requester
        with self._lock:
            if self._off or self._requester is not None:
                return self._requester
            try:
                fd = os.open(self._path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                log.debug("%s: no write-behind: %s", self._path, exc)
                self._off = True
                return None
            try:
                available = start_writeback(fd)
            except OSError as exc:
                log.debug("%s: no write-behind: %s", self._path, exc)
                available = False
            if not available:  # no sync_file_range on this system
                os.close(fd)
                self._off = True
                return None
            requester = _Requester(fd, self._path)
            self._thread = threading.Thread(
                target=requester.run, name="tlkv-store-writebehind", daemon=True
            )
            self._thread.start()
            weakref.finalize(self, requester.stop)
            self._requester = requester
            return requester
