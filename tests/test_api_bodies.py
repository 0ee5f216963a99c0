"""Request bodies (``api.bodies``, the guard's connection handling): refused bodies close the
connection, envelopes are refused by their header before the rest is read, and the bytes
of bodies in flight per worker are bounded (wait, then 503 busy).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import SMALL, make_envelope
from http_server import ServerProcess, assert_error, read_response
from waiting import async_wait_until

import api.bodies as bodies
from api.app import create_app
from api.bodies import BodyTicket, InflightBudget
from api.settings import Settings
from kvstore.codec.assembly import pack_header
from kvstore.codec.checksum import crc32c
from kvstore.codec.envelope import check_header, decode
from kvstore.codec.geometry import Geometry
from kvstore.errors import (
    BadMagicError,
    BusyError,
    FormatError,
    ShapeError,
    TruncatedError,
    UnsupportedVersionError,
)

GEOMETRY_ARG = ",".join(map(str, SMALL.as_tuple()))
TOKEN = "tok"
MAX_BODY = 1024 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data = tmp_path_factory.mktemp("bodies") / "store"
    args = ("--geometry", GEOMETRY_ARG, "--max-body", str(MAX_BODY))
    with ServerProcess(data, *args, token=TOKEN) as srv:
        yield srv


def _head(method: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of one response read from ``sock`` (Content-Length framed)."""
    status, headers, body = read_response(sock)
    assert status, body  # the server answered before it closed
    return status, headers, body


def _closed(sock: socket.socket, timeout: float = 5.0) -> bool:
    """Whether the server closes ``sock`` while we keep sending (it must not drain us)."""
    sock.settimeout(0.05)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            sock.sendall(b"4000\r\n" + b"\0" * 0x4000 + b"\r\n")
        except OSError:
            return True
        try:
            if sock.recv(65536) == b"":
                return True
        except TimeoutError:
            pass
        except OSError:
            return True
    return False


# --- header checks in the codec --------------------------------------------------------


HEADER_CASES = [
    (lambda d: b"XLKV" + d[4:], None, BadMagicError),
    (lambda d: d[:4] + b"\x09\x00" + d[6:], None, UnsupportedVersionError),
    (lambda d: d[:6] + b"\x03\x00" + d[8:], None, FormatError),  # v1 with the v2 dtype
    (lambda d: d[:12] + b"\0\0\0\0" + d[16:], None, FormatError),  # B = 0
    (lambda d: d, Geometry(4, 2, 2, 16), ShapeError),
]


@pytest.mark.parametrize(("mutate", "geometry", "error"), HEADER_CASES)
def test_check_header_raises_what_decode_raises(mutate: Any, geometry: Any, error: type) -> None:
    data = mutate(make_envelope(SMALL, 8, seed=1))
    data = data[:-4] + crc32c(data[:-4]).to_bytes(4, "little")  # the header's rule alone fails
    with pytest.raises(error) as whole:
        decode(data, geometry)
    with pytest.raises(error) as early:
        check_header(data[:28], len(data), geometry)
    assert str(early.value) == str(whole.value)


def test_check_header_length() -> None:
    data = make_envelope(SMALL, 8, seed=1)
    assert check_header(data[:28]) == len(data)
    assert check_header(data, len(data), SMALL) == len(data)
    with pytest.raises(TruncatedError) as early:
        check_header(data[:28], len(data) - 1)
    with pytest.raises(TruncatedError) as whole:
        decode(data[:-1])
    assert str(early.value) == str(whole.value)
    with pytest.raises(TruncatedError):
        check_header(data[:27])
    with pytest.raises(TruncatedError, match="at least 32"):
        check_header(data[:28], 30)


# --- 1: a refused body is not drained ----------------------------------------------------


@pytest.mark.parametrize("auth", [False, True], ids=["401", "413"])
def test_refused_chunked_body_closes_the_connection(server: ServerProcess, auth: bool) -> None:
    headers = {"transfer-encoding": "chunked", "content-type": "application/vnd.tlkv"}
    if auth:
        headers["authorization"] = f"Bearer {TOKEN}"
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(_head("PUT", "/v1/blocks", headers))
        if auth:  # a header announcing more than --max-body
            sock.sendall(b"1c\r\n" + pack_header(1, SMALL, 100_000) + b"\r\n")
        status, reply, body = _response(sock)
        assert status == (413 if auth else 401), body
        assert reply["connection"] == "close"
        assert _closed(sock)


def test_refused_content_length_body_closes_the_connection(server: ServerProcess) -> None:
    headers = {"content-length": str(MAX_BODY), "content-type": "application/vnd.tlkv"}
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(_head("PUT", "/v1/blocks", headers) + b"\0" * 4096)
        status, reply, _ = _response(sock)
        assert status == 401 and reply["connection"] == "close"
        sock.settimeout(5)
        with contextlib.suppress(ConnectionResetError):
            assert sock.recv(1) == b""


def test_keep_alive_after_a_body_read_to_its_end(server: ServerProcess) -> None:
    data = make_envelope(SMALL, 8, seed=3)
    headers = {
        "content-length": str(len(data)),
        "content-type": "application/vnd.tlkv",
        "authorization": f"Bearer {TOKEN}",
    }
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        for _ in range(2):  # the same connection twice
            sock.sendall(_head("PUT", "/v1/blocks", headers) + data)
            status, reply, _ = _response(sock)
            assert status == 200 and "connection" not in reply


# --- 2: an envelope is refused by its header, before the rest is sent ---------------------


BAD_HEADERS = [
    (b"JUNK" + bytes(24), MAX_BODY, 422, "format"),
    (
        pack_header(1, Geometry(4, 2, 2, 16), 2),
        Geometry(4, 2, 2, 16).envelope_bytes(2),
        422,
        "shape",
    ),
    (pack_header(1, SMALL, 3), None, 422, "format"),  # Content-Length is not the header's
    (pack_header(1, SMALL, 2)[:4] + b"\x07\x00" + bytes(22), MAX_BODY, 415, "version"),
]


@pytest.mark.parametrize(
    ("head", "length", "status", "kind"), BAD_HEADERS, ids=["magic", "shape", "length", "version"]
)
def test_envelope_refused_from_its_header(
    server: ServerProcess, head: bytes, length: int | None, status: int, kind: str
) -> None:
    length = length or SMALL.envelope_bytes(2)
    headers = {
        "content-length": str(length),
        "content-type": "application/vnd.tlkv",
        "authorization": f"Bearer {TOKEN}",
    }
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(_head("PUT", "/v1/blocks", headers) + head)  # nothing more is sent
        got, reply, body = _response(sock)
    assert (got, reply["connection"]) == (status, "close"), body
    assert kind.encode() in body


def test_sequence_envelope_refused_from_its_header(server: ServerProcess) -> None:
    headers = {
        "content-length": str(MAX_BODY),
        "content-type": "application/vnd.tlkv",
        "authorization": f"Bearer {TOKEN}",
    }
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(_head("PUT", "/v1/sequences/s", headers) + b"JUNK" + bytes(24))
        status, _, body = _response(sock)
    assert status == 422 and b"magic" in body


def test_chunked_envelope_longer_than_its_header(server: ServerProcess) -> None:
    data = make_envelope(SMALL, 8, seed=4)
    with server.client() as http:
        r = http.put(
            "/v1/blocks",
            content=iter([data[:30], data[30:], b"extra"]),
            headers={"content-type": "application/vnd.tlkv"},
        )
        assert "length equals" in assert_error(r, 422, "format")
        r = http.put(
            "/v1/blocks",
            content=iter([data[:30], data[30:-1]]),
            headers={"content-type": "application/vnd.tlkv"},
        )
        assert "length equals" in assert_error(r, 422, "format")
        r = http.put(
            "/v1/blocks",
            content=iter([data[:5], data[5:29], data[29:]]),
            headers={"content-type": "application/vnd.tlkv"},
        )
        assert r.status_code == 200, r.text


# --- 2: the in-flight budget ------------------------------------------------------------


def test_budget_grants_in_order_and_times_out() -> None:
    async def run() -> None:
        budget = InflightBudget(100, wait=0.2)
        await budget.acquire(60)
        order: list[str] = []

        async def take(name: str, n: int) -> None:
            await budget.acquire(n)
            order.append(name)

        big = asyncio.ensure_future(take("big", 80))
        await async_wait_until(lambda: len(budget._waiters) == 1, '"big" to queue')
        small = asyncio.ensure_future(take("small", 10))  # fits, but waits behind "big"
        await async_wait_until(lambda: len(budget._waiters) == 2, '"small" to queue behind "big"')
        assert order == [] and budget.used == 60
        budget.release(60)
        await asyncio.gather(big, small)
        assert order == ["big", "small"] and budget.used == 90
        with pytest.raises(BusyError, match="max-inflight"):
            await budget.acquire(20)
        assert budget.used == 90  # nothing held by the refused request
        budget.release(90)
        await budget.acquire(100)
        assert budget.used == 100

    asyncio.run(run())


def test_budget_head_timing_out_lets_the_next_in() -> None:
    async def run() -> None:
        budget = InflightBudget(100, wait=0.1)
        await budget.acquire(50)
        big = asyncio.ensure_future(budget.acquire(100))
        await async_wait_until(lambda: len(budget._waiters) == 1, "the head to queue")
        budget.wait = 5.0  # the next waits longer than the head
        small = asyncio.ensure_future(budget.acquire(30))
        with pytest.raises(BusyError):
            await big
        await asyncio.wait_for(small, 1)  # granted as soon as the head gave up
        assert budget.used == 80

    asyncio.run(run())


def test_busy_answer_is_503_with_retry_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two envelopes of the whole budget: the second waits, then gets 503 busy. Each is
    larger than ``EARN_BYTES``: the first reserves its whole size once that much arrived."""
    monkeypatch.setattr(bodies, "INFLIGHT_WAIT_SECONDS", 0.2)
    data = make_envelope(SMALL, 1024, seed=5)
    assert len(data) > bodies.EARN_BYTES + 100
    app = create_app(Settings(data=tmp_path / "store", max_body=len(data), max_inflight=len(data)))
    release = asyncio.Event()
    parked = asyncio.Event()

    def scope() -> dict[str, Any]:
        headers = [(b"content-length", str(len(data)).encode())]
        headers.append((b"content-type", b"application/vnd.tlkv"))
        return {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "PUT",
            "scheme": "http",
            "path": "/v1/blocks",
            "raw_path": b"/v1/blocks",
            "root_path": "",
            "query_string": b"",
            "headers": headers,
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 2),
        }

    async def request(slow: bool) -> tuple[int, dict[bytes, bytes]]:
        earned = bodies.EARN_BYTES + 100
        parts = [data[:100], data[100:earned], data[earned:]]
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            if len(parts) == 1 and slow:
                parked.set()  # holding its body's bytes in the budget
                await release.wait()
            chunk = parts.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(parts)}

        async def send(message: MutableMapping[str, Any]) -> None:
            sent.append(dict(message))

        await app(scope(), receive, send)
        return sent[0]["status"], dict(sent[0]["headers"])

    async def run() -> None:
        async with app.router.lifespan_context(app):
            first = asyncio.ensure_future(request(slow=True))
            await parked.wait()
            status, headers = await request(slow=False)
            assert status == 503
            assert headers[b"retry-after"] == b"1" and headers[b"connection"] == b"close"
            release.set()
            assert (await first)[0] == 200
            assert (await request(slow=False))[0] == 200  # the budget was given back

    asyncio.run(run())


def test_ticket_gives_back_what_it_holds() -> None:
    async def run() -> None:
        budget = InflightBudget(100)
        ticket = BodyTicket(budget)
        await ticket.take(30)
        await ticket.take(20)
        assert budget.used == 50 and ticket.held == 50
        ticket.close()
        assert budget.used == 0
        ticket.close()
        assert budget.used == 0

    asyncio.run(run())


def test_max_inflight_setting() -> None:
    assert Settings(max_body=10).inflight_bytes == 20
    assert Settings(max_body=10, max_inflight=35).inflight_bytes == 35
    with pytest.raises(ValueError, match="max-inflight"):
        Settings(max_body=10, max_inflight=9)
    env = {"TLKV_MAX_BODY": "1KiB", "TLKV_MAX_INFLIGHT": "8KiB"}
    assert Settings.from_env(env).inflight_bytes == 8192


# --- 2: the worker's memory under 16 concurrent max-size junk uploads ---------------------

RSS_GEOMETRY = Geometry(16, 32, 8, 128)  # 2 MiB blocks


def _mib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) // 1024
    raise AssertionError(key)


def _sixteen_at_once(tmp_path: Path, send: Any, *args: Any) -> tuple[int, list[int]]:
    """16 threads each running ``send(port, *args, statuses)`` at once against a one-worker
    server on an ``RSS_GEOMETRY`` store: the worker's peak RSS (MiB) and the statuses."""
    import threading

    geometry = ",".join(map(str, RSS_GEOMETRY.as_tuple()))
    with ServerProcess(tmp_path / "store", "--geometry", geometry) as srv:
        assert srv.proc is not None
        statuses: list[int] = []
        threads = [
            threading.Thread(target=send, args=(srv.port, *args, statuses)) for _ in range(16)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return _mib(srv.proc.pid, "VmHWM"), sorted(statuses)


def _junk_upload(port: int, head: bytes, size: int, statuses: list[int]) -> None:
    request = _head(
        "PUT", "/v1/blocks", {"content-type": "application/vnd.tlkv", "content-length": str(size)}
    )
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        try:
            sock.sendall(request + head)
            junk, left = b"\x5a" * (1 << 20), size - len(head)
            while left > 0:
                sock.sendall(junk[: min(left, len(junk))])
                left -= len(junk)
        except OSError:
            pass  # refused early: the server closed while we were sending
        statuses.append(_response(sock)[0])


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
@pytest.mark.parametrize("junk", ["bad-magic", "bad-crc"])
def test_worker_rss_under_16_max_size_junk_uploads(tmp_path: Path, junk: str) -> None:
    """Issue target: worker RSS <= 2 x max-body + 150 MiB (defaults: 64 MiB, 2 x in flight).

    ``bad-crc`` bodies have a valid header, so each is read whole; the budget bounds them.
    """
    max_body = 64 * 1024 * 1024
    n = max_body // RSS_GEOMETRY.record_bytes(1) - 1
    size = RSS_GEOMETRY.envelope_bytes(n)
    head = b"JUNK" + bytes(24) if junk == "bad-magic" else pack_header(1, RSS_GEOMETRY, n)
    peak, statuses = _sixteen_at_once(tmp_path, _junk_upload, head, size)
    assert statuses == [422] * 16
    assert peak <= 2 * max_body // 2**20 + 150, peak


# --- 4: the worker's memory under 16 concurrent max-size JSON queries ---------------------


def _json_query(form: str, size: int) -> bytes:
    """A ``{"hashes": [...]}`` or ``{"tokens": [...]}`` body of about ``size`` bytes."""
    rng = np.random.default_rng(9)
    if form == "hashes":
        items = [b'"%016x"' % h for h in rng.integers(0, 2**63, size // 20, dtype=np.uint64)]
    else:  # 8-byte items, as 8.4 M token ids in 64 MiB
        items = [b"%d" % t for t in rng.integers(10**6, 10**7, size // 9, dtype=np.int64)]
    return b'{"%s": [%s]}' % (form.encode(), b", ".join(items))


def _query(port: int, route: str, body: bytes, statuses: list[int]) -> None:
    request = _head(
        "POST", route, {"content-type": "application/json", "content-length": str(len(body))}
    )
    with socket.create_connection(("127.0.0.1", port), timeout=300) as sock:
        try:
            sock.sendall(request)
            sock.sendall(body)
            statuses.append(_response(sock)[0])
        except (OSError, AssertionError):  # a 503 closes the connection: we may see a reset
            statuses.append(0)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
@pytest.mark.parametrize(
    ("route", "form"), [("/v1/has-blocks", "hashes"), ("/v1/prefix", "tokens")]
)
def test_worker_rss_under_16_max_size_json_queries(tmp_path: Path, route: str, form: str) -> None:
    """Issue target: 16 concurrent 64 MiB JSON queries keep the worker within
    2 x max-body + 150 MiB (json.loads alone took it past 500 MiB with one)."""
    max_body = 64 * 1024 * 1024
    body = _json_query(form, max_body - 64)
    assert max_body - 2**20 < len(body) <= max_body
    peak, statuses = _sixteen_at_once(tmp_path, _query, route, body)
    print(f"{route} {form}: peak worker RSS {peak} MiB, statuses {sorted(statuses)}")
    assert len(statuses) == 16 and set(statuses) <= {200, 503, 0}, statuses
    assert 200 in statuses
    assert peak <= 2 * max_body // 2**20 + 150, peak
