"""The plumbing of the HTTP client (:class:`kvstore.client.Client`): its connections,
request building and sending, error answers as typed exceptions, and the block reads that
check the envelope's CRC-32C as it arrives.

The wire I/O is ``kvstore.client_wire.BodyTransport`` (kept-alive HTTP/1.1 connections
read by ``kvstore.client_http1``; why, in those modules). httpx stays the API: its request
building, auth header, timeouts and exception types (``httpx.HTTPError``) are what callers
already use, and an explicit ``transport=`` (tests pass a recording one) replaces ours. A block read
(``_get_direct``) goes to the transport's round trip without httpx's request and
response objects (the same bytes on the wire, less client CPU). A block read and a prefix
check the envelope's CRC-32C as it arrives, end to end, and ask the server to skip its own
check before sending (``_envelope_query``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
import numpy as np

from .client_wire import (
    CHECK,
    CRC_OK,
    INTO,
    Answer,
    BodyTransport,
    ReceivePool,
    env_proxy,
    origin_of,
)
from .codec.hashing import exact_u64_array
from .errors import (
    ChecksumError,
    NotFoundError,
    ServiceError,
    TlkvError,
)
from .protocol import (
    ERROR_KINDS,
    HASHES_MEDIA_TYPE,
    JSON_MEDIA_TYPE,
    READER_CHECKS_CRC,
    READER_CHECKS_HEADER,
    check_model_id,
    error_for_kind,
    hash_hex,
)

__all__ = ["LOOKUP_PATH", "MODELS_PATH", "ClientSession", "HashLike", "error_from_response"]

HashLike = int | str | np.integer
_Session = TypeVar("_Session", bound="ClientSession")
MODELS_PATH = "/v1/models"  # /v1 routes no model prefixes
LOOKUP_PATH = "/v1/lookup"
_ARRIVED_CORRUPT = (
    "{what}: the envelope arrived with a CRC-32C that does not match its bytes, after the "
    "server checked it (FORMAT.md 2.2: the trailer is the CRC-32C of every byte before it)"
)


def error_from_response(response: httpx.Response) -> TlkvError:
    """The typed exception for an error response (``ServiceError`` for an unknown kind)."""
    try:
        error = response.json()["error"]
        kind, message = str(error["kind"]), str(error["message"])
    except (ValueError, KeyError, TypeError):
        text = response.text[:200]
        return ServiceError(f"HTTP {response.status_code} without the error shape: {text!r}")
    if kind not in ERROR_KINDS:
        exc = ServiceError(f"{kind}: {message}")
        exc.http_status = response.status_code
        return exc
    return error_for_kind(kind, message)


def _u64(hashes: Iterable[HashLike]) -> np.ndarray:
    """Hashes (ints, numpy integers or hex strings) as a little-endian u64 array."""
    if isinstance(hashes, np.ndarray):
        if hashes.dtype.kind not in "iu" or (hashes.dtype.kind == "i" and (hashes < 0).any()):
            raise ValueError(f"hashes must be u64 values, found dtype {hashes.dtype}")
        return np.ascontiguousarray(hashes.reshape(-1), dtype="<u8")
    items = hashes if isinstance(hashes, list) else list(hashes)
    packed = exact_u64_array(items)
    if packed is not None:
        return packed
    if all(type(h) is int for h in items):  # numpy converts plain ints in one C loop
        with contextlib.suppress(OverflowError):  # out of range: refused below, by name
            return np.array(items, dtype="<u8")
    return np.array([int(hash_hex(h), 16) for h in items], dtype="<u8")


class ClientSession:
    """One tlkv server's connection pool and request plumbing, for :class:`Client`
    (whose docstring lists the arguments)."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout: float | None = 60.0,
        transport: httpx.BaseTransport | None = None,
        model: str | None = None,
    ) -> None:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        # "/v1/..." becomes "/v1/models/<model, percent-encoded>/..."
        self._prefix = (
            "" if model is None else f"/v1/models/{quote(check_model_id(model), safe='')}"
        )
        if transport is None and not env_proxy(base_url):
            transport = BodyTransport()
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"), headers=headers, timeout=timeout, transport=transport
        )
        self._direct = transport if isinstance(transport, BodyTransport) else None
        self._answers = ReceivePool()  # what prefix() reads into
        # What httpx would build for every GET of this client: the origin, the base URL's
        # path (without its closing "/"), the headers (Host, auth, ...), the timeouts.
        template = self._http.build_request("GET", "/")
        self._origin = origin_of(template.url)
        self._base_path = template.url.raw_path.decode("ascii")[:-1]
        self._get_headers = template.headers.raw
        self._checked_get_headers = [
            *self._get_headers,
            (READER_CHECKS_HEADER.encode(), READER_CHECKS_CRC.encode()),
        ]
        self._timeouts = template.extensions.get("timeout", {})

    def close(self) -> None:
        """Close the connection pool (and drop the receive buffers)."""
        self._http.close()
        self._answers.clear()

    def __enter__(self: _Session) -> _Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(
        self,
        method: str,
        url: str,
        *,
        content: Any = None,
        body_type: str | None = None,
        params: dict[str, Any] | None = None,
        missing_ok: bool = False,
        into: Any = None,
        headers: dict[str, str] | None = None,
        check: bool = False,
    ) -> httpx.Response | None:
        headers = {**({"content-type": body_type} if body_type else {}), **(headers or {})}
        url = self._path(url)
        if content is not None and not isinstance(content, bytes):
            content = bytes(content)
        if into is not None and not isinstance(into, ReceivePool):
            into = memoryview(into).cast("B")
        extensions: dict[str, Any] = {INTO: into} if into is not None else {}
        if check:
            extensions[CHECK] = True
        request = self._http.build_request(
            method, url, content=content, params=params, headers=headers, extensions=extensions
        )
        return self._checked(self._send(request), missing_ok)

    def _path(self, url: str) -> str:
        """``url`` with this client's model in it: "/v1/..." becomes "/v1/models/<m>/..."."""
        if self._prefix and url.startswith("/v1/") and url not in (MODELS_PATH, LOOKUP_PATH):
            return self._prefix + url[3:]
        return url

    @staticmethod
    def _checked(response: httpx.Response, missing_ok: bool) -> httpx.Response | None:
        """``response``, None for a 404 ``NotFoundError`` when ``missing_ok``; an error
        answer raises its typed exception."""
        if response.status_code == 404 and missing_ok:
            err = error_from_response(response)
            if isinstance(err, NotFoundError):
                return None
            raise err
        if response.status_code >= 400:
            raise error_from_response(response)
        return response

    def _get_direct(self, url: str) -> bytes | None:
        """The body of a plain ``GET url`` (None for a 404 ``NotFoundError``), sent on
        tlkv's transport without building httpx's request and response objects.

        The request is the one httpx would build (``__init__`` keeps its parts), so the
        wire bytes are the same, without the client CPU of building both objects per read
        (BENCHMARKS.md, peers), plus ``READER_CHECKS_HEADER``: the envelope's CRC-32C is
        checked here as it arrives, and the server need not check it before sending. An
        envelope that arrives corrupt is asked for again without the header: the server
        then checks it, quarantines a corrupt stored block and answers 404 (or the tier's
        copy), exactly as for any other reader; corrupt again, it raises ChecksumError
        (damaged between the server's check and here). An error answer, and a transport
        error, get their httpx request and go through the same rules as any other call.
        """
        assert self._direct is not None
        path = self._path(url)
        answer = self._exchange_get(path, self._checked_get_headers)
        if answer.status == 200 and not answer.crc_ok:
            answer = self._exchange_get(path, self._get_headers)
            if answer.status == 200 and not answer.crc_ok:
                raise ChecksumError(_ARRIVED_CORRUPT.format(what=f"GET {path}"))
        if answer.status == 200:
            return answer.content
        response = self._checked(answer.response(self._http.build_request("GET", path)), True)
        return None if response is None else response.content

    def _exchange_get(self, path: str, headers: Any) -> Answer:
        """One ``GET path`` on the transport, its 200 body read as a checked envelope."""
        assert self._direct is not None
        if self._http.is_closed:
            raise RuntimeError("Cannot send a request, as the client has been closed.")
        try:
            return self._direct.exchange(
                self._origin,
                "GET",
                self._base_path + path,
                headers,
                None,
                self._timeouts,
                check=True,
            )
        except httpx.TransportError as exc:
            exc.request = self._http.build_request("GET", path)
            raise

    def _send(self, request: httpx.Request) -> httpx.Response:
        """Send ``request`` (built by httpx: base URL, headers, timeouts) and read its answer.

        On tlkv's own transport the request goes to it directly. ``httpx.Client.send``
        wraps an answer's stream in one that refers back to the response: a cycle that keeps
        every answer (2 MiB for a block) alive until the garbage collector runs, so the
        next answer is read into freshly faulted pages, which can double a block GET's
        time (BENCHMARKS.md, peers). This client uses none of what ``send``
        adds around the exchange (redirects are not followed, no auth flow, cookies or
        event hooks), so the direct call is the same request and answer. With any other
        transport (a caller's, or httpx's own behind a proxy), httpx sends as usual.
        """
        transport = self._direct
        if transport is None:
            return self._http.send(request)
        if self._http.is_closed:
            raise RuntimeError("Cannot send a request, as the client has been closed.")
        response = transport.handle_request(request)
        response.request = request
        response.read()
        return response

    def _ok(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        response = self._request(method, url, **kwargs)
        assert response is not None
        return response

    def _query(
        self, url: str, hashes: Iterable[HashLike] | None, tokens: Sequence[int] | None, **kw: Any
    ) -> httpx.Response:
        if (hashes is None) == (tokens is None):
            raise ValueError("pass exactly one of hashes= or tokens=")
        if hashes is not None:
            body: bytes = _u64(hashes).tobytes()
            kind = HASHES_MEDIA_TYPE
        else:
            body = json.dumps({"tokens": [int(t) for t in tokens or ()]}).encode()
            kind = JSON_MEDIA_TYPE
        return self._ok("POST", url, content=body, body_type=kind, **kw)

    def _envelope_query(
        self, url: str, hashes: Iterable[HashLike] | None, tokens: Sequence[int] | None, **kw: Any
    ) -> httpx.Response:
        """``_query`` of an envelope answer. On this client's own transport the envelope's
        CRC-32C is checked as it arrives and the server is asked not to check it first
        (``READER_CHECKS_HEADER``); an answer that fails the check is asked for again
        without the header, so that the server's check quarantines a block that rotted on
        disk and cuts the answer before it; failing again, ChecksumError. With another
        transport (a caller's, a proxy's) the server checks, as for any client."""
        if self._direct is None:
            return self._query(url, hashes, tokens, **kw)
        checks = {READER_CHECKS_HEADER: READER_CHECKS_CRC}
        response = self._query(url, hashes, tokens, check=True, headers=checks, **kw)
        if response.extensions.get(CRC_OK) is not False:
            return response
        response.extensions.pop(INTO, None)  # the receive buffer goes back to the pool
        response = self._query(url, hashes, tokens, check=True, **kw)
        if response.extensions.get(CRC_OK) is False:
            raise ChecksumError(_ARRIVED_CORRUPT.format(what=f"POST {url}"))
        return response
