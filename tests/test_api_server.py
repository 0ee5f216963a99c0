"""The server as a process: auth on and off, two workers on one store, restart, settings.

Each test starts its own ``tlkv serve`` subprocess(es) on real LMDB directories.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import SMALL, make_envelope
from http_server import ServerProcess, assert_error
from waiting import wait_until

from api.settings import Settings, parse_size
from kvstore import decode

ENVELOPE = {"content-type": "application/vnd.tlkv"}
GEOMETRY_ARG = ",".join(map(str, SMALL.as_tuple()))
TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data = tmp_path_factory.mktemp("auth") / "store"
    token_file = data.parent / "token"
    token_file.write_text(TOKEN + "\n")
    with ServerProcess(data, "--token-file", str(token_file), "--geometry", GEOMETRY_ARG) as srv:
        yield srv


ROUTES = [
    ("GET", "/v1/info"),
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
    ("PUT", "/v1/blocks"),
    ("GET", "/v1/blocks/0000000000000001"),
    ("HEAD", "/v1/blocks/0000000000000001"),
    ("DELETE", "/v1/blocks/0000000000000001"),
    ("POST", "/v1/has-blocks"),
    ("POST", "/v1/prefix"),
    ("GET", "/v1/sequences"),
    ("PUT", "/v1/sequences/x"),
    ("GET", "/v1/sequences/x"),
    ("DELETE", "/v1/sequences/x"),
    ("GET", "/no/such/route"),
]


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer wrong", f"Basic {TOKEN}", TOKEN, "Bearer", f"Bearer {TOKEN}x", "bearer x"],
)
def test_auth_required(auth_server: ServerProcess, authorization: str | None) -> None:
    headers = {"authorization": authorization} if authorization else {}
    with httpx.Client(base_url=auth_server.url, headers=headers) as http:
        for method, path in ROUTES:
            r = http.request(method, path, content=b"{}")
            if method == "HEAD":
                assert r.status_code == 401
                continue
            assert_error(r, 401, "unauthorized")
            assert r.headers["www-authenticate"].startswith("Bearer")
        assert http.get("/healthz").status_code == 200  # no auth on the health check


def test_auth_accepts_the_token(auth_server: ServerProcess) -> None:
    data = make_envelope(SMALL, 8, seed=1)
    for scheme in ("Bearer", "bearer"):
        headers = {"authorization": f"{scheme} {TOKEN}"}
        with httpx.Client(base_url=auth_server.url, headers=headers) as http:
            assert http.get("/v1/info").status_code == 200
            assert http.put("/v1/blocks", content=data, headers=ENVELOPE).status_code == 200
            h = f"{int(decode(data).hashes[0]):016x}"
            assert http.get(f"/v1/blocks/{h}").status_code == 200
            assert http.get("/openapi.json").status_code == 200


def test_token_from_environment(tmp_path: Path) -> None:
    with ServerProcess(tmp_path / "store", token="env-token") as srv:
        assert_error(httpx.get(f"{srv.url}/v1/info"), 401, "unauthorized")
        ok = httpx.get(f"{srv.url}/v1/info", headers={"authorization": "Bearer env-token"})
        assert ok.status_code == 200
        assert ok.json()["geometry"] is None  # a new store without --geometry


@pytest.mark.slow
def test_two_workers_one_store(tmp_path: Path) -> None:
    with ServerProcess(tmp_path / "store", "--workers", "2", "--geometry", GEOMETRY_ARG) as srv:
        envelopes = [make_envelope(SMALL, 12, seed=100 + i) for i in range(24)]
        # "Connection: close": every request on a new connection, so both workers get some.
        closing = httpx.Client(base_url=srv.url, headers={"connection": "close"})

        def put_and_get(data: bytes) -> str:
            r = closing.put("/v1/blocks", content=data, headers=ENVELOPE)
            assert r.status_code == 200, r.text
            for h in decode(data).hashes:
                assert closing.get(f"/v1/blocks/{int(h):016x}").status_code == 200
            m = re.search(r"tlkv_worker_pid (\d+)", closing.get("/metrics").text)
            assert m
            return m.group(1)

        with closing, concurrent.futures.ThreadPoolExecutor(8) as pool:
            pids = set(pool.map(put_and_get, envelopes))
        assert len(pids) == 2, pids
        with srv.client() as http:
            for data in envelopes:  # whichever worker answers sees every block
                hashes = [f"{int(h):016x}" for h in decode(data).hashes]
                assert http.post("/v1/has-blocks", json={"hashes": hashes}).json()["prefix"] == 3
        assert "Traceback" not in srv.log()


def _sample(text: str, series: str) -> float:
    """The value of one series in a Prometheus text answer (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line[len(series) + 1 :])
    return 0.0


@pytest.mark.slow
def test_metrics_sum_every_worker(tmp_path: Path) -> None:
    n = 30
    info = 'tlkv_http_requests_total{method="GET",route="/v1/info",status="200"}'
    latency = 'tlkv_http_request_duration_seconds_count{route="/v1/info"}'
    scrapes = 'tlkv_http_requests_total{method="GET",route="/metrics",status="200"}'
    with ServerProcess(tmp_path / "store", "--workers", "2", "--geometry", GEOMETRY_ARG) as srv:
        data = make_envelope(SMALL, 4, seed=7)  # one block
        block = f"/v1/blocks/{int(decode(data).hashes[0]):016x}"
        with srv.client() as http:
            assert http.put("/v1/blocks", content=data, headers=ENVELOPE).status_code == 200
        closing = httpx.Client(base_url=srv.url, headers={"connection": "close"})

        def requests(_: int) -> None:  # each on a new connection: both workers answer some
            assert closing.get("/v1/info").status_code == 200
            assert closing.get(block).status_code == 200
            assert closing.get("/v1/blocks/00000000000000ff").status_code == 404

        with closing, concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(requests, range(n)))
        # A worker counts a request just after answering it: poll until the sums hold all.
        series = (info, latency, "tlkv_store_hits_total", "tlkv_store_misses_total")
        deadline = time.monotonic() + 30
        while True:
            text = httpx.get(f"{srv.url}/metrics").text
            if all(_sample(text, s) == n for s in series):
                break
            assert time.monotonic() < deadline, text
            time.sleep(0.01)  # the poll's interval

        def check(text: str) -> str:
            """Whichever worker answers, the scrape counts every worker's requests."""
            assert _sample(text, info) == n, text
            assert _sample(text, latency) == n
            assert _sample(text, "tlkv_store_hits_total") == n
            assert _sample(text, "tlkv_store_misses_total") == n
            return str(int(_sample(text, "tlkv_worker_pid")))

        # Kept-alive connections opened at once, until both workers hold some.
        clients: dict[str, httpx.Client] = {}
        with contextlib.ExitStack() as stack, concurrent.futures.ThreadPoolExecutor(8) as pool:
            for _ in range(8):
                batch = [stack.enter_context(srv.client()) for _ in range(8)]
                pids = pool.map(lambda c: check(c.get("/metrics").text), batch)
                clients = {**dict(zip(pids, batch)), **clients}
                if len(clients) == 2:
                    break
            assert len(clients) == 2, clients

            seen = [-1.0]

            def settled() -> bool:  # the scrape before this one counted, and no other since
                counted = _sample(clients[min(clients)].get("/metrics").text, scrapes)
                settled, seen[0] = counted == seen[0] + 1, counted
                return settled

            wait_until(settled, "the scrape counts to settle")
            made = int(seen[0]) + 1  # scrapes made so far, the last one included
            previous: float = made - 1
            for _ in range(10):  # alternate between the workers: the counts never go back
                for pid, client in clients.items():
                    text = client.get("/metrics").text
                    assert check(text) == pid
                    counted = _sample(text, scrapes)  # the scrape just before may not be yet
                    assert previous <= counted and made - 1 <= counted <= made, (counted, made)
                    previous = counted
                    made += 1
        text = httpx.get(f"{srv.url}/metrics").text
        starts = re.findall(r'^tlkv_worker_start_time_seconds\{pid="(\d+)"\} ', text, re.M)
        assert set(starts) == set(clients)
        metrics_dir = re.search(r"metrics (\S+),", srv.log())
        assert metrics_dir and Path(metrics_dir.group(1)).is_dir()
    assert not Path(metrics_dir.group(1)).exists()  # removed when the server stops
    assert "Traceback" not in srv.log()


@pytest.mark.slow
def test_restart_finds_every_block(tmp_path: Path) -> None:
    data_dir = tmp_path / "store"
    envelopes = [make_envelope(SMALL, 10, seed=200 + i, version=1 + i % 2) for i in range(10)]
    seq = make_envelope(SMALL, 14, seed=300)
    with ServerProcess(data_dir) as srv, srv.client() as http:
        assert http.get("/v1/info").json()["geometry"] is None
        # Before the first put there is no geometry: hashes are answered, tokens cannot be
        # hashed (no block_tokens) and no envelope can be built for /v1/prefix.
        r = http.post("/v1/has-blocks", json={"hashes": ["00000000000000ff"]})
        assert r.json() == {"present": [False], "prefix": 0}
        assert_error(http.post("/v1/has-blocks", json={"tokens": [1, 2]}), 422, "invalid_request")
        assert_error(http.post("/v1/prefix", json={"hashes": []}), 404, "not_found")
        for data in envelopes:
            assert http.put("/v1/blocks", content=data, headers=ENVELOPE).status_code == 200
        assert http.put("/v1/sequences/kept", content=seq, headers=ENVELOPE).status_code == 201
        before = {
            int(h): http.get(f"/v1/blocks/{int(h):016x}").content
            for data in envelopes
            for h in decode(data).hashes
            if h
        }
    with ServerProcess(data_dir) as srv, srv.client() as http:
        info = http.get("/v1/info").json()
        assert info["geometry"]["block_tokens"] == SMALL.block_tokens
        for h, content in before.items():
            assert http.get(f"/v1/blocks/{h:016x}").content == content
        assert http.get("/v1/sequences/kept").content == seq
        assert http.get("/v1/sequences").json()["sequences"] == ["kept"]


@pytest.mark.slow
def test_geometry_mismatch_refused_at_start(tmp_path: Path) -> None:
    data_dir = tmp_path / "store"
    with ServerProcess(data_dir, "--geometry", GEOMETRY_ARG):
        pass
    srv = ServerProcess(data_dir, "--geometry", "4,2,2,16")
    with pytest.raises(RuntimeError, match="ShapeError"):
        srv.start()


def test_settings_from_env(tmp_path: Path) -> None:
    token_file = tmp_path / "tok"
    token_file.write_text("  abc \n")
    s = Settings.from_env(
        {
            "TLKV_DATA": str(tmp_path),
            "TLKV_GEOMETRY": "16,32,8,128",
            "TLKV_CAPACITY": "2GiB",
            "TLKV_TOKEN": "ignored",
            "TLKV_TOKEN_FILE": str(token_file),
            "TLKV_MAX_BODY": "1MiB",
        }
    )
    assert s.token == "abc" and s.capacity_bytes == 2 << 30 and s.max_body == 1 << 20
    assert s.geometry is not None and s.geometry.as_tuple() == (16, 32, 8, 128)
    assert Settings.from_env({}).max_body == 64 << 20
    assert Settings.from_env({"TLKV_TOKEN": "t"}).token == "t"


@pytest.mark.parametrize(
    ("text", "value"),
    [("64MiB", 64 << 20), ("2GiB", 2 << 30), ("512k", 512 << 10), ("1000", 1000), ("1MB", 10**6)],
)
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "x", "1.3", "MiB", "-1", "1iB", "12 parsecs"])
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


@pytest.mark.slow
def test_quarantined_count_in_info_and_tlkv_stats(tmp_path: Path) -> None:
    """A block whose CRC fails on disk is quarantined on read: /v1/info and `tlkv stats`
    (of the server and of the directory) count it, not only /metrics."""
    import json
    import subprocess
    import sys

    from store_helpers import flip_on_disk, marked_block, marker_bytes

    from kvstore import Store, encode
    from kvstore.client import Client

    data = tmp_path / "store"
    with Store(data, geometry=SMALL) as s:
        s.put(encode(SMALL, [marked_block(1.0, 11), marked_block(-3.5, 12)]))
    flip_on_disk(data, marker_bytes(-3.5), 7)

    def stats(*args: str) -> dict:
        cmd = [sys.executable, "-m", "kvstore", "stats", *args, "--json"]
        ran = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True)
        return dict(json.loads(ran.stdout))

    # The background scrub (on by default) would find it first: this test is the read's.
    with ServerProcess(data, "--scrub-rate", "0") as srv, Client(srv.url) as client:
        assert client.info()["corrupt"] == 0
        assert client.get(12) is None  # CRC fails: quarantined, a miss
        assert client.get(11) is not None
        assert client.info()["corrupt"] == 1
        assert stats(srv.url)["corrupt"] == 1
    local = stats("--data", str(data))
    assert (local["corrupt"], local["blocks"]) == (1, 1)
    assert local["geometry"] == SMALL.as_dict()
