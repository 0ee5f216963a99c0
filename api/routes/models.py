"""``GET /v1/models``: the models the request's token may read, with geometry and size;
``DELETE /v1/models/{model}``: delete one, with its blocks and sequences (a token that may
write it)."""

from __future__ import annotations

from urllib.parse import unquote

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from ..access import EVERYTHING, check_access, model_not_found
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


@router.delete("/v1/models/{model:path}")
async def delete_model(request: Request, model: str) -> Response:
    """Delete a model with every block and sequence of it, in one transaction: what it
    held (``blocks``, ``bytes``, ``sequences``). 404 when there is no such model (or the
    token may neither read nor write it), 403 when the token may read it but not write
    it, 422 for ``default`` (the store itself). The id is percent-encoded in one path
    segment; one registered before the model-id rule (``.``, ``..``) is deleted too."""
    store = store_of(request)
    raw = request.scope.get("raw_path") or request.url.path.encode()
    model_id = unquote(bytes(raw).split(b"/", 3)[3].decode("latin-1"))
    access = request.scope.get(ACCESS_KEY, EVERYTHING)
    check_access(access, model_id, True, lambda m: m in store.models())
    held = await run_in_threadpool(store.delete_model, model_id)
    if held is None:
        raise model_not_found(model_id)
    request.app.state.known_models.discard(model_id)
    return json_response({"model": model_id, **held})
