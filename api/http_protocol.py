"""uvicorn's httptools protocol, answering the plain block read itself.

``GET /v1/blocks/{hash}`` is what engines send most: one per block of a prefix they
restore. Through ASGI, each read also pays for uvicorn's request cycle and its task,
FastAPI's middleware stack and ours (metrics, guard, model scope) before
``api.routes.blocks.BlockReadFastPath`` answers it. Under wrk (``tools/bench_http.py``)
that was about 120 us of the server's user CPU per 2 MiB read, as much again as the
uvicorn request handling of a bare app. :class:`TlkvHttpProtocol` (what ``tlkv serve``
runs) answers the read in the protocol, in ``on_headers_complete``, with what the app
sends: ``api.blockread`` decides whether the read is plain (the path, the method, the
formats, the access rule) and what it answers, here as in the app's two doors, so
this module only adds the transport's own declines and writes the answer:

- the stored envelope from LMDB's map, its CRC-32C checked first (``Store.get_buffers``)
  unless the request says that its reader checks it as it arrives (``READER_CHECKS_HEADER:
  crc32c``, which ``kvstore.Client.get`` sends; ``/v1/prefix`` honours it too): the check
  then runs once, end to end, where the block is in the reader's cache, instead of the
  server reading each block once more. The read snapshot ends when the transport
  releases the body, and a body whose transport makes no progress for
  ``BODY_HOLD_SECONDS`` aborts its connection (``api.bodywatch``);
- the same headers (uvicorn's ``date`` and ``server`` included), the same 404 body
  and uvicorn's access-log line when that log is on;
- the same metrics, written out within ``BATCH_SECONDS`` (``Metrics.observe_request_soon``),
  and the same access rule (a bearer token that may read the default model).

Head and body go out in one vectored write, the body not copied (uvloop keeps the
buffer until the socket took it).

Only the plain case is taken. Anything else goes to uvicorn's own handling, which runs
the app exactly as before: another path (``/v1/models/{model}/blocks/...`` included), a
method other than GET, a query string, a request body, ``Expect``, ``If-None-Match``,
a token missing or not allowed to read, a store with an object-store tier (a miss reads
through in the pool), formats other than both, a request behind one not yet answered or
while the transport is paused (pipelined requests keep their order and wait for the
transport to drain), HTTP/1.0 or ``Connection: close``, ``limit_concurrency``, a
``root_path``, and a read that raises (the app answers with the error it names).

Request bodies reach the app as the parser's chunks (``_BodyChunks``), without uvicorn's
two copies of each into and out of a ``bytearray``.

It relies on attributes of uvicorn's ``HttpToolsProtocol`` (``url``, ``headers``,
``cycle`` and its ``body``, ``pipeline``, ``flow``, ``parser``):
``tests/test_http_protocol.py`` checks its answers against the app's, byte for byte, on
the uvicorn installed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.protocols.utils import get_client_addr

from kvstore.protocol import READER_CHECKS_CRC, READER_CHECKS_HEADER
from kvstore.store.protocols import BufferSource

from .blockread import ROUTE, block_answer, may_read_default, plain_block_read
from .bodywatch import watch_body

_GET = frozenset({"GET"})  # a HEAD goes to the app
_READER_CHECKS = READER_CHECKS_HEADER.encode()
_READER_CHECKS_CRC = READER_CHECKS_CRC.encode()
# Request headers that take a read off the plain case.
_NOT_PLAIN = frozenset({b"content-length", b"transfer-encoding", b"if-none-match"})


class _NoWaiter:
    """The event of a request nothing waits on."""

    def set(self) -> None:
        """Nothing to wake."""


class _Answered:
    """Stands for the request cycle of a read answered here: complete (uvicorn's
    protocol starts the next request at once and ignores this one's end)."""

    response_complete = True
    more_body = False
    message_event = _NoWaiter()


_ANSWERED = _Answered()


class _BodyChunks:
    """A request cycle's body buffer that keeps the chunks as the parser gave them.

    uvicorn appends each chunk to a ``bytearray`` and hands the app ``bytes()`` of it:
    two copies of every byte of a 16 MiB put. Here ``+=`` keeps the chunk and
    ``bytes()`` of one chunk is that chunk (the app usually takes each as it comes);
    several are joined once.
    """

    __slots__ = ("chunks", "size")

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.size = 0

    def __iadd__(self, chunk: bytes) -> _BodyChunks:
        self.chunks.append(chunk)
        self.size += len(chunk)
        return self

    def __len__(self) -> int:
        return self.size

    def __bytes__(self) -> bytes:
        return self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)


def _tlkv_app(app: Any) -> FastAPI | None:
    """The tlkv app under uvicorn's wrappers (proxy headers, message logger)."""
    for _ in range(8):
        if isinstance(app, FastAPI):
            return app
        app = getattr(app, "app", None)
    return None


class TlkvHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools HTTP/1.1 protocol; plain block reads answered in it."""

    answered = 0  # block reads answered by the protocol in this process (tests, debugging)
    # uvicorn's default headers (date, server) as bytes, for the list they were made of:
    # the server replaces that list once a second.
    _defaults: tuple[list[tuple[bytes, bytes]] | None, bytes] = (None, b"")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tlkv_app = _tlkv_app(self.app)
        self._plain = (
            self.tlkv_app is not None and self.limit_concurrency is None and not self.root_path
        )
        self._vectored = False
        self._state: Any = None
        self._store: BufferSource | None = None
        self._settings: Any = None
        self._metrics: Any = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # uvloop writes a list of buffers with one writev and keeps them, uncopied;
        # asyncio's transports of Python 3.11 join them first.
        self._vectored = type(transport).__module__.startswith("uvloop")
        # The app's state as its lifespan left it, read once per connection (Starlette's
        # State answers each attribute through a Python __getattr__). A store closed
        # since refuses the read, and the app answers.
        if self.tlkv_app is not None:
            state = self._state = self.tlkv_app.state
            self._store = getattr(state, "store", None)
            self._settings = getattr(state, "settings", None)
            self._metrics = getattr(state, "metrics", None)

    def on_headers_complete(self) -> None:
        if self._plain and self._answer_block_read():
            return
        # A read answered earlier in the same data armed the keep-alive timer: a request
        # the app answers must not be cut by it.
        self._unset_keepalive_if_required()
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        # uvicorn's cycle starts, and restarts after each message it hands over, with an
        # empty bytearray: the chunks go to a _BodyChunks instead. (No cycle: an upgrade,
        # which uvicorn's on_body leaves alone.)
        if (
            cycle is not None
            and not cycle.response_complete
            and type(cycle.body) is bytearray
            and not cycle.body
        ):
            cycle.body = _BodyChunks()  # type: ignore[assignment]
        super().on_body(body)

    def _answer_block_read(self) -> bool:
        """Answer a plain ``GET /v1/blocks/{hash}``; False: not plain, the app answers."""
        t0 = time.perf_counter()
        settings = self._settings
        if settings is None:
            return False
        # The URL as sent: with a query string it is longer than a block path.
        path = self.url.decode("latin-1")
        method = self.parser.get_method().decode("latin-1")
        h = plain_block_read(path, method, b"", settings.formats, self._store, _GET)
        if h is None:
            return False
        cycle = self.cycle
        if (
            (cycle is not None and not cycle.response_complete)
            or self.pipeline
            or self.flow.write_paused
            or self.expect_100_continue
            or self.transport.is_closing()
        ):
            return False
        parser = self.parser
        if (
            parser.get_http_version() != "1.1"
            or not parser.should_keep_alive()
            or parser.should_upgrade()
        ):
            return False
        authorization = host = None
        check_crc = True
        for name, value in self.headers:
            if name in _NOT_PLAIN:
                return False
            if name == _READER_CHECKS:
                check_crc = value != _READER_CHECKS_CRC
            elif name == b"authorization":
                if authorization is not None:
                    return False  # sent twice: the app refuses it
                authorization = value
            elif name == b"host":
                if host is not None:
                    return False
                host = value
        store = self._store
        if (
            store is None
            or store.tier is not None
            or not may_read_default(settings.tokens, authorization)
            or (
                settings.tokens is None
                and settings.host_rule is not None
                and not settings.host_rule.allows(host)
            )
        ):
            return False
        try:
            found = store.get_buffers([h], check_crc=check_crc)
        except Exception:  # a remap this thread may not wait for, a closed store, ...
            return False
        answer = block_answer(h, found)
        body = answer.take_body()
        self._respond(answer.status, answer.headers, body)
        del body
        watch_body(self._state, self.transport, path, answer.owners)
        self._done()
        TlkvHttpProtocol.answered += 1
        status = answer.status
        if self.access_log and self.access_logger.isEnabledFor(logging.INFO):
            # uvicorn's line and arguments: its access formatter unpacks them.
            client = get_client_addr(self.scope)
            self.access_logger.info('%s - "%s %s HTTP/%s" %d', client, "GET", path, "1.1", status)
        metrics = self._metrics
        if metrics is not None:
            seconds = time.perf_counter() - t0
            metrics.observe_request_soon("GET", ROUTE, status, seconds, store, self.loop)
        return True

    def _respond(self, status: int, headers: list[tuple[bytes, bytes]], body: Any) -> None:
        """Write a whole response: status line, uvicorn's default headers, ``headers``,
        then ``body`` (not copied)."""
        defaults = self.server_state.default_headers
        cached = TlkvHttpProtocol._defaults
        if cached[0] is not defaults:
            encoded = b"".join(b"%s: %s\r\n" % header for header in defaults)
            cached = TlkvHttpProtocol._defaults = (defaults, encoded)
        head = [STATUS_LINE[status], cached[1]]
        for name, value in headers:
            head += (name, b": ", value, b"\r\n")
        head.append(b"\r\n")
        if self._vectored:
            self.transport.writelines((b"".join(head), body))
        else:
            self.transport.write(b"".join(head))
            self.transport.write(body)

    def _done(self) -> None:
        """What uvicorn does when a response completes: count it, arm keep-alive."""
        self.cycle = _ANSWERED  # type: ignore[assignment]
        self.server_state.total_requests += 1
        self._unset_keepalive_if_required()
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )
