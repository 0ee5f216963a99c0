"""Pure-ASGI guard in front of every route: bearer-token auth (the token's model access is
left in the scope for ``api.models``), the request body limit, the in-flight body budget
and the minimum body rate (``api.bodies``), and closing connections whose body was refused
unread.

``Authorization`` and ``Host`` sent twice are refused (422 ``invalid_request``); a server
without a token answers only a ``Host`` that names it (``api.hosts``; 403 ``forbidden``).
Pure ASGI (no ``BaseHTTPMiddleware``) so the hot paths pay one function call, not a task
and a stream copy. A ``Content-Length`` over the limit is refused with 413 before any of
the body is read; a chunked body is counted as it streams in and refused as soon as the
count passes the limit, so an over-limit body is never buffered. Each request gets a
:class:`~api.bodies.BodyTicket` on the worker's in-flight budget, given back when the
request ends. Any answer sent before the request's body was read to its end (a 401, a 413,
an envelope refused by its header, a 408, a 503) carries ``Connection: close``, so the server
closes the connection instead of draining the rest of the body for keep-alive.
"""

from __future__ import annotations

from typing import Any

from kvstore.errors import ForbiddenError, InvalidRequestError, TooLargeError, UnauthorizedError

from .access import EVERYTHING, Access, TokenTable
from .access import SCOPE_KEY as ACCESS_KEY
from .bodies import SCOPE_KEY, BodyTicket, InflightBudget
from .errors import send_error
from .hosts import HostRule

Scope = dict[str, Any]
Message = dict[str, Any]

OPEN_PATHS = frozenset({"/healthz", "/"})  # "/": the static status page (no data)
# Fields a request sends at most once (RFC 9110 5.3): two cannot be told from a forged one.
SINGLETONS = (b"authorization", b"host")
ANY_HOST_PATHS = frozenset({"/healthz"})  # liveness probes name the server as they like


def singletons(scope: Scope) -> tuple[bytes | None, ...]:
    """The values of ``SINGLETONS`` in the request (None where absent), in that order.

    Raises:
        InvalidRequestError: one of them is sent more than once.
    """
    found: list[bytes | None] = [None] * len(SINGLETONS)
    for key, value in scope["headers"]:
        if key in SINGLETONS:
            i = SINGLETONS.index(key)
            if found[i] is not None:
                name = key.decode().capitalize()
                raise InvalidRequestError(f"rule '{name} is sent at most once' failed: found two")
            found[i] = bytes(value)
    return tuple(found)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


def bearer_access(tokens: TokenTable, authorization: bytes | None) -> Access | None:
    """The access of an ``Authorization: Bearer`` header's token in ``tokens`` (None: no
    header, another scheme, or no such token)."""
    if authorization is None:
        return None
    scheme, _, credentials = authorization.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return tokens.lookup(credentials.strip())


class GuardMiddleware:
    """Refuse unauthenticated requests (401) and over-limit bodies (413)."""

    def __init__(
        self,
        app: Any,
        *,
        token: str | None,
        max_body: int,
        budget: InflightBudget | None = None,
        tokens: TokenTable | None = None,
        min_body_rate: int = 0,
        body_timeout: float = 0.0,
        hosts: HostRule | None = None,
    ) -> None:
        self.app = app
        self.hosts = hosts
        self.min_body_rate = min_body_rate
        self.body_timeout = body_timeout
        self.tokens = tokens if tokens is not None or token is None else TokenTable.single(token)
        self.max_body = max_body
        self.budget = budget

    def _access(self, scope: Scope) -> Access | None:
        """The access of the request's bearer token (None: missing or wrong).

        Raises:
            InvalidRequestError: ``Authorization`` or ``Host`` is sent twice.
            ForbiddenError: without tokens, a ``Host`` the server does not answer.
        """
        authorization, host = singletons(scope)
        if self.tokens is None:
            hosts = self.hosts
            if hosts is not None and scope["path"] not in ANY_HOST_PATHS and not hosts.allows(host):
                assert host is not None
                raise ForbiddenError(hosts.describe(host))
            return EVERYTHING
        if scope["path"] in OPEN_PATHS:
            return EVERYTHING
        return bearer_access(self.tokens, authorization)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit():
            unread = int(length) > 0
        else:
            unread = _header(scope, b"transfer-encoding") is not None
        if unread:
            receive, send = _close_unless_read(receive, send)
        try:
            access = self._access(scope)
        except (InvalidRequestError, ForbiddenError) as exc:
            await send_error(send, exc)
            return
        if access is None:
            await send_error(send, UnauthorizedError("missing or wrong bearer token"))
            return
        scope[ACCESS_KEY] = access
        if length is not None:
            # The server frames the body by Content-Length: it can never exceed it.
            if length.isdigit() and int(length) > self.max_body:
                await send_error(
                    send,
                    TooLargeError(
                        f"request body of {int(length)} bytes exceeds the limit of "
                        f"{self.max_body} bytes"
                    ),
                )
                return
        else:
            receive = self._limited(receive)
        ticket = BodyTicket(self.budget, self.min_body_rate, self.body_timeout)
        scope[SCOPE_KEY] = ticket
        try:
            await self.app(scope, receive, send)
        finally:
            ticket.close()

    def _limited(self, receive: Any) -> Any:
        limit = self.max_body
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise TooLargeError(
                        f"request body exceeds the limit of {limit} bytes "
                        f"(refused after {seen} bytes)"
                    )
            return message

        return limited_receive


def _close_unless_read(receive: Any, send: Any) -> tuple[Any, Any]:
    """``receive``/``send`` that add ``Connection: close`` to a response started before the
    last byte of the request body was received (the server would drain it otherwise)."""
    done = False

    async def tracking_receive() -> Message:
        nonlocal done
        message = await receive()
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            done = True
        return message

    async def closing_send(message: Message) -> None:
        if message["type"] == "http.response.start" and not done:
            headers = list(message.get("headers", []))
            if not any(k.lower() == b"connection" for k, _ in headers):
                headers.append((b"connection", b"close"))
                message = {**message, "headers": headers}
        await send(message)

    return tracking_receive, closing_send
