"""The drill's cases beyond the kill loop (``tools/drill.py --case ...``), each run against
a live ``tlkv serve`` on ``port`` and returning a summary with ``ok``.

- ``stalled_readers``: two raw connections ask for a 16 MiB ``/v1/prefix`` and never read
  it, while puts make the store's map grow; both connections must be aborted within
  ``ABORT_WITHIN`` seconds of the request (``tlkv_http_stalled_bodies_total``), every put
  answer 200 or 503 ``busy`` (retried), none 5xx otherwise.
- ``model_cap``: puts into ``DEFAULT_MAX_MODELS + 5`` new models, each on its own
  connection (spread over the workers): exactly the limit are created, the rest answer
  507 ``model_limit``, and ``/v1/models`` and ``/metrics`` keep answering 200.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from typing import Any

import numpy as np

from kvstore import Block, Geometry, chain_hashes, encode

ENVELOPE = {"content-type": "application/vnd.tlkv"}
STALL_BYTES = 16 << 20  # per prefix answer: far more than the socket buffers take
ABORT_WITHIN = 33.0  # the server's 30 s watch, a sweep and this side's polling
DEFAULT_MAX_MODELS = 200  # tlkv serve's --max-models default


def _request(
    port: int, method: str, path: str, body: bytes | None = None, headers: Any = None
) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _metric(port: int, name: str, wait: float = 30.0) -> float:
    """A series' value from ``/metrics``; a 503 ``busy`` (the worker's store is remapping
    while bodies are held, the service's documented answer) is asked again, for up to
    ``wait`` seconds."""
    deadline = time.monotonic() + wait
    while True:
        status, body = _request(port, "GET", "/metrics")
        if status != 503 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if status != 200:
        raise RuntimeError(f"/metrics answered {status}")
    for line in body.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def _envelope(seed: int, geometry: Geometry, n: int) -> tuple[bytes, list[str]]:
    """``n`` blocks of one chain (one random KV block repeated: the bytes do not matter)."""
    rng = np.random.default_rng(seed)
    b = geometry.block_tokens
    hashes = chain_hashes(rng.integers(0, 2**32, n * b, dtype=np.uint64), b)
    kv = rng.standard_normal(geometry.kv_shape).astype(np.float16)
    env = encode(geometry, [Block(int(h), b, kv) for h in hashes])
    return env, [f"{int(h):016x}" for h in hashes]


def stalled_readers(port: int, geometry: Geometry) -> dict[str, Any]:
    """Two readers that never read a prefix answer while the map must grow (see above);
    ``geometry``: the server's (the case's blocks are of its size)."""
    n = max(1, STALL_BYTES // geometry.envelope_bytes(1))
    env, hashes = _envelope(1, geometry, n)
    status, _ = _request(port, "PUT", "/v1/blocks", env, ENVELOPE)
    if status != 200:
        raise RuntimeError(f"the prefix's put answered {status}")
    body = json.dumps({"hashes": hashes}).encode()
    request = (
        b"POST /v1/prefix HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    stalled_before = _metric(port, "tlkv_http_stalled_bodies_total")
    socks = []
    for _ in range(2):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.sendall(request)
        socks.append(sock)
    asked = time.monotonic()
    statuses: list[int] = []
    try:
        grow = 4 * (64 << 20) // len(env) + 1  # the map (64 MiB at first) must grow
        for seed in range(100, 100 + grow):
            while True:
                more = _envelope(seed, geometry, n)[0]
                status, _ = _request(port, "PUT", "/v1/blocks", more, ENVELOPE)
                statuses.append(status)
                if status != 503:
                    break
                time.sleep(1)
        aborted, took = 0.0, 0.0
        while time.monotonic() - asked < ABORT_WITHIN + 10:
            aborted = _metric(port, "tlkv_http_stalled_bodies_total") - stalled_before
            took = time.monotonic() - asked
            if aborted >= 2:
                break
            time.sleep(0.2)
    finally:
        for sock in socks:
            sock.close()
    errors = sum(1 for s in statuses if s >= 500 and s != 503)
    return {
        "puts": len(statuses),
        "put_statuses": {str(s): statuses.count(s) for s in sorted(set(statuses))},
        "aborted": int(aborted),
        "aborted_after_seconds": round(took, 1),
        "5xx": errors,
        "ok": aborted >= 2 and took <= ABORT_WITHIN and errors == 0 and statuses[-1] == 200,
    }


def model_cap(port: int, geometry: Geometry, limit: int = DEFAULT_MAX_MODELS) -> dict[str, Any]:
    """``limit`` + 5 new models, one connection each, on a server holding no model but
    ``default``: ``limit`` created, 5 refused."""
    env, _ = _envelope(2, geometry, 1)
    statuses: list[int] = []
    kinds: list[str] = []
    for i in range(limit + 5):
        status, body = _request(port, "PUT", f"/v1/models/drill-{i}/blocks", env, ENVELOPE)
        statuses.append(status)
        if status != 200:
            kinds.append(json.loads(body)["error"]["kind"])
    models_status, models = _request(port, "GET", "/v1/models")
    metrics_status, _ = _request(port, "GET", "/metrics")
    created = sum(1 for m in json.loads(models)["models"] if m["model"].startswith("drill-"))
    return {
        "created": created,
        "refused": {k: kinds.count(k) for k in sorted(set(kinds))},
        "models_status": models_status,
        "metrics_status": metrics_status,
        "ok": created == limit
        and statuses.count(200) == limit
        and kinds == ["model_limit"] * 5
        and models_status == metrics_status == 200,
    }
