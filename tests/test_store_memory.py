"""``kvstore.store.keep_freed_memory``: a process that calls it keeps a large put's freed
memory in its heap; one that does not returns it to the kernel.

Each case runs in a child process (the setting is process-wide): it allocates and frees
64 blocks of 2 MiB (a 64-block put's overflow pages) through the C library, then reads
glibc's ``mallinfo2`` for the free bytes its heap still holds.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from kvstore.store import keep_freed_memory
from kvstore.store.memory import KEPT_BYTES

_CHILD = """
import ctypes, ctypes.util, json, sys
from kvstore.store import keep_freed_memory
mode, kept_bytes, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
kept = keep_freed_memory(kept_bytes) if mode == "keep" else None
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Info
blocks = [libc.malloc(2 << 20) for _ in range(count)]
for b in blocks:
    ctypes.memset(b, 1, 2 << 20)  # touched, as LMDB's copy touches its dirty pages
for b in blocks:
    libc.free(b)
print(json.dumps({"kept": kept, "free_heap": libc.mallinfo2().fordblks}))
"""

glibc = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="mallopt and mallinfo2 are glibc's"
)


def _free_heap_after_put(
    mode: str, kept_bytes: int = KEPT_BYTES, blocks: int = 64
) -> tuple[bool | None, int]:
    """(what ``keep_freed_memory`` returned, or None when not called; free heap bytes)
    after ``blocks`` blocks of 2 MiB were allocated, touched and freed."""
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, mode, str(kept_bytes), str(blocks)],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(out.stdout)
    return result["kept"], int(result["free_heap"])


@glibc
def test_a_process_that_keeps_freed_memory_holds_a_large_puts_pages() -> None:
    kept, free_heap = _free_heap_after_put("keep")
    assert kept is True
    assert free_heap >= 120 << 20  # nearly all of the 128 MiB freed


@glibc
def test_freeing_more_than_kept_bytes_at_once_still_keeps_kept_bytes() -> None:
    """A put beside large buffers of its own frees more than ``kept_bytes`` at once: the
    trim that follows leaves ``kept_bytes`` in the heap (``M_TOP_PAD``), not nothing."""
    kept, free_heap = _free_heap_after_put("keep", kept_bytes=64 << 20, blocks=48)
    assert kept is True
    assert free_heap >= 60 << 20  # 96 MiB freed, 64 MiB of it kept


@glibc
def test_by_default_the_freed_pages_go_back_to_the_kernel() -> None:
    kept, free_heap = _free_heap_after_put("default")
    assert kept is None
    assert free_heap < 32 << 20


@pytest.mark.parametrize("kept_bytes", [-1, 2**31])
def test_kept_bytes_out_of_range_is_refused_before_anything_changes(kept_bytes: int) -> None:
    with pytest.raises(ValueError, match="kept_bytes"):
        keep_freed_memory(kept_bytes)
