"""A loopback HTTP peer that answers with the bytes a test writes, for the client's wire:
the framings, malformed answers and dropped connections a real server rarely sends."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator

import pytest


class FakeServer:
    """A loopback server whose every connection runs ``handler(sock, index)`` in a thread."""

    def __init__(self, handler: Callable[[socket.socket, int], None]) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.accepted = 0
        self.closed = threading.Semaphore(0)  # released as each connection is closed
        self._handler = handler
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                sock, _addr = self.listener.accept()
            except OSError:
                return
            index, self.accepted = self.accepted, self.accepted + 1
            threading.Thread(target=self._run, args=(sock, index), daemon=True).start()

    def _run(self, sock: socket.socket, index: int) -> None:
        with sock, contextlib.suppress(OSError):
            self._handler(sock, index)
        self.closed.release()

    def close(self) -> None:
        self.listener.close()


def _read_head(sock: socket.socket) -> tuple[bytes, bytes]:
    """A request's head (through its blank line) and the bytes read after it."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("client closed")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head + b"\r\n\r\n", rest


def read_request(sock: socket.socket) -> bytes:
    """The request head (for bodiless requests: a GET)."""
    return _read_head(sock)[0]


def read_request_with_body(sock: socket.socket) -> tuple[bytes, bytes]:
    """A request's head and its body of Content-Length bytes (what the client sends)."""
    head, body = _read_head(sock)
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("client closed")
        body += chunk
    return head, body


def reply(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n" % (len(body), extra) + body


@pytest.fixture
def fake() -> Iterator[Callable[[Callable[[socket.socket, int], None]], FakeServer]]:
    servers: list[FakeServer] = []

    def start(handler: Callable[[socket.socket, int], None]) -> FakeServer:
        servers.append(FakeServer(handler))
        return servers[-1]

    yield start
    for s in servers:
        s.close()
