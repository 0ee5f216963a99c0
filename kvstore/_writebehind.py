"""Write-behind for durable commits: the disk starts while LMDB's commit still copies.

A durable LMDB commit first copies every dirty page into the page cache (one large
``writev``; for a 64-block put, 128 MiB) and only then calls ``fdatasync``, so the disk
is idle during the copy and the copy waits for nothing. While a large commit runs, a
helper thread asks the kernel every ``INTERVAL`` seconds to start writing the file's
dirty pages (``sync_file_range(SYNC_FILE_RANGE_WRITE)``: asynchronous), so the copy and
the disk overlap. Durability does not depend on it: LMDB's own ``fdatasync`` and meta
page write still decide when a commit is durable. Linux only; elsewhere (or without the
compiled ``kvstore._syscalls``) ``during`` does nothing.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

try:
    from . import _syscalls
except ImportError:  # pragma: no cover - the extension is optional
    _syscalls = None  # type: ignore[assignment]

log = logging.getLogger("tlkv.store")

INTERVAL = 0.002  # seconds between writeback requests during a commit
MIN_BYTES = 8 << 20  # smaller commits copy in ~1 ms: nothing to overlap


class WriteBehind:
    """Starts the kernel writing ``path`` (LMDB's data file) during large commits.

    ``enabled=False`` (commits that do not sync) makes ``during`` do nothing.
    """

    def __init__(self, path: str, *, enabled: bool = True) -> None:
        self._path = path
        self._fd = -1
        self._thread: threading.Thread | None = None
        self._active = threading.Event()
        self._closed = not enabled
        self.requests = 0  # writeback requests made (for tests and diagnostics)
        self._lock = threading.Lock()

    @contextmanager
    def during(self, nbytes: int) -> Iterator[None]:
        """Write behind while the block runs, if it commits at least ``MIN_BYTES``."""
        if nbytes < MIN_BYTES or not self._ready():
            yield
            return
        self._active.set()
        try:
            yield
        finally:
            self._active.clear()

    def close(self) -> None:
        """Stop the helper thread and close the file."""
        with self._lock:
            self._closed = True
            self._active.set()  # wake the helper so it sees _closed
            thread, self._thread = self._thread, None
        if thread is not None and thread.is_alive():
            thread.join()
        self._active.clear()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _ready(self) -> bool:
        """Open the file and start the helper on first use; False if unavailable."""
        if _syscalls is None or self._closed:
            return False
        if self._thread is not None:
            return True
        with self._lock:
            if self._closed:
                return False
            if self._thread is None:
                try:
                    self._fd = os.open(self._path, os.O_RDONLY | os.O_CLOEXEC)
                    if not _syscalls.start_writeback(self._fd):
                        os.close(self._fd)
                        self._fd = -1
                        self._closed = True  # no sync_file_range here
                        return False
                except OSError as exc:
                    log.debug("%s: no write-behind: %s", self._path, exc)
                    self._closed = True
                    return False
                self._thread = threading.Thread(
                    target=self._run, name="tlkv-store-writebehind", daemon=True
                )
                self._thread.start()
        return True

    def _run(self) -> None:
        active, fd = self._active, self._fd
        while True:
            active.wait()
            if self._closed:
                return
            try:
                _syscalls.start_writeback(fd)
                self.requests += 1
            except OSError as exc:  # never take a commit down: LMDB's fdatasync decides
                log.debug("%s: sync_file_range failed: %s", self._path, exc)
            time.sleep(INTERVAL)
