"""HTTP/1.1 on one kept-alive socket, for the client's wire: a request written, its
response read (status line, headers, body) through a buffered reader the connection keeps.

``http.client`` parses every response's headers into an ``email`` message and opens a new
buffered reader on the socket for each response, client CPU that a block read pays on
every call. :class:`Connection` reads the same responses with ``readline`` and one
``read(n)`` (a ``bytes`` filled in place) or ``readinto`` per body, and checks what
``http.client`` checks on the way out:

- the request: a target without control characters or spaces, header names without
  separators, values without a bare CR or LF (``ValueError``, as ``http.client``);
- the response: a status line ``HTTP/x.y NNN reason`` of at most 64 KiB, at most 100
  header lines, 1xx answers skipped (except 101); a body framed by ``chunked`` (it wins
  over a Content-Length, RFC 9112 6.3), by Content-Length, or by the connection's close;
  none for HEAD, 204 and 304. A malformed or short answer raises :class:`ProtocolError`;
  no byte of a status line at all raises :class:`Disconnected` (the server closed the
  connection: a kept-alive one may be retried).
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from typing import Any

__all__ = ["Connection", "Disconnected", "Head", "ProtocolError"]

_MAX_LINE = 65536  # http.client's limit for a status or header line
_MAX_HEADERS = 100  # http.client's limit for the number of header lines
_JOIN_BODY = 64 << 10  # a body up to this size goes out in the head's write
_END_OF_HEAD = (b"\r\n", b"\n", b"")
# http.client's request checks: a target without control characters or spaces, a header
# name without separators or whitespace, a value without a CR or LF that is not a fold.
_BAD_TARGET = re.compile("[\x00-\x20\x7f]").search
_GOOD_NAME = re.compile(rb"[^:\s][^:\r\n]*").fullmatch
_BAD_VALUE = re.compile(rb"\n(?![ \t])|\r(?![ \t\n])").search


class ProtocolError(Exception):
    """The server's answer breaks HTTP/1.1 framing (or ends before its body does)."""


class Disconnected(ProtocolError):
    """The connection closed before any byte of a status line."""


@dataclass
class Head:
    """A response's status line and headers, and how its body is framed."""

    status: int
    reason: str
    headers: list[tuple[str, str]]
    length: int | None  # the body's length; None: chunked, or up to the connection's close
    chunked: bool
    will_close: bool  # the server closes the connection after this response


def _bytes(text: Any) -> bytes:
    return text if isinstance(text, bytes) else str(text).encode("latin-1")


class Connection:
    """One connected socket (TCP, or TLS over it) and the reader kept for its answers."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._fp = sock.makefile("rb")

    def close(self) -> None:
        """Close the reader and the socket."""
        self._fp.close()
        self.sock.close()

    def send(self, method: str, target: str, headers: Any, body: bytes | None) -> None:
        """Write the request: ``headers`` as ``(name, value)`` pairs (bytes or text),
        Host and Content-Length among them; ``body`` as given (not framed here)."""
        if _BAD_TARGET(target):
            raise ValueError(f"URL can't contain control characters: {target!r}")
        parts = [f"{method} {target} HTTP/1.1\r\n".encode("ascii")]
        for name, value in headers:
            name, value = _bytes(name), _bytes(value)
            if not _GOOD_NAME(name):
                raise ValueError(f"Invalid header name {name!r}")
            if _BAD_VALUE(value):
                raise ValueError(f"Invalid header value {value!r}")
            parts += (name, b": ", value, b"\r\n")
        parts.append(b"\r\n")
        head = b"".join(parts)
        if body and len(body) <= _JOIN_BODY:
            self.sock.sendall(head + body)  # one segment: no delayed-ACK wait on the body
            return
        self.sock.sendall(head)
        if body:
            self.sock.sendall(body)

    def _line(self) -> bytes:
        line = self._fp.readline(_MAX_LINE + 1)
        if len(line) > _MAX_LINE:
            raise ProtocolError("a status or header line longer than 64 KiB")
        return line

    def read_head(self, method: str) -> Head:
        """The next final response's head (1xx answers before it skipped)."""
        first = True
        while True:
            line = self._line()
            if not line:
                if first:
                    raise Disconnected("the server closed the connection without answering")
                raise ProtocolError("the connection closed within an answer's head")
            first = False
            version, status, reason = _status_line(line)
            headers = self._headers()
            if 100 <= status < 200 and status != 101:
                continue
            return _framing(method, version, status, reason, headers)

    def _headers(self) -> list[tuple[str, str]]:
        headers: list[tuple[str, str]] = []
        while True:
            line = self._line()
            if line in _END_OF_HEAD:
                return headers
            if len(headers) >= _MAX_HEADERS:
                raise ProtocolError(f"more than {_MAX_HEADERS} header lines")
            if line[:1] in (b" ", b"\t") and headers:  # an obsolete fold: the value goes on
                name, text = headers[-1]
                headers[-1] = (name, f"{text} {line.strip().decode('latin-1')}")
                continue
            key, colon, value = line.partition(b":")
            if not colon or not key or key != key.strip():
                raise ProtocolError(f"a malformed header line: {line[:80]!r}")
            headers.append((key.decode("latin-1"), value.strip().decode("latin-1")))

    def read_body(self, head: Head, into: Any = None) -> tuple[bytes, memoryview | None]:
        """The body: ``(content, None)``, or ``(b"", the filled part of into)`` when
        ``into`` (a writable buffer) is given and the length is known and fits."""
        if head.chunked:
            return self._chunked(), None
        if head.length is None:
            return self._fp.read(), None
        n = head.length
        if into is not None and n <= len(into):
            filled = memoryview(into)[:n]
            if self._fp.readinto(filled) != n:
                raise ProtocolError(f"the connection closed within a body of {n} bytes")
            return b"", filled
        data = self._fp.read(n) if n else b""
        if len(data) != n:
            raise ProtocolError(f"the connection closed within a body of {n} bytes")
        return data, None

    def read_exactly(self, view: memoryview) -> None:
        """Fill the writable ``view`` with the next bytes of a body whose length the caller
        knows (``ProtocolError`` when the connection closes first)."""
        if self._fp.readinto(view) != len(view):
            raise ProtocolError(f"the connection closed within a body ({len(view)} bytes due)")

    def _chunked(self) -> bytes:
        parts = []
        while True:
            line = self._line()
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise ProtocolError(f"a malformed chunk size line: {line[:80]!r}") from None
            if size < 0:
                raise ProtocolError("a negative chunk size")
            if size == 0:
                break
            data = self._fp.read(size)
            if len(data) != size or self._line() not in (b"\r\n", b"\n"):
                raise ProtocolError("the connection closed within a chunk")
            parts.append(data)
        while self._line() not in _END_OF_HEAD:  # trailer fields: read and dropped
            pass
        return b"".join(parts)


def _status_line(line: bytes) -> tuple[str, int, str]:
    text = line.decode("latin-1")
    parts = text.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/"):
        raise ProtocolError(f"a malformed status line: {text[:80]!r}")
    status = parts[1]
    if len(status) != 3 or not status.isdigit() or not 100 <= int(status) <= 999:
        raise ProtocolError(f"a malformed status code: {text[:80]!r}")
    return parts[0], int(status), parts[2].strip() if len(parts) > 2 else ""


def _framing(
    method: str, version: str, status: int, reason: str, headers: list[tuple[str, str]]
) -> Head:
    """How the body of this response is framed, and whether the connection stays open."""
    fields: dict[str, list[str]] = {}
    for name, value in headers:
        fields.setdefault(name.lower(), []).append(value)
    tokens = {t.strip().lower() for v in fields.get("connection", ()) for t in v.split(",")}
    if version == "HTTP/1.1":
        will_close = "close" in tokens
    elif version == "HTTP/1.0":
        will_close = "keep-alive" not in tokens
    else:
        raise ProtocolError(f"an unsupported HTTP version: {version}")
    if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        return Head(status, reason, headers, 0, False, will_close)
    codings = [t.strip().lower() for v in fields.get("transfer-encoding", ()) for t in v.split(",")]
    if codings:
        if codings[-1] != "chunked":  # a body framed by the close alone
            return Head(status, reason, headers, None, False, True)
        return Head(status, reason, headers, None, True, will_close)
    lengths = {v.strip() for v in fields.get("content-length", ())}
    if not lengths:
        return Head(status, reason, headers, None, False, True)
    if len(lengths) > 1 or not all(v.isdigit() for v in lengths):
        raise ProtocolError(f"a malformed Content-Length: {sorted(lengths)}")
    return Head(status, reason, headers, int(lengths.pop()), False, will_close)
