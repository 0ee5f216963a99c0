"""Preallocation: room past the last page of LMDB's data file, on disk and in the page cache.

A put that grows the store writes pages the file does not have yet: the file system
allocates blocks for them and the kernel hands out new page-cache pages. Where a new
page is expensive (a VM that gives freed memory back to its host: BENCHMARKS.md,
"Preallocation") that costs a large put most of its speed; LMDB writing into pages the
kernel already holds runs at memory speed. A durable commit into new blocks also waits
for the file system's journal (ext4: the new extents), which a commit over blocks
written before does not (BENCHMARKS.md, "Durable writes by kind of space").

With ``nbytes`` > 0 the store keeps room past the last page in use:

- the commit that would leave less than ``nbytes / 2`` of it extends the file so that
  ``nbytes`` lie past what the commit writes (``posix_fallocate``: blocks reserved on
  disk, so puts into the room do not fail for a full disk). The extension runs inside the
  committing write transaction, so no other writer, in this process or another, commits
  meanwhile, and it never changes a byte already in the file;
- a helper thread then fills the new range, so its pages sit in the page cache:
  - in a durable store it writes zeros over the range and flushes them, chunk by chunk.
    Each chunk is written while the helper holds LMDB's writer lock (a write transaction
    it aborts), and only above the last page LMDB uses at that moment: no commit of any
    process writes meanwhile, and no page LMDB has written is touched (LMDB never reads
    a page above its last page). The store's later durable commits into the range then
    flush data alone. The disk writes the room's bytes twice: once as zeros, once as data;
  - without sync it reads the range once (zeros: allocated but unwritten, the read costs
    no disk I/O and needs no lock); those commits wait for no flush anyway.

  Opening fills the first room the same way before it returns, so the first puts find
  it ready. Puts that outrun the helper write into room not yet filled, as into room
  only allocated, while the helper's zeros take a share of the disk.

The kernel may drop those clean pages under memory pressure; puts into the room then run
as they would without preallocation. Costs: ``nbytes`` of disk held ahead of the data, up
to ``nbytes`` of page cache, and for a durable store the zeros' disk writes and a commit
waiting for at most one chunk of them (``ZERO_CHUNK``). LMDB ignores file bytes past its
last page: a store preallocated once opens, reads and copies as any other
(``check_data_file`` refuses only a file shorter than its meta page says). A failed
extension (a full disk, a file-size limit) is logged and skipped: the put goes on as
without preallocation. On a file system without ``fallocate`` glibc's
``posix_fallocate`` writes a zero byte into each new block past the end instead: slower,
and as safe, since only the transaction's holder writes.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager

from ..fileio import start_writeback

log = logging.getLogger("tlkv.store")

READ_CHUNK = 8 << 20  # the helper's read size: one reused buffer
ZERO_CHUNK = 2 << 20  # zeros written per hold of LMDB's writer lock
_ZEROS = bytes(ZERO_CHUNK)  # all zero pages: writing from it touches no new memory

# Holds LMDB's writer lock for a ``with`` and gives the bytes of the data file in use, up
# to LMDB's last page (None: not now, e.g. another process changed the map's size).
HoldWriter = Callable[[], AbstractContextManager[int | None]]
# A weak reference to one (``weakref.WeakMethod``): None once its store is gone.
WeakHold = Callable[[], HoldWriter | None]


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


def _write_zeros(fd: int, start: int, end: int, stop: threading.Event, hold: WeakHold) -> None:
    """Write zeros over ``[start, end)`` of ``fd``, then flush them (``fdatasync``).

    Each chunk is written under LMDB's writer lock and only above the last page LMDB uses
    then: no commit, in this process or another, writes meanwhile, and no page LMDB has
    written is touched. Stops at ``stop``, or when the lock cannot be had."""
    zeros = memoryview(_ZEROS)
    try:
        while start < end and not stop.is_set():
            upto = min(start + ZERO_CHUNK, end)
            held = hold()
            if held is None:
                return
            with held() as used:
                if used is None:
                    return
                at = max(start, used)
                while at < upto:
                    wrote = os.pwrite(fd, zeros[: upto - at], at)
                    if wrote <= 0:
                        return
                    at += wrote
            del held
            start_writeback(fd)  # the disk starts now, not in one flush at the end
            start = upto
        os.fdatasync(fd)
    except OSError as exc:  # a warm-up is never worth failing a put for
        log.debug("preallocation: writing the room failed: %s", exc)
    except Exception:  # not expected: said loudly, and the helper goes on
        log.warning("preallocation: writing the room failed", exc_info=True)


def _helper(
    fd: int,
    ranges: queue.SimpleQueue[tuple[int, int] | None],
    stop: threading.Event,
    hold: WeakHold | None,
    filled: Callable[[], None],
) -> None:
    """The helper thread: fill each queued ``(start, end)`` range of ``fd`` once (zeros
    written under ``hold``, or read without it), until ``None`` or ``stop``; closes
    ``fd``."""
    buf = bytearray(0 if hold is not None else READ_CHUNK)
    try:
        while (item := ranges.get()) is not None:
            if hold is not None:
                _write_zeros(fd, *item, stop, hold)
            else:
                _read_range(fd, *item, buf, stop)
            filled()
    finally:
        os.close(fd)


class _Tally:
    """A count the helper thread adds to without holding its ``Preallocation`` alive."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0

    def add(self) -> None:
        self.n += 1


class Preallocation:
    """Keeps ``nbytes`` of allocated file past the pages in use, page-cached, and written
    when ``hold`` is given (see module).

    Args:
        path: LMDB's data file.
        nbytes: the room kept ahead; 0 turns it off (every call then does nothing).
        psize: LMDB's page size.
        hold: a weak reference to a ``HoldWriter`` of the store's environment: the room is
            written with zeros and flushed (a durable store). None: the room is read.
    """

    def __init__(self, path: str, nbytes: int, psize: int, hold: WeakHold | None = None) -> None:
        self.path = path
        self.nbytes = nbytes
        self.psize = psize
        self.hold = hold
        self.extensions = 0  # files extended so far (for tests and diagnostics)
        self.failures = 0  # extensions that failed (a full disk, a file-size limit)
        self._filled = _Tally()  # ranges filled (written or read) so far
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

    @property
    def filled(self) -> int:
        """Ranges finished with so far, at open and by the helper: written (or read) in
        full, or cut short by ``stop`` or an error."""
        return self._filled.n

    def extend(self, last_pgno: int, need: int) -> tuple[int, int] | None:
        """Call inside a write transaction, before its commit: extend the file if the commit
        (``need`` bytes above page ``last_pgno``, LMDB's last page in use) would leave less
        than half the room. Returns the new range, for ``warm`` or ``fill``, or None."""
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

    def fill(self, span: tuple[int, int]) -> None:
        """Write ``span`` with zeros and flush it (``hold`` given), or read it into the page
        cache, now, in this thread. Call it outside any transaction of this thread."""
        if self.hold is not None:
            _write_zeros(self._fd, *span, self._stop, self.hold)
        else:
            _read_range(self._fd, *span, bytearray(READ_CHUNK), self._stop)
        self._filled.add()

    def warm(self, span: tuple[int, int]) -> None:
        """Have the helper thread fill ``span`` (started on first use; none once stopped)."""
        with self._thread_lock:
            if self._stop.is_set():
                return
            self._ranges.put(span)
            if self._thread is not None:
                return
            self._thread = threading.Thread(
                target=_helper,
                args=(os.dup(self._fd), self._ranges, self._stop, self.hold, self._filled.add),
                name="tlkv-store-prealloc",
                daemon=True,
            )
            self._thread.start()
            weakref.finalize(self, self._ranges.put, None)

    def stop(self) -> None:
        """Stop the helper, after the chunk it is filling, and wait for it. Call it outside
        any transaction of this thread and before the store's map guard is held
        exclusively: the helper may be waiting for LMDB's writer lock or the guard."""
        with self._thread_lock:
            self._stop.set()
            thread, self._thread = self._thread, None
        if thread is not None:
            self._ranges.put(None)
            thread.join()

    def close(self) -> None:
        """Stop the helper and close the file."""
        self.stop()
        if self._fd >= 0:
            self._close_fd()
            self._fd = -1
            self.nbytes = 0
