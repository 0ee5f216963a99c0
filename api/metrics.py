"""Prometheus metrics: request counts and latency by route template and status, store gauges.

Hand-rolled text exposition format 0.0.4 (no client library). Numbers are per worker
process: with ``--workers N`` each scrape of ``/metrics`` is answered by one worker, and
its request counters cover that worker only (``tlkv_worker_pid`` tells which); the store
gauges (blocks, bytes) describe the shared store, and the hit/miss/eviction/corrupt
counters are whatever ``Store.stats()`` reports (hits and misses: that worker's reads).
Requests the guard refuses before routing (401, 413) and unknown paths count under the
route ``<unmatched>``.
"""

from __future__ import annotations

import bisect
import os
import time
from collections.abc import Mapping
from typing import Any

UNMATCHED = "<unmatched>"  # every path that matched no route: keeps label cardinality bounded

BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# Store stats exported, with their Prometheus type and help text.
_STORE_METRICS = (
    ("blocks", "gauge", "Blocks in the store."),
    ("bytes", "gauge", "Stored envelope bytes."),
    ("capacity_bytes", "gauge", "Capacity bound of the store in bytes (absent: unbounded)."),
    ("pinned_blocks", "gauge", "Blocks referenced by a sequence."),
    ("sequences", "gauge", "Named sequences."),
    ("hits", "counter", "Block reads that found the block."),
    ("misses", "counter", "Block reads that did not find the block."),
    ("evictions", "counter", "Blocks evicted to stay within capacity."),
    ("corrupt", "counter", "Blocks quarantined because their CRC failed."),
)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class _Series:
    __slots__ = ("buckets", "count", "sum")

    def __init__(self) -> None:
        self.buckets = [0] * (len(BUCKETS) + 1)
        self.count = 0
        self.sum = 0.0


class Metrics:
    """Request counters and latency histograms of one worker."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, int], int] = {}
        self.latency: dict[str, _Series] = {}
        self.started = time.time()
        self.grpc_calls: dict[tuple[str, str], int] = {}

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        """Count one finished request and its latency."""
        key = (method, route, status)
        self.requests[key] = self.requests.get(key, 0) + 1
        series = self.latency.get(route)
        if series is None:
            series = self.latency[route] = _Series()
        series.buckets[bisect.bisect_left(BUCKETS, seconds)] += 1
        series.count += 1
        series.sum += seconds

    def observe_grpc(self, method: str, code: str) -> None:
        """Count one finished tl.kv.v1 call by method and status code name."""
        key = (method, code)
        self.grpc_calls[key] = self.grpc_calls.get(key, 0) + 1

    def render(self, store_stats: Mapping[str, Any] | None) -> str:
        """The exposition text: request metrics, then the store's."""
        out = [
            "# HELP tlkv_worker_pid Process id of the worker that answered this scrape.",
            "# TYPE tlkv_worker_pid gauge",
            f"tlkv_worker_pid {os.getpid()}",
            "# HELP tlkv_worker_start_time_seconds Start time of this worker (Unix seconds).",
            "# TYPE tlkv_worker_start_time_seconds gauge",
            f"tlkv_worker_start_time_seconds {self.started:.3f}",
            "# HELP tlkv_http_requests_total HTTP requests answered by this worker.",
            "# TYPE tlkv_http_requests_total counter",
        ]
        for (method, route, status), n in sorted(self.requests.items()):
            out.append(
                f'tlkv_http_requests_total{{method="{_label(method)}",route="{_label(route)}",'
                f'status="{status}"}} {n}'
            )
        out += [
            "# HELP tlkv_http_request_duration_seconds Request latency by route template.",
            "# TYPE tlkv_http_request_duration_seconds histogram",
        ]
        for route, s in sorted(self.latency.items()):
            r = _label(route)
            cumulative = 0
            for le, n in zip((*BUCKETS, None), s.buckets):
                cumulative += n
                bound = "+Inf" if le is None else repr(le)
                out.append(
                    f'tlkv_http_request_duration_seconds_bucket{{route="{r}",le="{bound}"}} '
                    f"{cumulative}"
                )
            out.append(f'tlkv_http_request_duration_seconds_sum{{route="{r}"}} {s.sum:.6f}')
            out.append(f'tlkv_http_request_duration_seconds_count{{route="{r}"}} {s.count}')
        out += [
            "# HELP tlkv_grpc_calls_total tl.kv.v1 gRPC calls answered by this worker.",
            "# TYPE tlkv_grpc_calls_total counter",
        ]
        for (method, code), n in sorted(self.grpc_calls.items()):
            out.append(f'tlkv_grpc_calls_total{{method="{_label(method)}",code="{code}"}} {n}')
        if store_stats is not None:
            for key, kind, help_text in _STORE_METRICS:
                value = store_stats.get(key)
                if value is None:
                    continue
                name = f"tlkv_store_{key}" + ("_total" if kind == "counter" else "")
                out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]
        return "\n".join(out) + "\n"


class MetricsMiddleware:
    """Pure-ASGI middleware timing every HTTP request into a :class:`Metrics`."""

    def __init__(self, app: Any, *, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 500

        async def send_status(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or UNMATCHED
            self.metrics.observe(scope["method"], template, status, time.perf_counter() - t0)
