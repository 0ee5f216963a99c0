"""Request bodies: the worker's budget of body bytes in flight, and envelope bodies refused
from their first 28 bytes.

Every body a route reads is counted against one per-worker :class:`InflightBudget`
(``--max-inflight``) before its bytes are held: a body of known size (its Content-Length,
or for an envelope the size its header implies) reserves all of it up front, first come
first served, so several large uploads queue instead of growing the worker together; a
chunked body of unknown size reserves chunk by chunk. A request that cannot get its bytes
within :data:`INFLIGHT_WAIT_SECONDS` is answered 503 ``busy`` with Retry-After. The guard
middleware (``api.middleware``) opens each request's :class:`BodyTicket` and gives its
bytes back when the request ends.

An envelope body (``PUT /v1/blocks``, ``PUT /v1/sequences/{name}``) is checked from its
header alone (``kvstore.codec.envelope.check_header``: magic, version, dtype, geometry
against the store's, exact length against the Content-Length) before anything else of it
is read or buffered; the CRC and the fills are the store's ``decode`` once it is whole.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, NoReturn

from fastapi import Request

from kvstore.codec.envelope import check_header
from kvstore.codec.geometry import Geometry
from kvstore.codec.layout import HEADER, HEADER_SIZE, SUPPORTED_VERSIONS
from kvstore.codec.tokens import record_bytes
from kvstore.errors import BusyError, InvalidRequestError, TooLargeError

# How long a body waits for its bytes of the budget before the request is answered 503.
INFLIGHT_WAIT_SECONDS = 10.0
SCOPE_KEY = "tlkv.body_ticket"


class InflightBudget:
    """Bytes of request bodies one worker may hold at once, granted in arrival order.

    Lives on the worker's event loop (not thread-safe; every caller is a coroutine).
    """

    def __init__(self, limit: int, wait: float | None = None) -> None:
        if limit < 1:
            raise ValueError(f"the in-flight budget must be positive, found {limit}")
        self.limit = limit
        self.wait = INFLIGHT_WAIT_SECONDS if wait is None else wait
        self.used = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    async def acquire(self, n: int) -> None:
        """Reserve ``n`` bytes, waiting behind earlier requests for at most ``wait`` seconds.

        Raises:
            BusyError: the bytes were not free in time (nothing is held then).
            TooLargeError: ``n`` exceeds the whole budget.
        """
        if n > self.limit:
            raise TooLargeError(
                f"a body of {n} bytes exceeds the in-flight budget of {self.limit} bytes"
            )
        if not self._waiters and self.used + n <= self.limit:
            self.used += n
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((n, fut))
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.wait)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            if fut.done() and not fut.cancelled():
                self.release(n)  # granted just as the wait ended: give it back
            else:
                fut.cancel()  # _grant drops it; a large head leaving may let smaller ones in
                self._grant()
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise BusyError(
                f"the worker holds {self.used} of {self.limit} bytes of request bodies "
                f"(--max-inflight); {n} more were not free within {self.wait:g} s: retry"
            ) from None

    def release(self, n: int) -> None:
        """Give back ``n`` bytes and let waiting requests in, in order."""
        self.used -= n
        self._grant()

    def _grant(self) -> None:
        while self._waiters:
            n, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if self.used + n > self.limit:
                return
            self._waiters.popleft()
            self.used += n
            fut.set_result(None)


class BodyTicket:
    """The bytes one request holds of its worker's budget, given back when it ends."""

    __slots__ = ("budget", "held")

    def __init__(self, budget: InflightBudget | None) -> None:
        self.budget = budget
        self.held = 0

    async def take(self, n: int) -> None:
        """Hold ``n`` more bytes (waits; see :meth:`InflightBudget.acquire`)."""
        if self.budget is not None and n > 0:
            await self.budget.acquire(n)
            self.held += n

    def close(self) -> None:
        """Give every held byte back."""
        if self.budget is not None and self.held:
            self.budget.release(self.held)
        self.held = 0


def ticket_of(request: Request) -> BodyTicket:
    """The request's ticket (one that counts nothing outside the guard middleware)."""
    ticket = request.scope.get(SCOPE_KEY)
    return ticket if isinstance(ticket, BodyTicket) else BodyTicket(None)


def _content_length(request: Request) -> int | None:
    length = request.headers.get("content-length")
    return int(length) if length is not None and length.isdigit() else None


def _refuse_length(
    head: Any, found: int, geometry: Geometry | None, versions: tuple[int, ...]
) -> NoReturn:
    """Raise the format's own length rule (``TruncatedError``) with ``found`` bytes, the
    body's size so far, which differs from the size the header implies."""
    check_header(head, found, geometry, versions)
    raise InvalidRequestError(f"the body's {found} bytes are not what its header announces")


async def _fill(buf: bytearray, pos: int, chunks: Any) -> int:
    view = memoryview(buf)
    async for chunk in chunks:
        end = pos + len(chunk)
        if end > len(buf):
            return end
        view[pos:end] = chunk
        pos = end
    return pos


async def read_body(request: Request, weight: int = 1) -> bytes | bytearray:
    """The whole request body, ``weight`` times its bytes held against the worker's
    in-flight budget (at most the whole budget; ``weight`` > 1 for a body whose parsing
    takes memory of its own, reserved in the same single wait).

    The guard middleware bounds it by ``--max-body``. With a Content-Length it is read into
    one preallocated buffer (no join copy).

    Raises:
        BusyError: the budget had no room in time.
        InvalidRequestError: the body ended early.
    """
    ticket = ticket_of(request)
    length = _content_length(request)
    if length is None:
        buf = bytearray()
        async for chunk in request.stream():
            await ticket.take(len(chunk) * weight)
            buf += chunk
        return buf
    limit = ticket.budget.limit if ticket.budget is not None else length
    await ticket.take(max(length, min(length * weight, limit)))
    buf = bytearray(length)
    pos = await _fill(buf, 0, request.stream())
    if pos > length:  # cannot happen: the server frames the body by Content-Length
        raise InvalidRequestError("request body longer than its Content-Length")
    if pos != length:
        raise InvalidRequestError(f"request body ended after {pos} of {length} bytes")
    return buf


async def read_envelope(
    request: Request,
    geometry: Geometry | None,
    max_body: int,
    versions: tuple[int, ...] = SUPPORTED_VERSIONS,
    token_records: int = 0,
) -> bytes | bytearray:
    """An envelope body, refused by its header before the rest is read.

    The first 28 bytes pass :func:`~kvstore.codec.envelope.check_header` (``geometry``:
    the store's, None while it has none), the exact length included, before the size
    the header implies is reserved and read into one buffer. A body shorter than a header
    is returned as it is (the store's ``decode`` refuses it). ``token_records``: that many
    token records (``kvstore.codec.tokens``, ``8 + 4*B`` bytes each, B from the header)
    follow the envelope in the body, read into the same buffer after it.

    Raises:
        EnvelopeError: a header rule failed (the format's own error and message).
        TooLargeError: a chunked body's header implies more than ``max_body``.
        BusyError: the budget had no room in time.
        InvalidRequestError: the body ended early.
    """
    ticket = ticket_of(request)
    length = _content_length(request)
    chunks = request.stream().__aiter__()
    head = bytearray()
    async for chunk in chunks:
        await ticket.take(len(chunk))
        head += chunk
        if len(head) >= HEADER_SIZE:
            break
    if len(head) < HEADER_SIZE:
        return head
    extra = token_records * record_bytes(HEADER.unpack_from(head)[4]) if token_records else 0
    envelope_length = None if length is None else length - extra
    expected = check_header(memoryview(head)[:HEADER_SIZE], envelope_length, geometry, versions)
    if expected + extra > max_body:
        raise TooLargeError(
            f"the envelope's header announces {expected} bytes, and {extra} bytes of token "
            f"records follow: over the limit of {max_body} bytes"
        )
    total = expected + extra
    if len(head) > total:
        _refuse_length(memoryview(head)[:HEADER_SIZE], len(head) - extra, geometry, versions)
    await ticket.take(total - len(head))
    buf = bytearray(total)
    buf[: len(head)] = head
    first = len(head)
    del head
    pos = await _fill(buf, first, chunks)
    if pos > total or (pos < total and length is None):
        _refuse_length(memoryview(buf)[:HEADER_SIZE], pos - extra, geometry, versions)
    if pos != total:  # shorter than its Content-Length: the client went away
        raise InvalidRequestError(f"request body ended after {pos} of {total} bytes")
    return buf
