"""Request parsing shared by the routers: hashes, content types, bodies, JSON answers.

The hot paths parse by hand (``json.loads``, ``np.frombuffer``), not with pydantic models:
a request model halves a JSON endpoint's rate, and has-blocks takes 8,192 hashes.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from fastapi import Request
from starlette.responses import Response

from kvstore.codec.hashing import chain_hashes_array
from kvstore.errors import InvalidRequestError, ServiceError
from kvstore.protocol import (
    ENVELOPE_MEDIA_TYPE,
    HASH_HEX_DIGITS,
    HASH_HEX_PATTERN,
    HASHES_MEDIA_TYPE,
    JSON_MEDIA_TYPE,
    hash_hex,
    is_hash_hex,
)
from kvstore.store import Store

from ..bodies import read_body as read_body

# Every body is read through api.bodies (the in-flight budget); re-exported for the routes.
from ..jsonquery import JSON_FALLBACK_BYTES, JSON_WEIGHT, NO_GEOMETRY, NotPlain, parse_plain
from ..modelscope import model_store

OCTET_STREAM = HASHES_MEDIA_TYPE
ENVELOPE_TYPES = frozenset({ENVELOPE_MEDIA_TYPE, OCTET_STREAM})

HASH_PATTERN = HASH_HEX_PATTERN

# Request-body schemas for the OpenAPI document (the routes parse bodies by hand).
ENVELOPE_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            ENVELOPE_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}},
            OCTET_STREAM: {"schema": {"type": "string", "format": "binary"}},
        },
    }
}
HASHES_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            JSON_MEDIA_TYPE: {
                "schema": {
                    "oneOf": [
                        {
                            "type": "object",
                            "required": ["hashes"],
                            "additionalProperties": False,
                            "properties": {
                                "hashes": {
                                    "type": "array",
                                    "items": {"type": "string", "pattern": HASH_PATTERN},
                                }
                            },
                        },
                        {
                            "type": "object",
                            "required": ["tokens"],
                            "additionalProperties": False,
                            "properties": {
                                "tokens": {
                                    "type": "array",
                                    "description": "token ids written as JSON integers "
                                    "(7, not 7.0 or 7e0)",
                                    "items": {
                                        "type": "integer",
                                        "minimum": 0,
                                        "maximum": 0xFFFFFFFF,
                                    },
                                }
                            },
                        },
                    ]
                }
            },
            OCTET_STREAM: {
                "schema": {
                    "type": "string",
                    "format": "binary",
                    "description": "little-endian u64 hashes",
                }
            },
        },
    }
}
ENVELOPE_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {"content": {ENVELOPE_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}}}
}


def store_of(request: Request) -> Store:
    """The store the worker's lifespan opened, as the model the request addresses."""
    store = getattr(request.app.state, "store", None)
    if store is None:  # only if the lifespan did not run (a misconfigured server)
        raise ServiceError("the store is not open")
    return model_store(request.scope, store)


def parse_hash_list(items: Any) -> np.ndarray:
    """``<u8`` hashes from a JSON list of 16-lowercase-hex-digit strings, vectorized.

    Raises:
        InvalidRequestError: not a list, or an item that is not such a string.
    """
    if not isinstance(items, list):
        raise InvalidRequestError(f"'hashes' must be a list, found {type(items).__name__}")
    if not items:
        return np.zeros(0, dtype="<u8")
    try:
        joined = "".join(items)  # TypeError on any non-string
    except TypeError:
        joined = ""
    ok = len(joined) == HASH_HEX_DIGITS * len(items) and set(map(len, items)) == {HASH_HEX_DIGITS}
    if ok:
        try:
            raw = bytes.fromhex(joined)
        except ValueError:
            ok = False
        else:
            ok = raw.hex() == joined  # refuses upper case and whitespace that fromhex allows
    if not ok:
        for i, item in enumerate(items):
            if not is_hash_hex(item):
                raise InvalidRequestError(
                    f"hashes[{i}]: a block hash is 16 lowercase hex digits, found {item!r:.40}"
                )
        raise InvalidRequestError("hashes: every item must be 16 lowercase hex digits")
    return np.frombuffer(raw, dtype=">u8").astype("<u8")


def hex_list(hashes: Any) -> list[str]:
    """Hashes as 16-lowercase-hex-digit strings."""
    return [hash_hex(h) for h in hashes]


def content_type(request: Request) -> str | None:
    """The request's one ``Content-Type`` value (None when absent).

    Raises:
        InvalidRequestError: the field is sent more than once (RFC 9110 8.3: a singleton
            field; two values cannot be told apart from a forged one).
    """
    values = request.headers.getlist("content-type")
    if len(values) > 1:
        raise InvalidRequestError(
            f"rule 'Content-Type is sent at most once' failed: found {len(values)} fields"
        )
    return values[0] if values else None


def media_type(request: Request) -> str | None:
    """The request's media type without parameters, lower case (None when absent)."""
    value = content_type(request)
    if value is None:
        return None
    return value.split(";", 1)[0].strip().lower()


def max_body_of(request: Request) -> int:
    """The worker's ``--max-body``."""
    return int(request.app.state.settings.max_body)


def require_envelope_type(request: Request) -> None:
    """An envelope body comes as exactly ``application/vnd.tlkv`` or
    ``application/octet-stream`` (any case), with no parameter: a charset or any other
    parameter means the sender took the bytes for something else.

    Raises:
        InvalidRequestError: no content type, another one, or one with parameters.
    """
    value = content_type(request)
    kind = None if value is None else value.strip().lower()
    if kind not in ENVELOPE_TYPES:
        found = "none" if value is None else repr(value[:100])
        raise InvalidRequestError(
            f"an envelope body must be sent as Content-Type {ENVELOPE_MEDIA_TYPE} or "
            f"{OCTET_STREAM} (no parameters), found {found}"
        )


def parse_tokens(items: Any) -> list[int]:
    """Token ids from a JSON list of integers in 0..2^32-1.

    Raises:
        InvalidRequestError: not a list, or an item that is not such an integer.
    """
    if not isinstance(items, list):
        raise InvalidRequestError(f"'tokens' must be a list, found {type(items).__name__}")
    for i, t in enumerate(items):
        if type(t) is not int or not 0 <= t <= 0xFFFFFFFF:
            raise InvalidRequestError(f"tokens[{i}]: a token id is an integer in 0..2^32-1")
    return items


async def request_hashes(request: Request, store: Store) -> np.ndarray:
    """The ``<u8`` hashes of a has-blocks / prefix request, in any of its three forms.

    JSON ``{"hashes": [hex, ...]}``, JSON ``{"tokens": [int, ...]}`` (full blocks hashed with
    the store's block_tokens), or an ``application/octet-stream`` body of little-endian u64.
    JSON in the plain grammar is parsed without a Python object per item (``jsonquery``);
    other JSON only up to ``JSON_FALLBACK_BYTES``.

    Raises:
        InvalidRequestError: a malformed body, or tokens for a store with no geometry yet.
    """
    kind = media_type(request)
    if kind not in (JSON_MEDIA_TYPE, OCTET_STREAM):
        raise InvalidRequestError(
            f"the body must be {JSON_MEDIA_TYPE} or {OCTET_STREAM} (u64 hashes), found {kind!r}"
        )
    # A JSON query's parsed hashes and its answer take up to its size again: reserved.
    body = await read_body(request, weight=1 if kind == OCTET_STREAM else JSON_WEIGHT)
    if kind == OCTET_STREAM:
        if len(body) % 8:
            raise InvalidRequestError(
                f"a binary body is little-endian u64 hashes: {len(body)} bytes is not a "
                "multiple of 8"
            )
        return np.frombuffer(body, dtype="<u8")
    geometry = store.geometry
    try:
        return parse_plain(body, None if geometry is None else geometry.block_tokens)
    except NotPlain:
        if len(body) > JSON_FALLBACK_BYTES:
            raise InvalidRequestError(
                f"a JSON body over {JSON_FALLBACK_BYTES} bytes must be exactly "
                '{"hashes": ["<16 hex>", ...]} or {"tokens": [<int>, ...]} with plain items '
                "(no escapes, fractions, exponents or other keys); or send u64 hashes as "
                f"{OCTET_STREAM}"
            ) from None
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequestError(f"malformed JSON body: {exc}") from None
    if not isinstance(obj, dict) or obj.keys() not in ({"hashes"}, {"tokens"}):
        raise InvalidRequestError(
            'the JSON body must be {"hashes": [...]} or {"tokens": [...]}, nothing else'
        )
    if "hashes" in obj:
        return parse_hash_list(obj["hashes"])
    tokens = parse_tokens(obj["tokens"])
    if geometry is None:
        raise InvalidRequestError(NO_GEOMETRY)
    return chain_hashes_array(np.asarray(tokens, dtype=np.uint32), geometry.block_tokens)


def json_response(
    obj: Any, status_code: int = 200, headers: dict[str, str] | None = None
) -> Response:
    """A JSON response built with ``json.dumps`` (no pydantic on the way out)."""
    return Response(
        json.dumps(obj, separators=(",", ":")).encode(),
        status_code=status_code,
        media_type=JSON_MEDIA_TYPE,
        headers=headers,
    )
