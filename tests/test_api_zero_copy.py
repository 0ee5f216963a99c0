"""Zero-copy bodies over a real uvicorn (uvloop + httptools): the read snapshot a body is
sent from stays open until the transport has written it, whatever a concurrent writer
does meanwhile; a client that stops reading is cut off after ``BODY_HOLD_SECONDS`` without
progress, one that reads slowly is not."""

from __future__ import annotations

import array
import fcntl
import socket
import termios
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from http_server import ServerProcess, ThreadServer, assert_error
from waiting import parked_on

from api import bodywatch
from api.app import create_app
from api.http_protocol import TlkvHttpProtocol
from api.settings import Settings
from kvstore import Block, Geometry, decode, encode, join
from kvstore.store import lmdbenv

ENVELOPE = {"content-type": "application/vnd.tlkv"}

# 8 MiB blocks: twice what the kernel buffers for a socket here (tcp_wmem max, 4 MiB)
G = Geometry(16, 128, 8, 128)


def _block(seed: int, block_hash: int) -> bytes:
    kv = np.random.default_rng(seed).standard_normal(G.kv_shape).astype(np.float16)
    return encode(G, [Block(block_hash, G.block_tokens, kv)])


class _Server(ThreadServer):
    """The app under uvicorn in a thread: uvloop and httptools, or ``tlkv serve``'s
    protocol on httptools (block reads answered in it)."""

    def __init__(self, data: Path, http: Any = "httptools") -> None:
        # A map large enough from the start: the writer never needs a remap (which would
        # wait for the held bodies: see test_a_remap_waits_for_held_bodies).
        super().__init__(create_app(Settings(data=data, geometry=G, capacity_bytes=1 << 30)), http)

    def answered_reads(self, before: int) -> None:
        """Block reads since ``TlkvHttpProtocol.answered`` was ``before`` went through
        the protocol's own path when it serves, else none did."""
        if self.http is TlkvHttpProtocol:
            assert TlkvHttpProtocol.answered > before
        else:
            assert TlkvHttpProtocol.answered == before


@pytest.fixture(params=["httptools", TlkvHttpProtocol], ids=["asgi", "protocol"])
def server(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[_Server]:
    """Each scenario twice: block reads answered by the app (through ASGI) and by
    ``TlkvHttpProtocol`` itself."""
    with _Server(tmp_path / "store", request.param) as s:
        yield s


def _starved_client(port: int) -> socket.socket:
    """A connection with a tiny receive buffer: the server's transport keeps the rest."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    return sock


def _read_response(f: Any) -> tuple[int, bytes]:
    status = int(f.readline().split()[1])
    length = 0
    while (line := f.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        if name.lower() == "content-length":
            length = int(value)
    return status, f.read(length)


def _wait(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _readable(sock: socket.socket) -> int:
    """Bytes the kernel holds for ``sock`` to read (FIONREAD)."""
    return int(array.array("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0])


def _churn(store: Any, gone: list[int], n: int) -> None:
    """Delete ``gone`` and put ``n`` new blocks of the same size, a commit each: LMDB
    reuses the freed pages as soon as no open snapshot still needs them."""
    for h in gone:
        assert store.delete(h)
    for i in range(n):
        store.put(_block(1000 + i, 0x7000 + i))


def _pipelined_gets_with_writer(
    server: _Server, sent: Callable[[socket.socket], bool] | None = None
) -> tuple[list[tuple[int, bytes]], list[bytes], int]:
    """Two pipelined GETs from a starved client while a writer frees and reuses pages:
    the answers, the blocks as put, and how many snapshots were held during the churn."""
    store = server.store
    originals = [_block(1, 0xA1), _block(2, 0xB2)]
    for data in originals:
        store.put(data)
    answered = TlkvHttpProtocol.answered
    sock = _starved_client(server.port)
    with sock, sock.makefile("rb") as f:
        sock.sendall(
            b"GET /v1/blocks/00000000000000a1 HTTP/1.1\r\nHost: t\r\n\r\n"
            b"GET /v1/blocks/00000000000000b2 HTTP/1.1\r\nHost: t\r\n\r\n"
        )
        # The first answer has been sent (send returned) but sits in the transport.
        held = (lambda: sent(sock)) if sent else (lambda: store.held_snapshots()[0] >= 1)
        _wait(held, "no body held by the transport")
        _churn(store, [0xA1, 0xB2], 8)
        held = store.held_snapshots()[0]
        answers = [_read_response(f), _read_response(f)]
    server.answered_reads(answered)
    return answers, originals, held


@pytest.mark.slow
def test_pipelined_gets_against_a_concurrent_writer_stay_intact(server: _Server) -> None:
    answers, expected, held_during = _pipelined_gets_with_writer(server)
    assert held_during >= 1  # the snapshot was still open while the client did not read
    for (status, body), original in zip(answers, expected):
        assert status == 200
        assert len(body) == len(original)
        assert body == original  # not one byte from the writer's reused pages
        decode(body, G)  # CRC and every rule
    # Once the transport has written everything, no snapshot is left open.
    _wait(lambda: server.store.held_snapshots() == (0, 0.0), "snapshot left open")


@pytest.mark.slow
def test_the_scenario_catches_a_snapshot_ended_at_send_return(
    server: _Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Control: with the snapshot ended as soon as the body is handed over (what ending it
    when ``send`` returns amounts to), the same scenario serves the writer's bytes."""

    def ended_at_once(self: lmdbenv.LmdbEnv, txn: Any, values: list[Any]) -> list[memoryview]:
        out = [memoryview(np.frombuffer(v, np.uint8).data) for v in values]
        self.end_read(txn)
        return out

    monkeypatch.setattr(lmdbenv.LmdbEnv, "hold", ended_at_once)
    store = server.store

    def sent(sock: socket.socket) -> bool:  # the first body was handed to the transport:
        return store.hits >= 1 and _readable(sock) >= 2048  # more than its head has arrived

    answers, expected, _ = _pipelined_gets_with_writer(server, sent)
    assert [status for status, _ in answers] == [200, 200]
    assert any(body != original for (_, body), original in zip(answers, expected))


@pytest.mark.slow
def test_prefix_body_is_zero_copy_and_released(server: _Server) -> None:
    store = server.store
    blocks = [_block(10 + i, 0xC0 + i) for i in range(4)]
    for data in blocks:
        store.put(data)
    sock = _starved_client(server.port)
    body = b'{"hashes": [%s]}' % b", ".join(b'"%016x"' % (0xC0 + i) for i in range(4))
    with sock, sock.makefile("rb") as f:
        sock.sendall(
            b"POST /v1/prefix HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        _wait(lambda: store.held_snapshots()[0] == 1, "no prefix body held")
        _churn(store, [0xC0 + i for i in range(4)], 8)
        status, answer = _read_response(f)
    assert status == 200
    env = decode(answer, G)
    assert [int(h) for h in env.hashes] == [0xC0 + i for i in range(4)]
    assert answer == join(blocks)
    _wait(lambda: store.held_snapshots() == (0, 0.0), "snapshot left open")


def test_a_stalled_client_is_cut_off(server: _Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bodywatch, "BODY_HOLD_SECONDS", 0.5)
    store = server.store
    store.put(_block(3, 0xD4))
    answered = TlkvHttpProtocol.answered
    sock = _starved_client(server.port)
    with sock:
        sock.sendall(b"GET /v1/blocks/00000000000000d4 HTTP/1.1\r\nHost: t\r\n\r\n")
        _wait(lambda: store.held_snapshots()[0] == 1, "no body held")
        assert store.held_snapshots()[1] < 0.5
        # Never read: the server aborts the connection, the snapshot ends.
        _wait(lambda: store.held_snapshots() == (0, 0.0), "stalled snapshot not ended", 10)
        sock.settimeout(5)
        received = 0
        try:
            while chunk := sock.recv(1 << 16):
                received += len(chunk)
        except OSError:  # reset by the server
            pass
        assert received < len(_block(3, 0xD4))  # what the kernel had taken, then the end
    server.answered_reads(answered)
    text = server.app.state.metrics.render(None)
    assert "tlkv_http_stalled_bodies_total 1.0" in text


def test_a_slow_reader_is_not_cut_off(server: _Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that keeps reading, slowly, gets the whole body: the hold time counts time
    without progress, not time since the first byte (here 6-7 times the hold time)."""
    monkeypatch.setattr(bodywatch, "BODY_HOLD_SECONDS", 0.5)
    store = server.store
    original = _block(6, 0xD6)
    store.put(original)
    answered = TlkvHttpProtocol.answered
    sock = _starved_client(server.port)
    started = time.monotonic()
    with sock:
        sock.sendall(b"GET /v1/blocks/00000000000000d6 HTTP/1.1\r\nHost: t\r\n\r\n")
        _wait(lambda: store.held_snapshots()[0] == 1, "no body held")
        received = bytearray()
        sock.settimeout(5)
        while len(received) < len(original) or b"\r\n\r\n" not in received[:4096]:
            target = len(received) + (128 << 10)
            while len(received) < target:  # 128 KiB, then a pause well under the hold time
                chunk = sock.recv(1 << 16)
                assert chunk, f"cut off after {len(received)} bytes"
                received += chunk
                if received.endswith(original):
                    break
            if received.endswith(original):
                break
            time.sleep(0.05)
    assert time.monotonic() - started > 3 * 0.5
    head, _, body = bytes(received).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and body == original
    server.answered_reads(answered)
    _wait(lambda: store.held_snapshots() == (0, 0.0), "snapshot left open")
    assert "tlkv_http_stalled_bodies_total 0.0" in server.app.state.metrics.render(None)


def test_a_remap_waits_for_held_bodies(server: _Server) -> None:
    """A remap (map growth) waits until the transport has released the body, and the
    body read meanwhile is intact."""
    store = server.store
    original = _block(5, 0xE5)
    store.put(original)
    answered = TlkvHttpProtocol.answered
    sock = _starved_client(server.port)
    with sock, sock.makefile("rb") as f:
        sock.sendall(b"GET /v1/blocks/00000000000000e5 HTTP/1.1\r\nHost: t\r\n\r\n")
        _wait(lambda: store.held_snapshots()[0] == 1, "no body held")
        grown = threading.Event()

        def grow() -> None:
            store._h.env.lmdb.resize(grow=True, need=0)
            grown.set()

        t = threading.Thread(target=grow)
        t.start()
        held_cond = (
            store._h.env.lmdb.snapshots._held_cond
        )  # what a remap waits on for held bodies to end
        _wait(lambda: parked_on(held_cond) or grown.is_set(), "the remap neither waits nor ends")
        assert not grown.is_set()  # waiting for the transport to let go
        status, body = _read_response(f)
        t.join(10)
    assert grown.is_set()
    assert status == 200 and body == original
    server.answered_reads(answered)


def test_a_stalled_prefix_client_is_cut_off(
    server: _Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefix answer goes out in several parts; the second ``send`` waits for the client
    (flow control), so the watch must start with the first byte or it never starts."""
    monkeypatch.setattr(bodywatch, "BODY_HOLD_SECONDS", 0.5)
    store = server.store
    for i in range(3):
        store.put(_block(40 + i, 0xF0 + i))
    before = server.app.state.metrics.render(None)
    assert "tlkv_http_stalled_bodies_total 0.0" in before
    sock = _starved_client(server.port)
    body = b'{"hashes": [%s]}' % b", ".join(b'"%016x"' % (0xF0 + i) for i in range(3))
    with sock:
        sock.sendall(
            b"POST /v1/prefix HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        _wait(lambda: store.held_snapshots()[0] == 1, "no prefix body held")
        started = time.monotonic()
        _wait(lambda: store.held_snapshots() == (0, 0.0), "stalled prefix not ended", 10)
        assert time.monotonic() - started < 5
    text = server.app.state.metrics.render(None)
    assert "tlkv_http_stalled_bodies_total 1.0" in text


# 2 MiB blocks: an 8-block prefix (16 MiB) is far more than the socket buffers take.
G2 = Geometry(16, 32, 8, 128)


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.mark.slow
def test_stalled_prefix_readers_of_a_real_server_are_cut_off_and_puts_go_on(
    tmp_path: Path,
) -> None:
    """``tlkv serve``: two raw connections ask for a 16 MiB prefix and never read. Both
    are aborted within 30 s of their first byte (counted), while puts that make the map
    grow wait for them and succeed (or answer 503 busy with Retry-After), never 500."""
    data = tmp_path / "store"
    geometry = ",".join(map(str, G2.as_tuple()))
    kv = np.random.default_rng(7).standard_normal((8, *G2.kv_shape)).astype(np.float16)
    with (
        ServerProcess(data, "--geometry", geometry) as srv,
        httpx.Client(base_url=srv.url, timeout=120) as c,
    ):
        prefix = encode(G2, [Block(0x100 + i, G2.block_tokens, kv[i]) for i in range(8)])
        assert c.put("/v1/blocks", content=prefix, headers=ENVELOPE).status_code == 200
        body = b'{"hashes": [%s]}' % b", ".join(b'"%016x"' % (0x100 + i) for i in range(8))
        request = (  # a Host naming the server: it has no token (api.hosts)
            b"POST /v1/prefix HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        socks = [_starved_client(srv.port) for _ in range(2)]
        try:
            for sock in socks:
                sock.sendall(request)
            asked = time.monotonic()
            _wait(
                lambda: _metric(c.get("/metrics").text, "tlkv_store_open_snapshots") >= 2,
                "the stalled bodies hold no snapshot",
            )
            statuses: list[int] = []
            waited = 0.0
            for n in range(4):  # 64 MiB more than the 64 MiB map: it must grow
                blocks = [Block(0x200 + 8 * n + i, G2.block_tokens, kv[i]) for i in range(8)]
                t0 = time.monotonic()
                while True:
                    r = c.put("/v1/blocks", content=encode(G2, blocks), headers=ENVELOPE)
                    statuses.append(r.status_code)
                    if r.status_code != 503:
                        break
                    assert_error(r, 503, "busy") and r.headers["retry-after"]
                waited = max(waited, time.monotonic() - t0)
                assert r.status_code == 200, r.text
            assert 500 not in statuses
            assert waited > 5  # a put needed a remap while the bodies were held
            stalled = 0.0
            while stalled < 2:
                stalled = _metric(c.get("/metrics").text, "tlkv_http_stalled_bodies_total")
                assert time.monotonic() - asked < 33, "a stalled body outlived 30 s"
                time.sleep(0.2)
            _wait(
                lambda: _metric(c.get("/metrics").text, "tlkv_store_open_snapshots") == 0,
                "a snapshot outlived its aborted body",
            )
        finally:
            for sock in socks:
                sock.close()
