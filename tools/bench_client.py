"""Client read-path benchmarks: ``Client.prefix`` and ``Client.get`` against stdlib
``http.client`` reading the same response into one preallocated buffer.

One ``tlkv serve`` (2 workers, geometry 16,32,8,128: 2 MiB v1 blocks) holds a 2,048-token
prompt as 128 blocks. Each round asks for the same 256 MiB prefix (and the same 2 MiB
block) with every contender in turn, so server cost and machine noise fall on all of them
alike:

- the baseline: ``http.client``, ``readinto`` a fresh anonymous mapping of the
  Content-Length (4 KiB pages mapped as the data arrives, as the client's new ``bytes``
  are: a client returns a new object every call);
- the client, and the client on httpx's own transport (what it used before);
- ``http.client`` into a fresh ``np.empty`` (numpy asks for transparent huge pages for
  large arrays) and into one buffer allocated once and reused (no page faults at all).

Contenders are compared round by round: the ratio is the median of the per-round ratios
(shown with their range), the times are medians. On a shared machine a best-of favours
whoever is bimodal; huge-page allocation is, under load.
"""

from __future__ import annotations

import argparse
import http.client
import json
import mmap
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_common import Row
from bench_servers import GEOMETRY, start_tlkv

PROMPT_TOKENS = 2048


def _fresh(length: int) -> memoryview:
    """New anonymous memory, not advised: 4 KiB pages mapped as the data arrives."""
    return memoryview(mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))


def _readinto(
    conn: http.client.HTTPConnection,
    method: str,
    path: str,
    body: bytes | None,
    alloc: Callable[[int], Any],
) -> int:
    """One request on a keep-alive connection, its body read into ``alloc(length)``."""
    headers = {"content-type": "application/json"} if body else {}
    try:
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
    except (ConnectionError, http.client.RemoteDisconnected):  # the server closed it (idle)
        conn.close()
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
    length = int(r.getheader("content-length", "0"))
    got = r.readinto(alloc(length))
    if r.status != 200 or got != length:
        raise RuntimeError(f"{method} {path}: HTTP {r.status}, {got}/{length} bytes")
    return got


def _rounds(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each contender, interleaved round by round (after a warm-up)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def _spread(ratios: list[float]) -> str:
    return f"{min(ratios):.2f}-{max(ratios):.2f}x over {len(ratios)} rounds"


def run(args: argparse.Namespace) -> list[Row]:
    import httpx
    import numpy as np

    from kvstore import Block, Geometry, chain_hashes, encode
    from kvstore.client import Client

    rounds = 3 if args.quick else 9
    g = Geometry(*GEOMETRY)
    tokens = list(range(7, 7 + PROMPT_TOKENS))
    hashes = chain_hashes(tokens, g.block_tokens)
    kv = np.random.default_rng(0).standard_normal(g.kv_shape).astype(np.float16)
    base = Path(os.environ.get("TLKV_BENCH_DIR", tempfile.gettempdir()))
    root = Path(tempfile.mkdtemp(prefix="tlkv-bench-client-", dir=base))
    server = None
    try:
        server = start_tlkv(root / "store", root / "tlkv.log")
        url = f"http://127.0.0.1:{server.port}"
        fast = Client(url)
        old = Client(url, transport=httpx.HTTPTransport())
        for i in range(0, len(hashes), 8):
            fast.put(encode(g, [Block(h, g.block_tokens, kv) for h in hashes[i : i + 8]], 1))
        conn = http.client.HTTPConnection("127.0.0.1", server.port)
        query = json.dumps({"tokens": tokens}).encode()
        block = f"/v1/blocks/{hashes[0]:016x}"
        total = g.envelope_bytes(len(hashes), 1)
        if len(fast.prefix(tokens=tokens)) != total:
            raise RuntimeError("the prefix is not the whole prompt")

        warm = memoryview(bytearray(total))

        def contenders(method: str, path: str, body: bytes | None, fast_fn: Any, old_fn: Any):
            return {
                "base": lambda: _readinto(conn, method, path, body, _fresh),
                "fast": fast_fn,
                "old": old_fn,
                "huge": lambda: _readinto(conn, method, path, body, lambda n: np.empty(n, "u1")),
                "warm": lambda: _readinto(conn, method, path, body, lambda n: warm[:n]),
            }

        prefix = _rounds(
            contenders(
                "POST",
                "/v1/prefix",
                query,
                lambda: fast.prefix(tokens=tokens),
                lambda: old.prefix(tokens=tokens),
            ),
            rounds,
        )
        get = _rounds(
            contenders("GET", block, None, lambda: fast.get(hashes[0]), lambda: old.get(hashes[0])),
            rounds * 20,
        )
        fast.close()
        old.close()
        conn.close()
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(root, ignore_errors=True)

    rows = []
    for label, times, unit in (
        (f"Client.prefix(tokens=...), {len(hashes)} x 2 MiB", prefix, "s"),
        ("Client.get, one 2 MiB block", get, "ms"),
    ):
        scale = 1.0 if unit == "s" else 1e3
        med = {k: fmt_time(statistics.median(v) * scale, unit) for k, v in times.items()}

        def paired(key: str, times: dict[str, list[float]] = times) -> list[float]:
            return [b / f for b, f in zip(times[key], times["fast"])]

        ratios = paired("base")
        ratio = statistics.median(ratios)
        is_prefix = unit == "s"
        rows.append(
            Row(
                label,
                med["fast"],
                f"http.client readinto, fresh buffer {med['base']}",
                ratio,
                ">= 0.8x" if is_prefix else "",
                ratio >= 0.8 if is_prefix else None,
            )
        )
        rows.append(Row("  (per-round ratios)", _spread(ratios)))
        for key, what in (
            ("huge", "http.client readinto, np.empty (huge pages)"),
            ("warm", "http.client readinto, reused buffer"),
        ):
            rows.append(
                Row(f"  same vs {what}", med["fast"], med[key], statistics.median(paired(key)))
            )
        old_ratios = [b / o for b, o in zip(times["base"], times["old"])]
        rows.append(
            Row(
                "  the client on httpx's own transport",
                med["old"],
                f"http.client readinto, fresh buffer {med['base']}",
                statistics.median(old_ratios),
            )
        )
    return rows


def fmt_time(value: float, unit: str) -> str:
    return f"{value:.3f} {unit}"
