"""Operating-system file plumbing shared by the store and the archives.

- :func:`start_writeback`: Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` from the
  optional C extension ``_syscalls`` (asynchronous, GIL released; a hint, never a sync);
- :class:`WritebackFile` and :func:`atomic_file`: an output written to a sibling temp file,
  handed to writeback as it grows, fsynced and renamed into place (never half a file
  under the final name);
- :func:`drop_mapped_pages`: ``madvise(MADV_DONTNEED)`` on pages of a shared file mapping
  (LMDB's map) already read, so scanning a large store does not grow the resident set.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import Any, BinaryIO

import numpy as np

try:
    from . import _syscalls
except ImportError:  # pragma: no cover - the extension is optional
    _syscalls = None  # type: ignore[assignment]

__all__ = [
    "WritebackFile",
    "atomic_file",
    "current_umask",
    "drop_mapped_pages",
    "fsync_dir",
    "populate_mapped_pages",
    "start_writeback",
    "writeback_available",
]


def writeback_available() -> bool:
    """Whether :func:`start_writeback` can do anything on this system."""
    return _syscalls is not None


def start_writeback(fd: int) -> bool:
    """Ask the kernel to start writing the file's dirty pages; does not wait.

    Returns False where the call does not exist (not Linux, or no compiled extension).

    Raises:
        OSError: the call failed.
    """
    if _syscalls is None:
        return False
    return bool(_syscalls.start_writeback(fd))


# Archive files are handed to the kernel's writeback every this many bytes.
WRITEBACK_BYTES = 16 << 20


class WritebackFile:
    """An unbuffered file that asks the kernel to start writing back every few MiB, so
    that the final fsync has little left to wait for (Linux ``sync_file_range``)."""

    def __init__(self, fd: int) -> None:
        self.raw = os.fdopen(fd, "wb", buffering=0)
        self.fd = fd
        self.written = 0
        self.synced = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        while view.nbytes:
            n = self.raw.write(view)
            view = view[n:]
            self.written += n
        if self.written - self.synced >= WRITEBACK_BYTES:
            with contextlib.suppress(OSError):  # a hint only: the final fsync decides
                start_writeback(self.fd)
            self.synced = self.written
        return len(data)

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        self.raw.close()


def current_umask() -> int:
    """The process umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """A sibling temp file renamed onto ``path`` after fsync; removed on any error."""
    final = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(final)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(final)}.", suffix=".tmp", dir=directory)
    try:
        os.fchmod(fd, 0o666 & ~current_umask())  # what open() would give, not mkstemp's 0600
        out = WritebackFile(fd)
        try:
            yield out  # type: ignore[misc]
            os.fsync(fd)
        finally:
            out.close()
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def fsync_dir(directory: str) -> None:
    with contextlib.suppress(OSError):
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4
_libc: Any = None
if sys.platform.startswith("linux"):
    with contextlib.suppress(OSError):
        _libc = ctypes.CDLL(None, use_errno=True)


_MADV_POPULATE_READ = 22  # Linux 5.14+
_populate_ok = True


def _page_range(part: Any) -> tuple[int, int] | None:
    if not isinstance(part, memoryview) or part.nbytes < _PAGE:
        return None
    try:  # released by the reader already: ValueError
        addr = np.frombuffer(part, dtype=np.uint8).ctypes.data
    except ValueError:
        return None
    start = addr - addr % _PAGE
    end = addr + part.nbytes
    end += -end % _PAGE
    return start, end - start


def populate_mapped_pages(parts: list[Any]) -> None:
    """Map the pages of memory-mapped buffers in one call each (``MADV_POPULATE_READ``)
    before they are read: LMDB's map is opened without readahead (``MADV_RANDOM``), so
    a first read of a large value would otherwise take one page fault per 4 KiB page.
    A no-op where the kernel lacks it."""
    global _populate_ok
    if _libc is None or not _populate_ok:
        return
    for part in parts:
        span = _page_range(part)
        if span is None:
            continue
        if _libc.madvise(ctypes.c_void_p(span[0]), ctypes.c_size_t(span[1]), _MADV_POPULATE_READ):
            _populate_ok = ctypes.get_errno() != 22  # EINVAL: an older kernel, stop trying
            return


def drop_mapped_pages(parts: list[Any]) -> None:
    """Unmap the LMDB pages a frame was read from (they stay in the page cache), so that
    reading a large store does not grow this process's resident set. The map is a shared
    file mapping, so ``MADV_DONTNEED`` only drops page-table entries, never data."""
    if _libc is None:
        return
    for part in parts:
        if not isinstance(part, memoryview) or part.nbytes < _PAGE:
            continue
        with contextlib.suppress(ValueError):  # released by the reader already
            addr = np.frombuffer(part, dtype=np.uint8).ctypes.data
            start = addr - addr % _PAGE
            end = addr + part.nbytes
            end += -end % _PAGE
            _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)
