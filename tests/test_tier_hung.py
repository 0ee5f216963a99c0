"""A hung tier behind a real uvicorn server (the app in this process, so that the stall
bound can be short): once ``/healthz`` says the tier is unreachable, a miss, a tier HEAD
and a prefix answer at once, without a request to the tier, while one probe at a time
asks it in the background; when the tier answers again, reads go through it again."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import SMALL, make_envelope
from http_server import ThreadServer
from s3_server import CREDENTIALS, S3Server
from test_tier_api import HungEndpoint

import kvstore.tier.tier as tier_module
from api.app import create_app
from api.http_protocol import TlkvHttpProtocol
from api.settings import Settings
from kvstore import decode

ENVELOPE = {"content-type": "application/vnd.tlkv"}


@pytest.fixture
def hung() -> Iterator[HungEndpoint]:
    endpoint = HungEndpoint()
    yield endpoint
    endpoint.close()


def _miss(http: httpx.Client, i: int) -> float:
    """Seconds a read of an absent block and a tier HEAD of another took (both absent)."""
    t0 = time.monotonic()
    assert http.get(f"/v1/blocks/{0xDEAD00 + i:016x}").status_code == 404
    r = http.post("/v1/has-blocks?tier=1", json={"hashes": [f"{0xBEEF00 + i:016x}"]})
    assert r.json()["present"] == [False]
    r = http.post("/v1/prefix", json={"hashes": [f"{0xFEED00 + i:016x}"]})
    assert r.headers["x-tlkv-prefix-blocks"] == "0"
    return time.monotonic() - t0


def test_misses_answer_at_once_while_the_tier_is_unreachable(
    tmp_path: Path, hung: HungEndpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tier_module, "REQUEST_STALL_SECONDS", 1.0)
    monkeypatch.setattr(tier_module, "_WATCH_EVERY", 0.1)
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    settings = Settings(
        data=tmp_path / "store",
        geometry=SMALL,
        tier="s3://hung-bucket/p",
        tier_endpoint=f"http://127.0.0.1:{hung.port}",
    )
    with ThreadServer(create_app(settings), TlkvHttpProtocol) as srv:
        url = f"http://127.0.0.1:{srv.port}"

        def first_miss() -> None:  # asks the tier, which never answers: it waits
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(f"{url}/v1/blocks/{0xAB:016x}", timeout=60)

        first = threading.Thread(target=first_miss, daemon=True)
        first.start()
        with httpx.Client(base_url=url, timeout=60) as http:
            deadline = time.monotonic() + 10
            while http.get("/healthz").json()["tier"] != "unreachable":
                assert time.monotonic() < deadline, "the stalled request never marked it down"
                time.sleep(0.05)
        with httpx.Client(base_url=f"http://127.0.0.1:{srv.port}", timeout=5) as http:
            took = [_miss(http, i) for i in range(3)]
            assert max(took) < 1.0, took
            data = make_envelope(SMALL, 8, seed=4)  # local writes and reads are untouched
            assert http.put("/v1/blocks", content=data, headers=ENVELOPE).status_code == 200
            h = f"{int(decode(data).hashes[0]):016x}"
            assert http.get(f"/v1/blocks/{h}").content == decode(data).single(0)
        probes = len(hung.held)
        assert probes <= 3, probes  # the stalled read, the uploader's and one probe
        hung.close()  # the requests it held fail now
        srv.server.force_exit = True  # and the first miss's, still failing over, is not awaited


def test_the_tier_is_used_again_once_a_probe_gets_an_answer(
    tmp_path: Path, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tier that failed is left alone (misses answer at once) until a background probe
    finds it answering; then a miss reads the block through from it again."""
    url = f"s3://{s3_server.new_bucket()}/p"
    data = make_envelope(SMALL, 8, seed=5)
    h = int(decode(data).hashes[0])
    with ThreadServer(
        create_app(
            Settings(
                data=tmp_path / "a", geometry=SMALL, tier=url, tier_endpoint=s3_server.endpoint
            )
        ),
        TlkvHttpProtocol,
    ) as a:
        a.store.put(data)
        assert a.store.wait_uploaded(30)
    tier = tier_module.Tier(url, endpoint=s3_server.endpoint)
    tier._record([tier_module.TierError("down for the test")])  # a failure: backed off
    assert tier.state == "unreachable"
    assert tier.fetch([h]) == [None]  # at once, without a request
    deadline = time.monotonic() + 10
    while tier.state != "ok":  # after the backoff a probe ran and found the tier answering
        assert time.monotonic() < deadline, tier.info()
        tier.fetch([h])
        time.sleep(0.05)
    assert tier.fetch([h]) == [decode(data).single(0)]
