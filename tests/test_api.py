"""The HTTP service against a real ``tlkv serve`` subprocess: every route, every error kind.

One server per module (module-scoped) on a real LMDB directory; the small geometry
(4, 2, 2, 8) keeps envelopes at a few KiB.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from conftest import SMALL, make_blocks, make_envelope
from http_server import ServerProcess, assert_error

from kvstore import Block, Geometry, chain_hashes, crc32c, decode, encode, split, transcode
from kvstore.codec import checksum
from kvstore.codec.assembly import pack_header
from kvstore.codec.layout import TRAILER

ENVELOPE = {"content-type": "application/vnd.tlkv"}
GEOMETRY_ARG = ",".join(map(str, SMALL.as_tuple()))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data = tmp_path_factory.mktemp("api") / "store"
    with ServerProcess(data, "--geometry", GEOMETRY_ARG, "--max-body", "256KiB") as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with server.client() as client:
        yield client


def _put(http: httpx.Client, data: bytes) -> dict:
    r = http.put("/v1/blocks", content=data, headers=ENVELOPE)
    assert r.status_code == 200, r.text
    return r.json()


def _hex(h: int) -> str:
    return f"{h:016x}"


# --- service routes -------------------------------------------------------------------


def test_healthz(http: httpx.Client) -> None:
    r = http.get("/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_info(http: httpx.Client) -> None:
    info = http.get("/v1/info").json()
    assert set(info) == {
        "version",
        "crc32c_kernel",
        "geometry",
        "formats",
        "blocks",
        "bytes",
        "capacity_bytes",
        "corrupt",
        "tier",
    }
    assert info["corrupt"] == 0
    assert info["tier"] is None  # no --tier
    assert info["crc32c_kernel"] == checksum.KERNEL
    assert info["geometry"] == {"block_tokens": 4, "n_layers": 2, "n_kv_heads": 2, "head_dim": 8}
    assert info["formats"] == [1, 2]
    assert info["capacity_bytes"] is None
    assert isinstance(info["blocks"], int) and isinstance(info["bytes"], int)


def test_openapi_is_served(http: httpx.Client) -> None:
    schema = http.get("/openapi.json").json()
    assert schema["openapi"].startswith("3.")
    for path in ("/v1/blocks", "/v1/blocks/{hash}", "/v1/has-blocks", "/v1/prefix"):
        assert path in schema["paths"], path
    assert "/v1/sequences/{name}" in schema["paths"]


def test_metrics(http: httpx.Client) -> None:
    http.get("/v1/info")
    text = http.get("/metrics").text
    assert 'tlkv_http_requests_total{method="GET",route="/v1/info",status="200"}' in text
    assert 'tlkv_http_request_duration_seconds_bucket{le="+Inf",route="/v1/info"}' in text
    for name in ("blocks", "bytes", "hits_total", "misses_total", "evictions_total"):
        assert f"\ntlkv_store_{name} " in text, name
    assert "\ntlkv_store_corrupt_total " in text


# --- blocks ---------------------------------------------------------------------------


def test_put_get_roundtrip_verbatim(http: httpx.Client) -> None:
    data = make_envelope(SMALL, 10, version=1, seed=1)  # 2 full blocks + a 2-token tail
    env = decode(data)
    full = [int(h) for h in env.hashes if h]
    reply = _put(http, data)
    assert reply == {"stored": [_hex(h) for h in full], "duplicate": [], "partial": 1}
    assert _put(http, data) == {"stored": [], "duplicate": [_hex(h) for h in full], "partial": 1}
    parts = split(data)
    for h, part in zip(full, parts):
        r = http.get(f"/v1/blocks/{_hex(h)}")
        assert r.status_code == 200
        assert r.headers["content-type"] == "application/vnd.tlkv"
        assert r.content == part
        assert r.headers["etag"]


def test_put_accepts_octet_stream_and_refuses_untyped(http: httpx.Client) -> None:
    a = make_envelope(SMALL, 4, seed=2)
    b = make_envelope(SMALL, 4, seed=3)
    r = http.put("/v1/blocks", content=a, headers={"content-type": "application/octet-stream"})
    assert r.status_code == 200 and len(r.json()["stored"]) == 1
    r = http.put("/v1/blocks", content=b, headers={"content-type": "Application/VND.tlkv"})
    assert r.status_code == 200 and len(r.json()["stored"]) == 1
    for headers in (
        {},
        {"content-type": "application/vnd.tlkv; charset=utf-8"},
        {"content-type": "application/octet-stream;x=1"},
        {"content-type": ""},
    ):
        for path in ("/v1/blocks", "/v1/sequences/typed"):
            r = http.put(path, content=b, headers=headers)
            assert "Content-Type" in assert_error(r, 422, "invalid_request"), headers
            assert r.headers["connection"] == "close"  # the body was not read


def test_two_content_types_are_refused(http: httpx.Client) -> None:
    """Content-Type is a singleton field (RFC 9110): two, even of one value, are 422."""
    data = make_envelope(SMALL, 4, seed=31)
    twice = [("content-type", "application/vnd.tlkv"), ("content-type", "application/json")]
    same = [("content-type", "application/vnd.tlkv")] * 2
    for headers in (twice, same):
        for path in ("/v1/blocks", "/v1/sequences/twice"):
            r = http.put(path, content=data, headers=headers)
            assert "at most once" in assert_error(r, 422, "invalid_request")
    query = [("content-type", "application/json")] * 2
    r = http.post("/v1/has-blocks", content=b'{"hashes": []}', headers=query)
    assert "at most once" in assert_error(r, 422, "invalid_request")
    assert http.get(f"/v1/blocks/{_hex(decode(data)[0].hash)}").status_code == 404


def test_put_v2_and_transcode_on_get(http: httpx.Client) -> None:
    data = make_envelope(SMALL, 8, version=2, seed=4)
    reply = _put(http, data)
    h = reply["stored"][0]
    got = http.get(f"/v1/blocks/{h}")
    assert decode(got.content).version == 2
    as_v1 = http.get(f"/v1/blocks/{h}", params={"format": 1})
    assert as_v1.status_code == 200
    assert as_v1.content == transcode(got.content, 1)
    assert as_v1.headers["etag"] != got.headers["etag"]
    same = http.get(f"/v1/blocks/{h}", params={"format": 2})
    assert same.content == got.content


def test_etag_and_head(http: httpx.Client) -> None:
    data = make_envelope(SMALL, 4, seed=5)
    h = _put(http, data)["stored"][0]
    r = http.get(f"/v1/blocks/{h}")
    etag = r.headers["etag"]
    head = http.head(f"/v1/blocks/{h}")
    assert head.status_code == 200 and head.content == b""
    assert head.headers["etag"] == etag
    assert int(head.headers["content-length"]) == len(data)
    cached = http.get(f"/v1/blocks/{h}", headers={"if-none-match": etag})
    assert cached.status_code == 304 and cached.content == b""
    missing = http.head(f"/v1/blocks/{'0' * 15}1")
    assert missing.status_code == 404 and missing.content == b""


def test_get_missing_block(http: httpx.Client) -> None:
    assert_error(http.get("/v1/blocks/00000000000000ff"), 404, "not_found")


@pytest.mark.parametrize(
    "bad", ["ABCDEF0123456789", "abc", "0123456789abcdef0", "0123456789abcdeg", "+123456789abcdef"]
)
def test_bad_hash_in_path(http: httpx.Client, bad: str) -> None:
    assert_error(http.get(f"/v1/blocks/{bad}"), 422, "invalid_request")
    assert_error(http.delete(f"/v1/blocks/{bad}"), 422, "invalid_request")


@pytest.mark.parametrize("fmt", ["3", "0", "x", "1.5"])
def test_bad_format_param(http: httpx.Client, fmt: str) -> None:
    assert_error(
        http.get("/v1/blocks/0000000000000001", params={"format": fmt}), 422, "invalid_request"
    )


def test_delete_block(http: httpx.Client) -> None:
    h = _put(http, make_envelope(SMALL, 4, seed=6))["stored"][0]
    r = http.delete(f"/v1/blocks/{h}")
    assert r.status_code == 204 and r.content == b""
    assert_error(http.delete(f"/v1/blocks/{h}"), 404, "not_found")
    assert_error(http.get(f"/v1/blocks/{h}"), 404, "not_found")


def _corrupt_crc(data: bytes) -> bytes:
    return data[:-4] + bytes([data[-4] ^ 0xFF]) + data[-3:]


def test_put_error_kinds(http: httpx.Client) -> None:
    data = make_envelope(SMALL, 8, seed=7)
    assert "CRC" in assert_error(
        http.put("/v1/blocks", content=_corrupt_crc(data), headers=ENVELOPE), 422, "format"
    )
    assert_error(http.put("/v1/blocks", content=data[:-1], headers=ENVELOPE), 422, "format")
    assert_error(http.put("/v1/blocks", content=b"", headers=ENVELOPE), 422, "format")
    assert_error(http.put("/v1/blocks", content=b"x" * 40, headers=ENVELOPE), 422, "format")
    other = make_envelope(Geometry(4, 2, 2, 16), 4, seed=7)
    assert_error(http.put("/v1/blocks", content=other, headers=ENVELOPE), 422, "shape")
    # A version no reader supports: re-pack the header and fix the CRC.
    head = bytearray(data)
    struct.pack_into("<H", head, 4, 9)
    body = bytes(head[:-4])
    v9 = body + TRAILER.pack(crc32c(body))
    assert_error(http.put("/v1/blocks", content=v9, headers=ENVELOPE), 415, "version")
    assert_error(
        http.put("/v1/blocks", content=data, headers={"content-type": "text/plain"}),
        422,
        "invalid_request",
    )


def test_refused_envelope_stores_nothing(http: httpx.Client) -> None:
    data = make_envelope(SMALL, 8, seed=8)
    http.put("/v1/blocks", content=_corrupt_crc(data), headers=ENVELOPE)
    for h in decode(data).hashes:
        assert http.get(f"/v1/blocks/{int(h):016x}").status_code == 404


# --- has-blocks and prefix --------------------------------------------------------------


@pytest.fixture(scope="module")
def prompt(http: httpx.Client) -> tuple[list[int], list[int]]:
    """Tokens of a 5-block prompt whose first 3 full blocks are stored."""
    rng = np.random.default_rng(42)
    tokens = [int(t) for t in rng.integers(0, 2**32, 22, dtype=np.uint64)]  # 5 full + 2
    hashes = chain_hashes(tokens, SMALL.block_tokens)
    blocks = make_blocks(SMALL, 22, seed=9)
    blocks = [Block(hashes[i], 4, b.kv) for i, b in enumerate(blocks[:3])]
    _put(http, encode(SMALL, blocks, 1))
    return tokens, hashes


def test_has_blocks_three_forms(http: httpx.Client, prompt: tuple[list[int], list[int]]) -> None:
    tokens, hashes = prompt
    expected = {"present": [True, True, True, False, False], "prefix": 3}
    r = http.post("/v1/has-blocks", json={"hashes": [_hex(h) for h in hashes]})
    assert r.json() == expected
    r = http.post("/v1/has-blocks", json={"tokens": tokens})
    assert r.json() == expected
    binary = np.array(hashes, dtype="<u8").tobytes()
    r = http.post(
        "/v1/has-blocks", content=binary, headers={"content-type": "application/octet-stream"}
    )
    assert r.json() == expected
    # Not a prefix: a gap, then present blocks.
    r = http.post("/v1/has-blocks", json={"hashes": [_hex(hashes[3]), _hex(hashes[0])]})
    assert r.json() == {"present": [False, True], "prefix": 0}
    assert http.post("/v1/has-blocks", json={"hashes": []}).json() == {
        "present": [],
        "prefix": 0,
    }


@pytest.mark.parametrize(
    "body",
    [
        b"{",
        b"[]",
        b'"hashes"',
        b"{}",
        b'{"hashes": [], "tokens": []}',
        b'{"hashes": "0000000000000001"}',
        b'{"hashes": [1]}',
        b'{"hashes": ["000000000000000G"]}',
        b'{"hashes": ["00000000000000001"]}',
        b'{"hashes": ["ABCDEF0123456789"]}',
        b'{"hashes": [" 0000000000000001"]}',
        b'{"hashes": ["00000000 0000001"]}',
        b'{"hashes": [null]}',
        b'{"tokens": [-1]}',
        b'{"tokens": [4294967296]}',
        b'{"tokens": [1.0]}',
        b'{"tokens": [true]}',
        b'{"tokens": "1 2 3"}',
        b"\xff\xfe",
        b"[" * 100000 + b"]" * 100000,
    ],
)
def test_has_blocks_bad_json(http: httpx.Client, body: bytes) -> None:
    for route in ("/v1/has-blocks", "/v1/prefix"):
        r = http.post(route, content=body, headers={"content-type": "application/json"})
        assert_error(r, 422, "invalid_request")


def test_has_blocks_bad_binary_and_types(http: httpx.Client) -> None:
    octet = {"content-type": "application/octet-stream"}
    assert_error(
        http.post("/v1/has-blocks", content=b"x" * 9, headers=octet), 422, "invalid_request"
    )
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "application/vnd.tlkv"):
        r = http.post("/v1/has-blocks", content=b"{}", headers={"content-type": ctype})
        assert_error(r, 422, "invalid_request")
    r = http.post("/v1/has-blocks", content=b'{"hashes": []}')  # no content type at all
    assert_error(r, 422, "invalid_request")


def test_has_blocks_8192_hashes(http: httpx.Client, prompt: tuple[list[int], list[int]]) -> None:
    _, hashes = prompt
    many = np.arange(1, 8193, dtype="<u8")
    many[:3] = hashes[:3]
    r = http.post(
        "/v1/has-blocks",
        content=many.tobytes(),
        headers={"content-type": "application/octet-stream"},
    )
    reply = r.json()
    assert len(reply["present"]) == 8192 and reply["prefix"] == 3
    r = http.post("/v1/has-blocks", json={"hashes": [f"{int(h):016x}" for h in many]})
    assert r.json() == reply


def test_prefix(http: httpx.Client, prompt: tuple[list[int], list[int]]) -> None:
    tokens, hashes = prompt
    r = http.post("/v1/prefix", json={"tokens": tokens})
    assert r.status_code == 200
    assert r.headers["x-tlkv-prefix-blocks"] == "3"
    assert r.headers["content-type"] == "application/vnd.tlkv"
    env = decode(r.content, SMALL)
    assert [int(h) for h in env.hashes] == hashes[:3]
    singles = [http.get(f"/v1/blocks/{_hex(h)}").content for h in hashes[:3]]
    assert split(r.content) == singles
    binary = np.array(hashes, dtype="<u8").tobytes()
    r2 = http.post(
        "/v1/prefix", content=binary, headers={"content-type": "application/octet-stream"}
    )
    assert r2.content == r.content
    v2 = http.post("/v1/prefix", json={"tokens": tokens}, params={"format": 2})
    assert decode(v2.content).version == 2 and len(decode(v2.content)) == 3


def test_prefix_empty(http: httpx.Client, prompt: tuple[list[int], list[int]]) -> None:
    _, hashes = prompt
    r = http.post("/v1/prefix", json={"hashes": [_hex(hashes[4])]})
    assert r.status_code == 200 and r.headers["x-tlkv-prefix-blocks"] == "0"
    assert len(r.content) == 32
    assert len(decode(r.content, SMALL)) == 0
    r = http.post("/v1/prefix", json={"hashes": []}, params={"format": 2})
    assert len(r.content) == 32 and decode(r.content).version == 2


# --- sequences ------------------------------------------------------------------------


def test_sequences(http: httpx.Client) -> None:
    data = make_envelope(SMALL, 10, seed=11)
    r = http.put("/v1/sequences/chat-1.a_b", content=data, headers=ENVELOPE)
    assert r.status_code == 201
    got = http.get("/v1/sequences/chat-1.a_b")
    assert got.status_code == 200 and got.content == data
    assert got.headers["content-type"] == "application/vnd.tlkv"
    assert "chat-1.a_b" in http.get("/v1/sequences").json()["sequences"]
    # Its blocks are stored content-addressed and pinned.
    h = _hex(int(decode(data).hashes[0]))
    assert http.get(f"/v1/blocks/{h}").status_code == 200
    assert_error(http.delete(f"/v1/blocks/{h}"), 409, "pinned")
    assert http.delete("/v1/sequences/chat-1.a_b").status_code == 204
    assert_error(http.get("/v1/sequences/chat-1.a_b"), 404, "not_found")
    assert_error(http.delete("/v1/sequences/chat-1.a_b"), 404, "not_found")
    assert "chat-1.a_b" not in http.get("/v1/sequences").json()["sequences"]
    assert http.delete(f"/v1/blocks/{h}").status_code == 204


@pytest.mark.parametrize("name", ["a" * 129, "bad name", "semi;colon", "new%0Aline", "%C3%A9"])
def test_sequence_bad_names(http: httpx.Client, name: str) -> None:
    data = make_envelope(SMALL, 4, seed=12)
    assert_error(
        http.put(f"/v1/sequences/{name}", content=data, headers=ENVELOPE), 422, "invalid_request"
    )
    assert_error(http.get(f"/v1/sequences/{name}"), 422, "invalid_request")


def test_sequence_without_blocks_is_refused(http: httpx.Client) -> None:
    r = http.put("/v1/sequences/empty", content=encode(SMALL, []), headers=ENVELOPE)
    assert "at least one block" in assert_error(r, 422, "invalid_request")
    assert_error(http.get("/v1/sequences/empty"), 404, "not_found")


def test_sequence_bad_envelope(http: httpx.Client) -> None:
    data = make_envelope(SMALL, 4, seed=13)
    r = http.put("/v1/sequences/s1", content=_corrupt_crc(data), headers=ENVELOPE)
    assert_error(r, 422, "format")
    assert_error(http.get("/v1/sequences/s1"), 404, "not_found")


# --- routing errors and limits ------------------------------------------------------------


def test_unknown_route_and_method(http: httpx.Client) -> None:
    assert_error(http.get("/v2/nothing"), 404, "not_found")
    assert_error(http.get("/v1/blocks/a/b"), 404, "not_found")
    r = http.post("/v1/info")
    assert_error(r, 405, "method_not_allowed")
    assert "GET" in r.headers["allow"]
    assert_error(http.patch("/v1/blocks"), 405, "method_not_allowed")


def test_body_over_limit_content_length(server: ServerProcess, http: httpx.Client) -> None:
    big = b"\0" * (256 * 1024 + 1)
    r = http.put("/v1/blocks", content=big, headers=ENVELOPE)
    assert "limit" in assert_error(r, 413, "too_large")
    assert r.headers.get("connection") == "close"
    assert http.get("/healthz").status_code == 200  # a new connection, server fine


@pytest.mark.parametrize(
    ("path", "first", "headers"),
    [
        # An envelope whose header announces more than the limit: refused by its header.
        ("/v1/blocks", pack_header(1, SMALL, 100_000), ENVELOPE),
        # Bytes counted as they stream in, refused once past the limit.
        ("/v1/has-blocks", b"", {"content-type": "application/octet-stream"}),
    ],
    ids=["envelope", "counted"],
)
def test_body_over_limit_chunked(
    server: ServerProcess, http: httpx.Client, path: str, first: bytes, headers: dict
) -> None:
    sent = 0

    def chunks() -> Iterator[bytes]:
        nonlocal sent
        yield first
        for _ in range(1024):  # up to 64 MiB if never refused
            sent += 65536
            yield b"\0" * 65536

    try:
        r = http.request(
            "PUT" if path == "/v1/blocks" else "POST", path, content=chunks(), headers=headers
        )
    except httpx.HTTPError:
        pass  # the server may close while we are still sending: also a refusal
    else:
        assert_error(r, 413, "too_large")
        assert r.headers.get("connection") == "close"
    assert sent < 64 * 1024 * 1024
    assert http.get("/healthz").status_code == 200
    # A chunked body under the limit is fine.
    data = make_envelope(SMALL, 4, seed=14)
    r = http.put("/v1/blocks", content=iter([data[:10], data[10:]]), headers=ENVELOPE)
    assert r.status_code == 200


def test_no_5xx_so_far(http: httpx.Client) -> None:
    text = http.get("/metrics").text
    assert 'status="5' not in text, [line for line in text.splitlines() if 'status="5' in line]


def test_log_has_no_tracebacks(server: ServerProcess) -> None:
    assert "Traceback" not in server.log(), server.log()
