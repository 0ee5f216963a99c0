"""``GET /v1/models``: the models the request's token may read, with geometry and size."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from ..access import EVERYTHING
from ..access import SCOPE_KEY as ACCESS_KEY
from .common import json_response, store_of

router = APIRouter(tags=["models"])


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    """Every model the token may read: id, geometry (null until its first put), blocks,
    bytes, sequences."""
    store = store_of(request)
    access = request.scope.get(ACCESS_KEY, EVERYTHING)
    out = []
    for model in access.readable(store.models()):
        handle = store.model(model)
        stats = handle.stats()
        g = handle.geometry
        out.append(
            {
                "model": model,
                "geometry": None if g is None else g.as_dict(),
                "blocks": stats["blocks"],
                "bytes": stats["bytes"],
                "sequences": stats["sequences"],
            }
        )
    return json_response({"models": out})
