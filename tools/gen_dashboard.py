"""Write ``deploy/grafana/tlkv.json``, the Grafana dashboard of ``tlkv serve``.

Run ``python tools/gen_dashboard.py`` after changing a panel; tests/test_deploy.py checks
that the file is this script's output and runs every expression against a real Prometheus.
The dashboard is importable as is: its datasource is a template variable (``datasource``,
any Prometheus), and ``job``, ``instance`` and ``model`` variables filter the series.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "tlkv.json"

SEL = 'job=~"$job", instance=~"$instance"'  # every query's target filter
MSEL = SEL + ', model=~"$model"'
RATE = "$__rate_interval"

# (title, unit, [(expr, legend)]) in reading order; two panels per row.
PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    (
        "HTTP requests by route",
        "reqps",
        [(f"sum by (route) (rate(tlkv_http_requests_total{{{SEL}}}[{RATE}]))", "{{route}}")],
    ),
    (
        "HTTP latency p50 / p99 by route",
        "s",
        [
            (
                f"histogram_quantile(0.5, sum by (route, le) "
                f"(rate(tlkv_http_request_duration_seconds_bucket{{{SEL}}}[{RATE}])))",
                "p50 {{route}}",
            ),
            (
                f"histogram_quantile(0.99, sum by (route, le) "
                f"(rate(tlkv_http_request_duration_seconds_bucket{{{SEL}}}[{RATE}])))",
                "p99 {{route}}",
            ),
        ],
    ),
    (
        "gRPC calls by code",
        "reqps",
        [(f"sum by (code) (rate(tlkv_grpc_requests_total{{{SEL}}}[{RATE}]))", "{{code}}")],
    ),
    (
        "HTTP 5xx ratio",
        "percentunit",
        [
            (
                f'(sum(rate(tlkv_http_requests_total{{{SEL}, status=~"5.."}}[{RATE}])) '
                f"or vector(0)) / sum(rate(tlkv_http_requests_total{{{SEL}}}[{RATE}]))",
                "5xx",
            )
        ],
    ),
    (
        "Hit rate by model and tier",
        "percentunit",
        [
            (
                f"sum by (model, tier) (rate(tlkv_model_block_hits_total{{{MSEL}}}[{RATE}])) "
                f"/ ignoring (tier) group_left "
                f"sum by (model) (rate(tlkv_model_block_lookups_total{{{MSEL}}}[{RATE}]))",
                "{{model}} {{tier}}",
            )
        ],
    ),
    (
        "Bytes served and written",
        "Bps",
        [
            (
                f"sum by (model) (rate(tlkv_model_served_bytes_total{{{MSEL}}}[{RATE}]))",
                "served {{model}}",
            ),
            (
                f"sum by (model) (rate(tlkv_model_written_bytes_total{{{MSEL}}}[{RATE}]))",
                "written {{model}}",
            ),
        ],
    ),
    (
        "Blocks by model",
        "short",
        [(f"sum by (model) (tlkv_model_blocks{{{MSEL}}})", "{{model}}")],
    ),
    (
        "Stored bytes and capacity",
        "bytes",
        [
            (f"sum by (model) (tlkv_model_bytes{{{MSEL}}})", "{{model}}"),
            (f"max(tlkv_store_capacity_bytes{{{SEL}}})", "capacity"),
        ],
    ),
    (
        "Evictions by model",
        "ops",
        [
            (
                f"sum by (model) (rate(tlkv_model_evictions_total{{{MSEL}}}[{RATE}]))",
                "{{model}}",
            )
        ],
    ),
    (
        "Corrupt blocks quarantined",
        "short",
        [(f"sum by (model) (tlkv_model_corrupt_blocks_total{{{MSEL}}})", "{{model}}")],
    ),
    (
        "Tier backlog",
        "short",
        [
            (f"sum(tlkv_tier_backlog_blocks{{{SEL}}})", "blocks"),
            (f"max(tlkv_tier_backlog_oldest_seconds{{{SEL}}})", "oldest (s)"),
        ],
    ),
    (
        "Tier state and upload errors",
        "short",
        [
            (f"min(tlkv_store_tier_up{{{SEL}}})", "tier up"),
            (f"sum(rate(tlkv_store_tier_errors_total{{{SEL}}}[{RATE}]))", "errors/s"),
        ],
    ),
    (
        "Scrub rate",
        "Bps",
        [(f"sum(rate(tlkv_scrub_checked_bytes_total{{{SEL}}}[{RATE}]))", "checked")],
    ),
    (
        "Since the last scrub pass",
        "s",
        [
            (
                f"time() - max(tlkv_scrub_last_pass_end_timestamp_seconds{{{SEL}}} > 0)",
                "since last pass",
            ),
            (f"max(tlkv_scrub_period_seconds{{{SEL}}})", "period"),
        ],
    ),
]


def _variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": {"query": query, "refId": f"{name}-var"},
        "definition": query,
        "refresh": 2,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
    }


def dashboard() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model."""
    panels = []
    for i, (title, unit, targets) in enumerate(PANELS):
        panels.append(
            {
                "id": i + 1,
                "type": "timeseries",
                "title": title,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                "targets": [
                    {
                        "refId": chr(ord("A") + j),
                        "datasource": {"type": "prometheus", "uid": "${datasource}"},
                        "expr": expr,
                        "legendFormat": legend,
                    }
                    for j, (expr, legend) in enumerate(targets)
                ],
            }
        )
    return {
        "uid": "tlkv-serve",
        "title": "tlkv",
        "description": "tlkv serve: requests, hit rate by model and tier, store, tier, scrub",
        "tags": ["tlkv", "kv-cache"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                _variable("job", "Job", "label_values(tlkv_worker_pid, job)"),
                _variable(
                    "instance", "Instance", 'label_values(tlkv_worker_pid{job=~"$job"}, instance)'
                ),
                _variable("model", "Model", f"label_values(tlkv_model_blocks{{{SEL}}}, model)"),
            ]
        },
        "panels": panels,
    }


def render() -> str:
    """The file's text."""
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(render())
    print(f"wrote {OUT}")
