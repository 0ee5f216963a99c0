"""The status page: ``GET /`` (a static page, no auth: it holds no data) and ``GET
/v1/status``, the JSON it reads (auth as every ``/v1`` route).

The page (``api/static/status.html``) is plain HTML and JavaScript: no build step, nothing
from a CDN; it is served with a Content-Security-Policy that runs only its own script and
style and lets no other page frame it. With tokens it asks for one (kept in the tab's
``sessionStorage``) and shows what ``/v1/status`` answers that token: only the models it
may read, and the store-wide figures (total bytes, tier backlog, scrub) only when
``/metrics`` would show that token its store-wide series. Reads and hits are the
``/metrics`` counters (every worker summed); the last errors are the warnings this worker
logged, shown only to a token that may read every model (they name blocks and models).
"""

from __future__ import annotations

import base64
import collections
import functools
import hashlib
import logging
import re
import time
from importlib.resources import files
from typing import Any

from fastapi import APIRouter, Request
from prometheus_client.parser import text_string_to_metric_families
from starlette.responses import HTMLResponse, Response

import kvstore

from ..access import ALL, EVERYTHING
from ..access import SCOPE_KEY as ACCESS_KEY
from ..errors import ServiceError
from ..opsmetrics import TIER_LOCAL, TIER_OBJECT, sum_backlogs
from .common import json_response

router = APIRouter()

LAST_ERRORS = 20  # warnings and errors kept per worker for the page


class _Recent(logging.Handler):
    """The last ``LAST_ERRORS`` warnings and errors of the ``tlkv`` loggers."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: collections.deque[dict[str, Any]] = collections.deque(maxlen=LAST_ERRORS)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(
            {
                "time": record.created,
                "level": record.levelname.lower(),
                "logger": record.name,
                "message": record.getMessage(),
            }
        )


_recent = _Recent()
logging.getLogger("tlkv").addHandler(_recent)  # once per process, at import


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


@functools.cache
def _page() -> tuple[str, dict[str, str]]:
    """The page and its headers: a Content-Security-Policy that lets run only its own
    inline script and style (by hash), talk only to this server, and be framed by no
    page (clickjacking), and the headers that go with it."""
    html = files("api").joinpath("static/status.html").read_text(encoding="utf-8")
    scripts = re.findall(r"<script>(.*?)</script>", html, re.S)
    styles = re.findall(r"<style>(.*?)</style>", html, re.S)
    policy = (
        "default-src 'none'; "
        f"script-src {' '.join(map(_sha256, scripts))}; "
        f"style-src {' '.join(map(_sha256, styles))}; "
        "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    )
    headers = {
        "cache-control": "no-cache",
        "content-security-policy": policy,
        "x-frame-options": "DENY",
        "x-content-type-options": "nosniff",
        "referrer-policy": "no-referrer",
    }
    return html, headers


@router.get("/", include_in_schema=False)
async def page() -> Response:
    """The status page (static; its script reads ``/v1/status``)."""
    html, headers = _page()
    return HTMLResponse(html, headers=headers)


def _counters(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The samples of a ``/metrics`` text by sample name."""
    out: dict[str, list[tuple[dict[str, str], float]]] = collections.defaultdict(list)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name].append((s.labels, s.value))
    return out


def _one(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float | None:
    values = [v for _, v in samples.get(name, [])]
    return max(values) if values else None


@router.get("/v1/status", tags=["service"])
async def status(request: Request) -> Response:
    """What the status page shows: version, uptime, capacity; per model the token may read
    its geometry, blocks, bytes, sequences, evictions, corrupt blocks, lookups and hits
    by tier (every worker summed); the tier's state; the store's total bytes, the tier's
    upload backlog and the scrub (only for a token that sees /metrics' store-wide series:
    one that may read every model, or the metrics token); the last warnings of this worker
    (only for a token that may read every model). Never cached (``no-store``)."""
    store = request.app.state.store
    if store is None:  # only if the lifespan did not run (a misconfigured server)
        raise ServiceError("the store is not open")
    access = request.scope.get(ACCESS_KEY, EVERYTHING)
    metrics = request.app.state.metrics
    metrics.ops.observe_handles(store.open_handles())
    samples = _counters(metrics.render(None, None, None, access.can_read))
    reads: dict[str, dict[str, float]] = collections.defaultdict(dict)
    for labels, value in samples.get("tlkv_model_block_lookups_total", []):
        reads[labels["model"]]["lookups"] = value
    for labels, value in samples.get("tlkv_model_block_hits_total", []):
        reads[labels["model"]][f"hits_{labels['tier']}"] = value
    models = []
    for model in access.readable(store.models()):
        handle = store.model(model)
        stats = handle.stats()
        g = handle.geometry
        r = reads.get(model, {})
        models.append(
            {
                "model": model,
                "geometry": None if g is None else g.as_dict(),
                "blocks": stats["blocks"],
                "bytes": stats["bytes"],
                "sequences": stats["sequences"],
                "evictions": stats["evictions"],
                "corrupt": stats["corrupt"],
                "lookups": int(r.get("lookups", 0)),
                "hits": {
                    TIER_LOCAL: int(r.get(f"hits_{TIER_LOCAL}", 0)),
                    TIER_OBJECT: int(r.get(f"hits_{TIER_OBJECT}", 0)),
                },
            }
        )
    starts = [v for _, v in samples.get("tlkv_worker_start_time_seconds", [])]
    tier = store.tier_info()
    store_wide = access.sees_store_metrics()  # the rule of /metrics' store-wide series
    return json_response(
        {
            "version": kvstore.__version__,
            "uptime_seconds": time.time() - min(starts) if starts else None,
            "capacity_bytes": store.capacity_bytes,
            "total_bytes": store.total_bytes() if store_wide else None,
            "models": models,
            "tier": None if tier is None else _tier(store, tier["state"], store_wide),
            "scrub": _scrub(samples) if store_wide else None,
            "errors": list(_recent.records) if ALL in access.read else [],
        },
        headers={"cache-control": "no-store"},
    )


def _tier(store: Any, state: str, store_wide: bool) -> dict[str, Any] | None:
    """The tier's state (what ``/healthz`` tells anyone), with the upload backlog of every
    model for a token that sees store-wide figures."""
    if not store_wide:
        return {"state": state}
    backlog = sum_backlogs(store.model(m).tier_info() for m in store.models())
    return None if backlog is None else {"state": state, **backlog}


def _scrub(samples: dict[str, list[tuple[dict[str, str], float]]]) -> dict[str, Any]:
    return {
        "rate_bytes_per_second": _one(samples, "tlkv_scrub_rate_bytes_per_second"),
        "period_seconds": _one(samples, "tlkv_scrub_period_seconds"),
        "last_pass_end": _one(samples, "tlkv_scrub_last_pass_end_timestamp_seconds"),
        "checked_bytes": _one(samples, "tlkv_scrub_checked_bytes_total"),
        "found": _one(samples, "tlkv_scrub_corrupt_blocks_total"),
        "repaired": _one(samples, "tlkv_scrub_repaired_blocks_total"),
    }
