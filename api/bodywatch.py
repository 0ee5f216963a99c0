"""Zero-copy response bodies held by their transports: watched, and cut off when stalled.

A body sent straight from LMDB's map (``Store.get_buffers``) pins its read snapshot until
the transport releases the buffers, which may be long after ``send`` returned (uvloop
queues what the socket did not take). A client that stops reading would keep that
snapshot, and its pages, forever: a body whose transport makes no progress for
``BODY_HOLD_SECONDS`` has its connection aborted, which releases it.

Progress is the transport's write buffer changing size (the socket took bytes, or the next
part of the body was queued), looked at every second (every quarter of
``BODY_HOLD_SECONDS`` when that is shorter), so a connection is aborted at most a second
after that long without progress, and a client that keeps reading, however slowly, is
never cut off (nginx's ``send_timeout`` measures the same: the time between two
successive writes, not the whole response).

Both doors that send such bodies use :func:`watch_body`: ``api.http_protocol`` (in
uvicorn's protocol) and the routes of ``api.routes.blocks`` (through ASGI,
:func:`watch_body_of`).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any

from .metrics import TRANSPORT_KEY

log = logging.getLogger("tlkv.api")

# A zero-copy body whose transport makes no progress this long has its connection
# aborted: the read snapshot it pins ends.
BODY_HOLD_SECONDS = 30.0


def _alive(owners: list[weakref.ref[Any]]) -> bool:
    return any(owner() is not None for owner in owners)


def _buffered(transport: Any) -> int:
    """Bytes the transport still holds to write (-1 when it cannot say)."""
    try:
        return int(transport.get_write_buffer_size())
    except Exception:  # no transport, or one closed meanwhile
        return -1


class _Held:
    """One body offered to its transport: its owners, its transport's buffer size when
    last looked at, and when the transport last made progress (loop time)."""

    __slots__ = ("buffered", "metrics", "owners", "progress", "transport", "what")

    def __init__(
        self, owners: list[weakref.ref[Any]], transport: Any, what: str, metrics: Any, now: float
    ) -> None:
        self.owners = owners
        self.transport = transport
        self.what = what
        self.metrics = metrics
        self.buffered = _buffered(transport)
        self.progress = now

    def stalled(self, now: float) -> bool:
        """Note any progress since the last look; whether none came for the hold time."""
        buffered = _buffered(self.transport)
        if buffered != self.buffered:
            self.buffered, self.progress = buffered, now
        return now - self.progress >= BODY_HOLD_SECONDS

    def expire(self) -> None:
        log.warning(
            "%s: the client has read nothing of the body for %.0f s; its connection is "
            "aborted to end the read snapshot the body pins",
            self.what,
            BODY_HOLD_SECONDS,
        )
        if self.metrics is not None:
            self.metrics.observe_stalled_body()
        if self.transport is not None:
            self.transport.abort()


def _every() -> float:
    """Seconds between two looks at the held bodies."""
    return min(1.0, BODY_HOLD_SECONDS / 4)


class _BodyWatch:
    """The bodies of one event loop still held by their transports; one timer of the loop
    (not one per request) looks at them every ``_every()`` seconds while any is."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.held: list[_Held] = []
        self.timer: asyncio.TimerHandle | None = None

    def add(self, owners: list[weakref.ref[Any]], transport: Any, what: str, metrics: Any) -> None:
        self.held.append(_Held(owners, transport, what, metrics, self.loop.time()))
        if self.timer is None:
            self.timer = self.loop.call_later(_every(), self.sweep)

    def sweep(self) -> None:
        self.timer = None
        now = self.loop.time()
        keep = []
        for held in self.held:
            if not _alive(held.owners):
                continue  # written out: its snapshot has ended
            if held.stalled(now):
                held.expire()
                continue
            keep.append(held)
        self.held = keep
        if keep:
            self.timer = self.loop.call_later(_every(), self.sweep)


def watch_body(state: Any, transport: Any, what: str, owners: list[weakref.ref[Any]]) -> None:
    """Abort ``transport`` if it still holds any of the buffers whose exporting arrays
    ``owners`` refers to (``owner_refs``; the body's parts, one snapshot) and makes no
    progress writing them for ``BODY_HOLD_SECONDS``. Call it when the body's first byte
    is offered to the transport: a ``send`` of a later part may wait for the client without
    end (flow control), so the watch must already run.

    ``state``: the app's state (its metrics count the abort); ``what``: the request's
    path, for the log.
    """
    if _alive(owners):
        loop = asyncio.get_running_loop()
        watch = getattr(state, "body_watch", None)
        if watch is None or watch.loop is not loop:
            watch = state.body_watch = _BodyWatch(loop)
        watch.add(owners, transport, what, getattr(state, "metrics", None))


def watch_body_of(scope: dict[str, Any], owners: list[weakref.ref[Any]]) -> None:
    """``watch_body`` for an ASGI request (the transport the metrics middleware left)."""
    watch_body(scope["app"].state, scope.get(TRANSPORT_KEY), scope.get("path", ""), owners)
