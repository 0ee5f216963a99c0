"""One JSON error shape for every error the service answers: ``{"error": {"kind", "message"}}``.

Kinds and statuses come from ``kvstore.errors`` (``kind``/``http_status`` of each class):
``format`` 422, ``shape`` 422, ``version`` 415, ``not_found`` 404, ``pinned`` 409,
``unconvertible`` 409, ``too_large`` 413, ``unauthorized`` 401, ``store_full`` 507,
``model_limit`` 507, ``invalid_request`` 422, ``busy`` 503 (with Retry-After), ``timeout``
408 (a body slower than ``--min-body-rate``; with ``Connection: close``), plus
``method_not_allowed`` 405 and ``internal`` 500 (a bug, logged; never the answer to bad
input). FastAPI's validation errors, unknown routes and methods, malformed bodies and a
client that disconnects mid-body are all mapped here, so no other shape ever leaves. A
405 lists in ``Allow`` every method of every route at the path; ``OPTIONS`` answers 204
with it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.routing import Match

from kvstore.errors import (
    BusyError,
    InvalidRequestError,
    MethodNotAllowedError,
    NotFoundError,
    RequestTimeoutError,
    ServiceError,
    StoreFullError,
    TlkvError,
    TooLargeError,
    UnauthorizedError,
)
from kvstore.protocol import JSON_MEDIA_TYPE

log = logging.getLogger("tlkv.api")

RETRY_AFTER_SECONDS = 1  # the Retry-After of a 503 busy

ERROR_MEDIA_TYPE = JSON_MEDIA_TYPE
_MAX_MESSAGE = 500

Send = Callable[[dict[str, Any]], Awaitable[None]]


def error_body(kind: str, message: str) -> bytes:
    """The JSON bytes of an error: ``{"error": {"kind": kind, "message": message}}``."""
    if len(message) > _MAX_MESSAGE:
        message = message[: _MAX_MESSAGE - 3] + "..."
    return json.dumps({"error": {"kind": kind, "message": message}}).encode()


def _extra_headers(error: type[TlkvError]) -> dict[str, str]:
    if issubclass(error, UnauthorizedError):
        return {"www-authenticate": 'Bearer realm="tlkv"'}
    if issubclass(error, TooLargeError | RequestTimeoutError):
        # The rest of the body is never read: close rather than drain it for keep-alive.
        return {"connection": "close"}
    if issubclass(error, BusyError):
        return {"retry-after": str(RETRY_AFTER_SECONDS)}
    return {}


def error_response(error: TlkvError, headers: dict[str, str] | None = None) -> Response:
    """The response for a tlkv error: its ``http_status`` and the JSON shape."""
    return Response(
        error_body(error.kind, str(error) or error.kind),
        status_code=error.http_status,
        media_type=ERROR_MEDIA_TYPE,
        headers={**_extra_headers(type(error)), **(headers or {})},
    )


def error_parts(error: TlkvError) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The status, raw headers and body of the response to a tlkv error."""
    body = error_body(error.kind, str(error) or error.kind)
    headers: Iterable[tuple[str, str]] = [
        ("content-type", ERROR_MEDIA_TYPE),
        ("content-length", str(len(body))),
        *_extra_headers(type(error)).items(),
    ]
    return error.http_status, [(k.encode(), v.encode("latin-1")) for k, v in headers], body


async def send_error(send: Send, error: TlkvError) -> None:
    """Send a tlkv error as a whole response over raw ASGI (for the middlewares)."""
    status, headers, body = error_parts(error)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()))
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


async def _on_tlkv_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, TlkvError)
    if exc.http_status >= 500 and not isinstance(exc, StoreFullError | BusyError):
        log.error("%s %s failed: %r", request.method, request.url.path, exc)
    elif isinstance(exc, RequestTimeoutError):  # a slow or stalled sender, for the operator
        log.warning("%s %s: %s", request.method, request.url.path, exc)
    return error_response(exc)


async def _on_validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return error_response(InvalidRequestError(_validation_message(exc)))


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")


def allowed_methods(request: Request) -> list[str]:
    """Every method some route takes at the request's path, and OPTIONS (Starlette's own
    405 names only the methods of the first route that matched the path).

    Asks each route whether it takes the path with each method (``BaseRoute.matches``), so
    it holds however the routers are nested.
    """
    allowed = {"OPTIONS"}
    for method in _METHODS:
        scope = {**request.scope, "method": method}
        for route in request.app.router.routes:
            if route.matches(scope)[0] == Match.FULL:
                allowed.add(method)
                break
    return sorted(allowed)


async def _on_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    what = f"{request.method} {request.url.path}"
    error: TlkvError
    if exc.status_code == 404:
        error = NotFoundError(f"no route for {what}")
    elif exc.status_code == 405:
        allow = ", ".join(allowed_methods(request))
        if request.method == "OPTIONS":
            return Response(status_code=204, headers={"allow": allow})
        error = MethodNotAllowedError(f"{what}: method not allowed (allowed: {allow})")
        return error_response(error, {"allow": allow})
    elif exc.status_code == 401:
        error = UnauthorizedError(str(exc.detail))
    elif exc.status_code == 413:
        error = TooLargeError(str(exc.detail))
    else:
        error = InvalidRequestError(f"{what}: {exc.detail}")
        error.http_status = exc.status_code if 400 <= exc.status_code < 500 else 422
    return error_response(error, dict(exc.headers or {}))


async def _on_value_error(request: Request, exc: Exception) -> Response:
    # Bad input the library refused with a plain ValueError (a sequence name, a token id,
    # a value that does not fit f16 on transcoding) or a JSON body nested too deep.
    return error_response(InvalidRequestError(str(exc) or type(exc).__name__))


async def _on_disconnect(request: Request, exc: Exception) -> Response:
    # Nobody reads this answer; it only keeps the disconnect out of the 500 path.
    return error_response(InvalidRequestError("client disconnected before the body ended"))


async def _on_unexpected(request: Request, exc: Exception) -> Response:
    # Starlette re-raises after this answer, so uvicorn logs the traceback once.
    log.error("unexpected %s on %s %s", type(exc).__name__, request.method, request.url.path)
    return error_response(ServiceError(f"internal error ({type(exc).__name__}); see the log"))


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception the app can raise onto the one JSON error shape."""
    app.add_exception_handler(TlkvError, _on_tlkv_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)
    app.add_exception_handler(ValueError, _on_value_error)
    app.add_exception_handler(RecursionError, _on_value_error)
    app.add_exception_handler(ClientDisconnect, _on_disconnect)
    app.add_exception_handler(Exception, _on_unexpected)
