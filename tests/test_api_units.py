"""In-process pieces of the service: the streamed prefix answer, hash parsing, metrics text,
which thread transcodes."""

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
from api.routes.blocks import _stream
from api.routes.common import parse_hash_list
from api.settings import Settings
from kvstore import Store, decode, join, split
from kvstore.errors import InvalidRequestError, NotFoundError


async def _collect(agen: object) -> bytes:
    return b"".join([bytes(c) async for c in agen])  # type: ignore[attr-defined]


def test_streamed_prefix_equals_joined_blocks(tmp_path: Path) -> None:
    data = make_envelope(SMALL, 20, seed=1, version=2)  # 5 full blocks
    with Store(tmp_path / "s") as store:
        store.put(data)
        hashes = decode(data).hashes.copy()
        first = store.get(int(hashes[0]))
        assert first is not None
        out = asyncio.run(_collect(_stream(store, hashes, first, SMALL, 2)))
        assert out == join(split(data))
        assert len(out) == SMALL.envelope_bytes(5, 2)
        as_v1 = store.get(int(hashes[0]), version=1)
        assert as_v1 is not None
        v1 = asyncio.run(_collect(_stream(store, hashes, as_v1, SMALL, 1)))
        assert decode(v1).version == 1 and len(decode(v1)) == 5


def test_streamed_prefix_aborts_when_a_block_vanishes(tmp_path: Path) -> None:
    data = make_envelope(SMALL, 12, seed=2)
    with Store(tmp_path / "s") as store:
        store.put(data)
        hashes = decode(data).hashes.copy()
        first = store.get(int(hashes[0]))
        assert first is not None
        store.delete(int(hashes[2]))
        with pytest.raises(NotFoundError):
            asyncio.run(_collect(_stream(store, hashes, first, SMALL, 1)))


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


@pytest.mark.parametrize("streamed", [False, True], ids=["gathered", "streamed"])
def test_prefix_transcodes_and_joins_off_the_event_loop(
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
    monkeypatch.setattr(blocks_module, "join", spy("join", blocks_module.join))
    # A gathered answer is assembled (CRC checks, transcodes) in one call, zero-copy.
    monkeypatch.setattr(blocks_module, "_held_prefix", spy("assemble", blocks_module._held_prefix))
    if streamed:  # every answer above one byte streams block by block
        monkeypatch.setattr(blocks_module, "PREFIX_BUFFER_BYTES", 1)
    data = make_envelope(SMALL, 24, seed=3, version=1)  # 6 full blocks, stored as v1
    hashes = [f"{int(h):016x}" for h in decode(data).hashes]
    app = create_app(Settings(data=tmp_path / "store", geometry=SMALL))

    async def requests() -> None:
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as http,
        ):
            typed = {"content-type": "application/vnd.tlkv"}
            assert (await http.put("/v1/blocks", content=data, headers=typed)).status_code == 200
            r = await http.post("/v1/prefix", json={"hashes": hashes}, params={"format": 2})
            assert r.status_code == 200 and r.headers["x-tlkv-prefix-blocks"] == "6"
            env = decode(r.content)
            assert env.version == 2 and len(env) == 6
            r = await http.post("/v1/prefix", json={"hashes": hashes})  # no transcoding
            assert r.content == join(split(data))

    asyncio.run(requests())
    names = {name for name, _ in calls}
    assert "transcode" in names and (streamed or "assemble" in names), calls
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
