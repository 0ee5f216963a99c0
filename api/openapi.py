"""The service's OpenAPI document: FastAPI's, completed with what the routes cannot say.

FastAPI documents each route's 200 and its parameters; the service also answers every error
in one JSON shape (``api.errors``), guards every route but ``/healthz`` with a bearer token
when one is configured, takes envelopes under strict media-type rules, and creates and
deletes resources that refer to each other. :func:`install_openapi` adds all of that once,
from the facts' owners (``kvstore.protocol``, ``kvstore.errors``), so that a client
generator or a schema-driven fuzzer (schemathesis, in ``.ci/run``) sees the contract the
server keeps: every status an operation may answer, its error schema, the sequence-name and
hash patterns, and links from a put to the reads and deletes of what it stored.

Not documented: uvicorn answers malformed HTTP (a bad request line, header or chunk size)
itself with a plain-text 400 before any route runs; 405 with ``Allow`` for a method no
route takes at a path (``OPTIONS`` answers 204 with ``Allow``).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute

from kvstore.protocol import (
    ENVELOPE_MEDIA_TYPE,
    ERROR_KINDS,
    HASHES_MEDIA_TYPE,
    JSON_MEDIA_TYPE,
    MODEL_ID_PATTERN,
)

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "additionalProperties": False,
    "properties": {
        "error": {
            "type": "object",
            "required": ["kind", "message"],
            "additionalProperties": False,
            "properties": {
                "kind": {"type": "string", "enum": sorted(ERROR_KINDS)},
                "message": {"type": "string"},
            },
        }
    },
}

_ERRORS = {
    401: "unauthorized: missing or wrong bearer token",
    403: "forbidden: the token may read this model but not write it (or, on a server "
    "without a token, the Host names another server)",
    404: "not_found: no such block, sequence, model or route (a model the token may not "
    "read is answered as one that does not exist)",
    408: "timeout: the body came slower than --min-body-rate in a --body-timeout window "
    "(the connection is closed)",
    409: "pinned: a sequence references the block (DELETE); unconvertible: a block stored "
    "with --allow-nonfinite cannot be transcoded to the asked format (?format=)",
    413: "too_large: the body exceeds --max-body (the connection is closed)",
    415: "version: the envelope's format version is not one the server accepts",
    422: "format, shape or invalid_request: the envelope breaks a reader rule, its geometry "
    "is not the store's, or the request is malformed (path, query, media type, JSON)",
    503: "busy: the worker holds --max-inflight bytes of request bodies, or the store "
    "cannot grow its map while response bodies a client stopped reading are held; retry "
    "after Retry-After seconds",
    507: "store_full: the blocks do not fit even after evicting every unpinned one; "
    "model_limit: the write would create a model beyond --max-models",
}

# Statuses beyond the generic ones (401; 408, 413, 422, 503 with a body; 422 with parameters).
_EXTRA: dict[tuple[str, str], tuple[int, ...]] = {
    ("put", "/v1/blocks"): (415, 507),
    ("get", "/v1/blocks/{hash}"): (404, 409),
    ("head", "/v1/blocks/{hash}"): (404, 409),
    ("delete", "/v1/blocks/{hash}"): (404, 409),
    ("post", "/v1/prefix"): (404, 409),
    ("put", "/v1/sequences/{name}"): (415, 507),
    ("get", "/v1/sequences/{name}"): (404,),
    ("delete", "/v1/sequences/{name}"): (404,),
    ("delete", "/v1/models/{model}"): (403, 404),
}

_OPEN = frozenset({"/healthz"})

# Every /v1 route but the models list is also served for one model (api.modelscope).
MODEL_PREFIX = "/v1/models/{model}"
_MODEL_PARAMETER = {
    "name": "model",
    "in": "path",
    "required": True,
    "description": "a model id, percent-encoded in this one path segment",
    "schema": {"type": "string", "pattern": MODEL_ID_PATTERN},
}
_READ_METHODS = frozenset({"get", "head", "options"})
_READ_POSTS = frozenset({"/v1/has-blocks", "/v1/prefix"})


def _add_model_paths(schema: dict[str, Any]) -> None:
    """The ``/v1/models/{model}/...`` twin of every ``/v1/...`` operation: 404 for a model
    that does not exist (or that the token may not read), 403 for a write it may not make."""
    for path, item in list(schema["paths"].items()):
        if not path.startswith("/v1/") or path.startswith("/v1/models") or path == "/v1/status":
            continue
        twin: dict[str, Any] = {}
        for method, op in item.items():
            op = copy.deepcopy(op)
            op["operationId"] = f"{op['operationId']}_model"
            op["parameters"] = [_MODEL_PARAMETER, *op.get("parameters", [])]
            op["summary"] = f"{op.get('summary', '')} (one model)".strip()
            twin[method] = op
            extra = {404} | (
                set() if method in _READ_METHODS or path in _READ_POSTS else {403, 404}
            )
            _MODEL_EXTRA[(method, MODEL_PREFIX + path[3:])] = (
                *_EXTRA.get((method, path), ()),
                *sorted(extra),
            )
        schema["paths"][MODEL_PREFIX + path[3:]] = twin


_MODEL_EXTRA: dict[tuple[str, str], tuple[int, ...]] = {}

ENVELOPE_BODY_DESCRIPTION = (
    f"One export envelope (28-byte header, n block records, CRC-32C trailer), sent with "
    f"Content-Type exactly {ENVELOPE_MEDIA_TYPE} or {HASHES_MEDIA_TYPE} (any case, no "
    f"parameters; none or another is refused with 422 invalid_request). Its header is checked "
    f"from the first 28 bytes (magic, version, dtype, geometry against the store's, the exact "
    f"length against Content-Length) and the request refused before the rest is read; the CRC "
    f"and the fills once it is whole."
)

# Links from a put to the reads and deletes of what it stored (schemathesis' stateful phase).
_LINKS: dict[tuple[str, str, str], dict[str, Any]] = {
    ("put", "/v1/blocks", "200"): {
        "GetStoredBlock": ("get_block", {"hash": "$response.body#/stored/0"}),
        "HeadStoredBlock": ("get_block_head", {"hash": "$response.body#/stored/0"}),
        "DeleteStoredBlock": ("delete_block", {"hash": "$response.body#/stored/0"}),
    },
    ("delete", "/v1/blocks/{hash}", "204"): {
        "GetDeletedBlock": ("get_block", {"hash": "$request.path.hash"}),
    },
    ("put", "/v1/sequences/{name}", "201"): {
        "GetSequence": ("get_sequence", {"name": "$request.path.name"}),
        "DeleteSequence": ("delete_sequence", {"name": "$request.path.name"}),
    },
    ("delete", "/v1/sequences/{name}", "204"): {
        "GetDeletedSequence": ("get_sequence", {"name": "$request.path.name"}),
    },
}


def _error_response(status: int) -> dict[str, Any]:
    return {
        "description": _ERRORS[status],
        "content": {JSON_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/Error"}}},
    }


def complete(schema: dict[str, Any], *, token: bool) -> dict[str, Any]:
    """``schema`` (FastAPI's document) with the service's whole contract added, in place."""
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    schemas["Error"] = ERROR_SCHEMA
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    if token:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    _add_model_paths(schema)
    seen: set[str] = set()
    for path, item in schema["paths"].items():
        for method, op in item.items():
            # Ids are the route functions' names; a GET/HEAD route's HEAD is named apart.
            if method == "head" or op["operationId"] in seen:
                op["operationId"] = f"{op['operationId']}_{method}"
            seen.add(op["operationId"])
            statuses: set[int] = set(_MODEL_EXTRA.get((method, path), ()))
            statuses.update(_EXTRA.get((method, path), ()))
            if token and path not in _OPEN:
                op["security"] = [{"bearer": []}]
                statuses.add(401)
            body = op.get("requestBody")
            if body is not None:
                statuses.update((408, 413, 422, 503))
                if ENVELOPE_MEDIA_TYPE in body.get("content", {}):
                    body["description"] = ENVELOPE_BODY_DESCRIPTION
            if path == "/v1/models/{model}":  # a model id, as in every /v1/models/{model}/...
                op["parameters"] = [_MODEL_PARAMETER]
            if op.get("parameters"):
                statuses.add(422)
            responses = op["responses"]
            for status in statuses:
                responses[str(status)] = _error_response(status)
            op["responses"] = responses = dict(sorted(responses.items()))
            ok = responses.get("200", {}).get("content", {})
            if ENVELOPE_MEDIA_TYPE in ok:
                ok.pop(JSON_MEDIA_TYPE, None)  # an envelope answer is never JSON
            for (m, p, code), links in _LINKS.items():
                if (m, p) == (method, path) and code in responses:
                    responses[code]["links"] = {
                        name: {"operationId": target, "parameters": params}
                        for name, (target, params) in links.items()
                    }
    return schema


def route_name(route: APIRoute) -> str:
    """A route's operation id: its function's name (``generate_unique_id_function``)."""
    return route.name


def install_openapi(app: FastAPI, *, token: bool) -> None:
    """Serve the completed document at ``/openapi.json`` (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            with warnings.catch_warnings():  # the GET/HEAD route's one id: made apart below
                warnings.filterwarnings("ignore", "Duplicate Operation ID")
                schema = get_openapi(
                    title=app.title,
                    version=app.version,
                    description=app.description,
                    routes=app.routes,
                )
            app.openapi_schema = complete(schema, token=token)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
