"""The HTTP bench's mixed load run: concurrent clients (10% put, 70% get, 20% has-blocks)
on one ``tlkv serve`` for a while; then every acknowledged put is read back and checked
byte for byte, and the workers' anonymous memory is sampled over the run (5xx, lost or
corrupt puts, RSS growth: the rows ``bench_http`` prints)."""

from __future__ import annotations

import http.client
import json
import multiprocessing
import random
import time
from collections import Counter
from typing import Any

from bench_http_clients import block_envelopes, collect
from bench_servers import Server

from kvstore.protocol import ENVELOPE_MEDIA_TYPE, HASHES_MEDIA_TYPE


def _load_client(
    port: int, known: list[int], seconds: float, seed: int, first_hash: int, out: Any
) -> None:
    """One of the concurrent clients: 10% put, 70% get, 20% has-blocks."""
    import numpy as np

    rng = random.Random(seed)
    statuses: Counter[int] = Counter()
    acked: list[int] = []
    errors: list[str] = []
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    fresh = block_envelopes(list(range(first_hash, first_hash + 100000)), seed=seed)
    mine = list(known)
    probe = np.array(known + [rng.getrandbits(63) for _ in range(256)], dtype="<u8").tobytes()
    buf = bytearray(4 << 20)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        roll = rng.random()
        try:
            if roll < 0.1:
                h, body = next(fresh)
                conn.request(
                    "PUT", "/v1/blocks", body=body, headers={"content-type": ENVELOPE_MEDIA_TYPE}
                )
                r = conn.getresponse()
                r.read()
                if r.status == 200:
                    acked.append(h)
                    mine.append(h)
            elif roll < 0.8:
                conn.request("GET", f"/v1/blocks/{rng.choice(mine):016x}")
                r = conn.getresponse()
                length = int(r.getheader("content-length", "0"))
                view, got = memoryview(buf), 0
                while got < length:
                    k = r.readinto(view[got:length])
                    if not k:
                        break
                    got += k
            else:
                conn.request(
                    "POST",
                    "/v1/has-blocks",
                    body=probe,
                    headers={"content-type": HASHES_MEDIA_TYPE},
                )
                r = conn.getresponse()
                r.read()
            statuses[r.status] += 1
        except (OSError, http.client.HTTPException) as exc:
            errors.append(repr(exc))
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.close()
    out.put((dict(statuses), acked, errors))


def _verify_acked(port: int, acked: list[int]) -> tuple[int, int]:
    """(missing, corrupt): acknowledged puts not served back byte for byte."""
    import numpy as np

    from kvstore import crc32c

    missing = corrupt = 0
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    for i in range(0, len(acked), 8192):
        chunk = acked[i : i + 8192]
        body = np.array(chunk, dtype="<u8").tobytes()
        conn.request(
            "POST",
            "/v1/has-blocks",
            body=body,
            headers={"content-type": "application/octet-stream"},
        )
        present = json.loads(conn.getresponse().read())["present"]
        missing += present.count(False)
    for h in acked:
        conn.request("GET", f"/v1/blocks/{h:016x}")
        r = conn.getresponse()
        data = r.read()
        if r.status != 200:
            missing += 1
        elif crc32c(data[:-4]) != int.from_bytes(data[-4:], "little") or data[28:36] != h.to_bytes(
            8, "little"
        ):
            corrupt += 1
    conn.close()
    return missing, corrupt


def load_run(server: Server, known: list[int], seconds: float, clients: int) -> dict[str, Any]:
    """``clients`` processes (forked) on ``server`` for ``seconds``: statuses, every
    acknowledged put read back and checked, the workers' anonymous RSS over the run."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    rss_start = server.rss_anon_mib()
    workers_before = set(server.worker_pids())
    procs = [
        ctx.Process(
            target=_load_client,
            args=(server.port, known, seconds, 1000 + i, (i + 1) << 40, queue),
        )
        for i in range(clients)
    ]
    for p in procs:
        p.start()
    rss_samples = []
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        time.sleep(min(1.0, max(0.0, t_end - time.monotonic())))
        rss_samples.append(server.rss_anon_mib())
    results = collect(procs, queue, seconds + 300)
    statuses: Counter[int] = Counter()
    acked: list[int] = []
    errors: list[str] = []
    for st, ack, err in results:
        statuses.update(st)
        acked += ack
        errors += err
    missing, corrupt = _verify_acked(server.port, acked)
    return {
        "requests": sum(statuses.values()),
        "5xx": sum(n for s, n in statuses.items() if s >= 500),
        "statuses": dict(statuses),
        "acked": len(acked),
        "missing": missing,
        "corrupt": corrupt,
        "errors": errors,
        "rss_start": rss_start,
        "rss_mid": rss_samples[len(rss_samples) // 2] if rss_samples else rss_start,
        "rss_end": server.rss_anon_mib(),
        # No worker died or was replaced during the run.
        "alive": server.proc.poll() is None and set(server.worker_pids()) == workers_before,
    }
