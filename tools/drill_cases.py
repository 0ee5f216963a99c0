"""The drill's cases beyond the kill loop (``tools/drill.py --case ...``), each run against
a live ``tlkv serve`` on ``port`` and returning a summary with ``ok``.

- ``stalled_readers``: two raw connections ask for a 16 MiB ``/v1/prefix`` and never read
  it, while puts make the store's map grow; both connections must be aborted within
  ``ABORT_WITHIN`` seconds of the request (``tlkv_http_stalled_bodies_total``), every put
  answer 200 or 503 ``busy`` (retried), none 5xx otherwise.
- ``model_cap``: puts into ``DEFAULT_MAX_MODELS + 5`` new models, each on its own
  connection (spread over the workers): exactly the limit are created, the rest answer
  507 ``model_limit``, and ``/v1/models`` and ``/metrics`` keep answering 200.
- ``slow_upload``: ``TRICKLERS`` connections each announce a ~64 MiB ``PUT /v1/blocks``
  (a valid header), send 40 bytes, then a byte every 2 s, reconnecting when refused, for
  ``SLOW_SECONDS``; meanwhile ordinary puts must all answer 200 within
  ``ORDINARY_WITHIN`` seconds, and every trickler is refused with 408 ``timeout``.
- ``foreign_models``: on a server started with ``--max-models 5``, another process adds
  32 models through a library ``Store(path, max_models=200)``, then ``tlkv archive
  restore`` adds 32 more; ``/v1/models``, ``/metrics`` and ``/v1/status`` keep answering
  200 and list them all, and the server writes into them.
"""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvstore import Block, Geometry, Store, chain_hashes, encode
from kvstore.codec.assembly import pack_header

ENVELOPE = {"content-type": "application/vnd.tlkv"}
STALL_BYTES = 16 << 20  # per prefix answer: far more than the socket buffers take
ABORT_WITHIN = 33.0  # the server's 30 s watch, a sweep and this side's polling
DEFAULT_MAX_MODELS = 200  # tlkv serve's --max-models default
TRICKLERS = 8  # slow senders of the slow-upload case
SLOW_SECONDS = 15.0  # how long they trickle: more than a window (5 s) and a budget wait (10 s)
ORDINARY_WITHIN = 3.0  # seconds an ordinary put may take meanwhile
FOREIGN_MODELS = 32  # models the other process adds, each way


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


def _trickle(port: int, size: int, head: bytes, stop: threading.Event, out: list[Any]) -> None:
    """Announce ``size`` bytes, send ``head`` and 12 zeros, then a byte every 2 s; note
    each answer (status, seconds held, error kind) and connect again, until ``stop``."""
    request = (
        b"PUT /v1/blocks HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/vnd.tlkv\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (size, head + bytes(12))
    )
    while not stop.is_set():
        with socket.create_connection(("127.0.0.1", port)) as sock:
            t0 = time.monotonic()
            sock.settimeout(2.0)
            answer = b""
            try:
                sock.sendall(request)
                while not stop.is_set() and b"\r\n\r\n" not in answer:
                    try:
                        chunk = sock.recv(65536)
                    except TimeoutError:
                        sock.sendall(b"\0")
                        continue
                    if not chunk:
                        break
                    answer += chunk
                head_part, _, body = answer.partition(b"\r\n\r\n")
                length = 0
                for line in head_part.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                sock.settimeout(5.0)
                while len(body) < length and (chunk := sock.recv(65536)):
                    body += chunk
            except OSError:
                body = b""
            if stop.is_set() and not answer:
                return
            status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/") else 0
            try:
                kind = json.loads(body)["error"]["kind"] if status else "closed"
            except ValueError:
                kind = "?"
            out.append((status, round(time.monotonic() - t0, 1), kind))


def slow_upload(port: int, geometry: Geometry, max_body: int = 64 << 20) -> dict[str, Any]:
    """The slow-upload attack (see the module docstring) against a server of ``geometry``
    with ``max_body`` (its ``--max-body``)."""
    n = max_body // geometry.record_bytes(1) - 1
    size = geometry.envelope_bytes(n)
    head = pack_header(1, geometry, n)
    stop = threading.Event()
    answers: list[Any] = []
    threads = [
        threading.Thread(target=_trickle, args=(port, size, head, stop, answers), daemon=True)
        for _ in range(TRICKLERS)
    ]
    for t in threads:
        t.start()
    time.sleep(1.0)
    puts: list[tuple[int, float]] = []
    seed = 7000
    deadline = time.monotonic() + SLOW_SECONDS
    while time.monotonic() < deadline:
        env = _envelope(seed, geometry, 2)[0]
        t0 = time.monotonic()
        status, _ = _request(port, "PUT", "/v1/blocks", env, ENVELOPE)
        puts.append((status, time.monotonic() - t0))
        seed += 1
    stop.set()
    for t in threads:
        t.join(15)
    kinds = {f"{s} {k}": sum(1 for a in answers if (a[0], a[2]) == (s, k)) for s, _, k in answers}
    slowest = max(seconds for _, seconds in puts)
    return {
        "tricklers": TRICKLERS,
        "seconds": SLOW_SECONDS,
        "ordinary_puts": len(puts),
        "put_statuses": {str(s): [p[0] for p in puts].count(s) for s in {p[0] for p in puts}},
        "slowest_put_seconds": round(slowest, 2),
        "trickler_answers": kinds,
        "longest_held_seconds": max((a[1] for a in answers), default=0.0),
        "ok": all(s == 200 for s, _ in puts)
        and slowest < ORDINARY_WITHIN
        and len(answers) >= TRICKLERS
        and all((a[0], a[2]) == (408, "timeout") for a in answers),
    }


_ADD_MODELS = """
import sys
sys.path.insert(0, sys.argv[3])
from drill_cases import _envelope
from kvstore import Geometry, Store
g = Geometry(*map(int, sys.argv[2].split(",")))
with Store(sys.argv[1], max_models=200) as s:
    for i in range(int(sys.argv[4])):
        s.model(f"library-{i}").put(_envelope(9000 + i, g, 1)[0])
"""


def foreign_models(port: int, geometry: Geometry, data: Path) -> dict[str, Any]:
    """Models added by other processes to the store ``data`` of a server on ``port``
    started with ``--max-models 5`` (see the module docstring)."""
    statuses: dict[str, int] = {}
    for model in ("served-a", "served-b"):
        env = _envelope(8000, geometry, 1)[0]
        statuses[model] = _request(port, "PUT", f"/v1/models/{model}/blocks", env, ENVELOPE)[0]
    _request(port, "GET", "/v1/models")  # the server has its handles open
    g = ",".join(map(str, geometry.as_tuple()))
    here = str(Path(__file__).resolve().parent)
    added = subprocess.run(
        [sys.executable, "-c", _ADD_MODELS, str(data), g, here, str(FOREIGN_MODELS)],
        capture_output=True,
        text=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        with Store(Path(tmp) / "other", geometry=geometry) as other:
            for i in range(FOREIGN_MODELS):
                other.model(f"archived-{i}").put(_envelope(9500 + i, geometry, 1)[0])
        archive = str(Path(tmp) / "models.tlkv")
        tlkv = [sys.executable, "-m", "kvstore", "archive"]
        created = subprocess.run(
            [*tlkv, "create", "--data", str(Path(tmp) / "other"), "-o", archive]
        )
        restored = subprocess.run(
            [*tlkv, "restore", archive, "--data", str(data)], capture_output=True, text=True
        )
    answers = {
        route: _request(port, "GET", route)[0] for route in ("/v1/models", "/metrics", "/v1/status")
    }
    listed = {m["model"] for m in json.loads(_request(port, "GET", "/v1/models")[1])["models"]}
    env = _envelope(8100, geometry, 1)[0]
    write = _request(port, "PUT", "/v1/models/library-0/blocks", env, ENVELOPE)[0]
    expected = {"default", "served-a", "served-b"}
    expected |= {f"library-{i}" for i in range(FOREIGN_MODELS)}
    expected |= {f"archived-{i}" for i in range(FOREIGN_MODELS)}
    return {
        "served_puts": statuses,
        "library_exit": added.returncode,
        "restore_exit": restored.returncode,
        "answers": answers,
        "models_listed": len(listed),
        "write_into_a_foreign_model": write,
        "ok": set(statuses.values()) == {200}
        and added.returncode == 0
        and created.returncode == 0
        and restored.returncode == 0
        and set(answers.values()) == {200}
        and listed == expected
        and write == 200,
    }
