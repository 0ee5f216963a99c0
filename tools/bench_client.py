"""Client read-path benchmarks: ``Client.prefix`` and ``Client.get`` against stdlib
``http.client`` reading the same response into one preallocated buffer.

One ``tlkv serve`` (2 workers, geometry 16,32,8,128: 2 MiB v1 blocks) holds a 2,048-token
prompt as 128 blocks. Each round asks for the same 256 MiB prefix (and the same 2 MiB
block) with every contender in turn, so server cost and machine noise fall on all of them
alike: the baseline (``http.client``, ``readinto`` a fresh ``np.empty`` buffer of the
Content-Length, so its pages are mapped as the data arrives: the client too returns a new
object every call), the client, the client on httpx's own transport (what it used before),
and ``http.client`` reading into one buffer allocated once and reused, whose pages are
already mapped (what is left: the page faults of fresh memory). Reported: the best round
of each and the spread of the per-round ratios against the baseline.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench_common import Row
from bench_http import GEOMETRY, _start_tlkv

PROMPT_TOKENS = 2048


def _readinto(
    conn: http.client.HTTPConnection, method: str, path: str, body: bytes | None, buf: memoryview
) -> int:
    """One request on a keep-alive connection, its body read into ``buf`` (or a fresh one)."""
    import numpy as np

    headers = {"content-type": "application/json"} if body else {}
    try:
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
    except (ConnectionError, http.client.RemoteDisconnected):  # the server closed it (idle)
        conn.close()
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
    length = int(r.getheader("content-length", "0"))
    got = r.readinto(buf[:length] if len(buf) else np.empty(length, np.uint8))
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
    return (
        f"per round {min(ratios):.2f}-{max(ratios):.2f}x, median {statistics.median(ratios):.2f}x"
    )


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
        server = _start_tlkv(root / "store", root / "tlkv.log")
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
        fresh = memoryview(b"")
        prefix = _rounds(
            {
                "base": lambda: _readinto(conn, "POST", "/v1/prefix", query, fresh),
                "warm": lambda: _readinto(conn, "POST", "/v1/prefix", query, warm),
                "fast": lambda: fast.prefix(tokens=tokens),
                "old": lambda: old.prefix(tokens=tokens),
            },
            rounds,
        )
        get = _rounds(
            {
                "base": lambda: _readinto(conn, "GET", block, None, fresh),
                "warm": lambda: _readinto(conn, "GET", block, None, warm),
                "fast": lambda: fast.get(hashes[0]),
                "old": lambda: old.get(hashes[0]),
            },
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
        fmt = "{:.3f} " + unit
        best = {k: min(v) for k, v in times.items()}
        fast_s = fmt.format(best["fast"] * scale)
        ratio = best["base"] / best["fast"]
        per_round = [b / f for b, f in zip(times["base"], times["fast"])]
        is_prefix = unit == "s"
        rows.append(
            Row(
                label,
                fast_s,
                f"http.client readinto, fresh buffer {fmt.format(best['base'] * scale)}",
                ratio,
                ">= 0.8x" if is_prefix else "",
                ratio >= 0.8 if is_prefix else None,
            )
        )
        rows.append(Row("  (spread over rounds)", _spread(per_round)))
        rows.append(
            Row(
                "  same vs a reused, already mapped buffer",
                fast_s,
                f"http.client readinto, warm buffer {fmt.format(best['warm'] * scale)}",
                best["warm"] / best["fast"],
            )
        )
        rows.append(
            Row(
                "  the client on httpx's own transport",
                fmt.format(best["old"] * scale),
                f"http.client readinto, fresh buffer {fmt.format(best['base'] * scale)}",
                best["base"] / best["old"],
            )
        )
    return rows
