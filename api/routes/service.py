"""Service routes: ``/healthz`` (no auth), ``/metrics`` (Prometheus text), ``/v1/info``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import PlainTextResponse, Response

import kvstore
from kvstore.codec.checksum import KERNEL
from kvstore.protocol import PROMETHEUS_MEDIA_TYPE, TEXT_MEDIA_TYPE

from ..access import EVERYTHING
from ..access import SCOPE_KEY as ACCESS_KEY
from ..metrics import tier_stats
from .common import json_response, store_of

router = APIRouter()


@router.get("/healthz", tags=["service"])
async def healthz(request: Request) -> Response:
    """Liveness: 200 while the worker runs (no auth); ``tier`` names the object-store
    tier's state (``ok``, ``unknown`` before its first answer, ``unreachable``) when the
    store has one: readiness detail, never a failure (local data is served regardless)."""
    store = request.app.state.store
    tier = None if store is None else store.tier
    if tier is None:
        return json_response({"status": "ok"})
    return json_response({"status": "ok", "tier": tier.state})


@router.get(
    "/metrics",
    tags=["service"],
    response_class=PlainTextResponse,
    responses={200: {"content": {TEXT_MEDIA_TYPE: {"schema": {"type": "string"}}}}},
)
async def metrics(request: Request) -> Response:
    """Prometheus text: request counts and latency (all workers summed); the store's (its
    ``default`` model's), and blocks/bytes/sequences of each model the token may read."""
    store = store_of(request)
    stats = dict(store.stats())
    access = request.scope.get(ACCESS_KEY, EVERYTHING)
    per_model = {}
    hits = misses = 0
    for model in store.models():
        model_stats = store.model(model).stats()
        hits += model_stats["hits"] or 0  # this process's reads, of every model
        misses += model_stats["misses"] or 0
        if access.can_read(model):
            per_model[model] = model_stats
    stats["hits"], stats["misses"] = hits, misses
    stats.update(tier_stats(store.tier_info()))
    request.app.state.metrics.observe_snapshots(store.held_snapshots())
    text = request.app.state.metrics.render(stats, per_model)
    return Response(text, media_type=PROMETHEUS_MEDIA_TYPE)


@router.get("/v1/info", tags=["service"])
async def info(request: Request) -> Response:
    """Version, geometry (null until the first put or --geometry), formats, size, capacity,
    ``corrupt``: blocks quarantined because their CRC failed (never served), and ``tier``:
    the object-store tier's URL, state, pending uploads and this worker's counters (null
    without a tier)."""
    store = store_of(request)
    stats = store.stats()
    g = store.geometry
    geometry = None if g is None else g.as_dict()
    return json_response(
        {
            "version": kvstore.__version__,
            "crc32c_kernel": KERNEL,
            "geometry": geometry,
            "formats": list(request.app.state.settings.formats),
            "blocks": stats.get("blocks"),
            "bytes": stats.get("bytes"),
            "capacity_bytes": stats.get("capacity_bytes"),
            "corrupt": stats.get("corrupt"),
            "tier": store.tier_info(),
        }
    )
