"""The tier through the service: `tlkv serve --tier` on moto's S3 API, HTTP and tl.kv.v1."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import SMALL, make_envelope
from http_server import ServerProcess, free_port
from s3_server import CREDENTIALS, S3Server

from kvstore import decode, split
from kvstore.protocol import ENVELOPE_MEDIA_TYPE, PREFIX_HEADER
from kvstore.transfer import TransferClient

pytestmark = pytest.mark.slow  # two and three server processes


def _hex(hashes: list[int]) -> list[str]:
    return [f"{h:016x}" for h in hashes]


def _wait(http: httpx.Client, ok: Any, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        info = http.get("/v1/info").json()
        if ok(info["tier"]) or time.monotonic() > deadline:
            return info["tier"]  # type: ignore[no-any-return]
        time.sleep(0.05)


def test_two_servers_share_a_bucket(tmp_path: Path, s3_server: S3Server) -> None:
    url = f"s3://{s3_server.new_bucket()}/svc"
    tier = ("--tier", url, "--tier-endpoint", s3_server.endpoint)
    envelope = make_envelope(SMALL, 4 * 10, seed=11)
    hashes = [int(h) for h in decode(envelope).hashes if h]
    body = {"hashes": _hex(hashes)}
    with ServerProcess(tmp_path / "a", *tier, env=CREDENTIALS) as a, a.client() as http:
        r = http.put("/v1/blocks", content=envelope, headers={"content-type": ENVELOPE_MEDIA_TYPE})
        assert r.status_code == 200, r.text
        assert _wait(http, lambda t: t["pending_uploads"] == 0)["uploads"] == len(hashes)
        want_prefix = http.post("/v1/prefix", json=body).content
        want_block = http.get(f"/v1/blocks/{hashes[-1]:016x}").content
    grpc_port = free_port()
    with (
        ServerProcess(tmp_path / "b", *tier, "--grpc-port", str(grpc_port), env=CREDENTIALS) as b,
        b.client() as http,
    ):
        local = http.post("/v1/has-blocks", json=body).json()
        assert local == {"present": [False] * len(hashes), "prefix": 0}
        remote = http.post("/v1/has-blocks?tier=1", json=body).json()
        assert remote == {"present": [True] * len(hashes), "prefix": len(hashes)}
        r = http.post("/v1/prefix", json={"hashes": _hex([*hashes[:6], 99])})
        assert r.status_code == 200 and r.content == decode_join(want_prefix, 6)
        assert http.get(f"/v1/blocks/{hashes[-1]:016x}").content == want_block
        assert http.get(f"/v1/blocks/{12345:016x}").status_code == 404
        with TransferClient(f"grpc://127.0.0.1:{grpc_port}") as c:
            assert c.fetch(hashes=hashes) == want_prefix
        info = http.get("/v1/info").json()["tier"]
        assert info["state"] == "ok" and info["pending_uploads"] == 0
        assert info["read_through_hits"] == len(hashes)
        assert http.get("/healthz").json() == {"status": "ok", "tier": "ok"}
        text = http.get("/metrics").text
        assert f"tlkv_store_tier_read_through_hits_total {float(len(hashes))}" in text
        assert "tlkv_store_tier_pending_uploads 0.0" in text
        assert "tlkv_store_tier_up 1.0" in text


def decode_join(prefix: bytes, n: int) -> bytes:
    """The first ``n`` blocks of an envelope, as the service joins them."""
    from kvstore import join

    return join(split(prefix)[:n])


def test_unreachable_tier_leaves_local_service_whole(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    envelope = make_envelope(SMALL, 4 * 6, seed=12)
    hashes = [int(h) for h in decode(envelope).hashes if h]
    args = ("--tier", "s3://nowhere/p", "--tier-endpoint", dead)
    with ServerProcess(tmp_path / "a", *args, env=CREDENTIALS) as a, a.client() as http:
        r = http.put("/v1/blocks", content=envelope, headers={"content-type": ENVELOPE_MEDIA_TYPE})
        assert r.status_code == 200, r.text
        assert http.get(f"/v1/blocks/{777:016x}").status_code == 404  # a miss, not a 5xx
        tier = _wait(http, lambda t: t["state"] == "unreachable")
        assert tier["state"] == "unreachable" and tier["errors"] > 0
        assert tier["pending_uploads"] == len(hashes)
        t0 = time.perf_counter()
        for h in hashes:
            assert http.get(f"/v1/blocks/{h:016x}").status_code == 200
        r = http.post("/v1/prefix", json={"hashes": _hex([*hashes, 5])})
        assert r.status_code == 200 and r.headers[PREFIX_HEADER] == str(len(hashes))
        assert time.perf_counter() - t0 < 2.0
        assert http.post("/v1/has-blocks?tier=1", json={"hashes": _hex([5])}).status_code == 200
        health = http.get("/healthz")
        assert health.status_code == 200 and health.json()["tier"] == "unreachable"
        assert "tlkv_store_tier_up 0.0" in http.get("/metrics").text


class HungEndpoint:
    """A TCP endpoint on loopback that accepts connections and never answers (nor reads)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


def test_a_hung_tier_is_down_on_every_worker(tmp_path: Path) -> None:
    """An S3 endpoint that accepts connections and never answers: within 35 s of a put,
    ``/healthz`` on any connection (either of two workers, only one of which uploads)
    says the tier is unreachable, ``tlkv_store_tier_up`` is 0 and ``/v1/info`` names the
    stalled request; from then on, misses and tier HEADs answer "absent" at once."""
    hung = HungEndpoint()
    tier = ("--tier", "s3://hung-bucket/p", "--tier-endpoint", f"http://127.0.0.1:{hung.port}")
    try:
        with ServerProcess(tmp_path / "s", "--workers", "2", *tier, env=CREDENTIALS) as srv:
            with srv.client() as http:
                r = http.put(
                    "/v1/blocks",
                    content=make_envelope(SMALL, 8, seed=3),
                    headers={"content-type": ENVELOPE_MEDIA_TYPE},
                )
                assert r.status_code == 200, r.text
            put_at = time.monotonic()
            down = 0
            while down < 10:  # ten fresh connections in a row, spread over the workers
                assert time.monotonic() - put_at < 35, "a worker still reports the tier up"
                health = httpx.get(f"{srv.url}/healthz", timeout=5).json()
                down = down + 1 if health["tier"] == "unreachable" else 0
                time.sleep(0.1 if down else 0.5)
            for _ in range(6):
                with httpx.Client(base_url=srv.url, timeout=5) as http:
                    assert "tlkv_store_tier_up 0.0" in http.get("/metrics").text
                    info = http.get("/v1/info").json()["tier"]
                    assert info["state"] == "unreachable" and info["last_error"], info
            # Unreachable: a miss and a tier HEAD answer "absent" at once on every worker,
            # across backoffs (before, each miss sent another request and hung with it).
            for i in range(6):
                with httpx.Client(base_url=srv.url, timeout=5) as http:
                    t0 = time.monotonic()
                    assert http.get(f"/v1/blocks/{0xDEAD00 + i:016x}").status_code == 404
                    r = http.post("/v1/has-blocks?tier=1", json={"hashes": _hex([0xBEEF00 + i])})
                    assert r.json()["present"] == [False]
                    assert time.monotonic() - t0 < 1.0
                time.sleep(0.6)
    finally:
        hung.close()
