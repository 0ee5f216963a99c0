"""Sequence routes: a named, pinned KV state stored as its blocks plus its partial tail."""

from __future__ import annotations

import functools
from typing import Annotated

from fastapi import APIRouter, Path, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from kvstore.codec.layout import SUPPORTED_VERSIONS
from kvstore.codec.tokens import split_records
from kvstore.errors import InvalidRequestError, NotFoundError
from kvstore.protocol import SEQUENCE_NAME_PATTERN, check_sequence_name

from ..bodies import read_envelope
from ..formats import require_formats, served
from ..tokenbody import token_records_of
from .common import (
    ENVELOPE_BODY,
    ENVELOPE_MEDIA_TYPE,
    ENVELOPE_RESPONSE,
    json_response,
    max_body_of,
    require_envelope_type,
    store_of,
)

router = APIRouter(tags=["sequences"])

NamePath = Annotated[
    str, Path(pattern=SEQUENCE_NAME_PATTERN, description="1-128 characters of [A-Za-z0-9._-]")
]


def _check_name(name: str) -> str:
    try:
        return check_sequence_name(name)
    except ValueError as exc:
        raise InvalidRequestError(str(exc)[:200]) from None


@router.get("/v1/sequences")
async def list_sequences(request: Request) -> Response:
    """Names of every stored sequence."""
    return json_response({"sequences": list(store_of(request).sequences())})


@router.put("/v1/sequences/{name}", status_code=201, openapi_extra=ENVELOPE_BODY)
async def put_sequence(request: Request, name: NamePath) -> Response:
    """Store (or replace) a sequence: its blocks in order, the partial tail last; with
    ``x-tlkv-token-records``, its full blocks' token records follow (checked)."""
    _check_name(name)
    require_envelope_type(request)
    store = store_of(request)
    records = token_records_of(request)
    body = await read_envelope(request, store.geometry, max_body_of(request), token_records=records)
    part, tokens = split_records(body, records)
    envelope = require_formats(part, request.app.state.settings.formats)
    await run_in_threadpool(functools.partial(store.put_sequence, name, envelope, tokens=tokens))
    return json_response({"name": name}, status_code=201)


@router.get("/v1/sequences/{name}", responses=ENVELOPE_RESPONSE)
async def get_sequence(request: Request, name: NamePath) -> Response:
    """The sequence's envelope, byte-identical to what was put (on a ``--formats`` server,
    in its format)."""
    data = store_of(request).get_sequence(_check_name(name))
    if data is None:
        raise NotFoundError(f"sequence {name!r} not found")
    formats = request.app.state.settings.formats
    if formats != SUPPORTED_VERSIONS:  # a transcode, if any, off the event loop
        data = await run_in_threadpool(served, data, formats, f"sequence {name!r}")
    return Response(data, media_type=ENVELOPE_MEDIA_TYPE)


@router.delete("/v1/sequences/{name}", status_code=204)
async def delete_sequence(request: Request, name: NamePath) -> Response:
    """Delete a sequence (its blocks lose the pin): 204, or 404 when absent."""
    store = store_of(request)
    if not await run_in_threadpool(store.delete_sequence, _check_name(name)):
        raise NotFoundError(f"sequence {name!r} not found")
    return Response(status_code=204)
