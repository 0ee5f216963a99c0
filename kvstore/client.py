"""HTTP client of the tlkv service (``tlkv serve``): httpx's API over a transport of its own.

Mirrors the store's API over HTTP; server errors come back as the codec's and store's
typed exceptions (chosen by the error's ``kind``), and :meth:`Client.push` implements the
spec's transfer rule for the prefix cache: only the full blocks the server lacks travel.

The wire I/O is ``kvstore.client_wire.BodyTransport`` (kept-alive HTTP/1.1 connections
read by ``kvstore.client_http1``; why, in those modules). httpx stays the API: its request
building, auth header, timeouts and exception types (``httpx.HTTPError``) are what callers
already use, and an explicit ``transport=`` (tests pass a recording one) replaces ours. A block read
(:meth:`Client.get`) goes to the transport's round trip without httpx's request and
response objects (the same bytes on the wire, less client CPU). A block read and a prefix
check the envelope's CRC-32C as it arrives, end to end, and ask the server to skip its own
check before sending (``_envelope_query``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Sequence
from typing import Any
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
from .codec.envelope import decode, join, split
from .codec.hashing import TokenInput, exact_u64_array
from .codec.layout import NO_HASH
from .codec.tokens import BlockTokens, pack_records, split_records, tokens_for
from .errors import (
    ChecksumError,
    NotFoundError,
    ServiceError,
    TlkvError,
)
from .protocol import (
    ENVELOPE_MEDIA_TYPE,
    ERROR_KINDS,
    HASHES_MEDIA_TYPE,
    JSON_MEDIA_TYPE,
    READER_CHECKS_CRC,
    READER_CHECKS_HEADER,
    TOKEN_RECORDS_HEADER,
    check_model_id,
    check_sequence_name,
    error_for_kind,
    hash_hex,
)
from .results import HasResult, PutReport

__all__ = ["Client", "HasResult", "PutReport", "error_from_response"]

HashLike = int | str | np.integer
_MODELS_PATH = "/v1/models"  # /v1 routes no model prefixes
_LOOKUP_PATH = "/v1/lookup"
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


def _name_path(name: str) -> str:
    """The URL path of a sequence; ``.`` and ``..`` are escaped (URL dot segments)."""
    check_sequence_name(name)
    return "/v1/sequences/" + (name.replace(".", "%2E") if set(name) == {"."} else name)


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


def _with_records(
    envelope: Any, tokens: TokenInput | BlockTokens | None, parent: int
) -> tuple[Any, dict[str, str] | None]:
    """A put's body and headers: the envelope alone, or with ``tokens`` (checked here
    against its full blocks' hashes) as token records after it."""
    if tokens is None:
        return envelope, None
    env = decode(envelope)
    kept = tokens_for(env.hashes, env.geometry.block_tokens, tokens, parent)
    body = b"".join([bytes(env.data), pack_records(kept)])
    return body, {TOKEN_RECORDS_HEADER: str(kept.n_blocks)}


class Client:
    """A connection pool to one tlkv server.

    Args:
        base_url: e.g. ``http://127.0.0.1:8000``.
        token: the server's bearer token, if it requires one.
        timeout: seconds for connect/read/write (``None``: no timeout).
        transport: an httpx transport (tests may pass an in-process one); by default
            :class:`BodyTransport`, or httpx's own where the environment sets a proxy.
        model: the model (namespace) every call addresses (``/v1/models/{model}/...``;
            None: the server's ``default``, today's routes).
    """

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

    def __enter__(self) -> Client:
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
        if self._prefix and url.startswith("/v1/") and url not in (_MODELS_PATH, _LOOKUP_PATH):
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

    # --- service --------------------------------------------------------------------

    def health(self) -> bool:
        """True when the server answers ``/healthz``."""
        return self._ok("GET", "/healthz").status_code == 200

    def models(self) -> list[dict[str, Any]]:
        """The models this token may read: ``{"model", "geometry", "blocks", "bytes",
        "sequences"}`` each."""
        return list(self._ok("GET", _MODELS_PATH).json()["models"])

    def delete_model(self, model: str) -> dict[str, int] | None:
        """Delete ``model`` with every block and sequence of it (a token that may write
        it): what it held (``blocks``, ``bytes``, ``sequences``), None when there is none."""
        # Dots encoded too: httpx would take "." or ".." (old ids) as path steps.
        path = f"{_MODELS_PATH}/{quote(model, safe='').replace('.', '%2E')}"
        response = self._send(self._http.build_request("DELETE", path))
        if response.status_code >= 400:
            err = error_from_response(response)
            if isinstance(err, NotFoundError):
                return None
            raise err
        return {k: int(v) for k, v in response.json().items() if k != "model"}

    def info(self) -> dict[str, Any]:
        """``{"version", "geometry", "formats", "blocks", "bytes", "capacity_bytes"}``."""
        return dict(self._ok("GET", "/v1/info").json())

    def metrics(self) -> str:
        """The Prometheus text of the worker that answered."""
        return self._ok("GET", "/metrics").text

    # --- blocks ---------------------------------------------------------------------

    def put(
        self,
        envelope: Any,
        *,
        tokens: TokenInput | BlockTokens | None = None,
        parent: int = 0,
    ) -> PutReport:
        """Store every full block of ``envelope`` (any buffer) on the server.

        ``tokens`` (and ``parent``): the full blocks' token ids, as ``Store.put`` takes
        them; checked here first, sent as token records after the envelope and checked
        again by the server (``TokenMismatchError``, nothing stored).
        """
        content, headers = _with_records(envelope, tokens, parent)
        reply = self._ok(
            "PUT", "/v1/blocks", content=content, body_type=ENVELOPE_MEDIA_TYPE, headers=headers
        )
        data = reply.json()
        return PutReport(
            [int(h, 16) for h in data["stored"]],
            [int(h, 16) for h in data["duplicate"]],
            int(data["partial"]),
        )

    def get(self, hash: HashLike, format: int | None = None) -> bytes | None:
        """The block's single-block envelope (transcoded to ``format``), None when absent.

        Its CRC-32C is checked as it arrives (``_get_direct``); ``ChecksumError`` when it
        arrives damaged even after the server checked it."""
        url = f"/v1/blocks/{hash_hex(hash)}"
        if format is None and self._direct is not None:
            return self._get_direct(url)
        params = {"format": format} if format is not None else None
        reply = self._request("GET", url, params=params, missing_ok=True)
        return None if reply is None else reply.content

    def get_with_tokens(self, hash: HashLike) -> tuple[bytes, tuple[int, np.ndarray] | None] | None:
        """The block's envelope and its ``(parent hash, token ids)`` when the server keeps
        them (None in their place otherwise); None when the block is absent."""
        url = f"/v1/blocks/{hash_hex(hash)}"
        reply = self._request("GET", url, params={"tokens": 1}, missing_ok=True)
        if reply is None:
            return None
        records = 1 if reply.headers.get(TOKEN_RECORDS_HEADER) == "1" else 0
        envelope, found = split_records(reply.content, records)
        if found is None:
            return reply.content, None
        return bytes(envelope), (int(found.parents[0]), found.ids[0].copy())

    def delete(self, hash: HashLike) -> bool:
        """Delete a block; False when absent. Raises PinnedError when a sequence pins it."""
        return self._request("DELETE", f"/v1/blocks/{hash_hex(hash)}", missing_ok=True) is not None

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

    def has_blocks(
        self,
        hashes: Iterable[HashLike] | None = None,
        tokens: Sequence[int] | None = None,
        *,
        tier: bool = False,
    ) -> HasResult:
        """Which ``hashes`` the server holds (or which full blocks of ``tokens``).

        Hashes travel as a binary u64 body; tokens as JSON, hashed by the server with its
        block_tokens. ``tier``: a block the server's object-store tier holds counts too
        (``?tier=1``: its reads would fetch it through).
        """
        params = {"tier": 1} if tier else None
        data = self._query("/v1/has-blocks", hashes, tokens, params=params).json()
        return HasResult(list(map(bool, data["present"])), int(data["prefix"]))

    def lookup(
        self,
        tokens: Sequence[int] | None = None,
        hashes: Iterable[HashLike] | None = None,
        models: Sequence[str] | None = None,
    ) -> list[dict[str, Any]]:
        """The longest prefix of the prompt each model holds (``POST /v1/lookup``): per
        model ``{"model", "block_tokens", "local_blocks", "local_tokens", "tier_blocks",
        "tier_tokens"}``; ``models`` default to every model the token may read."""
        if (hashes is None) == (tokens is None):
            raise ValueError("pass exactly one of hashes= or tokens=")
        query: dict[str, Any] = (
            {"tokens": [int(t) for t in tokens or ()]}
            if tokens is not None
            else {"hashes": [hash_hex(h) for h in hashes or ()]}
        )
        if models is not None:
            query["models"] = [check_model_id(m) for m in models]
        body = json.dumps(query).encode()
        reply = self._ok("POST", _LOOKUP_PATH, content=body, body_type=JSON_MEDIA_TYPE)
        return list(reply.json()["models"])

    def prefix(
        self,
        hashes: Iterable[HashLike] | None = None,
        tokens: Sequence[int] | None = None,
        format: int | None = None,
    ) -> bytes | memoryview:
        """One envelope holding the longest stored prefix's blocks, in order (maybe none).

        A read-only memoryview of a receive buffer the client keeps and fills again only
        once nothing references this answer any more: hold it (or arrays over it) as long
        as needed, it is never overwritten; ``bytes(answer)`` for a bytes object. A buffer
        used again keeps its pages mapped: a fresh one per 128 MiB answer cost ~32,000
        page faults, as much time as the copy. ``bytes`` when the client was given
        another ``transport``. ``prefix_into`` reads into the caller's own buffer. The
        envelope's CRC-32C is checked as it arrives (``_envelope_query``).
        """
        params = {"format": format} if format is not None else None
        response = self._envelope_query(
            "/v1/prefix", hashes, tokens, params=params, into=self._answers
        )
        filled = response.extensions.pop(INTO, None)  # the response must not hold the buffer
        return response.content if filled is None else filled.toreadonly()

    def prefix_into(
        self,
        out: Any,
        hashes: Iterable[HashLike] | None = None,
        tokens: Sequence[int] | None = None,
        format: int | None = None,
    ) -> memoryview | bytes:
        """``prefix``, its envelope read into the writable buffer ``out`` when it fits:
        returns the filled part of ``out`` (a memoryview), or the envelope as new bytes
        when it is larger than ``out`` (or the client was given another ``transport``).
        A buffer used again keeps its pages: a 12 MiB answer into a new ``bytes`` takes
        ~3,000 page faults, as many as the kernel's copy.
        """
        params = {"format": format} if format is not None else None
        response = self._envelope_query("/v1/prefix", hashes, tokens, params=params, into=out)
        filled = response.extensions.get(INTO)
        return response.content if filled is None else filled

    def push(
        self,
        envelope: Any,
        *,
        tokens: TokenInput | BlockTokens | None = None,
        parent: int = 0,
    ) -> int:
        """Send only the full blocks the server lacks (the spec's transfer rule).

        Asks has-blocks for the envelope's full-block hashes, then PUTs the missing full
        blocks as one envelope. Partial blocks are never sent (the store keeps none).
        ``tokens`` (and ``parent``), as ``put`` takes them: the missing blocks' token
        records travel with them (not counted in the bytes returned).

        Returns:
            Body bytes sent: ``geometry.envelope_bytes(missing, version)``, 0 (and no PUT)
            when the server holds every full block.
        """
        env = decode(envelope)
        hashes = env.hashes
        full = np.flatnonzero(hashes != NO_HASH)
        if not len(full):
            return 0
        present = self.has_blocks(hashes[full]).present
        missing: list[int] = []
        seen: set[int] = set()
        for index, here in zip(full.tolist(), present):
            h = int(hashes[index])
            if not here and h not in seen:
                seen.add(h)
                missing.append(index)
        if not missing:
            return 0
        if len(missing) == len(env):
            body: Any = env.data
        else:
            parts = split(env.data)
            body = join([parts[i] for i in missing])
        expected = env.geometry.envelope_bytes(len(missing), env.version)
        if len(body) != expected:  # pragma: no cover - guards the accounting invariant
            raise AssertionError(f"push body is {len(body)} bytes, expected {expected}")
        kept = None
        if tokens is not None:  # the rows of the blocks that travel, each with its parent
            kept = tokens_for(hashes, env.geometry.block_tokens, tokens, parent)
            rows = np.cumsum(hashes != NO_HASH) - 1
            kept = kept.take(rows[missing])
        self.put(body, tokens=kept)
        return len(body)

    # --- sequences ------------------------------------------------------------------

    def put_sequence(
        self,
        name: str,
        envelope: Any,
        *,
        tokens: TokenInput | BlockTokens | None = None,
        parent: int = 0,
    ) -> None:
        """Store (or replace) the named sequence: its blocks in order, partial tail last
        (``tokens`` and ``parent`` as ``put`` takes them)."""
        content, headers = _with_records(envelope, tokens, parent)
        self._ok(
            "PUT", _name_path(name), content=content, body_type=ENVELOPE_MEDIA_TYPE, headers=headers
        )

    def get_sequence(self, name: str) -> bytes | None:
        """The sequence's envelope, byte-identical to what was put; None when absent."""
        reply = self._request("GET", _name_path(name), missing_ok=True)
        return None if reply is None else reply.content

    def delete_sequence(self, name: str) -> bool:
        """Delete the named sequence; False when absent."""
        return self._request("DELETE", _name_path(name), missing_ok=True) is not None

    def sequences(self) -> list[str]:
        """Names of every stored sequence."""
        return list(self._ok("GET", "/v1/sequences").json()["sequences"])
