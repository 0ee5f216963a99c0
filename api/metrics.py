"""Prometheus metrics through prometheus-client: HTTP and gRPC requests, latency, the store.

Under ``tlkv serve --workers N`` (N > 1) every worker is a process of its own and a
scrape of ``/metrics`` reaches one of them, so the metrics use prometheus-client's
multiprocess mode: ``tlkv serve`` gives the run a fresh private
``PROMETHEUS_MULTIPROC_DIR`` before any worker starts, each worker writes its values to
its own files there, and the worker answering a scrape sums the files of all workers
(those of exited workers included, so a counter never goes back). Without that variable
(one worker, or an app created in-process as the tests do) each :class:`Metrics` keeps
its values in a registry of its own.

The variable must be set before ``prometheus_client`` is first imported in the process:
the client picks its value store (memory or files) at import time.

Every scrape reports:

- ``tlkv_http_requests_total{method,route,status}`` and the histogram
  ``tlkv_http_request_duration_seconds{route}``, over all workers. Requests the guard
  refuses before routing (401, 413) and unknown paths count under the route
  ``<unmatched>``.
- ``tlkv_grpc_requests_total{method,code}`` and the histogram
  ``tlkv_grpc_request_duration_seconds{method}``: the calls given to
  :meth:`Metrics.observe_grpc`, in every process that shares the directory.
- ``tlkv_store_hits_total`` and ``tlkv_store_misses_total``: block reads of all workers.
  Each worker's store counts its own reads; :meth:`Metrics.observe_store_reads` adds
  their increase after every request and before every scrape.
- ``tlkv_store_blocks``, ``_bytes``, ``_capacity_bytes`` (absent when unbounded),
  ``_pinned_blocks``, ``_sequences`` (gauges) and ``tlkv_store_evictions_total``,
  ``tlkv_store_corrupt_total``: read from the shared store when the scrape is answered.
- ``tlkv_store_open_snapshots`` (gauge, summed over live workers) and
  ``tlkv_store_oldest_snapshot_seconds`` (the oldest of any worker): read snapshots held
  open for zero-copy response bodies the transports have not yet released, as of each
  worker's last scrape or request (requests refresh them at most every 0.1 s);
  ``tlkv_http_stalled_bodies_total``: connections aborted because the client left such
  a body unread too long (see ``api.bodywatch.BODY_HOLD_SECONDS``).
- ``tlkv_worker_start_time_seconds``: one series per live worker, labelled ``pid`` in
  multiprocess mode (a worker drops its series when it shuts down; one that died
  without shutting down loses it when the next worker starts).
- ``tlkv_worker_pid``: the process id of the worker that answered this scrape, the one
  series that depends on which worker answers.
- the operator's series of :mod:`api.opsmetrics` (reads by model and tier, bytes, evictions
  and corrupt blocks by model, the tier's backlog, the scrub); those labelled ``model``
  only for the models the scraper may read.

Block reads answered by ``api.http_protocol`` (plain ``GET /v1/blocks/{hash}``) are
written out in batches (:meth:`Metrics.observe_request_soon`): within ``BATCH_SECONDS``
(50 ms), and at once when the same worker answers a scrape or shuts down. Another
worker's scrape in between may miss up to 50 ms of them.
"""

from __future__ import annotations

import asyncio
import bisect
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector

from kvstore.store.protocols import ServedStore

from .opsmetrics import ModelFilter, OpsMetrics

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
TRANSPORT_KEY = "tlkv.transport"  # the scope key under which the middleware leaves it
SNAPSHOT_REFRESH = 0.1  # seconds: requests refresh the open-snapshot gauges this often
SERIES_CACHE = 256  # label sets whose prometheus children a worker keeps at hand

UNMATCHED = "<unmatched>"  # every path that matched no route: keeps label cardinality bounded

BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_N_BUCKETS = len(BUCKETS) + 1  # and +Inf
BATCH_SECONDS = 0.05  # observe_request_soon's requests are written out this often

# Store-wide stats read at scrape time, with their Prometheus type and help text.
_STORE_METRICS = (
    ("blocks", "gauge", "Blocks in the store."),
    ("bytes", "gauge", "Stored envelope bytes."),
    ("capacity_bytes", "gauge", "Capacity bound of the store in bytes (absent: unbounded)."),
    ("pinned_blocks", "gauge", "Blocks referenced by a sequence."),
    ("sequences", "gauge", "Named sequences."),
    ("evictions", "counter", "Blocks evicted to stay within capacity."),
    ("corrupt", "counter", "Blocks quarantined because their CRC failed."),
    ("tier_up", "gauge", "1 while the object-store tier answers, 0 while it is unreachable."),
    ("tier_pending_uploads", "gauge", "Blocks stored here and not yet uploaded to the tier."),
    ("tier_uploads", "counter", "Block objects this worker created in the tier."),
    ("tier_errors", "counter", "Requests to the tier that failed (this worker)."),
    ("tier_read_through_hits", "counter", "Local misses served from the tier (this worker)."),
    ("tier_refused", "counter", "Tier objects refused by a reader rule (this worker)."),
)
# Per model (label ``model``), for the models the scraping token may read.
_MODEL_METRICS = (
    ("blocks", "Blocks of the model."),
    ("bytes", "Stored bytes of the model (block envelopes and sequence records)."),
    ("sequences", "Named sequences of the model."),
)


def tier_stats(info: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``tier_*`` entries of the store metrics from ``Store.tier_info()`` (none
    without a tier)."""
    if info is None:
        return {}
    return {
        "tier_up": int(info["state"] != "unreachable"),
        "tier_pending_uploads": info["pending_uploads"],
        "tier_uploads": info["uploads"],
        "tier_errors": info["errors"],
        "tier_read_through_hits": info["read_through_hits"],
        "tier_refused": info["refused"],
    }


def _forget_dead_workers(path: str) -> None:
    """``mark_process_dead`` for every process with per-pid series that is gone (one a
    supervisor replaced after a crash, so never shut down)."""
    for name in os.listdir(path):
        if not (name.startswith("gauge_live") and name.endswith(".db")):
            continue
        pid = name[: -len(".db")].rsplit("_", 1)[-1]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            mark_process_dead(int(pid), path)
        except PermissionError:  # alive, another user's
            pass


class _WorkerFiles:
    """``MultiProcessCollector`` over the files of ``path`` that a process has finished
    creating: the client creates a file empty and sizes it a moment later, and a scrape in
    that moment (a worker starting) would fail on the empty file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def collect(self) -> Iterable[Metric]:
        files = []
        for entry in os.scandir(self.path):
            try:
                if entry.name.endswith(".db") and entry.stat().st_size > 0:
                    files.append(entry.path)
            except FileNotFoundError:  # a live gauge's file, removed by mark_process_dead
                pass
        return MultiProcessCollector.merge(files, accumulate=True)


class _ScrapeTime:
    """Collector of what is read when a scrape is answered: the store's stats, the pid."""

    def __init__(
        self,
        store_stats: Mapping[str, Any] | None,
        model_stats: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        self.store_stats = store_stats
        self.model_stats = model_stats or {}

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "tlkv_worker_pid", "Process id of the worker that answered this scrape.", os.getpid()
        )
        if self.store_stats is None:
            return
        for key, kind, help_text in _STORE_METRICS:
            value = self.store_stats.get(key)
            if value is None:
                continue
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            yield family(f"tlkv_store_{key}", help_text, value=value)
        for key, help_text in _MODEL_METRICS:
            gauge = GaugeMetricFamily(f"tlkv_model_{key}", help_text, labels=["model"])
            for model, stats in self.model_stats.items():
                gauge.add_metric([model], stats[key])
            yield gauge


class _Sources:
    """Collectors read in turn, as one (``generate_latest`` takes a single collector)."""

    def __init__(self, *collectors: Collector) -> None:
        self.collectors = collectors

    def collect(self) -> Iterator[Metric]:
        for collector in self.collectors:
            yield from collector.collect()


class Metrics:
    """The service's metrics: summed over every worker in multiprocess mode.

    Keep one per process in multiprocess mode (two would each cache values of the same
    files): a gRPC server in a worker uses the app's (``app.state.metrics``), one in a
    process of its own creates its own with the run's ``PROMETHEUS_MULTIPROC_DIR``.
    Recording is thread-safe.
    """

    def __init__(self) -> None:
        self.multiprocess_dir = os.environ.get(MULTIPROC_ENV) or None
        if self.multiprocess_dir:
            _forget_dead_workers(self.multiprocess_dir)
        self.registry = CollectorRegistry()
        # In multiprocess mode a scrape reads the files, not a registry.
        registry = None if self.multiprocess_dir else self.registry
        self._requests = Counter(
            "tlkv_http_requests",
            "HTTP requests answered.",
            ("method", "route", "status"),
            registry=registry,
        )
        self._latency = Histogram(
            "tlkv_http_request_duration_seconds",
            "HTTP request latency by route template.",
            ("route",),
            buckets=BUCKETS,
            registry=registry,
        )
        self._grpc_requests = Counter(
            "tlkv_grpc_requests",
            "gRPC calls answered, by method and status code.",
            ("method", "code"),
            registry=registry,
        )
        self._grpc_latency = Histogram(
            "tlkv_grpc_request_duration_seconds",
            "gRPC call latency by method.",
            ("method",),
            buckets=BUCKETS,
            registry=registry,
        )
        self._hits = Counter(
            "tlkv_store_hits", "Block reads that found the block.", registry=registry
        )
        self._misses = Counter(
            "tlkv_store_misses", "Block reads that did not find the block.", registry=registry
        )
        self._seen_reads = (0, 0)
        self._series: dict[tuple[str, str, int], tuple[Any, Any]] = {}
        # observe_request_soon's: per label set [requests, seconds, per-bucket counts].
        self._pending: dict[tuple[str, str, int], list[Any]] = {}
        self._pending_store: ServedStore | None = None
        self._flush_timer: asyncio.TimerHandle | None = None
        self._open_snapshots = Gauge(
            "tlkv_store_open_snapshots",
            "Read snapshots held open for zero-copy response bodies not yet written out.",
            multiprocess_mode="livesum",
            registry=registry,
        )
        self._oldest_snapshot = Gauge(
            "tlkv_store_oldest_snapshot_seconds",
            "Age of the oldest read snapshot held for a zero-copy response body.",
            multiprocess_mode="livemax",
            registry=registry,
        )
        self._seen_snapshots = (0, 0.0)
        self._snapshots_at = 0.0
        self._stalled = Counter(
            "tlkv_http_stalled_bodies",
            "Connections aborted because the client left a zero-copy body unread too long.",
            registry=registry,
        )
        started = Gauge(
            "tlkv_worker_start_time_seconds",
            "Start time of the worker (Unix seconds).",
            multiprocess_mode="liveall",
            registry=registry,
        )
        started.set(time.time())
        self.ops = OpsMetrics(registry)  # api/opsmetrics.py: the operator's series

    def _children(self, key: tuple[str, str, int]) -> tuple[Any, Any]:
        """The request counter's and the latency histogram's children of a label set."""
        series = self._series.get(key)
        if series is None:
            # prometheus-client's labels() costs a lock and a tuple hash per call: keep
            # the children of the label sets seen (a bounded number: clients choose the
            # method, so past SERIES_CACHE sets they are looked up each time).
            method, route, status = key
            series = (
                self._requests.labels(method, route, str(status)),
                self._latency.labels(route),
            )
            if len(self._series) < SERIES_CACHE:
                self._series[key] = series
        return series

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        """Count one finished HTTP request and its latency."""
        series = self._children((method, route, status))
        series[0].inc()
        series[1].observe(seconds)

    def observe_request_soon(
        self,
        method: str,
        route: str,
        status: int,
        seconds: float,
        store: ServedStore | None,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        """``observe_request``, written out within ``BATCH_SECONDS`` (by a timer of
        ``loop``, the only thread that may call this) or at this worker's next scrape.

        For the reads ``api.http_protocol`` answers: each value written is a locked
        write into a shared file in multiprocess mode, four per request, about a fifth
        of such a read's Python time; batched, a burst of reads writes each once.
        """
        pending = self._pending.get((method, route, status))
        if pending is None:
            pending = self._pending[(method, route, status)] = [0, 0.0, [0] * _N_BUCKETS]
        pending[0] += 1
        pending[1] += seconds
        pending[2][bisect.bisect_left(BUCKETS, seconds)] += 1  # prometheus: amount <= bound
        self._pending_store = store
        if self._flush_timer is None:
            self._flush_timer = loop.call_later(BATCH_SECONDS, self.flush)

    def flush(self) -> None:
        """Write out what ``observe_request_soon`` holds (in the thread that calls that)."""
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        pending, self._pending = self._pending, {}
        for key, (n, seconds, buckets) in pending.items():
            counter, histogram = self._children(key)
            counter.inc(n)
            # Histogram children record one value per observe(): n observations are
            # added to the sum and the buckets they fall in, as observe() adds them.
            histogram._sum.inc(seconds)
            for i, count in enumerate(buckets):
                if count:
                    histogram._buckets[i].inc(count)
        store, self._pending_store = self._pending_store, None
        self._observe_store(store)

    def observe_request(
        self, method: str, route: str, status: int, seconds: float, store: ServedStore | None
    ) -> None:
        """``observe`` one finished HTTP request, then the store's read counters and
        open snapshots (``store`` None: not open)."""
        self.observe(method, route, status, seconds)
        self._observe_store(store)

    def _observe_store(self, store: ServedStore | None) -> None:
        """The store's read counters and open snapshots, after requests (None: no store)."""
        if store is not None:
            handles = store.open_handles()  # every model's reads
            self.observe_store_reads(sum(h.hits for h in handles), sum(h.misses for h in handles))
            self.observe_snapshots_of(store)
            self.ops.observe_handles(handles)

    def observe_grpc(self, method: str, code: str, seconds: float) -> None:
        """Count one finished gRPC call and its latency.

        Args:
            method: the full method name, e.g. ``/tlkv.v1.KvStore/GetBlock``.
            code: the status code's name, e.g. ``OK`` or ``NOT_FOUND``
                (``grpc.StatusCode.X.name``).
            seconds: from the call's arrival to its last response message.
        """
        self._grpc_requests.labels(method, code).inc()
        self._grpc_latency.labels(method).observe(seconds)

    def observe_store_reads(self, hits: int, misses: int) -> None:
        """Add the increase of a store's read counters (``Store.hits``, ``Store.misses``)
        since the last call; counters lower than last time are a newly opened store's."""
        seen_hits, seen_misses = self._seen_reads
        if hits != seen_hits:
            self._hits.inc(hits - seen_hits if hits > seen_hits else hits)
        if misses != seen_misses:
            self._misses.inc(misses - seen_misses if misses > seen_misses else misses)
        self._seen_reads = (hits, misses)

    def observe_snapshots(self, held: tuple[int, float]) -> None:
        """Record ``Store.held_snapshots()``: how many, and the oldest's age."""
        if held != self._seen_snapshots:
            self._open_snapshots.set(held[0])
            self._oldest_snapshot.set(held[1])
            self._seen_snapshots = held

    def observe_snapshots_of(self, store: ServedStore) -> None:
        """``observe_snapshots`` of ``store``, at most every ``SNAPSHOT_REFRESH`` seconds
        (requests call it; a scrape calls ``observe_snapshots`` itself)."""
        now = time.monotonic()
        if now - self._snapshots_at >= SNAPSHOT_REFRESH:
            self._snapshots_at = now
            self.observe_snapshots(store.held_snapshots())

    def observe_stalled_body(self) -> None:
        """Count one connection aborted over a body its client did not read."""
        self._stalled.inc()

    def render(
        self,
        store_stats: Mapping[str, Any] | None,
        model_stats: Mapping[str, Mapping[str, Any]] | None = None,
        extra: Collector | None = None,
        can_read: Callable[[str], bool] | None = None,
    ) -> str:
        """The exposition text (format 0.0.4): every worker's metrics, then the store's.

        ``store_stats`` is ``Store.stats()``; its ``hits`` and ``misses`` (this process's
        reads) are added to the read counters first. ``model_stats``: ``stats()`` of each
        model to export (``tlkv_model_blocks``/``_bytes``/``_sequences{model=...}``);
        ``extra``: more scrape-time series (``api.opsmetrics.ScrapeTime``); ``can_read``:
        whether the scraper may see a model's series (the per-model counters).
        """
        self.flush()
        if store_stats is not None:
            self.observe_store_reads(store_stats.get("hits") or 0, store_stats.get("misses") or 0)
        d = self.multiprocess_dir
        values: Collector = _WorkerFiles(d) if d else self.registry
        if can_read is not None:
            values = ModelFilter(values, can_read)
        sources = [values, _ScrapeTime(store_stats, model_stats)]
        if extra is not None:
            sources.append(extra)
        return generate_latest(_Sources(*sources)).decode()

    def close(self) -> None:
        """Write out pending requests, then drop this worker's per-process series
        (multiprocess mode), when it shuts down."""
        self.flush()
        if self.multiprocess_dir:
            mark_process_dead(os.getpid(), self.multiprocess_dir)


class MetricsMiddleware:
    """Pure-ASGI middleware timing every HTTP request into a :class:`Metrics`.

    After each request it also adds the store's new read counts (see
    :meth:`Metrics.observe_store_reads`).
    """

    def __init__(self, app: Any, *, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 500
        # The server's transport, from uvicorn's request cycle (whose ``receive`` reaches
        # here unwrapped; Starlette wraps ``send``): a stalled zero-copy body is released
        # by aborting it (api.bodywatch.watch_body).
        scope[TRANSPORT_KEY] = getattr(getattr(receive, "__self__", None), "transport", None)

        async def send_status(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            self.metrics.observe_request(
                scope["method"],
                getattr(route, "path", None) or UNMATCHED,
                status,
                time.perf_counter() - t0,
                getattr(scope["app"].state, "store", None),
            )


class _ModelSeries:
    """Collector of the per-model series alone."""

    def __init__(self, model_stats: Mapping[str, Mapping[str, Any]]) -> None:
        self.model_stats = model_stats

    def collect(self) -> Iterator[Metric]:
        for key, help_text in _MODEL_METRICS:
            gauge = GaugeMetricFamily(f"tlkv_model_{key}", help_text, labels=["model"])
            for model, stats in self.model_stats.items():
                gauge.add_metric([model], stats[key])
            yield gauge


def render_model_series(model_stats: Mapping[str, Mapping[str, Any]]) -> str:
    """The exposition text a token scoped to some models gets: ``tlkv_model_*`` of the
    models in ``model_stats`` (those it may read) and nothing store-wide (no block, byte,
    hit or request counts that move with other tenants' work)."""
    return generate_latest(_ModelSeries(model_stats)).decode()  # type: ignore[arg-type]
