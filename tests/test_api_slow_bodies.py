"""Slow request bodies against a real ``tlkv serve``: a body below ``--min-body-rate`` in a
``--body-timeout`` window is refused with 408 and gives its budget back, a trickling
sender never holds more of the budget than it sent, and ordinary puts keep succeeding
while eight such senders attack (``api/bodies.py``)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from http_server import ServerProcess, read_response

from kvstore import Block, Geometry, encode
from kvstore.codec.assembly import pack_header

G = Geometry(16, 32, 8, 128)  # 2 MiB blocks
GEOMETRY_ARG = ",".join(map(str, G.as_tuple()))
ENVELOPE = {"content-type": "application/vnd.tlkv"}
MAX_BODY = 64 << 20
# The largest envelope of the default --max-body: ~64 MiB of a valid header's n_blocks.
N_LARGE = MAX_BODY // G.record_bytes(1) - 1


def _envelope(seed: int, n: int = 1) -> bytes:
    kv = np.random.default_rng(seed).standard_normal(G.kv_shape).astype(np.float16)
    return encode(G, [Block(0x10000 * seed + i + 1, G.block_tokens, kv) for i in range(n)])


def _put_head(size: int, path: str = "/v1/blocks") -> bytes:
    return (
        f"PUT {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/vnd.tlkv\r\n"
        f"Content-Length: {size}\r\n\r\n"
    ).encode()


def _is_closed(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except OSError:
        return True


class Trickler(threading.Thread):
    """The slow sender of the issue: a valid header announcing ~64 MiB, ``first`` bytes of
    body at once (28 of header, the rest zeros), then one byte every ``every`` seconds; on
    each answer (or a closed connection) it notes the status and the seconds it held the
    connection, and connects again, until ``stop``."""

    def __init__(self, port: int, stop: threading.Event, first: int = 40, every: float = 2.0):
        super().__init__(daemon=True)
        self.port, self.stop, self.first, self.every = port, stop, first, every
        self.answers: list[tuple[int, float, str]] = []  # (status, seconds held, error kind)

    def run(self) -> None:
        size = G.envelope_bytes(N_LARGE)
        body = pack_header(1, G, N_LARGE) + bytes(self.first - 28)
        while not self.stop.is_set():
            with socket.create_connection(("127.0.0.1", self.port)) as sock:
                t0 = time.monotonic()
                try:
                    sock.sendall(_put_head(size) + body)
                    sock.settimeout(self.every)
                    while not self.stop.is_set():
                        try:
                            status, _, answer = read_response(sock)
                            break
                        except TimeoutError:
                            sock.sendall(b"\0")
                    else:
                        return
                except OSError:
                    status, answer = 0, b""
                kind = json.loads(answer)["error"]["kind"] if status else "closed"
                self.answers.append((status, time.monotonic() - t0, kind))


@pytest.fixture
def attack() -> Iterator[tuple[threading.Event, list[Trickler]]]:
    stop = threading.Event()
    senders: list[Trickler] = []
    yield stop, senders
    stop.set()
    for s in senders:
        s.join(10)


@pytest.mark.slow
def test_ordinary_puts_succeed_while_eight_slow_uploads_trickle(
    tmp_path: Path, attack: tuple[threading.Event, list[Trickler]]
) -> None:
    """The issue's attack on two workers with the defaults (64 MiB bodies, 2 x 64 MiB in
    flight per worker, 1 MiB/s over 5 s windows): eight connections each announce ~64 MiB,
    send 40 bytes, then one byte every 2 s, reconnecting whenever refused. Meanwhile every
    ordinary 2 MiB put answers 200 within a second or two (before: each waited 10 s for
    budget the tricklers held, then answered 503), and every trickler is refused with 408
    ``timeout`` one window (5 s) after it connected."""
    stop, senders = attack
    with ServerProcess(tmp_path / "store", "--geometry", GEOMETRY_ARG, "--workers", "2") as srv:
        senders += [Trickler(srv.port, stop) for _ in range(8)]
        for s in senders:
            s.start()
        time.sleep(1.0)  # every trickler connected and sent its first bytes
        puts: list[tuple[int, float]] = []
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            seed = 1
            t_end = time.monotonic() + 14  # longer than a window and a budget wait (10 s)
            while time.monotonic() < t_end:
                t0 = time.monotonic()
                r = http.put("/v1/blocks", content=_envelope(seed), headers=ENVELOPE)
                puts.append((r.status_code, time.monotonic() - t0))
                seed += 1
        stop.set()
        for s in senders:
            s.join(15)
        assert srv.alive()
    statuses = [status for status, _ in puts]
    slowest = max(seconds for _, seconds in puts)
    assert len(puts) >= 10 and set(statuses) == {200}, puts
    assert slowest < 3.0, puts
    answers = [a for s in senders for a in s.answers]
    assert len(answers) >= 16, answers  # each trickler refused at least twice in 14 s
    assert {(status, kind) for status, _, kind in answers} == {(408, "timeout")}, answers
    assert all(4.0 < held < 9.0 for _, held, _ in answers), answers


def test_a_stalled_body_is_refused_and_its_budget_freed(tmp_path: Path) -> None:
    """One worker whose whole in-flight budget is one 64 MiB body: a sender that sends the
    header and 100 KiB (enough to reserve its 64 MiB) and then stalls is answered 408
    ``timeout`` with ``Connection: close`` one window (1 s) later, and a 64 MiB put waiting
    behind it gets the budget then (before: it waited 10 s and answered 503 busy)."""
    args = ("--geometry", GEOMETRY_ARG, "--max-inflight", "64MiB", "--body-timeout", "1")
    with ServerProcess(tmp_path / "store", *args) as srv:
        size = G.envelope_bytes(N_LARGE)
        with socket.create_connection(("127.0.0.1", srv.port)) as sock:
            sock.sendall(_put_head(size) + pack_header(1, G, N_LARGE) + bytes(100 << 10))
            time.sleep(0.3)  # the stalled body holds the whole budget now
            big = _envelope(7, N_LARGE)
            with httpx.Client(base_url=srv.url, timeout=30) as http:
                t0 = time.monotonic()
                r = http.put("/v1/blocks", content=big, headers=ENVELOPE)
                waited = time.monotonic() - t0
            sock.settimeout(10)
            status, headers, body = read_response(sock)
            assert status == 408 and headers["connection"] == "close", (status, headers, body)
            error = json.loads(body)["error"]
            assert error["kind"] == "timeout" and "--min-body-rate" in error["message"]
            assert _is_closed(sock)
        assert r.status_code == 200, r.text
        assert len(r.json()["stored"]) == N_LARGE
        assert waited < 5.0, waited
        assert 'status="408"' in httpx.get(f"{srv.url}/metrics").text


def test_bodies_at_or_above_the_rate_pass_and_below_it_are_refused(tmp_path: Path) -> None:
    """With ``--min-body-rate 1MiB/s --body-timeout 1``: a 6 MiB envelope sent at about
    2 MiB/s in 256 KiB steps is stored; the same body at about 0.25 MiB/s is refused with
    408 in its first window; a JSON query that stalls after its first bytes too, and a
    chunked body of unknown size that trickles."""
    args = ("--geometry", GEOMETRY_ARG, "--min-body-rate", "1MiB/s", "--body-timeout", "1")
    data = _envelope(3, 3)

    def send(sock: socket.socket, head: bytes, body: bytes, step: int, pause: float) -> None:
        sock.sendall(head)
        sock.settimeout(pause)
        for i in range(0, len(body), step):
            try:
                sock.sendall(body[i : i + step])
            except OSError:
                return  # refused meanwhile: the answer is waiting
            try:
                if sock.recv(1, socket.MSG_PEEK):
                    return  # answered before the end
            except TimeoutError:
                pass

    with ServerProcess(tmp_path / "store", *args) as srv:
        with socket.create_connection(("127.0.0.1", srv.port)) as sock:
            send(sock, _put_head(len(data)), data, 256 << 10, 0.125)
            sock.settimeout(10)
            status, _, body = read_response(sock)
            assert status == 200, body
        with socket.create_connection(("127.0.0.1", srv.port)) as sock:
            t0 = time.monotonic()
            send(sock, _put_head(len(data)), data, 64 << 10, 0.25)
            sock.settimeout(10)
            status, headers, body = read_response(sock)
            assert status == 408 and json.loads(body)["error"]["kind"] == "timeout", body
            assert time.monotonic() - t0 < 3.0
        query = json.dumps({"hashes": [f"{i:016x}" for i in range(1000)]}).encode()
        head = (
            f"POST /v1/has-blocks HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(query)}\r\n\r\n"
        ).encode()
        with socket.create_connection(("127.0.0.1", srv.port)) as sock:
            sock.sendall(head + query[:100])
            sock.settimeout(10)
            status, headers, body = read_response(sock)
            assert status == 408 and headers["connection"] == "close", body
        chunked = (
            b"PUT /v1/blocks HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/vnd.tlkv"
            b"\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        with socket.create_connection(("127.0.0.1", srv.port)) as sock:
            sock.sendall(chunked + b"%x\r\n%s\r\n" % (100, data[:100]))
            sock.settimeout(0.4)
            for i in range(100, 110):  # a byte now and then: far below the rate
                try:
                    sock.sendall(b"1\r\n%s\r\n" % data[i : i + 1])
                    sock.recv(1, socket.MSG_PEEK)
                    break
                except TimeoutError:
                    pass
            sock.settimeout(10)
            status, _, body = read_response(sock)
            assert status == 408, body
        with httpx.Client(base_url=srv.url, timeout=30) as http:  # the worker is fine
            assert http.put("/v1/blocks", content=data, headers=ENVELOPE).status_code == 200
