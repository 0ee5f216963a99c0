"""The HTTP benchmarks' parts: the envelopes they send, and the clients that send them
and time the answers (``http.client`` keep-alive connections in processes, or ``wrk``),
the in-process and raw-LMDB puts beside them, and the server CPU they cost.
``bench_http`` decides what is measured and prints the rows.
"""

from __future__ import annotations

import contextlib
import http.client
import multiprocessing
import os
import random
import re
import shutil
import statistics
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench_servers import GEOMETRY, Server

from kvstore.protocol import ENVELOPE_MEDIA_TYPE

# --- envelopes ---------------------------------------------------------------------------


def block_envelopes(hashes: list[int], seed: int = 0) -> Iterator[tuple[int, bytes]]:
    """Single-block v1 envelopes: one random 2 MiB f16 payload under many hashes."""
    import numpy as np

    from kvstore import Block, Geometry, encode

    g = Geometry(*GEOMETRY)
    kv = np.random.default_rng(seed).standard_normal(g.kv_shape).astype(np.float16)
    for h in hashes:
        yield h, encode(g, [Block(h, g.block_tokens, kv)], 1)


def rehash_body(body: bytes, round_no: int) -> bytes:
    """``body`` with every block's hash moved to round ``round_no``'s own (new blocks)."""
    from kvstore import crc32c, join, split
    from kvstore.codec.assembly import crc_matches  # noqa: F401 - the codec is loaded
    from kvstore.codec.layout import HEADER_SIZE, RECORD, TRAILER, TRAILER_SIZE

    parts = []
    for part in split(body):
        buf = bytearray(part)
        h, n = RECORD.unpack_from(buf, HEADER_SIZE)
        RECORD.pack_into(buf, HEADER_SIZE, h + ((round_no + 1) << 48), n)
        TRAILER.pack_into(buf, len(buf) - TRAILER_SIZE, crc32c(memoryview(buf)[:-TRAILER_SIZE]))
        parts.append(bytes(buf))
    return join(parts)


def join_envelopes(parts: list[bytes]) -> bytes:
    """One envelope of the single-block ``parts``."""
    from kvstore import join

    return join(parts)


# --- load generators (http.client, one keep-alive connection per process) ----------------


def _get_loop(port: int, paths: list[str], seconds: float, out: Any) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port)
    buf = bytearray(4 << 20)
    view = memoryview(buf)
    rng = random.Random(os.getpid())
    n = nbytes = errors = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        conn.request("GET", rng.choice(paths))
        r = conn.getresponse()
        length = int(r.getheader("content-length", "0"))
        got = 0
        while got < length:
            k = r.readinto(view[got:length])
            if not k:
                break
            got += k
        r.close()
        if r.status != 200:
            errors += 1
        n += 1
        nbytes += got
    conn.close()
    out.put((n, nbytes, errors))


def _wrk_get(
    port: int, paths: list[str], seconds: float, connections: int
) -> tuple[float, int] | None:
    """GB/s and requests measured by wrk (None when wrk is not installed)."""
    wrk = shutil.which("wrk")
    if wrk is None:
        return None
    cmd = [wrk, f"-c{connections}", "-t2", f"-d{max(1, int(seconds))}s"]
    out = subprocess.run(
        [*cmd, f"http://127.0.0.1:{port}{paths[0]}"], capture_output=True, text=True, check=False
    ).stdout
    m = re.search(r"Transfer/sec:\s+([\d.]+)(\w+)", out)
    n = re.search(r"(\d+) requests in", out)
    if not m or not n:
        return None
    scale = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}[m.group(2)]
    return float(m.group(1)) * scale / 1e9, int(n.group(1))


def _cpu_seconds(server: Server) -> float:
    """User + system CPU time of the server's processes (supervisor and workers) so far."""
    total = 0
    for pid in [server.proc.pid, *server.worker_pids()]:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / os.sysconf("SC_CLK_TCK")


def get_cpu(
    server: Server, paths: list[str], seconds: float, clients: int
) -> tuple[float, float] | None:
    """GB/s and server CPU seconds per request of a wrk GET run (None without wrk)."""
    cpu0 = _cpu_seconds(server)
    got = _wrk_get(server.port, paths, seconds, clients)
    cpu = _cpu_seconds(server) - cpu0
    if got is None or not got[1]:
        return None
    return got[0], cpu / got[1]


def get_throughput(port: int, paths: list[str], seconds: float, clients: int) -> float:
    """GB/s of GET responses with ``clients`` keep-alive connections (wrk or processes)."""
    via_wrk = _wrk_get(port, paths, seconds, clients)
    if via_wrk is not None:
        return via_wrk[0]
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_get_loop, args=(port, paths, seconds, queue)) for _ in range(clients)
    ]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    results = collect(procs, queue, seconds + 120)
    elapsed = time.perf_counter() - t0
    if any(r[2] for r in results):
        raise RuntimeError(f"GET errors during the throughput run: {results}")
    return sum(r[1] for r in results) / elapsed / 1e9


def _put_loop(port: int, bodies: list[bytes], out: Any) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port)
    n = 0
    t0 = time.perf_counter()
    for body in bodies:
        conn.request("PUT", "/v1/blocks", body=body, headers={"content-type": ENVELOPE_MEDIA_TYPE})
        r = conn.getresponse()
        reply = r.read()
        if r.status != 200:
            raise RuntimeError(f"PUT failed: {r.status} {reply[:200]!r}")
        n += len(body)
    out.put((n, time.perf_counter() - t0))
    conn.close()


def collect(procs: list[Any], queue: Any, timeout: float) -> list[Any]:
    """One result per process; raises instead of hanging when a process died."""
    import queue as queue_module

    results = []
    deadline = time.monotonic() + timeout
    while len(results) < len(procs):
        try:
            results.append(queue.get(timeout=1.0))
        except queue_module.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"load processes failed (exit codes {dead})") from None
    for p in procs:
        p.join()
    return results


def put_throughput(port: int, batches: list[list[bytes]]) -> float:
    """GB/s of durable PUTs, one client process per batch list, concurrently."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_put_loop, args=(port, b, queue)) for b in batches]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    results = collect(procs, queue, 600)
    elapsed = time.perf_counter() - t0
    return sum(r[0] for r in results) / elapsed / 1e9


def store_put(path: Path, batches: list[list[bytes]]) -> float:
    """GB/s of in-process durable ``Store.put`` of the same bodies, one after another."""
    from kvstore import Geometry
    from kvstore.store.store import Store

    total = sum(len(body) for bodies in batches for body in bodies)
    try:
        with Store(path, geometry=Geometry(*GEOMETRY), map_bytes=2 * total + (64 << 20)) as st:
            t0 = time.perf_counter()
            for bodies in zip(*batches):
                for body in bodies:
                    st.put(body)
            return total / (time.perf_counter() - t0) / 1e9
    finally:
        shutil.rmtree(path, ignore_errors=True)


def raw_lmdb_put(path: Path, batches: list[list[bytes]]) -> float:
    """GB/s of raw py-lmdb durable puts of the same bytes (one 8-block txn per body)."""
    import lmdb

    from kvstore import split

    total = sum(len(body) for bodies in batches for body in bodies)
    env = lmdb.open(str(path), map_size=2 * total + (64 << 20), sync=True, metasync=True)
    try:
        t0 = time.perf_counter()
        for bodies in batches:
            for body in bodies:
                with env.begin(write=True) as txn:
                    for part in split(body):
                        txn.put(part[28:36], part)
        return total / (time.perf_counter() - t0) / 1e9
    finally:
        env.close()
        shutil.rmtree(path, ignore_errors=True)


def has_p50(port: int, body: bytes, content_type: str, repeat: int) -> float:
    """Median seconds of ``repeat`` has-blocks requests of ``body`` (10 warm-ups first)."""
    conn = http.client.HTTPConnection("127.0.0.1", port)
    times = []
    for i in range(repeat + 10):
        t0 = time.perf_counter()
        conn.request("POST", "/v1/has-blocks", body=body, headers={"content-type": content_type})
        r = conn.getresponse()
        reply = r.read()
        if r.status != 200:
            raise RuntimeError(f"has-blocks failed: {r.status} {reply[:200]!r}")
        if i >= 10:  # warm-up excluded
            times.append(time.perf_counter() - t0)
    conn.close()
    return statistics.median(times)
