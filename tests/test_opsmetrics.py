"""The operator's series of /metrics (api/opsmetrics.py) from a real `tlkv serve --workers 2`
on a moto tier: reads by model and tier, bytes, backlog, scrub progress, summed over workers."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from conftest import SMALL, make_envelope
from http_server import ServerProcess
from prometheus_client.parser import text_string_to_metric_families
from s3_server import CREDENTIALS, S3Server

from kvstore import decode
from kvstore.protocol import ENVELOPE_MEDIA_TYPE

pytestmark = pytest.mark.slow  # server processes with two workers

MODEL = "acme/llama@1"
PREFIX = "/v1/models/acme%2Fllama%401"


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _scrape_until(url: str, ok: object, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        samples = _samples(httpx.get(f"{url}/metrics").text)
        if ok(samples) or time.monotonic() > deadline:  # type: ignore[operator]
            return samples
        time.sleep(0.1)


def test_reads_by_model_and_tier_bytes_backlog_and_scrub(
    tmp_path: Path, s3_server: S3Server
) -> None:
    url = f"s3://{s3_server.new_bucket()}/ops"
    tier = ("--tier", url, "--tier-endpoint", s3_server.endpoint, "--workers", "2")
    envelope = make_envelope(SMALL, 4 * 6, seed=21)
    hashes = [int(h) for h in decode(envelope).hashes if h]
    scrub = ("--scrub-rate", "1GiB/s", "--scrub-period", "1")
    with ServerProcess(tmp_path / "a", *tier, *scrub, env=CREDENTIALS) as a:
        r = httpx.put(
            f"{a.url}{PREFIX}/blocks",
            content=envelope,
            headers={"content-type": ENVELOPE_MEDIA_TYPE},
        )
        assert r.status_code == 200, r.text
        other = make_envelope(SMALL, 4 * 3, seed=22)  # the default model's, for node b
        r = httpx.put(
            f"{a.url}/v1/blocks", content=other, headers={"content-type": ENVELOPE_MEDIA_TYPE}
        )
        assert r.status_code == 200, r.text
        sizes = []
        for h in hashes:  # a fresh connection each: the reads spread over both workers
            got = httpx.get(f"{a.url}{PREFIX}/blocks/{h:016x}")
            assert got.status_code == 200
            sizes.append(len(got.content))
        assert httpx.get(f"{a.url}{PREFIX}/blocks/{12345:016x}").status_code == 404
        n = len(hashes)
        samples = _scrape_until(
            a.url,
            lambda s: (
                _value(s, "tlkv_model_block_lookups_total", model=MODEL) == n + 1
                and _value(s, "tlkv_tier_backlog_blocks") == 0
                and _value(s, "tlkv_scrub_checked_blocks_total") >= n
            ),
        )
        assert _value(samples, "tlkv_model_block_lookups_total", model=MODEL) == n + 1
        assert _value(samples, "tlkv_model_block_hits_total", model=MODEL, tier="local") == n
        assert _value(samples, "tlkv_model_block_hits_total", model=MODEL, tier="object") == 0
        assert _value(samples, "tlkv_model_served_bytes_total", model=MODEL) == sum(sizes)
        assert _value(samples, "tlkv_model_written_bytes_total", model=MODEL) == sum(sizes)
        assert _value(samples, "tlkv_model_evictions_total", model=MODEL) == 0
        assert _value(samples, "tlkv_model_corrupt_blocks_total", model=MODEL) == 0
        assert _value(samples, "tlkv_tier_backlog_blocks") == 0  # all uploaded
        assert _value(samples, "tlkv_tier_backlog_bytes") == 0
        assert _value(samples, "tlkv_tier_backlog_oldest_seconds") == 0
        assert _value(samples, "tlkv_scrub_period_seconds") == 1
        assert _value(samples, "tlkv_scrub_rate_bytes_per_second") == 1 << 30
        assert _value(samples, "tlkv_scrub_checked_bytes_total") >= sum(sizes)
        assert _value(samples, "tlkv_scrub_last_pass_end_timestamp_seconds") > time.time() - 60
        assert _value(samples, "tlkv_scrub_corrupt_blocks_total") == 0
    # A second node on the same bucket: its reads are local misses the object tier answers.
    with ServerProcess(tmp_path / "b", *tier, "--scrub-rate", "0", env=CREDENTIALS) as b:
        for h in decode(other).hashes[:3]:
            assert httpx.get(f"{b.url}/v1/blocks/{int(h):016x}").status_code == 200
        d = "default"
        samples = _scrape_until(
            b.url, lambda s: _value(s, "tlkv_model_block_hits_total", model=d, tier="object") == 3
        )
        assert _value(samples, "tlkv_model_block_hits_total", model=d, tier="object") == 3
        assert _value(samples, "tlkv_model_block_hits_total", model=d, tier="local") == 0
        assert _value(samples, "tlkv_model_block_lookups_total", model=d) == 3
        assert _value(samples, "tlkv_scrub_period_seconds") == 0  # scrub off


def test_backlog_counts_blocks_bytes_and_the_oldest_age(tmp_path: Path) -> None:
    """A tier nobody answers: every put stays pending, with its bytes and its age."""
    from http_server import free_port
    from s3_server import set_credentials

    from kvstore import Store

    set_credentials()
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with Store(tmp_path / "s", tier="s3://nowhere/x", tier_endpoint=down) as s:
        first = make_envelope(SMALL, 4 * 3, seed=31)
        s.put(first)
        time.sleep(1.2)  # the first put's blocks age past 1 s: their age is what is tested
        s.put(make_envelope(SMALL, 4 * 2, seed=32))
        info = s.tier_info()
        assert info is not None
        stored = [b for b in s.get_many(decode(first).hashes.tolist()) if b is not None]
        assert info["pending_uploads"] == 5
        assert info["pending_bytes"] == 5 * len(stored[0])
        assert 1.0 <= info["oldest_pending_seconds"] < 30
