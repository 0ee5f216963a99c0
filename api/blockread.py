"""What a block read answers, decided without a transport: ``GET``/``HEAD /v1/blocks/{hash}``.

A block read has three doors, kept apart because their speed is measured: the FastAPI
route (``api.routes.blocks.get_block``: every read, ``?format=`` included), the pure-ASGI
``api.routes.blocks.BlockReadFastPath`` (a read without a query string, ahead of FastAPI's
routing) and ``api.http_protocol.TlkvHttpProtocol`` (a plain ``GET`` answered in uvicorn's
protocol, ahead of ASGI). This module owns what they share, and each door only writes it:

- :func:`plain_block_read`: whether a fast door may answer a request from the store as
  stored, and the hash it asks for (the path, the method, no query string, every format
  served, a store open); otherwise it declines and the request goes on to the next door;
- :func:`may_read_default`: the access rule for a door ahead of the guard (a bearer token
  that may read the default model);
- :func:`block_answer`: the answer to a read of what the store found: 404, 304 when an
  ``If-None-Match`` is the block's ETag, else 200 with the envelope's type, length and
  ETag, its body the stored buffer itself (zero copy) and weak references to the arrays
  that export it, whose release ends the read snapshot (``BlockAnswer.owners``).

What stays with a door is transport: how it reads (on the loop, or in the thread pool
when the store asks it to wait or a tier reads through), the states of its connection
that make the protocol decline, and how the answer is written.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.codec.assembly import stored_crc
from kvstore.codec.layout import SUPPORTED_VERSIONS
from kvstore.errors import NotFoundError
from kvstore.protocol import DEFAULT_MODEL, ENVELOPE_MEDIA_TYPE, is_hash_hex

from .access import TokenTable
from .errors import error_parts
from .middleware import bearer_access

ROUTE = "/v1/blocks/{hash}"  # the route's path, and the metrics' route label
BLOCK_PREFIX = "/v1/blocks/"
_PATH_LEN = len(BLOCK_PREFIX) + 16
READ_METHODS = frozenset({"GET", "HEAD"})
_ENVELOPE_TYPE = ENVELOPE_MEDIA_TYPE.encode()

Headers = list[tuple[bytes, bytes]]


@dataclass(slots=True)
class BlockAnswer:
    """A block read's answer: status, raw headers, body, and the owners of its buffer.

    ``body`` is sent after the headers in one part (``b""`` for a 304 or a ``HEAD``); a
    zero-copy body pins the read snapshot until the transport releases it, and ``owners``
    are weak references to the arrays exporting it (``owner_refs``), for ``watch_body``.
    A door takes the body out (``take_body``) so that it holds the only reference.
    """

    status: int
    headers: Headers
    body: Any
    owners: list[weakref.ref[Any]]

    def take_body(self) -> Any:
        """The body, no longer referenced by this answer."""
        body, self.body = self.body, b""
        return body


def plain_block_read(
    path: str,
    method: str,
    query: bytes,
    formats: Collection[int],
    store: object | None,
    methods: Collection[str] = READ_METHODS,
) -> int | None:
    """The hash a block read asks for, when a fast door may answer it from ``store`` as stored.

    None (decline: the next door answers): another path, a malformed hash, a method not in
    ``methods``, a query string (``?format=`` transcodes), a service that does not serve
    every format (a stored v2 block would be transcoded) or no store open.
    """
    if (
        len(path) != _PATH_LEN
        or method not in methods
        or query
        or not path.startswith(BLOCK_PREFIX)
        or store is None
    ):
        return None
    digits = path[len(BLOCK_PREFIX) :]
    if not is_hash_hex(digits) or formats != SUPPORTED_VERSIONS:
        return None
    return int(digits, 16)


def may_read_default(tokens: TokenTable | None, authorization: bytes | None) -> bool:
    """Whether a request with this ``Authorization`` header may read the default model
    (what the guard and the model scope let through to an unprefixed block read)."""
    if tokens is None:
        return True
    access = bearer_access(tokens, authorization)
    return access is not None and access.can_read(DEFAULT_MODEL)


def block_etag(data: Any) -> str:
    """The ETag of a stored envelope: its own CRC-32C and length, which change whenever a
    byte of the answer does."""
    return f'"{stored_crc(data):08x}-{len(data)}"'


def block_not_found(digits: str) -> NotFoundError:
    """The answer to a read of a block that is not stored."""
    return NotFoundError(f"block {digits} not found")


def owner_refs(parts: list[Any]) -> list[weakref.ref[Any]]:
    """Weak references to the arrays exporting the zero-copy buffers among ``parts``."""
    return [weakref.ref(p.obj) for p in parts if isinstance(getattr(p, "obj", None), np.ndarray)]


def block_answer(
    h: int,
    found: list[Any],
    request_headers: Iterable[tuple[bytes, bytes]] = (),
    head: bool = False,
) -> BlockAnswer:
    """The answer to a read of block ``h`` given what the store ``found`` (the block's
    envelope, or nothing), for a request with these raw headers (an ``If-None-Match``
    equal to the block's ETag answers 304) and method (``head``: no body).

    The envelope is popped from ``found``: the answer holds the only reference the door
    is given.
    """
    if not found:
        status, headers, body = error_parts(block_not_found(f"{h:016x}"))
        return BlockAnswer(status, headers, body, [])
    data = found.pop()
    etag = block_etag(data).encode()
    for name, value in request_headers:
        if name == b"if-none-match" and value == etag:
            return BlockAnswer(304, [(b"etag", etag)], b"", [])
    headers = [
        (b"content-type", _ENVELOPE_TYPE),
        (b"content-length", str(len(data)).encode()),
        (b"etag", etag),
    ]
    if head:
        return BlockAnswer(200, headers, b"", [])
    return BlockAnswer(200, headers, data, owner_refs([data]))
