"""Preallocation: room past the last page of LMDB's data file, on disk and in the page cache.

A put that grows the store writes pages the file does not have yet: the file system
allocates blocks for them and the kernel hands out new page-cache pages. Where a new
page is expensive (a VM that gives freed memory back to its host: BENCHMARKS.md,
"Preallocation") that costs a large put most of its speed; LMDB writing into pages the
kernel already holds runs at memory speed.

With ``nbytes`` > 0 the store keeps room past the last page in use:

- the commit that would leave less than ``nbytes / 2`` of it extends the file so that
  ``nbytes`` lie past what the commit writes (``posix_fallocate``: blocks reserved on
  disk, so puts into the room do not fail for a full disk). The extension runs inside the
  committing write transaction, so no other writer, in this process or another, commits
  meanwhile, and it never changes a byte already in the file;
- a helper thread then reads the new range once, so its pages sit in the page cache
  (zeros: the range is allocated but unwritten, and the read costs no disk I/O). Reads do
  not change the file, so the helper needs no lock. Opening reads the first room before
  it returns, so the first puts find it cached.

The kernel may drop those clean pages under memory pressure; puts into the room then run
as they would without preallocation. Costs: ``nbytes`` of disk held ahead of the data, and
up to ``nbytes`` of page cache. LMDB ignores file bytes past its last page: a store
preallocated once opens, reads and copies as any other (``check_data_file`` refuses only
a file shorter than its meta page says). A failed extension (a full disk, a file-size
limit) is logged and skipped: the put goes on as without preallocation. On a file system
without ``fallocate`` glibc's ``posix_fallocate`` writes a zero byte into each new block
past the end instead: slower, and as safe, since only the transaction's holder writes.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import weakref

log = logging.getLogger("tlkv.store")

READ_CHUNK = 8 << 20  # the helper's read size: one reused buffer


def _read_range(fd: int, start: int, end: int, buf: bytearray, stop: threading.Event) -> None:
    """Read ``fd`` from ``start`` to ``end`` into ``buf`` chunk by chunk, until ``stop``."""
    view = memoryview(buf)
    try:
        while start < end and not stop.is_set():
            got = os.preadv(fd, [view[: min(len(buf), end - start)]], start)
            if got <= 0:
                return
            start += got
    except OSError as exc:  # a warm-up is never worth failing a put for
        log.debug("preallocation: reading ahead failed: %s", exc)


def _warm(
    fd: int, ranges: queue.SimpleQueue[tuple[int, int] | None], stop: threading.Event
) -> None:
    """The helper thread: read each queued ``(start, end)`` range of ``fd`` once, until
    ``None`` or ``stop``; closes ``fd``."""
    buf = bytearray(READ_CHUNK)
    try:
        while (item := ranges.get()) is not None:
            _read_range(fd, *item, buf, stop)
    finally:
        os.close(fd)


class Preallocation:
    """Keeps ``nbytes`` of allocated, page-cached file past the pages in use (see module).

    Args:
        path: LMDB's data file.
        nbytes: the room kept ahead; 0 turns it off (every call then does nothing).
        psize: LMDB's page size.
    """

    def __init__(self, path: str, nbytes: int, psize: int) -> None:
        self.path = path
        self.nbytes = nbytes
        self.psize = psize
        self.extensions = 0  # files extended so far (for tests and diagnostics)
        self.failures = 0  # extensions that failed (a full disk, a file-size limit)
        self._fd = -1
        self._end = 0  # the file's size as last seen or set here
        self._ranges: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._thread_lock = threading.Lock()  # warm runs after commits, in any thread
        self._stop = threading.Event()
        if nbytes <= 0:
            return
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:  # the store opens as without preallocation
            log.info("%s: no preallocation: %s", path, exc)
            self.nbytes = 0
            return
        self._end = os.fstat(self._fd).st_size
        self._close_fd = weakref.finalize(self, os.close, self._fd)

    def extend(self, last_pgno: int, need: int) -> tuple[int, int] | None:
        """Call inside a write transaction, before its commit: extend the file if the commit
        (``need`` bytes above page ``last_pgno``, LMDB's last page in use) would leave less
        than half the room. Returns the new range, for ``warm`` or ``read``, or None."""
        if self.nbytes <= 0:
            return None
        used = (last_pgno + 1) * self.psize + need
        if self._end - used >= self.nbytes // 2:
            return None
        try:
            self._end = os.fstat(self._fd).st_size  # another process may have extended it
            if self._end - used >= self.nbytes // 2:
                return None
            start = self._end
            end = -(-(used + self.nbytes) // self.psize) * self.psize  # whole pages
            os.posix_fallocate(self._fd, start, end - start)
        except OSError as exc:
            level = logging.DEBUG if self.failures else logging.INFO  # once, not every put
            self.failures += 1
            log.log(level, "%s: preallocating %d bytes failed: %s", self.path, self.nbytes, exc)
            return None
        self._end = end
        self.extensions += 1
        return start, end

    def read(self, span: tuple[int, int]) -> None:
        """Read ``span`` of the file into the page cache now, in this thread."""
        _read_range(self._fd, *span, bytearray(READ_CHUNK), self._stop)

    def warm(self, span: tuple[int, int]) -> None:
        """Have the helper thread read ``span`` into the page cache (started on first use)."""
        self._ranges.put(span)
        with self._thread_lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(
                target=_warm,
                args=(os.dup(self._fd), self._ranges, self._stop),
                name="tlkv-store-prealloc",
                daemon=True,
            )
            self._thread.start()
            weakref.finalize(self, self._ranges.put, None)

    def close(self) -> None:
        """Stop the helper (after the chunk it is reading) and close the file."""
        if self._thread is not None:
            self._stop.set()
            self._ranges.put(None)
            self._thread.join()
            self._thread = None
        if self._fd >= 0:
            self._close_fd()
            self._fd = -1
            self.nbytes = 0
