"""HTTP client of the tlkv service (``tlkv serve``): httpx's API over a transport of its own.

Mirrors the store's API over HTTP; server errors come back as the codec's and store's
typed exceptions (chosen by the error's ``kind``), and :meth:`Client.push` implements the
spec's transfer rule for the prefix cache: only the full blocks the server lacks travel.

The connections, request plumbing and the reads that check each envelope's CRC-32C as
it arrives are ``kvstore.client_session.ClientSession``, which :class:`Client` extends.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import quote

import numpy as np

from .client_session import (
    LOOKUP_PATH,
    MODELS_PATH,
    ClientSession,
    HashLike,
    error_from_response,
)
from .client_wire import INTO
from .codec.envelope import decode, join, split
from .codec.hashing import TokenInput
from .codec.layout import NO_HASH
from .codec.tokens import BlockTokens, pack_records, split_records, tokens_for
from .errors import (
    NotFoundError,
)
from .protocol import (
    ENVELOPE_MEDIA_TYPE,
    JSON_MEDIA_TYPE,
    TOKEN_RECORDS_HEADER,
    check_model_id,
    check_sequence_name,
    hash_hex,
)
from .results import HasResult, PutReport

__all__ = ["Client", "HasResult", "PutReport", "error_from_response"]


def _name_path(name: str) -> str:
    """The URL path of a sequence; ``.`` and ``..`` are escaped (URL dot segments)."""
    check_sequence_name(name)
    return "/v1/sequences/" + (name.replace(".", "%2E") if set(name) == {"."} else name)


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


class Client(ClientSession):
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

    # --- service --------------------------------------------------------------------

    def health(self) -> bool:
        """True when the server answers ``/healthz``."""
        return self._ok("GET", "/healthz").status_code == 200

    def models(self) -> list[dict[str, Any]]:
        """The models this token may read: ``{"model", "geometry", "blocks", "bytes",
        "sequences"}`` each."""
        return list(self._ok("GET", MODELS_PATH).json()["models"])

    def delete_model(self, model: str) -> dict[str, int] | None:
        """Delete ``model`` with every block and sequence of it (a token that may write
        it): what it held (``blocks``, ``bytes``, ``sequences``), None when there is none."""
        # Dots encoded too: httpx would take "." or ".." (old ids) as path steps.
        path = f"{MODELS_PATH}/{quote(model, safe='').replace('.', '%2E')}"
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
        reply = self._ok("POST", LOOKUP_PATH, content=body, body_type=JSON_MEDIA_TYPE)
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
