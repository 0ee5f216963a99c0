"""The operator's series of ``/metrics``: reads by model and by where they were served,
bytes served and written, evictions and corrupt blocks by model, the tier's upload
backlog, and the scrub. :class:`~api.metrics.Metrics` owns one :class:`OpsMetrics` and
calls it; the names are the series table of docs/operating.md and the series that
``deploy/prometheus`` and ``deploy/grafana`` query.

Counters of this process's store handles (``Store.hits``, ``misses``, ``tier_hits``,
``served_bytes``, ``written_bytes``) become prometheus counters here by their increase
since the last look (:meth:`OpsMetrics.observe_handles`, after every request and before
every scrape), so they add up over workers in multiprocess mode like the request
counters. What the shared store knows (evictions, corrupt, the backlog) is read when a
scrape is answered (:func:`scrape_families`). A hit rate is a PromQL division of
counters (``tlkv:block_hit_ratio:rate5m`` in ``deploy/prometheus/tlkv-rules.yml``),
never a gauge here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvstore.store.protocols import HandleCounters

TIER_LOCAL = "local"  # the ``tier`` label of a hit served from this node's LMDB
TIER_OBJECT = "object"  # ... of a local miss the object-store tier answered


class OpsMetrics:
    """Counters and gauges recorded as things happen (``registry`` None: multiprocess
    mode, where the values live in the run's files)."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        r = registry
        self._lookups = Counter(
            "tlkv_model_block_lookups",
            "Block reads asked of the local store (a hit or a miss), by model.",
            ("model",),
            registry=r,
        )
        self._hits = Counter(
            "tlkv_model_block_hits",
            "Block reads answered, by model and by where: local (this node's store) or "
            "object (a local miss read through from the object-store tier).",
            ("model", "tier"),
            registry=r,
        )
        self._served = Counter(
            "tlkv_model_served_bytes",
            "Envelope bytes of blocks handed out by reads, by model.",
            ("model",),
            registry=r,
        )
        self._written = Counter(
            "tlkv_model_written_bytes",
            "Block bytes written to the store (puts, read-through copies, repairs), by model.",
            ("model",),
            registry=r,
        )
        self._seen: dict[int, tuple[int, int, int, int, int]] = {}
        self._scrub_bytes = Counter(
            "tlkv_scrub_checked_bytes", "Block bytes the scrub re-checked.", registry=r
        )
        self._scrub_blocks = Counter(
            "tlkv_scrub_checked_blocks", "Blocks the scrub re-checked.", registry=r
        )
        self._scrub_found = Counter(
            "tlkv_scrub_corrupt_blocks", "Blocks the scrub found corrupt.", registry=r
        )
        self._scrub_repaired = Counter(
            "tlkv_scrub_repaired_blocks",
            "Corrupt blocks the scrub repaired from the object-store tier.",
            registry=r,
        )
        self._scrub_end = Gauge(
            "tlkv_scrub_last_pass_end_timestamp_seconds",
            "When the scrub's last full pass ended (Unix seconds).",
            multiprocess_mode="max",
            registry=r,
        )
        self._scrub_duration = Gauge(
            "tlkv_scrub_last_pass_duration_seconds",
            "How long the scrub's last full pass took.",
            multiprocess_mode="mostrecent",
            registry=r,
        )
        self._scrub_period = Gauge(
            "tlkv_scrub_period_seconds",
            "The scrub's schedule: one pass per this many seconds (0: scrub off).",
            multiprocess_mode="max",
            registry=r,
        )
        self._scrub_rate = Gauge(
            "tlkv_scrub_rate_bytes_per_second",
            "The scrub's rate limit (0: scrub off).",
            multiprocess_mode="max",
            registry=r,
        )

    def observe_handles(self, handles: Iterable[HandleCounters]) -> None:
        """Add the increase of each open store handle's read and write counters since the
        last call (a handle's counters only grow while it is open)."""
        for h in handles:
            now = (h.hits, h.misses, h.tier_hits, h.served_bytes, h.written_bytes)
            seen = self._seen.get(id(h), (0, 0, 0, 0, 0))
            if now == seen:
                continue
            self._seen[id(h)] = now
            hits, misses, tier_hits, served, written = (a - b for a, b in zip(now, seen))
            model = h.model_id
            if hits or misses:
                self._lookups.labels(model).inc(hits + misses)
            if hits:
                self._hits.labels(model, TIER_LOCAL).inc(hits)
            if tier_hits:
                self._hits.labels(model, TIER_OBJECT).inc(tier_hits)
            if served:
                self._served.labels(model).inc(served)
            if written:
                self._written.labels(model).inc(written)

    def scrub_started(self, rate: float, period: float) -> None:
        """Record the scrub's settings (the alert compares passes with the period)."""
        self._scrub_rate.set(rate)
        self._scrub_period.set(period)

    def scrub_batch(self, blocks: int, nbytes: int, found: int, repaired: int) -> None:
        """Count what one scrub batch checked, found and repaired."""
        self._scrub_blocks.inc(blocks)
        self._scrub_bytes.inc(nbytes)
        if found:
            self._scrub_found.inc(found)
        if repaired:
            self._scrub_repaired.inc(repaired)

    def scrub_pass(self, seconds: float, ended: float) -> None:
        """Record a finished pass: its duration and end (Unix seconds)."""
        self._scrub_duration.set(seconds)
        self._scrub_end.set(ended)


class ModelFilter:
    """A collector's series without those of models the scraper may not read (a sample
    labelled ``model`` whose value ``can_read`` refuses is left out)."""

    def __init__(self, collector: Any, can_read: Callable[[str], bool]) -> None:
        self.collector = collector
        self.can_read = can_read

    def collect(self) -> Iterator[Metric]:
        for metric in self.collector.collect():
            metric.samples = [
                s
                for s in metric.samples
                if "model" not in s.labels or self.can_read(s.labels["model"])
            ]
            yield metric


def sum_backlogs(infos: Iterable[Mapping[str, Any] | None]) -> dict[str, Any] | None:
    """The upload backlog of every model together from their ``Store.tier_info()`` (None
    without a tier)."""
    out: dict[str, Any] | None = None
    for info in infos:
        if info is None:
            continue
        if out is None:
            out = {"pending_uploads": 0, "pending_bytes": 0, "oldest_pending_seconds": 0.0}
        out["pending_uploads"] += info["pending_uploads"]
        out["pending_bytes"] += info["pending_bytes"]
        out["oldest_pending_seconds"] = max(
            out["oldest_pending_seconds"], info["oldest_pending_seconds"]
        )
    return out


class ScrapeTime:
    """Collector of :func:`scrape_families` (``Metrics.render``'s ``extra``)."""

    def __init__(
        self, model_stats: Mapping[str, Mapping[str, Any]], tier: Mapping[str, Any] | None
    ) -> None:
        self.model_stats = model_stats
        self.tier = tier

    def collect(self) -> Iterator[Metric]:
        return scrape_families(self.model_stats, self.tier)


def scrape_families(
    model_stats: Mapping[str, Mapping[str, Any]], tier: Mapping[str, Any] | None
) -> Iterator[Metric]:
    """What is read from the shared store when a scrape is answered: evictions and corrupt
    blocks of each model the scraper may read, and the tier's upload backlog."""
    evictions = CounterMetricFamily(
        "tlkv_model_evictions",
        "Blocks evicted to stay within capacity, by model.",
        labels=["model"],
    )
    corrupt = CounterMetricFamily(
        "tlkv_model_corrupt_blocks",
        "Blocks quarantined because their CRC failed, by model.",
        labels=["model"],
    )
    for model, stats in model_stats.items():
        evictions.add_metric([model], stats.get("evictions") or 0)
        corrupt.add_metric([model], stats.get("corrupt") or 0)
    yield evictions
    yield corrupt
    if tier is None:
        return
    yield GaugeMetricFamily(
        "tlkv_tier_backlog_blocks",
        "Blocks stored here and not yet uploaded to the tier.",
        value=tier["pending_uploads"],
    )
    yield GaugeMetricFamily(
        "tlkv_tier_backlog_bytes",
        "Bytes of the blocks not yet uploaded to the tier.",
        value=tier["pending_bytes"],
    )
    yield GaugeMetricFamily(
        "tlkv_tier_backlog_oldest_seconds",
        "Age of the oldest block waiting for upload (0: none).",
        value=tier["oldest_pending_seconds"],
    )
