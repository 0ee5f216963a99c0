"""In-process pieces of the service: the streamed prefix answer, hash parsing, metrics text."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import SMALL, make_envelope

from api.errors import error_body
from api.metrics import Metrics
from api.routes.blocks import _stream
from api.routes.common import parse_hash_list
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
        'tlkv_http_request_duration_seconds_bucket{route="/v1/blocks/{hash}",le="0.001"} 1' in text
    )
    assert (
        'tlkv_http_request_duration_seconds_bucket{route="/v1/blocks/{hash}",le="+Inf"} 2' in text
    )
    assert "tlkv_store_blocks 3" in text and "tlkv_store_hits_total 1" in text
    assert "capacity_bytes" not in text  # an unbounded store has no capacity gauge
    for line in text.splitlines():
        assert line.startswith("#") or len(line.rsplit(" ", 1)) == 2


def test_error_body_is_bounded() -> None:
    body = json.loads(error_body("invalid_request", "x" * 10_000))
    assert body["error"]["kind"] == "invalid_request"
    assert len(body["error"]["message"]) <= 500
