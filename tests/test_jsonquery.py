"""The JSON query parser (api/jsonquery.py): the plain grammar parsed with numpy, byte for
byte what ``json.loads`` and the chained hash give; everything else left to json.loads."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import SMALL
from http_server import ThreadServer, assert_error

import api.jsonquery as jq
from api.app import create_app
from api.settings import Settings
from kvstore.codec.hashing import chain_hashes_array
from kvstore.errors import InvalidRequestError


@pytest.mark.parametrize("chunk", [7, 1000, 1 << 20])
@pytest.mark.parametrize("indent", [None, 1])
def test_tokens_hash_as_json_loads_and_chain_hashes_do(
    monkeypatch: pytest.MonkeyPatch, chunk: int, indent: int | None
) -> None:
    monkeypatch.setattr(jq, "_CHUNK", chunk)  # blocks cut by chunk boundaries too
    tokens = np.random.default_rng(1).integers(0, 2**32, 4003, dtype=np.uint64)
    body = json.dumps({"tokens": tokens.tolist()}, indent=indent).encode()
    got = jq.parse_plain(body, 16)
    assert got.dtype == np.dtype("<u8")
    assert np.array_equal(got, chain_hashes_array(tokens.astype(np.uint32), 16))


@pytest.mark.parametrize("chunk", [7, 1 << 20])
def test_hashes_parse_as_json_loads_does(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    monkeypatch.setattr(jq, "_CHUNK", chunk)
    hashes = np.random.default_rng(2).integers(0, 2**64, 999, dtype=np.uint64)
    body = json.dumps({"hashes": [f"{h:016x}" for h in hashes]}, indent=2).encode()
    assert np.array_equal(jq.parse_plain(bytearray(body), None), hashes)


@pytest.mark.parametrize(
    "body", [b'{"tokens": []}', b' { "hashes" : [ ] } ', b'{"tokens":[1,2,3]}']
)
def test_empty_and_short(body: bytes) -> None:
    assert len(jq.parse_plain(body, 4)) == 0


NOT_PLAIN = [
    b'{"tokens": [1, 2,]}',
    b'{"tokens": [01]}',
    b'{"tokens": [1.0]}',
    b'{"tokens": [1e3]}',
    b'{"tokens": [-1]}',
    b'{"tokens": [12345678901]}',  # 11 digits
    b'{"hashes": ["ABCDEF0123456789"]}',
    b'{"hashes": ["abcdef012345678"]}',
    b'{"\\u0074okens": [1]}',
    b'{"tokens": [1], "x": 1}',
    b'{"x": 1, "tokens": [1]}',
    b'[{"tokens": [1]}]',
    b'{"tokens": [1]} x',
    b'{"tokens": [[1]]}',
]


@pytest.mark.parametrize("body", NOT_PLAIN)
def test_anything_else_is_not_plain(body: bytes) -> None:
    with pytest.raises(jq.NotPlain):
        jq.parse_plain(body, 16)


def test_token_ids_past_u32_and_tokens_without_geometry() -> None:
    with pytest.raises(InvalidRequestError, match=r"0\.\.2\^32-1"):
        jq.parse_plain(b'{"tokens": [4294967296]}', 16)
    with pytest.raises(InvalidRequestError, match="no geometry"):
        jq.parse_plain(b'{"tokens": [1]}', None)
    assert len(jq.parse_plain(b'{"hashes": []}', None)) == 0


def test_a_large_json_query_must_be_plain(tmp_path: Path) -> None:
    """Over 1 MiB, a JSON query is parsed by the plain grammar only: anything else is 422
    naming it (json.loads would build an object per item); a plain one of that size is
    answered."""
    settings = Settings(data=tmp_path / "s", geometry=SMALL)
    with (
        ThreadServer(create_app(settings)) as srv,
        httpx.Client(base_url=f"http://127.0.0.1:{srv.port}", timeout=30) as http,
    ):
        _large_json_queries(http)


def _large_json_queries(http: httpx.Client) -> None:
    items = ", ".join(["1.0"] * 300_000)  # valid JSON, not plain (a fraction), 1.5 MiB
    r = http.post(
        "/v1/has-blocks",
        content=f'{{"tokens": [{items}]}}'.encode(),
        headers={"content-type": "application/json"},
    )
    assert "plain items" in assert_error(r, 422, "invalid_request")
    small = b'{"tokens": [1.0]}'  # small: json.loads's own answer
    r = http.post("/v1/has-blocks", content=small, headers={"content-type": "application/json"})
    assert "token id" in assert_error(r, 422, "invalid_request")
    hashes = [f"{i:016x}" for i in range(1, 80_000)]  # 1.6 MiB, plain
    r = http.post("/v1/has-blocks", json={"hashes": hashes})
    assert r.status_code == 200 and r.json()["present"] == [False] * len(hashes)
