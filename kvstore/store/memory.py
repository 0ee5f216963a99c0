"""A writer process's allocator: keep freed memory for the next large transaction (glibc).

LMDB ``malloc``s the dirty pages of a write transaction and frees them at commit. By
default glibc serves blocks of a few MiB (one 2 MiB block's overflow pages) from fresh
``mmap``s, or from heap it returns to the kernel once more than a few MiB lie free, so each
large put faults its whole size in again as new memory. Where a new page is expensive
(a VM whose guest hands freed memory back to the host) that costs a large put much of its
speed (BENCHMARKS.md, "Peers", twentieth session).

The setting is process-wide, so the store never makes it on its own: ``tlkv serve``'s
workers call it (large HTTP puts; a PushKv stream buffers whole), SGLang's backend on a store
directory calls it unless its config says ``"keep_freed_memory": 0`` (its saves are
batches of pages), and any other writer process that puts large batches may call it once
at start. The cost: after a large put up to ``kept_bytes`` of free heap stay in the
process, resident once touched, instead of going back to the kernel.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["KEPT_BYTES", "MMAP_THRESHOLD", "keep_freed_memory"]

# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
KEPT_BYTES = 512 << 20
"""Default free heap kept (``M_TRIM_THRESHOLD`` and ``M_TOP_PAD``): room for a 64 x 2 MiB
put's pages, several times over."""
MMAP_THRESHOLD = 32 << 20
"""Blocks up to this size come from the heap (``M_MMAP_THRESHOLD``; glibc's largest on
64-bit, ``HEAP_MAX_SIZE / 2``)."""


def keep_freed_memory(kept_bytes: int = KEPT_BYTES) -> bool:
    """Make this process reuse freed memory instead of returning it to the kernel.

    Allocations up to 32 MiB come from the heap, and up to ``kept_bytes`` of free heap
    stay in the process for the next transaction. Call it once, early, in a process that
    does large puts (an engine saving into a store directory, a bulk importer).

    Three glibc parameters: ``M_MMAP_THRESHOLD`` (32 MiB), ``M_TRIM_THRESHOLD`` (the heap
    is trimmed only once ``kept_bytes`` lie free at its top) and ``M_TOP_PAD`` (a trim
    leaves ``kept_bytes`` in place instead of handing back all it can: without it a
    process that frees more than ``kept_bytes`` at once, as a put beside a large batch
    of its own buffers does, keeps nothing and faults the next put's pages in again).
    The pad is also what each growth of the heap reserves beyond the request: address
    space, not memory, until it is touched.

    Returns:
        True when every parameter was set; False where the C library is not glibc (the
        process is unchanged).

    Raises:
        ValueError: ``kept_bytes`` is negative or does not fit a C ``int``.
    """
    if not 0 <= kept_bytes < 2**31:
        raise ValueError(f"kept_bytes must be in [0, 2**31): got {kept_bytes}")
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        and mallopt(_M_TRIM_THRESHOLD, kept_bytes)
        and mallopt(_M_TOP_PAD, kept_bytes)
    )
