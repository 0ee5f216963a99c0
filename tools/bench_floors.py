"""What this machine allows any store, measured beside the peers benchmarks: a loopback
TCP copy between two processes (the socket every networked read crosses), a file write
of the same bytes (the disk every durable write lands on) and plain py-lmdb putting the
same values (what LMDB itself costs a store built on it)."""

from __future__ import annotations

import os
import socket
import statistics
import time
from typing import Any

import lmdb
import numpy as np


def file_write(directory: str, blobs: list[bytes], durable: bool, batched: bool) -> float:
    """Seconds to write ``blobs`` into a new file in ``directory``: one ``write`` of them
    joined (``batched``) or one each, with an ``fdatasync`` after each write when
    ``durable``. The file stays until the run ends, as a store's blocks do: its pages are
    new page-cache pages, as the pages of a store that grows are."""
    parts = [b"".join(blobs)] if batched else blobs  # joined before the clock starts
    path = os.path.join(directory, f"blobs-{os.getpid()}-{time.monotonic_ns()}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        t0 = time.perf_counter()
        for part in parts:
            view = memoryview(part)
            while view:
                view = view[os.write(fd, view) :]
            if durable:
                os.fdatasync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)


class LmdbFloor:
    """A plain py-lmdb environment opened as ``Store(sync=False)`` opens its own (no fsync,
    no readahead): values put under 8-byte keys, no envelope, no checks, nothing else in
    the transaction. Puts go to pages freed by ``delete``, as a tlkv store's do once its
    blocks are deleted between runs."""

    def __init__(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        self.env = lmdb.open(path, map_size=16 << 30, sync=False, metasync=False, readahead=False)

    def put(self, names: list[int], blobs: list[bytes], batched: bool) -> float:
        """Seconds to put ``blobs``: in one transaction (``batched``) or one each."""
        keys = [h.to_bytes(8, "big") for h in names]
        t0 = time.perf_counter()
        if batched:
            with self.env.begin(write=True) as txn:
                for k, v in zip(keys, blobs):
                    txn.put(k, v)
        else:
            for k, v in zip(keys, blobs):
                with self.env.begin(write=True) as txn:
                    txn.put(k, v)
        return time.perf_counter() - t0

    def delete(self, names: list[int]) -> None:
        with self.env.begin(write=True) as txn:
            for h in names:
                txn.delete(h.to_bytes(8, "big"))

    def close(self) -> None:
        self.env.close()


def _send(port: int, nbytes: int) -> None:
    payload = memoryview(np.ones(nbytes, np.uint8))
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(payload)


def loopback_rate(ctx: Any, nbytes: int, runs: int) -> float:
    """Bytes per second of a loopback TCP copy between two processes (median of runs)."""
    buf = memoryview(bytearray(nbytes))
    rates = []
    for _ in range(runs + 1):
        with socket.socket() as srv:
            srv.bind(("127.0.0.1", 0))
            srv.listen(1)
            sender = ctx.Process(target=_send, args=(srv.getsockname()[1], nbytes))
            sender.start()
            conn, _addr = srv.accept()
            with conn:
                got = conn.recv_into(buf, 1)  # the first byte starts the clock
                t0 = time.perf_counter()
                while got < nbytes:
                    got += conn.recv_into(buf[got:])
                rates.append((nbytes - 1) / (time.perf_counter() - t0))
            sender.join()
    return statistics.median(rates[1:])
