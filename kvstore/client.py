"""HTTP client of the tlkv service (``tlkv serve``), on httpx.

Mirrors the store's API over HTTP; server errors come back as the codec's and store's
typed exceptions (chosen by the error's ``kind``), and :meth:`Client.push` implements the
spec's transfer rule for the prefix cache: only the full blocks the server lacks travel.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from .codec.envelope import decode, join, split
from .codec.layout import NO_HASH
from .errors import (
    NotFoundError,
    ServiceError,
    TlkvError,
)
from .protocol import (
    ENVELOPE_MEDIA_TYPE,
    ERROR_KINDS,
    check_sequence_name,
    error_for_kind,
    hash_hex,
)

__all__ = ["Client", "HasResult", "PutResult", "error_from_response"]

HashLike = int | str | np.integer


@dataclass(frozen=True)
class PutResult:
    """Answer of a put: hashes newly stored, hashes already present, partial blocks skipped."""

    stored: list[int]
    duplicate: list[int]
    partial: int


@dataclass(frozen=True)
class HasResult:
    """Answer of has-blocks: one bool per hash, and how many leading hashes are present."""

    present: list[bool]
    prefix: int


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
    return np.array([int(hash_hex(h), 16) for h in hashes], dtype="<u8")


class Client:
    """A connection pool to one tlkv server.

    Args:
        base_url: e.g. ``http://127.0.0.1:8000``.
        token: the server's bearer token, if it requires one.
        timeout: seconds for connect/read/write (``None``: no timeout).
        transport: an httpx transport (tests may pass an in-process one).
    """

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout: float | None = 60.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"), headers=headers, timeout=timeout, transport=transport
        )

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

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
    ) -> httpx.Response | None:
        headers = {"content-type": body_type} if body_type else None
        if content is not None and not isinstance(content, bytes):
            content = bytes(content)
        response = self._http.request(method, url, content=content, params=params, headers=headers)
        if response.status_code == 404 and missing_ok:
            err = error_from_response(response)
            if isinstance(err, NotFoundError):
                return None
            raise err
        if response.status_code >= 400:
            raise error_from_response(response)
        return response

    def _ok(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        response = self._request(method, url, **kwargs)
        assert response is not None
        return response

    # --- service --------------------------------------------------------------------

    def health(self) -> bool:
        """True when the server answers ``/healthz``."""
        return self._ok("GET", "/healthz").status_code == 200

    def info(self) -> dict[str, Any]:
        """``{"version", "geometry", "formats", "blocks", "bytes", "capacity_bytes"}``."""
        return dict(self._ok("GET", "/v1/info").json())

    def metrics(self) -> str:
        """The Prometheus text of the worker that answered."""
        return self._ok("GET", "/metrics").text

    # --- blocks ---------------------------------------------------------------------

    def put(self, envelope: Any) -> PutResult:
        """Store every full block of ``envelope`` (any buffer) on the server."""
        reply = self._ok("PUT", "/v1/blocks", content=envelope, body_type=ENVELOPE_MEDIA_TYPE)
        data = reply.json()
        return PutResult(
            [int(h, 16) for h in data["stored"]],
            [int(h, 16) for h in data["duplicate"]],
            int(data["partial"]),
        )

    def get(self, hash: HashLike, format: int | None = None) -> bytes | None:
        """The block's single-block envelope (transcoded to ``format``), None when absent."""
        params = {"format": format} if format is not None else None
        reply = self._request("GET", f"/v1/blocks/{hash_hex(hash)}", params=params, missing_ok=True)
        return None if reply is None else reply.content

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
            kind = "application/octet-stream"
        else:
            body = json.dumps({"tokens": [int(t) for t in tokens or ()]}).encode()
            kind = "application/json"
        return self._ok("POST", url, content=body, body_type=kind, **kw)

    def has_blocks(
        self, hashes: Iterable[HashLike] | None = None, tokens: Sequence[int] | None = None
    ) -> HasResult:
        """Which ``hashes`` the server holds (or which full blocks of ``tokens``).

        Hashes travel as a binary u64 body; tokens as JSON, hashed by the server with its
        block_tokens.
        """
        data = self._query("/v1/has-blocks", hashes, tokens).json()
        return HasResult([bool(p) for p in data["present"]], int(data["prefix"]))

    def prefix(
        self,
        hashes: Iterable[HashLike] | None = None,
        tokens: Sequence[int] | None = None,
        format: int | None = None,
    ) -> bytes:
        """One envelope holding the longest stored prefix's blocks, in order (maybe none)."""
        params = {"format": format} if format is not None else None
        return self._query("/v1/prefix", hashes, tokens, params=params).content

    def push(self, envelope: Any) -> int:
        """Send only the full blocks the server lacks (the spec's transfer rule).

        Asks has-blocks for the envelope's full-block hashes, then PUTs the missing full
        blocks as one envelope. Partial blocks are never sent (the store keeps none).

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
        self.put(body)
        return len(body)

    # --- sequences ------------------------------------------------------------------

    def put_sequence(self, name: str, envelope: Any) -> None:
        """Store (or replace) the named sequence: its blocks in order, partial tail last."""
        self._ok("PUT", _name_path(name), content=envelope, body_type=ENVELOPE_MEDIA_TYPE)

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
