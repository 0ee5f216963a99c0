"""The guard in front of every route, against a real ``tlkv serve`` on raw sockets: a
repeated ``Authorization`` or ``Host`` is refused by both doors (the protocol's block read
and the app); a server without a token answers only a ``Host`` that names it (DNS
rebinding, ``api/hosts.py``); the status page's headers; and ``/v1/status`` shows a token
scoped to some models no store-wide figure that ``/metrics`` withholds from it."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import grpc
import httpx
import pytest
from conftest import SMALL, make_envelope
from http_server import ServerProcess, free_port, read_response

from api.hosts import HostRule
from kvstore import decode
from kvstore.transfer._tlkv_v1 import kv_pb2, kv_pb2_grpc

ENVELOPE = {"content-type": "application/vnd.tlkv"}
GEOMETRY = ",".join(map(str, SMALL.as_tuple()))
ADMIN, TEAM_TOKEN = "admin-token-0123456789", "team-token-0123456789"
TEAM = "team/model@1"


def _raw(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """One request sent as written; the answer's status, headers and body."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        return read_response(sock)


def _get(path: str, *headers: str) -> bytes:
    lines = [f"GET {path} HTTP/1.1", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _kind(body: bytes) -> str:
    return str(json.loads(body)["error"]["kind"])


def _tokens(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.json"
    entries = [
        {"token": ADMIN, "read": ["*"], "write": ["*"]},
        {"token": TEAM_TOKEN, "read": [TEAM], "write": [TEAM]},
    ]
    path.write_text(json.dumps({"tokens": entries}))
    return path


def test_authorization_sent_twice_is_refused_by_both_doors(tmp_path: Path) -> None:
    """A valid and a wrong token, in either order: 422 ``invalid_request`` for the plain
    block read (answered in the protocol otherwise) and for a route of the app. Before,
    the protocol took the last header and the app the first, so one order passed each;
    gRPC took whichever matched."""
    data = make_envelope(SMALL, 8, seed=1)
    block = f"{int(decode(data).hashes[0]):016x}"
    grpc_port = free_port()
    args: tuple[str, ...] = ("--geometry", GEOMETRY, "--token-file", str(_tokens(tmp_path)))
    args += ("--grpc-port", str(grpc_port))
    with ServerProcess(tmp_path / "store", *args, token=ADMIN) as srv:
        with srv.client() as http:
            assert http.put("/v1/blocks", content=data, headers=ENVELOPE).status_code == 200
        good, bad = f"Authorization: Bearer {ADMIN}", "Authorization: Bearer wrong"
        host = "Host: 127.0.0.1"
        for path in (f"/v1/blocks/{block}", "/v1/info", f"/v1/blocks/{block}?format=1"):
            assert _raw(srv.port, _get(path, host, good))[0] == 200
            for pair in ((good, bad), (bad, good), (good, good)):
                status, _, body = _raw(srv.port, _get(path, host, *pair))
                assert (status, _kind(body)) == (422, "invalid_request"), (path, pair, body)
                assert b"Authorization is sent at most once" in body
        status, _, body = _raw(srv.port, _get("/v1/info", host, host, good))
        assert (status, _kind(body)) == (422, "invalid_request"), body
        # tl.kv.v1 too: two authorization metadata entries are refused, in either order.
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = kv_pb2_grpc.KvTransferStub(channel)
            assert stub.HasBlocks(
                kv_pb2.HasBlocksRequest(), metadata=(("authorization", f"Bearer {ADMIN}"),)
            )
            for pair in (("Bearer wrong", f"Bearer {ADMIN}"), (f"Bearer {ADMIN}", "Bearer wrong")):
                metadata = tuple(("authorization", value) for value in pair)
                with pytest.raises(grpc.RpcError) as info:
                    stub.HasBlocks(kv_pb2.HasBlocksRequest(), metadata=metadata)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value


def test_a_server_without_a_token_answers_only_a_host_naming_it(tmp_path: Path) -> None:
    """DNS rebinding: a page whose name came to resolve to 127.0.0.1 sends its own name as
    Host. Without a token, that is refused (403) on every route but /healthz, the protocol's
    block read included; the bound address, loopback names, IP addresses and names of
    --allowed-hosts are answered. Before, any Host was served."""
    data = make_envelope(SMALL, 8, seed=2)
    block = f"{int(decode(data).hashes[0]):016x}"
    args = ("--geometry", GEOMETRY, "--allowed-hosts", "kv.internal,cache.example:8000")
    with ServerProcess(tmp_path / "store", *args) as srv:
        with srv.client() as http:
            assert http.put("/v1/blocks", content=data, headers=ENVELOPE).status_code == 200
        paths = (f"/v1/blocks/{block}", "/v1/status", "/metrics", "/", "/v1/models")
        for path in paths:
            for bad in ("evil.example", f"evil.example:{srv.port}", "127.0.0.1.nip.io"):
                status, _, body = _raw(srv.port, _get(path, f"Host: {bad}"))
                assert (status, _kind(body)) == (403, "forbidden"), (path, bad, body)
                assert b"--allowed-hosts" in body
            for good in (
                f"127.0.0.1:{srv.port}",
                "localhost",
                f"LocalHost.:{srv.port}",
                "app.localhost",
                "[::1]:8000",
                "10.1.2.3",
                "kv.internal",
                "cache.example",
            ):
                status, _, body = _raw(srv.port, _get(path, f"Host: {good}"))
                assert status == 200, (path, good, body)
        assert _raw(srv.port, _get("/healthz", "Host: evil.example"))[0] == 200
    # With a token the Host is not the guard: a rebound page has no token to send.
    with ServerProcess(tmp_path / "store", *args, token=ADMIN) as srv:
        status, _, _ = _raw(
            srv.port, _get("/v1/info", "Host: evil.example", f"Authorization: Bearer {ADMIN}")
        )
        assert status == 200


@pytest.mark.parametrize(
    ("bound", "allowed", "host", "ok"),
    [
        ("127.0.0.1", (), b"127.0.0.1:8000", True),
        ("0.0.0.0", (), b"box.example", False),
        ("kv.example", (), b"KV.example.:80", True),
        ("::", (), b"[fe80::1]:8000", True),
        ("127.0.0.1", ("*",), b"anything.example", True),
        ("127.0.0.1", (), None, True),
        ("127.0.0.1", (), b"localhost.evil.example", False),
    ],
)
def test_host_rule(bound: str, allowed: tuple[str, ...], host: bytes | None, ok: bool) -> None:
    assert HostRule(bound, allowed).allows(host) is ok


def test_status_page_headers(tmp_path: Path) -> None:
    """``/`` carries a Content-Security-Policy (its own script and style only, no framing)
    and ``/v1/status`` is never cached."""
    with ServerProcess(tmp_path / "store") as srv:
        r = httpx.get(f"{srv.url}/")
        policy = r.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in policy and "default-src 'none'" in policy
        assert "script-src 'sha256-" in policy and "unsafe-inline" not in policy
        assert r.headers["x-frame-options"] == "DENY"
        assert r.headers["x-content-type-options"] == "nosniff"
        assert httpx.get(f"{srv.url}/v1/status").headers["cache-control"] == "no-store"


def test_status_shows_a_scoped_token_no_store_wide_figures(tmp_path: Path) -> None:
    """A token that may read one model gets, like from ``/metrics``, no store-wide figure:
    not the upload backlog of every model, not the scrub's counts, not the total bytes (a
    token that reads every model gets them). Before, the backlog and the scrub were shown."""
    tier = tmp_path / "tier"
    args = ("--token-file", str(_tokens(tmp_path)), "--tier", f"file://{tier}")
    with ServerProcess(tmp_path / "store", *args, token=ADMIN) as srv:
        team = "/v1/models/" + TEAM.replace("/", "%2F").replace("@", "%40")
        data = make_envelope(SMALL, 8, seed=3)
        admin = {"authorization": f"Bearer {ADMIN}"}
        scoped = {"authorization": f"Bearer {TEAM_TOKEN}"}
        r = httpx.put(f"{srv.url}{team}/blocks", content=data, headers={**ENVELOPE, **scoped})
        assert r.status_code == 200, r.text
        full = httpx.get(f"{srv.url}/v1/status", headers=admin).json()
        assert set(full["tier"]) > {"state", "pending_uploads"} and full["scrub"] is not None
        assert full["total_bytes"] is not None
        mine = httpx.get(f"{srv.url}/v1/status", headers=scoped).json()
        assert [m["model"] for m in mine["models"]] == [TEAM]
        assert mine["tier"] == {"state": full["tier"]["state"]}
        assert mine["scrub"] is None and mine["total_bytes"] is None and mine["errors"] == []
        metrics = httpx.get(f"{srv.url}/metrics", headers=scoped).text
        assert "tlkv_scrub_" not in metrics and "tlkv_tier_backlog" not in metrics
