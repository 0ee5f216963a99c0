"""Loads fetched ahead: a server's blocks start travelling at the scheduler's lookup.

A load from a server (``http://``, ``grpc://``) is a transfer: 12 MiB for a 1,024-token
prompt of a 12-layer model. The scheduler knows which blocks a request will load when its
lookup answers, a few milliseconds before the worker's ``start_load_kv`` runs (vLLM then
allocates, schedules the batch and prepares the model's inputs). When the engine's worker
runs in the scheduler's process (vLLM's one-process executor: ``LLM`` and ``vllm serve``
with one GPU or on CPU), the lookup starts the fetch on a thread and the worker takes the
answer, so the transfer overlaps that work instead of following it. The worker checks the
fetched blocks exactly as it checks blocks it fetches itself (reader rules, each block's
hash, CRC) before the forward can use them.

Where the worker is in another process (tensor parallelism: a worker process per GPU), no
worker of the engine registers here and nothing is fetched ahead: the worker fetches. A
fetch ahead that is not taken (vLLM did not allocate for the load, the request ended or was
planned again) is dropped; at most ``MAX_AHEAD_BYTES`` of fetches are held at once (beyond,
the worker fetches).

``ReceiveBuffers``: a server's answer is read into a buffer used again, whose pages stay
mapped: a 12 MiB answer read into new memory takes ~3,000 page faults (8.5 ms of CPU per
answer against 1.9 ms, measured on loopback), as many faults as the kernel's copy.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

__all__ = ["MAX_AHEAD_BYTES", "PREFETCHES", "Prefetches", "ReceiveBuffers"]

MAX_AHEAD_BYTES = 1 << 30  # fetched blocks held for workers at once (estimated before)


class Prefetches:
    """One process's fetches ahead, by engine (vLLM's ``engine_id``) and request id."""

    def __init__(self, max_bytes: int = MAX_AHEAD_BYTES) -> None:
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._workers: dict[str, int] = {}  # engine id -> worker connectors in this process
        self._ahead: dict[tuple[str, str], tuple[tuple[int, ...], int, Future[Any]]] = {}
        self._bytes = 0
        self._pool: ThreadPoolExecutor | None = None

    def add_worker(self, engine: str) -> None:
        """A worker connector of ``engine`` lives in this process."""
        with self._lock:
            self._workers[engine] = self._workers.get(engine, 0) + 1

    def remove_worker(self, engine: str) -> None:
        """That worker connector shut down."""
        with self._lock:
            left = self._workers.get(engine, 0) - 1
            if left > 0:
                self._workers[engine] = left
            else:
                self._workers.pop(engine, None)

    def worker_here(self, engine: str) -> bool:
        """Whether a worker of ``engine`` would take a fetch ahead in this process."""
        with self._lock:
            return engine in self._workers

    def start(
        self,
        engine: str,
        req_id: str,
        hashes: Sequence[int],
        nbytes: int,
        fetch: Callable[[], Any],
    ) -> bool:
        """Run ``fetch()`` (the blocks ``hashes``, about ``nbytes``) on a thread for request
        ``req_id``'s worker; replaces an earlier fetch of that request. False (nothing
        started) when no worker of ``engine`` is here or the bound would be passed."""
        self.drop(engine, req_id)
        with self._lock:
            if engine not in self._workers or self._bytes + nbytes > self._max_bytes:
                return False
            if self._pool is None:
                self._pool = ThreadPoolExecutor(2, thread_name_prefix="tlkv-prefetch")
            future = self._pool.submit(fetch)
            self._ahead[(engine, req_id)] = (tuple(hashes), nbytes, future)
            self._bytes += nbytes
            return True

    def take(self, engine: str, req_id: str, hashes: Sequence[int]) -> Future[Any] | None:
        """The fetch ahead of exactly these blocks for ``req_id``, handed over (None: the
        worker fetches)."""
        with self._lock:
            entry = self._ahead.pop((engine, req_id), None)
            if entry is None:
                return None
            self._bytes -= entry[1]
        return entry[2] if entry[0] == tuple(hashes) else None

    def drop(self, engine: str, req_id: str) -> None:
        """Forget request ``req_id``'s fetch ahead (its answer is let go when it comes)."""
        with self._lock:
            entry = self._ahead.pop((engine, req_id), None)
            if entry is not None:
                self._bytes -= entry[1]
        if entry is not None:
            entry[2].cancel()

    def held(self) -> tuple[int, int]:
        """(fetches ahead not taken yet, their estimated bytes)."""
        with self._lock:
            return len(self._ahead), self._bytes


class ReceiveBuffers:
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


PREFETCHES = Prefetches()  # the process's one registry: scheduler and worker meet here
