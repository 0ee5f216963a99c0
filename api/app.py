"""The FastAPI application: ``create_app`` builds it, its lifespan opens the store.

Uvicorn calls ``create_app`` (``factory=True``) in every worker process, so each worker
reads its :class:`~api.settings.Settings` from the environment and opens the LMDB store
after the fork, as LMDB requires; its :class:`~api.metrics.Metrics` add up with the other
workers' when ``PROMETHEUS_MULTIPROC_DIR`` is set (``tlkv serve`` sets it). With
``TLKV_GRPC`` set, the lifespan also starts the tl.kv.v1 gRPC server
(``api.grpc_service``) on that store and event loop. Middleware, outermost first: metrics,
the guard (auth, body limit, in-flight body budget), the model scope (``/v1/models/{model}/``
prefix, the token's access to the model), then the block-read fast path; every
error leaves in the one JSON shape of ``api.errors``.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

import kvstore
from kvstore.protocol import DEFAULT_MODEL
from kvstore.store.memory import keep_freed_memory
from kvstore.store.scrub import Scrubber
from kvstore.store.store import Store

from .bodies import InflightBudget
from .errors import install_error_handlers
from .metrics import Metrics, MetricsMiddleware
from .middleware import GuardMiddleware
from .modelscope import ModelScope
from .openapi import install_openapi, route_name
from .routes import blocks, lookup, models, sequences, service, status
from .settings import Settings

DESCRIPTION = (
    "Persistent store of LLM KV-cache blocks. Envelopes travel as application/vnd.tlkv; "
    'hashes are 16 lowercase hex digits; errors are {"error": {"kind", "message"}}.'
)


log = logging.getLogger("tlkv.api")

# FastAPI >= 0.165 looks for OpenTelemetry providers on every request (about 10 us of a
# 2 MiB GET's CPU here); the service's telemetry is its Prometheus /metrics, so the bridge
# is off where FastAPI has it.
_NO_NATIVE_TELEMETRY: dict[str, Any] = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters
    else {}
)


def _start_scrub(store: Store, settings: Settings, metrics: Metrics) -> Scrubber | None:
    """The background scrub of ``--scrub-rate`` (None when off); its progress goes to
    ``/metrics``. Every worker starts one; the holder of the store's lock scrubs."""
    if settings.scrub_rate <= 0:
        return None
    metrics.ops.scrub_started(settings.scrub_rate, settings.scrub_period)
    return Scrubber(
        store,
        rate=settings.scrub_rate,
        period=settings.scrub_period,
        on_batch=metrics.ops.scrub_batch,
        on_pass=lambda report, ended: metrics.ops.scrub_pass(report.seconds, ended),
    )


def create_app(settings: Settings | None = None) -> FastAPI:
    """The tlkv app; ``settings`` default to the ``TLKV_*`` environment variables."""
    settings = Settings.from_env() if settings is None else settings

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # A worker keeps the memory a large put frees (LMDB's dirty pages, bodies up to
        # 32 MiB) for the next one instead of faulting it in again (docs/service.md).
        if not keep_freed_memory():
            log.info("mallopt unavailable: freed memory goes back to the system after each put")
        store = Store(
            settings.data,
            geometry=settings.geometry,
            capacity_bytes=settings.capacity_bytes,
            preallocate_bytes=settings.preallocate_bytes,
            allow_nonfinite=settings.allow_nonfinite,
            tier=settings.tier,
            tier_endpoint=settings.tier_endpoint,
            max_models=settings.max_models,
        )
        app.state.store = store
        # The loop releases zero-copy bodies: a remap there must not wait for them.
        store.set_loop_thread(threading.get_ident())
        grpc_server = None
        scrubber = _start_scrub(store, settings, app.state.metrics)
        try:
            if settings.grpc_address is not None:
                from .grpc_service import start_server

                grpc_server = await start_server(
                    store,
                    settings.grpc_address,
                    token=settings.token,
                    tokens=settings.tokens,
                    quotas=settings.quotas,
                    formats=settings.formats,
                    max_stream=settings.grpc_max_stream,
                    metrics=app.state.metrics,
                )
            yield
        finally:
            if grpc_server is not None:
                await grpc_server.stop(grace=2.0)
            if scrubber is not None:
                scrubber.stop()
            app.state.store = None
            store.close()
            app.state.metrics.close()

    app = FastAPI(
        **_NO_NATIVE_TELEMETRY,
        title="tlkv",
        version=kvstore.__version__,
        description=DESCRIPTION,
        lifespan=lifespan,
        generate_unique_id_function=route_name,
    )
    app.state.settings = settings
    app.state.metrics = Metrics()
    app.state.store = None
    app.state.known_models = {DEFAULT_MODEL}  # api.modelscope's models seen to exist
    install_error_handlers(app)
    install_openapi(app, token=settings.tokens is not None)
    for module in (service, models, lookup, blocks, sequences, status):
        app.include_router(module.router)
    app.add_middleware(blocks.BlockReadFastPath)
    app.add_middleware(ModelScope)
    app.add_middleware(
        GuardMiddleware,
        token=settings.token,
        tokens=settings.tokens,
        max_body=settings.max_body,
        budget=InflightBudget(settings.inflight_bytes),
        min_body_rate=settings.min_body_rate,
        body_timeout=settings.body_timeout,
        hosts=settings.host_rule,
    )
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
    return app
