"""``TlkvHttpProtocol`` (what ``tlkv serve`` runs) over a real uvicorn (uvloop): a plain
``GET /v1/blocks/{hash}`` is answered in the protocol with the bytes the app sends for
it (the app's answer is what the same read gets with an empty query string, which takes
it off the plain case); everything else reaches the app unchanged."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from http_server import ThreadServer
from prometheus_client import generate_latest
from waiting import async_wait_until

from api.access import Access, TokenTable
from api.app import create_app
from api.http_protocol import TlkvHttpProtocol, _BodyChunks
from api.metrics import BATCH_SECONDS, Metrics
from api.settings import Settings
from kvstore import Block, Geometry, encode, join
from kvstore.codec.layout import VERSION_V2

G = Geometry(16, 2, 2, 8)
HASH = 0x1234ABCD5678EF01
PATH = f"/v1/blocks/{HASH:016x}"


def _block(block_hash: int = HASH, version: int = 1) -> bytes:
    import numpy as np

    kv = np.random.default_rng(block_hash % 1000).standard_normal(G.kv_shape)
    return encode(G, [Block(block_hash, G.block_tokens, kv.astype(np.float16))], version)


class _Server(ThreadServer):
    """The app under uvicorn in a thread, with ``TlkvHttpProtocol`` on uvloop."""

    def __init__(self, data: Path, log_level: str = "warning", **settings: Any) -> None:
        app = create_app(Settings(data=data, geometry=G, **settings))
        super().__init__(app, TlkvHttpProtocol, log_level)

    def exchange(self, *requests: bytes) -> list[tuple[bytes, list[tuple[bytes, bytes]], bytes]]:
        """Send ``requests`` at once on one connection (pipelined); their answers, each
        (status line, headers without ``date``, body)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as sock:
            sock.sendall(b"".join(requests))
            f = sock.makefile("rb")
            return [_response(f, r.startswith(b"HEAD ")) for r in requests]


def _response(f: Any, head: bool = False) -> tuple[bytes, list[tuple[bytes, bytes]], bytes]:
    status = f.readline()
    headers = []
    length = 0
    while (line := f.readline()) not in (b"\r\n", b""):
        name, _, value = line.rstrip(b"\r\n").partition(b": ")
        if name == b"content-length":
            length = int(value)
        if name != b"date":  # the second it was sent in
            headers.append((name, value))
    return status, headers, b"" if head else f.read(length)


def _get(path: str, *headers: bytes, method: bytes = b"GET") -> bytes:
    return b"%s %s HTTP/1.1\r\nHost: t\r\n%s\r\n" % (
        method,
        path.encode(),
        b"".join(h + b"\r\n" for h in headers),
    )


@pytest.fixture
def server(tmp_path: Path) -> Iterator[_Server]:
    with _Server(tmp_path / "store") as s:
        yield s


def _answered(server: _Server, *requests: bytes) -> tuple[list[Any], int]:
    before = TlkvHttpProtocol.answered
    answers = server.exchange(*requests)
    return answers, TlkvHttpProtocol.answered - before


def test_a_plain_read_is_answered_in_the_protocol_as_the_app_answers_it(server: _Server) -> None:
    data = _block()
    server.store.put(data)
    (plain,), n = _answered(server, _get(PATH))
    assert n == 1
    (app,), n = _answered(server, _get(PATH + "?"))
    assert n == 0
    assert plain == app
    status, headers, body = plain
    assert status == b"HTTP/1.1 200 OK\r\n"
    assert body == data
    assert dict(headers)[b"content-type"] == b"application/vnd.tlkv"
    assert dict(headers)[b"server"] == b"uvicorn"


def test_a_miss_is_answered_in_the_protocol_as_the_app_answers_it(server: _Server) -> None:
    server.store.put(_block())
    missing = "/v1/blocks/00000000000000ff"
    (plain,), n = _answered(server, _get(missing))
    assert n == 1
    (app,), _ = _answered(server, _get(missing + "?"))
    assert plain == app
    assert plain[0].startswith(b"HTTP/1.1 404 ")
    assert b"block 00000000000000ff not found" in plain[2]


@pytest.mark.parametrize(
    "request_bytes",
    [
        _get(PATH, method=b"HEAD"),
        _get(PATH + "?format=1"),
        _get(PATH.upper().replace("/V1/BLOCKS/", "/v1/blocks/")),  # upper-case hex: 422
        _get(PATH, b"If-None-Match: x"),
        _get(PATH, b"Content-Length: 0"),
        _get("/v1/models/default" + PATH),
        _get("/v1/blocks/"),
        b"GET %s HTTP/1.0\r\nHost: t\r\n\r\n" % PATH.encode(),
        _get(PATH, b"Connection: close"),
    ],
    ids=["head", "query", "upper-hex", "if-none-match", "body", "model", "no-hash", "1.0", "close"],
)
def test_what_is_not_plain_goes_to_the_app(server: _Server, request_bytes: bytes) -> None:
    server.store.put(_block())
    (answer,), n = _answered(server, request_bytes)
    assert n == 0
    assert answer[0].startswith(b"HTTP/1.1 ")


def test_a_conditional_read_still_gets_its_304(server: _Server) -> None:
    server.store.put(_block())
    (first,), _ = _answered(server, _get(PATH))
    etag = dict(first[1])[b"etag"]
    (again,), n = _answered(server, _get(PATH, b"If-None-Match: " + etag))
    assert n == 0 and again[0].startswith(b"HTTP/1.1 304 ")


def test_pipelined_reads_keep_their_order(server: _Server) -> None:
    blocks = [_block(0x100 + i) for i in range(4)]
    for data in blocks:
        server.store.put(data)
    paths = [f"/v1/blocks/{0x100 + i:016x}" for i in range(4)]
    requests = [_get(paths[0]), _get(paths[1] + "?"), _get(paths[2]), _get("/healthz")]
    requests.append(_get(paths[3]))
    answers, n = _answered(server, *requests)
    assert n >= 1  # the first at least; one behind an unanswered request goes to the app
    bodies = [body for _, _, body in answers]
    assert bodies[:3] == blocks[:3] and bodies[4] == blocks[3]
    assert b'"ok"' in bodies[3]


def test_a_store_with_v2_only_formats_goes_to_the_app(tmp_path: Path) -> None:
    with _Server(tmp_path / "store", formats=(VERSION_V2,)) as server:
        server.store.put(_block(version=VERSION_V2))
        (answer,), n = _answered(server, _get(PATH))
    assert n == 0 and answer[0] == b"HTTP/1.1 200 OK\r\n"


def test_tokens_are_checked_as_the_guard_checks_them(tmp_path: Path) -> None:
    tokens = TokenTable(
        {
            "reader": Access(frozenset({"default"}), frozenset()),
            "other": Access(frozenset({"m1"}), frozenset({"m1"})),
        }
    )
    with _Server(tmp_path / "store", tokens=tokens) as server:
        server.store.put(_block())
        (ok,), n = _answered(server, _get(PATH, b"Authorization: Bearer reader"))
        assert n == 1 and ok[0] == b"HTTP/1.1 200 OK\r\n"
        for header, status in [
            (b"X-No: auth", b"401"),
            (b"Authorization: Bearer wrong", b"401"),
            (b"Authorization: Basic reader", b"401"),
            (b"Authorization: Bearer other", b"404"),  # may not read the default model
        ]:
            (refused,), n = _answered(server, _get(PATH, header))
            assert n == 0 and refused[0].split()[1] == status, (header, refused)


def test_answered_reads_are_counted_in_the_metrics(server: _Server) -> None:
    server.store.put(_block())
    before = server.store.hits
    _, n = _answered(server, *[_get(PATH) for _ in range(5)], _get("/v1/blocks/00000000000000ff"))
    assert n == 6 and server.store.hits == before + 5
    (scrape,), _ = _answered(server, _get("/metrics"))  # the same worker: written out first
    text = scrape[2].decode()
    assert (
        'tlkv_http_requests_total{method="GET",route="/v1/blocks/{hash}",status="200"} 5.0' in text
    )
    assert (
        'tlkv_http_requests_total{method="GET",route="/v1/blocks/{hash}",status="404"} 1.0' in text
    )
    assert 'tlkv_http_request_duration_seconds_count{route="/v1/blocks/{hash}"} 6.0' in text
    assert f"tlkv_store_hits_total {before + 5}.0" in text


def _series(metrics: Metrics) -> list[str]:
    text = metrics.render(None)
    out = []
    for line in text.splitlines():
        if not line.startswith("tlkv_http_request") or "_created{" in line:
            continue  # _created: when the series was made, not what it counts
        name, _, value = line.rpartition(" ")
        out.append(f"{name} {float(value):.12g}")  # sums added in another order
    return out


def test_batched_requests_render_as_observed_ones() -> None:
    """``observe_request_soon`` + ``flush`` gives what ``observe`` gives, bucket by bucket
    (it adds to prometheus-client's histogram children directly)."""
    import asyncio

    latencies = [0.0001, 0.0005, 0.0007, 0.003, 0.3, 7.0, 11.0, 0.0005]
    one, batched = Metrics(), Metrics()
    for i, seconds in enumerate(latencies):
        one.observe("GET", "/v1/blocks/{hash}", 200 if i % 3 else 404, seconds)

    async def record() -> None:
        loop = asyncio.get_running_loop()
        for i, seconds in enumerate(latencies):
            batched.observe_request_soon(
                "GET", "/v1/blocks/{hash}", 200 if i % 3 else 404, seconds, None, loop
            )
        assert _series(batched) == _series(one)  # render writes pending ones out first
        batched.observe_request_soon("GET", "/x", 200, 0.001, None, loop)
        line = 'tlkv_http_requests_total{method="GET",route="/x",status="200"} 1.0'
        assert line not in generate_latest(batched.registry).decode()  # pending
        await async_wait_until(  # the timer writes them out (render() would flush them)
            lambda: line in generate_latest(batched.registry).decode(),
            f"the batch timer ({BATCH_SECONDS} s) to write the pending request out",
            timeout=5,
        )
        one.observe("GET", "/x", 200, 0.001)

    asyncio.run(record())
    assert _series(batched) == _series(one)


def test_the_access_log_line_is_uvicorns(tmp_path: Path) -> None:
    """With uvicorn's access log on, a read answered in the protocol logs the line the
    app's answer logs, through uvicorn's own formatter."""
    import logging
    import re

    from uvicorn.logging import AccessFormatter

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(self.format(record))

    handler = Collect()
    handler.setFormatter(AccessFormatter("%(client_addr)s %(request_line)s %(status_code)s"))
    with _Server(tmp_path / "store", log_level="info") as server:
        access = logging.getLogger("uvicorn.access")
        access.addHandler(handler)
        try:
            server.store.put(_block())
            (_, n) = _answered(server, _get(PATH))
            assert n == 1
            (_, n) = _answered(server, _get(PATH + "?"))
            assert n == 0
        finally:
            access.removeHandler(handler)
    plain, app = (re.sub(r":\d+ ", ":port ", line) for line in lines)
    assert plain == app == f"127.0.0.1:port GET {PATH} HTTP/1.1 200 OK"


def test_body_chunks_hand_over_what_was_received() -> None:
    chunks = _BodyChunks()
    assert len(chunks) == 0
    one = b"a" * 1000
    chunks += one
    assert len(chunks) == 1000 and bytes(chunks) is one  # one chunk: not copied
    chunks += b"bc"
    assert len(chunks) == 1002 and bytes(chunks) == one + b"bc"


def test_a_large_put_arrives_whole(server: _Server) -> None:
    """A put of many socket reads (uvicorn's body buffer replaced by _BodyChunks): the
    store holds every block, byte for byte."""
    blocks = [_block(0x200 + i) for i in range(600)]  # 1.2 MiB: several reads of 256 KiB
    body = join(blocks)
    head = b"PUT /v1/blocks HTTP/1.1\r\nHost: t\r\nContent-Type: application/vnd.tlkv\r\n"
    (answer,), _ = _answered(server, head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    assert answer[0] == b"HTTP/1.1 200 OK\r\n", answer
    for i, data in enumerate(blocks):
        assert server.store.get(0x200 + i) == data
