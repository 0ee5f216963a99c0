"""In-process pieces of the service: the prefix answer read in windows, hash parsing,
metrics text, which thread transcodes."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from conftest import SMALL, make_envelope
from http_server import REPO

import kvstore.store.reads as reads_module
from api.app import create_app
from api.errors import error_body
from api.metrics import Metrics
from api.routes import blocks as blocks_module
from api.routes.common import parse_hash_list
from api.settings import Settings
from kvstore import Store, decode, join, split
from kvstore.errors import InvalidRequestError, NotFoundError


def _prefix_calls(
    tmp_path: Path, data: bytes, calls: Any, window_blocks: int, monkeypatch: pytest.MonkeyPatch
) -> Any:
    """Run ``calls(http, hashes)`` against an app holding ``data``, its prefix answers
    read ``window_blocks`` blocks at a time; returns what it returns."""
    monkeypatch.setattr(blocks_module, "PREFIX_WINDOW_BYTES", SMALL.envelope_bytes(window_blocks))
    hashes = [f"{int(h):016x}" for h in decode(data).hashes]
    app = create_app(Settings(data=tmp_path / "store", geometry=SMALL))

    async def run() -> Any:
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as http,
        ):
            typed = {"content-type": "application/vnd.tlkv"}
            assert (await http.put("/v1/blocks", content=data, headers=typed)).status_code == 200
            return await calls(http, hashes, app.state.store)

    return asyncio.run(run())


@pytest.mark.parametrize("window_blocks", [1, 2, 5, 64])
def test_prefix_windows_equal_the_joined_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, window_blocks: int
) -> None:
    """However many windows a prefix answer is read in, it is the stored blocks joined,
    byte for byte, in the stored version or transcoded; a tail beyond the stored prefix
    is left out."""
    data = make_envelope(SMALL, 20, seed=1, version=2)  # 5 full blocks

    async def calls(http: httpx.AsyncClient, hashes: list[str], store: Any) -> None:
        r = await http.post("/v1/prefix", json={"hashes": [*hashes, "00000000000000aa"]})
        assert r.status_code == 200 and r.headers["x-tlkv-prefix-blocks"] == "5"
        assert r.content == join(split(data))
        assert int(r.headers["content-length"]) == SMALL.envelope_bytes(5, 2)
        r = await http.post("/v1/prefix", json={"hashes": hashes}, params={"format": 1})
        env = decode(r.content)  # the CRC of the whole answer checks
        assert (
            env.version == 1
            and len(env) == 5
            and env.hashes.tolist() == decode(data).hashes.tolist()
        )
        r = await http.post("/v1/prefix", json={"hashes": ["00000000000000aa"]})
        assert r.headers["x-tlkv-prefix-blocks"] == "0" and len(decode(r.content)) == 0

    _prefix_calls(tmp_path, data, calls, window_blocks, monkeypatch)


def test_prefix_cut_in_its_first_window_is_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block gone between the prefix lookup and the first window's read cuts the answer
    there: a whole, valid envelope of the blocks before it."""
    data = make_envelope(SMALL, 20, seed=4)
    real = blocks_module._first_window

    def first_window(store: Any, hashes: Any, *args: Any) -> Any:
        store.delete(int(hashes[2]))  # after the lookup counted it
        return real(store, hashes, *args)

    monkeypatch.setattr(blocks_module, "_first_window", first_window)

    async def calls(http: httpx.AsyncClient, hashes: list[str], store: Any) -> None:
        r = await http.post("/v1/prefix", json={"hashes": hashes})
        assert r.status_code == 200 and r.headers["x-tlkv-prefix-blocks"] == "2"
        assert r.content == join(split(data)[:2])

    _prefix_calls(tmp_path, data, calls, 4, monkeypatch)


def test_prefix_aborts_when_a_block_of_a_later_window_vanishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block gone before its window is read, after the header promised it, aborts the
    answer (the client sees an error, never a completed wrong envelope)."""
    data = make_envelope(SMALL, 20, seed=2)
    real = blocks_module._window

    def window(store: Any, hashes: Any, *args: Any) -> Any:
        store.delete(int(hashes[0]))
        return real(store, hashes, *args)

    monkeypatch.setattr(blocks_module, "_window", window)

    async def calls(http: httpx.AsyncClient, hashes: list[str], store: Any) -> None:
        # The app raises (Starlette wraps the error: the answer has started), so the
        # transport aborts; the error names the block.
        with pytest.raises(Exception) as caught:
            await http.post("/v1/prefix", json={"hashes": hashes})
        chain: list[BaseException] = []
        err: BaseException | None = caught.value
        while err is not None and len(chain) < 10:
            chain.append(err)
            err = err.__cause__ or err.__context__
        assert any(
            isinstance(e, NotFoundError) and "vanished while streaming the prefix" in str(e)
            for e in chain
        ), chain

    _prefix_calls(tmp_path, data, calls, 2, monkeypatch)


def test_parse_hash_list() -> None:
    assert parse_hash_list([]).tolist() == []
    hexes = ["0000000000000001", "ffffffffffffffff", "a91ab0c1027b9366"]
    assert parse_hash_list(hexes).tolist() == [1, 2**64 - 1, 0xA91AB0C1027B9366]
    assert parse_hash_list(hexes).dtype == np.dtype("<u8")
    for bad in (["0x00000000000001"], ["000000000000000A"], [1], ["00000000 0000001"], "00"):
        with pytest.raises(InvalidRequestError):
            parse_hash_list(bad)


def test_metrics_text() -> None:
    m = Metrics()
    m.observe("GET", "/v1/blocks/{hash}", 200, 0.0007)
    m.observe("GET", "/v1/blocks/{hash}", 404, 0.02)
    m.observe("GET", 'we"ird\\', 404, 100.0)
    text = m.render({"blocks": 3, "bytes": 10, "capacity_bytes": None, "hits": 1, "corrupt": 0})
    assert 'tlkv_http_requests_total{method="GET",route="/v1/blocks/{hash}",status="200"} 1' in text
    assert 'route="we\\"ird\\\\"' in text
    assert (
        'tlkv_http_request_duration_seconds_bucket{le="0.001",route="/v1/blocks/{hash}"} 1' in text
    )
    assert (
        'tlkv_http_request_duration_seconds_bucket{le="+Inf",route="/v1/blocks/{hash}"} 2' in text
    )
    assert "tlkv_store_blocks 3" in text and "tlkv_store_hits_total 1" in text
    assert "capacity_bytes" not in text  # an unbounded store has no capacity gauge
    for line in text.splitlines():
        assert line.startswith("#") or len(line.rsplit(" ", 1)) == 2


def test_metrics_of_two_apps_apart() -> None:
    a, b = Metrics(), Metrics()
    a.observe("GET", "/v1/info", 200, 0.001)
    a.observe_grpc("/tlkv.v1.KvStore/GetBlock", "NOT_FOUND", 0.003)
    text = b.render(None)
    assert "/v1/info" not in text and "GetBlock" not in text
    text = a.render(None)
    assert 'tlkv_http_requests_total{method="GET",route="/v1/info",status="200"} 1' in text
    assert 'tlkv_grpc_requests_total{code="NOT_FOUND",method="/tlkv.v1.KvStore/GetBlock"} 1' in text
    assert (
        'tlkv_grpc_request_duration_seconds_bucket{le="0.005",method="/tlkv.v1.KvStore/GetBlock"} 1'
        in text
    )


def test_metrics_store_reads_add_increases() -> None:
    m = Metrics()
    m.observe_store_reads(5, 2)
    m.observe_store_reads(5, 2)
    m.observe_store_reads(7, 2)
    m.observe_store_reads(1, 0)  # a store opened again counts from zero
    text = m.render({"hits": 3, "misses": 4})
    assert "tlkv_store_hits_total 10.0" in text and "tlkv_store_misses_total 6.0" in text


_WORKER = """
import sys
from api.metrics import Metrics

m = Metrics()
n = int(sys.argv[1])
for _ in range(n):
    m.observe("GET", "/v1/info", 200, 0.001)
m.observe_grpc("/tlkv.v1.KvStore/GetBlock", "OK", 0.002)
if sys.argv[2] == "shutdown":
    m.close()
print(m.render({"blocks": 1, "hits": n, "misses": 1}))
"""


def test_metrics_sum_over_processes(tmp_path: Path) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}

    def worker(n: int, then: str) -> str:
        cmd = [sys.executable, "-c", _WORKER, str(n), then]
        return subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout

    started = r'^tlkv_worker_start_time_seconds\{pid="(\d+)"\} '
    shutdown = worker(3, "shutdown")  # drops its start time, keeps its counts
    assert not re.search(started, shutdown, re.M)
    assert len(re.findall(started, worker(4, "crash"), re.M)) == 1  # exits without shutdown
    (tmp_path / "counter_999999999.db").touch()  # a process creating its file right now
    text = worker(0, "stay")  # drops the series of the worker that crashed
    assert len(re.findall(started, text, re.M)) == 1
    assert 'tlkv_http_requests_total{method="GET",route="/v1/info",status="200"} 7.0' in text
    assert 'tlkv_http_request_duration_seconds_count{route="/v1/info"} 7.0' in text
    assert 'tlkv_grpc_requests_total{code="OK",method="/tlkv.v1.KvStore/GetBlock"} 3.0' in text
    assert "tlkv_store_hits_total 7.0" in text and "tlkv_store_misses_total 3.0" in text
    assert "tlkv_store_blocks 1.0" in text


def test_error_body_is_bounded() -> None:
    body = json.loads(error_body("invalid_request", "x" * 10_000))
    assert body["error"]["kind"] == "invalid_request"
    assert len(body["error"]["message"]) <= 500


# --- transcoding and joins stay off the event loop ------------------------------------


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("streamed", [False, True], ids=["one window", "a window per block"])
def test_prefix_reads_and_transcodes_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, streamed: bool
) -> None:
    calls: list[tuple[str, bool]] = []

    def spy(name: str, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            calls.append((name, _on_event_loop()))
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(reads_module, "transcode", spy("transcode", reads_module.transcode))
    # (the routes transcode stored blocks through kvstore.store.transcode_stored, which calls
    # the reads module's transcode: the spy above sees every one)
    # A window of an answer is read (CRC checks, transcodes) in one call, zero-copy.
    monkeypatch.setattr(
        blocks_module, "_first_window", spy("assemble", blocks_module._first_window)
    )
    monkeypatch.setattr(blocks_module, "_window", spy("window", blocks_module._window))
    data = make_envelope(SMALL, 24, seed=3, version=1)  # 6 full blocks, stored as v1

    async def requests(http: httpx.AsyncClient, hashes: list[str], store: Any) -> None:
        r = await http.post("/v1/prefix", json={"hashes": hashes}, params={"format": 2})
        assert r.status_code == 200 and r.headers["x-tlkv-prefix-blocks"] == "6"
        env = decode(r.content)
        assert env.version == 2 and len(env) == 6
        r = await http.post("/v1/prefix", json={"hashes": hashes})  # no transcoding
        assert r.content == join(split(data))

    # a window per block, or one window for all six
    _prefix_calls(tmp_path, data, requests, 1 if streamed else 64, monkeypatch)
    names = {name for name, _ in calls}
    assert "transcode" in names and "assemble" in names, calls
    assert ("window" in names) == streamed, calls
    assert not [call for call in calls if call[1]], calls


@pytest.mark.parametrize("where", ["fast path", "route"])
def test_unexpected_error_is_a_json_500_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """An exception outside every handler, in tlkv's outer layers (the block-read fast
    path) or in a route, is answered 500 in the one JSON error shape, counted by the
    metrics, and the app keeps answering."""
    from http_server import assert_error

    data = make_envelope(SMALL, 4, seed=5, version=1)
    h = f"{int(decode(data).hashes[0]):016x}"
    app = create_app(Settings(data=tmp_path / "store", geometry=SMALL))

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    async def requests() -> None:
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app, raise_app_exceptions=False),
                base_url="http://t",
            ) as http,
        ):
            typed = {"content-type": "application/vnd.tlkv"}
            assert (await http.put("/v1/blocks", content=data, headers=typed)).status_code == 200
            store = app.state.store
            if where == "fast path":
                monkeypatch.setattr(store, "get_buffers", broken)
                url = f"/v1/blocks/{h}"
            else:
                monkeypatch.setattr(store, "get", broken)
                url = f"/v1/blocks/{h}?format=1"
            message = assert_error(await http.get(url), 500, "internal")
            assert "RuntimeError" in message
            monkeypatch.undo()
            assert (await http.get(f"/v1/blocks/{h}")).content == data
            metrics = (await http.get("/metrics")).text
            assert 'route="/v1/blocks/{hash}",status="500"} 1.0' in metrics

    asyncio.run(requests())


@pytest.mark.parametrize("n", [0, 1, 2, 65535, 65536, 65537, 140_000])
@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_has_blocks_answer_is_the_json_of_its_bools(n: int, share: float) -> None:
    """The has-blocks answer, written from the bool array a part at a time, is byte for
    byte what ``json.dumps`` writes for the same list (parts of 65,536, at and across the
    edges); ``Store.has_mask`` is ``Store.has`` as an array."""
    present = np.random.default_rng(n).random(n) < share
    prefix = int(np.argmin(present)) if not present.all() else n
    want = json.dumps({"present": present.tolist(), "prefix": prefix}, separators=(",", ":"))
    assert blocks_module._present_json(present, prefix) == want.encode()


def test_store_has_mask_is_has_as_an_array(tmp_path: Path) -> None:
    data = make_envelope(SMALL, 3 * SMALL.block_tokens, seed=3)
    with Store(str(tmp_path / "s"), geometry=SMALL) as store:
        store.put(data)
        held = [int(h) for h in decode(data).hashes]
        ask = [held[0], 12345, held[2], held[1]]
        mask = store.has_mask(ask)
        assert mask.dtype == bool and mask.tolist() == store.has(ask) == [True, False, True, True]
        assert store.has_mask([]).shape == (0,) and store.has([]) == []
