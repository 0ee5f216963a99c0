"""``kvstore.client_http1``: the client's HTTP/1.1 reader against answers written byte by
byte (``fake_http``): each framing, the answers it skips, what it refuses, and when a
connection is kept."""

from __future__ import annotations

import socket
from typing import Any

import httpx
import pytest
from fake_http import read_request, reply

from kvstore.client import Client


def _serve(answers: dict[bytes, bytes], close_after: bytes = b"") -> Any:
    """A handler answering each request whose path holds a key with its bytes; it closes
    the connection after answering a path that holds ``close_after``."""

    def handler(sock: socket.socket, index: int) -> None:
        while True:
            path = read_request(sock).split(b" ")[1]
            key = next(k for k in answers if k in path)
            sock.sendall(answers[key])
            if close_after and close_after in path:
                return

    return handler


def test_informational_answers_are_skipped(fake: Any) -> None:
    srv = fake(
        _serve(
            {
                b"/": b"HTTP/1.1 100 Continue\r\nx: 1\r\n\r\n"
                b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
            }
        )
    )
    with Client(srv.url) as c:
        assert c._ok("GET", "/a").content == b"ok"
        assert c._ok("GET", "/b").content == b"ok"
    assert srv.accepted == 1


def test_answers_without_a_body_leave_the_connection_usable(fake: Any) -> None:
    srv = fake(
        _serve(
            {
                b"/head": b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n",  # HEAD: no body follows
                b"/nothing": b"HTTP/1.1 204 No Content\r\n\r\n",
                b"/same": b"HTTP/1.1 304 Not Modified\r\ncontent-length: 9\r\n\r\n",
                b"/next": reply(b"next"),
            }
        )
    )
    with Client(srv.url) as c:
        head = c._http.head("/head")
        assert head.status_code == 200 and head.content == b""
        assert c._http.get("/nothing").status_code == 204
        assert c._http.get("/same").status_code == 304
        assert c._ok("GET", "/next").content == b"next"
    assert srv.accepted == 1


def test_chunked_with_extensions_folds_and_trailers(fake: Any) -> None:
    srv = fake(
        _serve(
            {
                b"/c": b"HTTP/1.1 200 OK\r\nx-long: a\r\n b\r\ntransfer-encoding: chunked\r\n\r\n"
                b"3;ext=1\r\nabc\r\nA\r\n0123456789\r\n0\r\nx-trailer: t\r\n\r\n",
                b"/next": reply(b"next"),
            }
        )
    )
    with Client(srv.url) as c:
        answer = c._ok("GET", "/c")
        assert answer.content == b"abc0123456789"
        assert answer.headers["x-long"] == "a b"
        assert c._ok("GET", "/next").content == b"next"
    assert srv.accepted == 1


def test_a_body_framed_by_the_close_and_connection_close(fake: Any) -> None:
    srv = fake(
        _serve(
            {
                b"/eof": b"HTTP/1.1 200 OK\r\n\r\nuntil the end",
                b"/closing": b"HTTP/1.1 200 OK\r\nconnection: close\r\n"
                b"content-length: 3\r\n\r\nbye",
                b"/old": b"HTTP/1.0 200 OK\r\ncontent-length: 3\r\n\r\nold",
            },
            close_after=b"/",
        )
    )
    with Client(srv.url) as c:
        assert c._ok("GET", "/eof").content == b"until the end"
        assert c._ok("GET", "/closing").content == b"bye"
        assert c._ok("GET", "/old").content == b"old"
    assert srv.accepted == 3  # none of the three connections was used again


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\nabcd",
        b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\n\r\n",
        b"HTTP/2 200 OK\r\ncontent-length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nab",
        b"HTTP/1.1 200 OK\r\n" + b"x: y\r\n" * 101 + b"\r\n",
        b"HTTP/1.1 200 OK\r\nx: " + b"y" * 65536 + b"\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent",  # the connection closes within the head
    ],
    ids=[
        "two-lengths",
        "negative-length",
        "no-colon",
        "four-digit-status",
        "http2",
        "bad-chunk-size",
        "short-chunk",
        "101-headers",
        "long-line",
        "cut-head",
    ],
)
def test_malformed_answers_are_protocol_errors(fake: Any, answer: bytes) -> None:
    srv = fake(_serve({b"/": answer}, close_after=b"/"))
    with Client(srv.url) as c, pytest.raises(httpx.RemoteProtocolError):
        c._ok("GET", "/")


def test_a_header_value_that_would_split_the_request_is_refused(fake: Any) -> None:
    srv = fake(_serve({b"/": reply(b"x")}))
    with Client(srv.url) as c:
        with pytest.raises(ValueError, match="Invalid header value"):
            c._http.get("/", headers={"x-evil": "a\r\nx-injected: 1"})
        assert c._ok("GET", "/").content == b"x"  # the refused request sent nothing
