"""Byte buffers used again: the HTTP target's receive buffers (``server_targets``) and the
vLLM connector's envelope buffer (its saver encodes into it).

A buffer used again keeps its pages mapped: an answer read, or an envelope encoded, into
new memory takes a page fault per 4 KiB page (~3,000 for the 12 MiB of a 1,024-token
prompt of a 12-layer model), which costs more CPU than the copy itself (BENCHMARKS.md,
vllm).
"""

from __future__ import annotations

import threading

import numpy as np

__all__ = ["KeptBuffers"]


class KeptBuffers:
    """Byte buffers lent for one answer each and given back once it is used: at most
    ``keep`` are kept, none over ``keep_bytes`` (a larger one is allocated each time)."""

    def __init__(self, keep: int = 3, keep_bytes: int = 256 << 20) -> None:
        self._keep = keep
        self._keep_bytes = keep_bytes
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of at least ``nbytes`` (its content undefined)."""
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.nbytes >= nbytes:
                    return self._free.pop(i)
        return np.empty(nbytes, np.uint8)

    def reserve(self, nbytes: int) -> None:
        """Keep a buffer of ``nbytes`` (within the bounds) whose pages are mapped now, so
        that a first answer of up to that size takes no page fault."""
        if 0 < nbytes <= self._keep_bytes:
            buf = np.empty(nbytes, np.uint8)
            buf.fill(0)  # every page written once: mapped
            self.give(buf)

    def give(self, buf: np.ndarray) -> None:
        """``buf`` is no longer used by its taker."""
        if buf.nbytes <= self._keep_bytes:
            with self._lock:
                if len(self._free) < self._keep:
                    self._free.append(buf)
                    return
                # keep the larger ones: an answer that fits none of them allocates
                small = min(range(len(self._free)), key=lambda i: self._free[i].nbytes)
                if self._free[small].nbytes < buf.nbytes:
                    self._free[small] = buf
