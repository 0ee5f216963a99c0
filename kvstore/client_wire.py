"""The HTTP client's wire: an httpx transport on kept-alive HTTP/1.1 connections.

A restore is dominated by one large response (128 blocks of 2 MiB: 256 MiB), and httpx's
own transport receives it as 4,098 reads of 64 KiB that h11 buffers and httpx joins;
``kvstore.client_http1`` reads a body of known length with one ``bytes`` allocation filled
in place by ``recv_into`` (``BufferedReader.read(n)``), and httpx hands that same object out as
``Response.content``. Measured in ``python tools/bench.py client`` (BENCHMARKS.md, the
client table).

:meth:`BodyTransport.exchange` is the round trip itself, without httpx's request and
response objects: ``kvstore.client`` sends its block reads through it directly (building
an httpx request and response costs about as much client CPU as the rest of a 2 MiB
read); :meth:`BodyTransport.handle_request` wraps the same call for httpx.

An answer can be read as an envelope (``check=True``; through httpx the ``CHECK``
extension): in parts of ``_CHECK_PART``, each part's CRC-32C taken as soon as it has
arrived, while it is still in the CPU's cache, and the result compared with the
envelope's trailer (:attr:`Answer.crc_ok`; through httpx the ``CRC_OK`` extension), into
the caller's buffer or the receive pool's when it fits, else into one new ``bytes``
(``BytesBuilder.view``). That check reads no byte from memory a second time, where the
server's check before sending reads each block once more from DRAM; a client that does it
asks the server to skip its own (``protocol.READER_CHECKS_HEADER``).
"""

from __future__ import annotations

import http.client
import select
import ssl
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

import httpx

from .client_http1 import Connection, Disconnected, ProtocolError
from .codec.assembly import crc_matches, stored_crc
from .codec.builder import BytesBuilder
from .codec.checksum import crc32c
from .codec.layout import MIN_ENVELOPE_SIZE, TRAILER_SIZE

__all__ = [
    "CHECK",
    "CRC_OK",
    "INTO",
    "Answer",
    "BodyTransport",
    "ReceivePool",
    "env_proxy",
    "origin_of",
    "read_checked_envelope",
]

Origin = tuple[str, str, int]  # scheme, host, port
INTO = "tlkv_into"  # request extension: a writable buffer a 200's body is read into
CHECK = "tlkv_check_envelope"  # request extension: a 200's body is an envelope, check it
CRC_OK = "tlkv_crc_ok"  # response extension: whether that envelope's CRC-32C matched
_KEEPALIVE_EXPIRY = 5.0  # seconds an idle connection is kept (httpx's default)
_MAX_IDLE = 20  # idle connections kept per transport (httpx's default)
# A checked envelope arrives in parts of this size: each is still in the CPU's cache (L2)
# when its CRC-32C is taken.
_CHECK_PART = 128 << 10


def read_checked_envelope(
    conn: Connection, n: int, room: memoryview | None = None
) -> tuple[bytes, memoryview | None, bool]:
    """The next ``n`` bytes of ``conn``, an envelope, read into ``room`` (``n`` writable
    bytes) or else into one new ``bytes`` object, part by part, each part's CRC-32C taken
    as soon as it has arrived: ``(content, filled, crc_ok)`` as in :class:`Answer`."""
    if room is not None:
        crc = _fill_checked(conn, room)
        return b"", room, n >= MIN_ENVELOPE_SIZE and crc == stored_crc(room)
    builder = BytesBuilder(n)
    with builder.view(n) as view:
        crc = _fill_checked(conn, view)
    builder.advance(n)
    data = builder.finish()
    return data, None, n >= MIN_ENVELOPE_SIZE and crc == stored_crc(data)


def _fill_checked(conn: Connection, room: memoryview) -> int:
    """Fill ``room`` from ``conn`` in parts; the CRC-32C of all but its last 4 bytes."""
    n = len(room)
    end = n - TRAILER_SIZE  # the CRC covers every byte before the trailer
    crc = 0
    for pos in range(0, n, _CHECK_PART):
        with room[pos : pos + _CHECK_PART] as part:
            conn.read_exactly(part)
            if pos < end:
                with part[: end - pos] as covered:
                    crc = crc32c(covered, crc)
    return crc


class ReceivePool:
    """Receive buffers of one client that its answers are read into, each used again
    once nothing references the last answer read into it (so an answer is never
    overwritten while someone holds it: a view, a slice of it, an array over it).

    A fresh buffer per answer costs a page fault per 4 KiB page as the kernel copies the
    data in (128 MiB: ~32,000), about as much time as the copy; a buffer used again has
    its pages mapped. At most ``_KEPT`` buffers are kept (the largest answers' size);
    an answer arriving while all are referenced gets a buffer of its own.
    """

    _KEPT = 2
    _ROUND = 1 << 20  # buffers are allocated in whole MiB (a slightly longer answer fits)

    def __init__(self) -> None:
        self._bufs: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, length: int) -> memoryview:
        """``length`` bytes of a buffer nothing else references."""
        with self._lock:
            bufs = self._bufs
            free = [i for i in range(len(bufs)) if sys.getrefcount(bufs[i]) <= _UNREFERENCED]
            for i in free:
                if len(self._bufs[i]) >= length:
                    return memoryview(self._bufs[i])[:length]
            buf = bytearray(-(-length // self._ROUND) * self._ROUND)
            if free:  # too small: replaced
                self._bufs[free[0]] = buf
            elif len(self._bufs) < self._KEPT:
                self._bufs.append(buf)
            return memoryview(buf)[:length]

    def clear(self) -> None:
        with self._lock:
            self._bufs.clear()


# sys.getrefcount(bufs[i]) of a pool buffer that nothing outside the pool references: the
# list's reference and the call's argument.
_UNREFERENCED = 2


class BodyTransport(httpx.BaseTransport):
    """An httpx transport on kept-alive connections (see the module docstring).

    Thread-safe: a request takes an idle connection of its origin (or opens one) and gives
    it back once the response is read in full. An idle connection that the server has
    closed (its socket reads as ready) or that idled for ``_KEEPALIVE_EXPIRY`` is dropped,
    as httpcore does; a reused connection that still turns out dead before any response
    byte (the server closed it while the request was in flight) is retried once on a new
    connection: every route of the service is idempotent (PUT, DELETE) or read-only (the
    POST queries), so the retry cannot apply a change twice.
    """

    def __init__(self) -> None:
        self._idle: dict[Origin, list[tuple[Connection, float]]] = {}
        self._lock = threading.Lock()
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    def _checkout(self, origin: Origin) -> Connection | None:
        now = time.monotonic()
        with self._lock:
            idle = self._idle.get(origin, [])
            while idle:
                conn, since = idle.pop()
                sock = conn.sock
                if sock is not None and now - since < _KEEPALIVE_EXPIRY:
                    try:
                        readable = select.select([sock], [], [], 0)[0]
                    except (OSError, ValueError):
                        readable = [sock]
                    if not readable:
                        return conn
                conn.close()
        return None

    def _checkin(self, origin: Origin, conn: Connection) -> None:
        with self._lock:
            idle = self._idle.setdefault(origin, [])
            if self._closed or len(idle) >= _MAX_IDLE:
                conn.close()
            else:
                idle.append((conn, time.monotonic()))

    def _connect(self, origin: Origin, timeout: float | None) -> Connection:
        """A new connection to ``origin``: ``http.client`` connects it (TCP_NODELAY set,
        TLS with httpx's verification for https) and hands its socket over."""
        scheme, host, port = origin
        conn: http.client.HTTPConnection
        if scheme == "https":
            if self._ssl is None:
                self._ssl = httpx.create_ssl_context()  # httpx's verification (certifi)
            conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=self._ssl)
        else:
            conn = http.client.HTTPConnection(host, port, timeout=timeout)
        conn.connect()
        sock, conn.sock = conn.sock, None
        assert sock is not None
        return Connection(sock)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        """httpx's entry: the request's round trip through :meth:`exchange`."""
        url = request.url
        try:
            answer = self.exchange(
                origin_of(url),
                request.method,
                url.raw_path.decode("ascii"),
                request.headers.raw,
                request.read() or None,
                request.extensions.get("timeout", {}),
                request.extensions.get(INTO),
                bool(request.extensions.get(CHECK)),
            )
        except httpx.TransportError as exc:
            exc.request = request
            raise
        return answer.response()

    def exchange(
        self,
        origin: Origin,
        method: str,
        target: str,
        headers: Any,
        body: bytes | None,
        timeouts: dict[str, Any],
        into: Any = None,
        check: bool = False,
    ) -> Answer:
        """One request and its whole answer on a kept-alive connection of ``origin``.

        ``target`` is the request's path and query, ``headers`` its ``(name, value)``
        pairs (Host included), ``timeouts`` httpx's ``connect``/``read``/``write``
        seconds. ``into``: a writable buffer (or a :class:`ReceivePool`) that a 200's body
        is read into when it fits. ``check``: a 200's body is an envelope, its CRC-32C
        checked as it arrives (:attr:`Answer.crc_ok`). Raises httpx's transport errors
        (without a request: the caller sets it).
        """
        conn = self._checkout(origin)
        reused = conn is not None
        while True:
            if conn is None:
                try:
                    conn = self._connect(origin, timeouts.get("connect"))
                except TimeoutError as exc:
                    raise httpx.ConnectTimeout(str(exc)) from exc
                except OSError as exc:
                    raise httpx.ConnectError(str(exc)) from exc
            try:
                return self._exchange(
                    conn, origin, method, target, headers, body, timeouts, into, check
                )
            except _StaleConnection as exc:
                conn.close()
                conn = None
                if not reused:
                    raise httpx.RemoteProtocolError(str(exc)) from exc
                reused = False
            except BaseException:
                conn.close()
                raise

    def _exchange(
        self,
        conn: Connection,
        origin: Origin,
        method: str,
        target: str,
        headers: Any,
        body: bytes | None,
        timeouts: dict[str, Any],
        into: Any,
        check: bool,
    ) -> Answer:
        sock = conn.sock
        try:
            sock.settimeout(timeouts.get("write"))
            conn.send(method, target, headers, body)
        except TimeoutError as exc:
            raise httpx.WriteTimeout(str(exc)) from exc
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise _StaleConnection(str(exc)) from exc
        except OSError as exc:
            raise httpx.WriteError(str(exc)) from exc
        try:
            sock.settimeout(timeouts.get("read"))
            try:
                head = conn.read_head(method)
            except (Disconnected, ConnectionResetError) as exc:
                raise _StaleConnection(str(exc)) from exc
            length = head.length
            if isinstance(into, ReceivePool):
                into = into.take(length) if head.status == 200 and length else None
            elif head.status != 200:
                into = None
            crc_ok = None
            if check and head.status == 200 and length is not None:
                room = None
                if into is not None and length <= len(into):
                    room = memoryview(into)[:length]
                content, filled, crc_ok = read_checked_envelope(conn, length, room)
            else:
                # A body of known length: one bytes object filled in place, or the
                # caller's buffer (pages it has used before: no fault a page) when it fits.
                content, filled = conn.read_body(head, into)
                if check and head.status == 200:  # framed by chunks or by the close
                    crc_ok = crc_matches(content)
        except TimeoutError as exc:
            raise httpx.ReadTimeout(str(exc)) from exc
        except ProtocolError as exc:
            raise httpx.RemoteProtocolError(str(exc)) from exc
        except OSError as exc:
            raise httpx.ReadError(str(exc)) from exc
        if head.will_close:
            conn.close()
        else:
            self._checkin(origin, conn)
        return Answer(head.status, head.reason, head.headers, content, filled, crc_ok)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn, _since in conns:
                conn.close()


class _StaleConnection(Exception):
    """A connection found closed by the server before any byte of the response."""


def env_proxy(base_url: str) -> bool:
    """True when the environment routes ``base_url`` through a proxy (httpx's default)."""
    url = httpx.URL(base_url)
    proxies = urllib.request.getproxies_environment()
    if not (proxies.get(url.scheme) or proxies.get("all")):
        return False
    return not urllib.request.proxy_bypass(url.host)


@dataclass
class Answer:
    """A response read in full: ``filled`` is the part of the caller's buffer its body
    went to (``content`` then stays empty), None when the body is ``content``;
    ``crc_ok``: whether a body read as a checked envelope matched its CRC-32C (None when
    it was not read so)."""

    status: int
    reason: str
    headers: list[tuple[str, str]]
    content: bytes
    filled: memoryview | None = None
    crc_ok: bool | None = None

    def response(self, request: httpx.Request | None = None) -> httpx.Response:
        """The answer as a read httpx response (the filled buffer under ``INTO``)."""
        response = httpx.Response(
            self.status,
            headers=self.headers,
            stream=httpx.ByteStream(self.content),
            extensions={
                "http_version": b"HTTP/1.1",
                "reason_phrase": self.reason.encode(),
                **({INTO: self.filled} if self.filled is not None else {}),
                **({CRC_OK: self.crc_ok} if self.crc_ok is not None else {}),
            },
        )
        if request is not None:
            response.request = request
        response.read()
        return response


def origin_of(url: httpx.URL) -> Origin:
    """``url``'s scheme, host and port (the scheme's default when it names none)."""
    return (url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80))
