"""``POST /v1/lookup``: the longest stored prefix of a prompt per model (``api.lookup``).

Body: JSON ``{"tokens": [<int>, ...]}`` or ``{"hashes": ["<16 hex>", ...]}``, with an
optional ``"models": ["<model id>", ...]`` (default: every model the token may read; under
``/v1/models/{model}/lookup``, that model).
Answer: ``{"models": [{"model", "block_tokens", "local_blocks", "local_tokens",
"tier_blocks", "tier_tokens"}, ...]}``.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from kvstore.errors import InvalidRequestError
from kvstore.protocol import JSON_MEDIA_TYPE, MODEL_ID_PATTERN

from ..access import EVERYTHING
from ..access import SCOPE_KEY as ACCESS_KEY
from ..jsonquery import JSON_FALLBACK_BYTES, JSON_WEIGHT
from ..lookup import LookupQuery, lookup
from ..modelscope import MODEL_KEY
from .common import (
    HASH_PATTERN,
    json_response,
    media_type,
    parse_hash_list,
    parse_tokens,
    read_body,
)

router = APIRouter(tags=["lookup"])

_TOKENS = {
    "type": "array",
    "description": "token ids written as JSON integers (7, not 7.0 or 7e0)",
    "items": {"type": "integer", "minimum": 0, "maximum": 0xFFFFFFFF},
}
_HASHES = {"type": "array", "items": {"type": "string", "pattern": HASH_PATTERN}}
_MODELS = {"type": "array", "items": {"type": "string", "pattern": MODEL_ID_PATTERN}}


def _one_of(key: str, schema: dict[str, Any]) -> dict[str, Any]:
    """A lookup body with ``key`` (``tokens`` or ``hashes``) and optional ``models``."""
    return {
        "type": "object",
        "required": [key],
        "additionalProperties": False,
        "properties": {key: schema, "models": _MODELS},
    }


# Exactly one of tokens and hashes (as has-blocks' body), models optional.
LOOKUP_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            JSON_MEDIA_TYPE: {
                "schema": {"oneOf": [_one_of("tokens", _TOKENS), _one_of("hashes", _HASHES)]}
            }
        },
    }
}


def parse_lookup(body: bytes | bytearray) -> LookupQuery:
    """A lookup body as a ``LookupQuery``.

    Raises:
        InvalidRequestError: not the JSON object described in the module docstring.
    """
    if len(body) > JSON_FALLBACK_BYTES:
        raise InvalidRequestError(
            f"a lookup body is at most {JSON_FALLBACK_BYTES} bytes of JSON, found {len(body)}"
        )
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequestError(f"malformed JSON body: {exc}") from None
    if not isinstance(obj, dict) or not set(obj) <= {"tokens", "hashes", "models"}:
        raise InvalidRequestError(
            'the JSON body is {"tokens": [...]} or {"hashes": [...]}, with "models" optional'
        )
    models = obj.get("models")
    if "models" in obj and not (
        isinstance(models, list) and all(isinstance(m, str) for m in models)
    ):
        raise InvalidRequestError("'models' must be a list of model ids")
    tokens = hashes = None
    if "tokens" in obj:
        tokens = np.asarray(parse_tokens(obj["tokens"]), dtype=np.uint32)
    if "hashes" in obj:
        hashes = parse_hash_list(obj["hashes"])
    return LookupQuery(tokens, hashes, models)


@router.post("/v1/lookup", openapi_extra=LOOKUP_BODY)
async def post_lookup(request: Request) -> Response:
    """The longest prefix of the prompt each model holds, on this node and in the tier."""
    if media_type(request) != JSON_MEDIA_TYPE:
        raise InvalidRequestError(f"the body must be {JSON_MEDIA_TYPE}")
    query = parse_lookup(await read_body(request, weight=JSON_WEIGHT))
    scoped = request.scope.get(MODEL_KEY)  # /v1/models/{model}/lookup: that model by default
    if scoped is not None and query.models is None:
        query.models = [scoped]
    store = request.app.state.store
    access = request.scope.get(ACCESS_KEY, EVERYTHING)
    answer = await run_in_threadpool(functools.partial(lookup, store, access, query))
    return json_response({"models": answer})
