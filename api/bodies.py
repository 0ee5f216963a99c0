"""Request bodies: the worker's budget of body bytes in flight, the minimum rate a body must
keep, and envelope bodies refused from their first 28 bytes.

Every body a route reads is counted against one per-worker :class:`InflightBudget`
(``--max-inflight``) before its bytes are held. A body of known size (its Content-Length,
or for an envelope the size its header implies) first reads its first ``EARN_BYTES``
(64 KiB, or all of it when smaller) chunk by chunk, each chunk counted as it arrives; then
it reserves the rest up front, first come first served, so several large uploads queue
instead of growing the worker together, and a sender that trickles a few bytes never holds
more than it sent. A chunked body of unknown size reserves chunk by chunk. A request that
cannot get its bytes within :data:`INFLIGHT_WAIT_SECONDS` is answered 503 ``busy`` with
Retry-After. The guard middleware (``api.middleware``) opens each request's
:class:`BodyTicket` and gives its bytes back when the request ends.

Every body is read under a :class:`BodyPace` (``--min-body-rate``, default 1 MiB/s, over
windows of ``--body-timeout`` seconds, default 5): a body that delivers less than the rate
times the window in a window (a stalled one included) is refused with 408 ``timeout``
(``RequestTimeoutError``, with ``Connection: close``), and the bytes it held go back to the
budget at once. The clock runs while the body is read and stops while the request waits
for budget (that wait is the server's, not the sender's). So a slow upload that declares a
large body cannot hold the budget of other writers for longer than one window.

An envelope body (``PUT /v1/blocks``, ``PUT /v1/sequences/{name}``) is checked from its
header alone (``kvstore.codec.envelope.check_header``: magic, version, dtype, geometry
against the store's, exact length against the Content-Length) before anything else of it
is read or buffered; the CRC and the fills are the store's ``decode`` once it is whole.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any, NoReturn

from fastapi import Request

from kvstore.codec.envelope import check_header
from kvstore.codec.geometry import Geometry
from kvstore.codec.layout import HEADER, HEADER_SIZE, SUPPORTED_VERSIONS
from kvstore.codec.tokens import record_bytes
from kvstore.errors import BusyError, InvalidRequestError, RequestTimeoutError, TooLargeError

log = logging.getLogger("tlkv.api")

# How long a body waits for its bytes of the budget before the request is answered 503.
INFLIGHT_WAIT_SECONDS = 10.0
SCOPE_KEY = "tlkv.body_ticket"
# A body of known size reads this much (or all of it when smaller), counted chunk by chunk,
# before it reserves the rest of its size.
EARN_BYTES = 64 * 1024
DEFAULT_MIN_BODY_RATE = 1024 * 1024  # bytes per second (--min-body-rate)
DEFAULT_BODY_TIMEOUT = 5.0  # seconds: the window the rate is measured over (--body-timeout)


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

    def try_acquire(self, n: int) -> bool:
        """Reserve ``n`` bytes if they are free now and nobody waits ahead; False otherwise."""
        if not self._waiters and self.used + n <= self.limit:
            self.used += n
            return True
        return False

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
        if self.try_acquire(n):
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


class BodyPace:
    """The minimum rate of one request body: at least ``rate`` bytes per second over each
    window of ``window`` seconds while the body is read (``rate`` 0: no minimum).

    Readers add what arrives to ``received``. When a window ends with less than
    ``rate * window`` bytes received in it, the reading task is cancelled and the read
    ends in :class:`~kvstore.errors.RequestTimeoutError` (``__exit__``). One timer of the
    loop per body, re-armed once per window: nothing runs per chunk but an addition.
    """

    __slots__ = ("expired", "mark", "rate", "received", "task", "timer", "window")

    def __init__(self, rate: int, window: float) -> None:
        self.rate = rate
        self.window = window
        self.received = 0
        self.mark = 0  # ``received`` when the current window began
        self.expired = False
        self.task: asyncio.Task[Any] | None = None
        self.timer: asyncio.TimerHandle | None = None

    def __enter__(self) -> BodyPace:
        if self.rate > 0:
            self.task = asyncio.current_task()
            self.resume()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.pause()
        self.task = None
        if self.expired and exc_type is not None and issubclass(exc_type, asyncio.CancelledError):
            task = asyncio.current_task()
            if task is not None and hasattr(task, "uncancel"):  # Python >= 3.11
                task.uncancel()
            raise RequestTimeoutError(
                f"rule 'a request body arrives at --min-body-rate {self.rate} bytes/s or more "
                f"in every {self.window:g} s window (--body-timeout)' failed: "
                f"{self.received - self.mark} bytes came in the last window, "
                f"{self.received} in all; the request is refused"
            ) from None

    def pause(self) -> None:
        """Stop the clock (the request waits for the server, not for its sender)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def resume(self) -> None:
        """Start a new window from now."""
        if self.task is not None and self.timer is None:
            self.mark = self.received
            self.timer = asyncio.get_running_loop().call_later(self.window, self._check)

    def _check(self) -> None:
        self.timer = None
        if self.received - self.mark >= self.rate * self.window:
            self.resume()
            return
        self.expired = True
        if self.task is not None:
            self.task.cancel()


class BodyTicket:
    """The bytes one request holds of its worker's budget, given back when it ends, and the
    pace its body must keep."""

    __slots__ = ("budget", "held", "pace")

    def __init__(
        self, budget: InflightBudget | None, min_rate: int = 0, window: float = 0.0
    ) -> None:
        self.budget = budget
        self.held = 0
        self.pace = BodyPace(min_rate, window)

    async def take(self, n: int) -> None:
        """Hold ``n`` more bytes (waits, the pace's clock stopped; see
        :meth:`InflightBudget.acquire`)."""
        if self.budget is not None and n > 0:
            if not self.budget.try_acquire(n):
                self.pace.pause()
                try:
                    await self.budget.acquire(n)
                finally:
                    self.pace.resume()
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


async def _gather(
    ticket: BodyTicket, chunks: AsyncIterator[bytes], got: list[bytes], size: int, want: int
) -> int:
    """Read chunks into ``got``, each counted in the budget as it comes, until ``size``
    (the bytes in ``got``) reaches ``want`` or the body ends; the new size."""
    pace = ticket.pace
    while size < want:
        try:
            chunk = await chunks.__anext__()
        except StopAsyncIteration:
            break
        if chunk:
            await ticket.take(len(chunk))
            got.append(chunk)
            size += len(chunk)
            pace.received = size
    return size


def _joined(got: list[bytes], size: int, capacity: int) -> bytearray:
    """One buffer of ``capacity`` bytes starting with the ``size`` bytes of ``got``."""
    buf = bytearray(capacity)
    pos = 0
    for chunk in got:
        end = min(pos + len(chunk), capacity)
        buf[pos:end] = chunk[: end - pos]
        pos = end
    return buf


async def _fill(buf: bytearray, pos: int, chunks: AsyncIterator[bytes], pace: BodyPace) -> int:
    """Read the rest of the body into ``buf`` from ``pos``; the body's whole size (more than
    ``len(buf)`` when it is longer, as soon as that shows)."""
    view = memoryview(buf)
    async for chunk in chunks:
        end = pos + len(chunk)
        if end > len(buf):
            return end
        view[pos:end] = chunk
        pos = pace.received = end
    return pos


async def read_body(request: Request, weight: int = 1) -> bytes | bytearray:
    """The whole request body, ``weight`` times its bytes held against the worker's
    in-flight budget (at most the whole budget; ``weight`` > 1 for a body whose parsing
    takes memory of its own, reserved in the same single wait), at the minimum rate.

    The guard middleware bounds it by ``--max-body``. With a Content-Length it is read into
    one preallocated buffer (no join copy) once its first ``EARN_BYTES`` arrived.

    Raises:
        BusyError: the budget had no room in time.
        RequestTimeoutError: the body came slower than ``--min-body-rate``.
        InvalidRequestError: the body ended early.
    """
    ticket = ticket_of(request)
    length = _content_length(request)
    chunks = request.stream().__aiter__()
    got: list[bytes] = []
    with ticket.pace:
        if length is None:
            size = await _gather(ticket, chunks, got, 0, 1 << 62)
            return b"".join(got)
        size = await _gather(ticket, chunks, got, 0, min(length, EARN_BYTES))
        limit = ticket.budget.limit if ticket.budget is not None else length
        await ticket.take(max(length, min(length * weight, limit)) - size)
        buf = _joined(got, size, length)
        del got
        pos = size
        if pos < length:
            pos = await _fill(buf, pos, chunks, ticket.pace)
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
    the store's, None while it has none), the exact length included; then the body's first
    ``EARN_BYTES`` are read before the rest of the size the header implies is reserved
    and read into one buffer, at the minimum rate. A body shorter than a header is
    returned as it is (the store's ``decode`` refuses it). ``token_records``: that many
    token records (``kvstore.codec.tokens``, ``8 + 4*B`` bytes each, B from the header)
    follow the envelope in the body, read into the same buffer after it.

    Raises:
        EnvelopeError: a header rule failed (the format's own error and message).
        TooLargeError: a chunked body's header implies more than ``max_body``.
        BusyError: the budget had no room in time.
        RequestTimeoutError: the body came slower than ``--min-body-rate``.
        InvalidRequestError: the body ended early.
    """
    ticket = ticket_of(request)
    length = _content_length(request)
    chunks = request.stream().__aiter__()
    got: list[bytes] = []
    with ticket.pace:
        size = await _gather(ticket, chunks, got, 0, HEADER_SIZE)
        if size < HEADER_SIZE:
            return b"".join(got)
        head = memoryview(got[0] if len(got[0]) >= HEADER_SIZE else b"".join(got))[:HEADER_SIZE]
        extra = token_records * record_bytes(HEADER.unpack_from(head)[4]) if token_records else 0
        envelope_length = None if length is None else length - extra
        expected = check_header(head, envelope_length, geometry, versions)
        total = expected + extra
        if total > max_body:
            raise TooLargeError(
                f"the envelope's header announces {expected} bytes, and {extra} bytes of "
                f"token records follow: over the limit of {max_body} bytes"
            )
        if size <= total:
            size = await _gather(ticket, chunks, got, size, min(total, EARN_BYTES))
        if size > total:
            _refuse_length(head, size - extra, geometry, versions)
        await ticket.take(total - size)
        buf = _joined(got, size, total)
        del got
        pos = size if size == total and length is not None else None
        if pos is None:
            pos = await _fill(buf, size, chunks, ticket.pace)
    if pos > total or (pos < total and length is None):
        _refuse_length(memoryview(buf)[:HEADER_SIZE], pos - extra, geometry, versions)
    if pos != total:  # shorter than its Content-Length: the client went away
        raise InvalidRequestError(f"request body ended after {pos} of {total} bytes")
    return buf
