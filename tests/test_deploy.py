"""deploy/: the Prometheus rules (promtool) and the Grafana dashboard, checked against Debian's
real `prometheus` scraping a `tlkv serve --workers 2` under a short load.

Marked ``ops``: skipped when the binaries are missing; .ci/run installs them. With
``TLKV_ARTEFACTS=DIR`` the dashboard's panels, drawn from the real query results, are also
saved as ``DIR/dashboard.png`` (docs/operating.md's image: ``docs/images``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from conftest import SMALL, make_envelope
from http_server import REPO, ServerProcess, free_port
from s3_server import CREDENTIALS, S3Server

from kvstore import decode
from kvstore.protocol import ENVELOPE_MEDIA_TYPE
from kvstore.transfer import TransferClient

pytestmark = pytest.mark.ops

DEPLOY = REPO / "deploy"
RULES = DEPLOY / "prometheus" / "tlkv-rules.yml"
DASHBOARD = DEPLOY / "grafana" / "tlkv.json"
MODEL = "acme/m@1"
MPATH = "/v1/models/acme%2Fm%401"  # the routes of model MODEL
# Grafana's variables as this test sets them: every job, instance and model.
VARIABLES = {"$__rate_interval": "10s", "$job": ".*", "$instance": ".*", "$model": ".*"}


def _need(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        pytest.skip(f"{binary} is not installed (Debian package prometheus)")
    return path


def _exprs() -> list[tuple[str, str]]:
    """(panel title, expression with the variables substituted) of every dashboard target."""
    board = json.loads(DASHBOARD.read_text())
    out = []
    for panel in board["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for name, value in VARIABLES.items():
                expr = expr.replace(name, value)
            assert "$" not in expr, f"{panel['title']}: a variable this test does not set"
            out.append((panel["title"], expr))
    return out


def _records() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r["record"] for g in groups for r in g["rules"] if "record" in r]


def test_promtool_checks_and_unit_tests_the_rules() -> None:
    promtool = _need("promtool")
    check = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    tests = sorted(str(p) for p in (DEPLOY / "prometheus" / "tests").glob("*.yml"))
    unit = subprocess.run([promtool, "test", "rules", *tests], capture_output=True, text=True)
    assert unit.returncode == 0, unit.stdout + unit.stderr


def test_dashboard_is_the_generators_output() -> None:
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import gen_dashboard
    finally:
        sys.path.pop(0)
    assert DASHBOARD.read_text() == gen_dashboard.render()
    board = json.loads(DASHBOARD.read_text())
    names = [v["name"] for v in board["templating"]["list"]]
    assert names == ["datasource", "job", "instance", "model"]
    for panel in board["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}"


class _Prometheus:
    """Debian's prometheus on a free loopback port, scraping ``target`` every second."""

    def __init__(self, tmp: Path, target: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "tlkv", "static_configs": [{"targets": [target]}]}],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = (tmp / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [
                _need("prometheus"),
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/-/ready").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("prometheus did not start")

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector of ``expr`` now; a parse error fails the test."""
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr})
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (expr, body)
        return list(body["data"]["result"])

    def query_range(self, expr: str, start: float, end: float) -> list[dict[str, Any]]:
        r = httpx.get(
            f"{self.url}/api/v1/query_range",
            params={"query": expr, "start": start, "end": end, "step": 1},
        )
        return list(r.json()["data"]["result"])

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)
        self.log.close()


def _load(url: str, grpc_port: int, seconds: float) -> None:
    """Puts, hits, misses, an object-tier hit, has-blocks, a 404, gRPC fetches."""
    kind = {"content-type": ENVELOPE_MEDIA_TYPE}
    deadline = time.monotonic() + seconds
    seed = 100
    with httpx.Client(base_url=url) as http, TransferClient(f"grpc://127.0.0.1:{grpc_port}") as c:
        while time.monotonic() < deadline:
            seed += 1
            for prefix in ("/v1", MPATH):
                env = make_envelope(SMALL, 4 * 8, seed=seed)
                hashes = [int(h) for h in decode(env).hashes if h]
                assert http.put(f"{prefix}/blocks", content=env, headers=kind).is_success
                for h in hashes:
                    assert http.get(f"{prefix}/blocks/{h:016x}").status_code == 200
                http.get(f"{prefix}/blocks/{seed:016x}")  # a miss
                http.post(f"{prefix}/has-blocks", json={"hashes": [f"{h:016x}" for h in hashes]})
            c.fetch(hashes=hashes[:2])
            time.sleep(0.2)  # load spread over several scrapes: the rates need samples
        # A block dropped here after its upload: the next read is an object-tier hit.
        deadline = time.monotonic() + 20
        while http.get("/v1/info").json()["tier"]["pending_uploads"]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        for h in hashes[:2]:  # two, a few scrapes apart: a rate needs the counter to move
            assert http.delete(f"/v1/blocks/{h:016x}").status_code == 204
            assert http.get(f"/v1/blocks/{h:016x}").status_code == 200
            time.sleep(2.5)  # scrapes apart (Prometheus samples on its interval)


@pytest.fixture
def served(tmp_path: Path, s3_server: S3Server) -> Iterator[tuple[ServerProcess, int]]:
    _need("prometheus")  # before starting anything
    grpc_port = free_port()
    args = (
        *("--workers", "2", "--capacity", "64MiB", "--grpc-port", str(grpc_port)),
        *("--tier", f"s3://{s3_server.new_bucket()}/ops", "--tier-endpoint", s3_server.endpoint),
        *("--scrub-rate", "1GiB/s", "--scrub-period", "2"),
    )
    with ServerProcess(tmp_path / "data", *args, env=CREDENTIALS) as srv:
        yield srv, grpc_port


def test_every_dashboard_expression_and_recording_rule_returns_data(
    tmp_path: Path, served: tuple[ServerProcess, int]
) -> None:
    srv, grpc_port = served
    prom = _Prometheus(tmp_path, f"127.0.0.1:{srv.port}")
    try:
        t0 = time.time()
        _load(srv.url, grpc_port, seconds=6)
        exprs = _exprs()
        records = _records()
        assert len(exprs) >= 14 and len(records) >= 7
        missing: list[str] = []
        deadline = time.monotonic() + 30
        for title, expr in [*exprs, *((r, r) for r in records)]:
            while not prom.query(expr) and time.monotonic() < deadline:
                time.sleep(0.5)
            if not prom.query(expr):
                missing.append(f"{title}: {expr}")
        assert missing == [], "no data for:\n" + "\n".join(missing)
        object_hits = 'tlkv:block_hit_ratio:rate5m{tier="object"}'
        while time.monotonic() < deadline and not any(
            float(s["value"][1]) > 0 for s in prom.query(object_hits)
        ):
            time.sleep(0.5)
        hits = prom.query(object_hits)
        assert hits and all(0 < float(s["value"][1]) <= 1 for s in hits)
        _draw(prom, t0, time.time(), tmp_path / "dashboard.png")
    finally:
        prom.stop()


def _legend(fmt: str, metric: dict[str, str]) -> str:
    """A panel target's legend with its ``{{label}}`` placeholders filled from ``metric``."""
    return re.sub(r"\{\{(\w+)\}\}", lambda m: str(metric.get(m.group(1), "")), fmt)


def _draw(prom: _Prometheus, start: float, end: float, path: Path) -> None:
    """The dashboard's panels as a PNG, from the query results over the run (Grafana's
    own rendering needs Grafana; matplotlib draws the same series)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    board = json.loads(DASHBOARD.read_text())
    panels = board["panels"]
    rows = -(-len(panels) // 2)
    fig, axes = plt.subplots(rows, 2, figsize=(10, 1.6 * rows), dpi=64, squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        for target in panel["targets"]:
            expr = target["expr"]
            for name, value in VARIABLES.items():
                expr = expr.replace(name, value)
            for series in prom.query_range(expr, start, end):
                xs = [float(t) - start for t, _ in series["values"]]
                ys = [float(v) for _, v in series["values"]]
                label = _legend(target["legendFormat"], series["metric"])
                ax.plot(xs, ys, linewidth=1, label=label[:28])
        ax.set_title(f"{panel['title']} ({panel['fieldConfig']['defaults']['unit']})", fontsize=8)
        ax.tick_params(labelsize=6)
        if ax.lines and len(ax.lines) <= 6:
            ax.legend(fontsize=5, loc="upper left")
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    assert path.stat().st_size > 0
    artefacts = os.environ.get("TLKV_ARTEFACTS")
    if artefacts:
        Path(artefacts).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(artefacts) / "dashboard.png")
