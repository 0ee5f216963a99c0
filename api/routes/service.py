"""Service routes: ``/healthz`` (no auth), ``/metrics`` (Prometheus text), ``/v1/info``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import PlainTextResponse, Response

import kvstore
from kvstore.codec.checksum import KERNEL
from kvstore.protocol import PROMETHEUS_MEDIA_TYPE, TEXT_MEDIA_TYPE

from ..access import EVERYTHING
from ..access import SCOPE_KEY as ACCESS_KEY
from ..metrics import render_model_series, tier_stats
from ..opsmetrics import ScrapeTime, sum_backlogs
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
    ``default`` model's), and blocks/bytes/sequences of each model the token may read.

    Store-wide series go only to a token that may read every model or to the metrics
    token (``--metrics-token-file``); any other token gets the per-model series of the
    models it may read, nothing else."""
    store = store_of(request)
    access = request.scope.get(ACCESS_KEY, EVERYTHING)
    if not access.sees_store_metrics():
        readable = access.readable(store.models())
        scoped = {m: store.model(m).stats() for m in readable}
        return Response(render_model_series(scoped), media_type=PROMETHEUS_MEDIA_TYPE)
    stats = dict(store.stats())
    per_model = {model: store.model(model).stats() for model in store.models()}
    handles = store.open_handles()  # this process's reads, of every model
    stats["hits"] = sum(h.hits for h in handles)
    stats["misses"] = sum(h.misses for h in handles)
    stats.update(tier_stats(store.tier_info()))
    metrics = request.app.state.metrics
    metrics.observe_snapshots(store.held_snapshots())
    metrics.ops.observe_handles(handles)
    backlog = sum_backlogs(store.model(m).tier_info() for m in store.models())
    text = metrics.render(stats, per_model, ScrapeTime(per_model, backlog))  # every model
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
