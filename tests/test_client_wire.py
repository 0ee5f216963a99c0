"""``kvstore.client_wire`` (the client's own transport) and the block reads that check the
envelope's CRC-32C as it arrives (``kvstore.client_session``), against answers written byte
by byte (``fake_http``) and a real server whose stored bytes rot.
"""

from __future__ import annotations

import json
import socket
import time
import tracemalloc
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from conftest import SMALL, make_envelope
from fake_http import read_request, read_request_with_body, reply
from http_server import ServerProcess
from store_helpers import flip_on_disk, marked_block, marker_bytes

from kvstore import Geometry, client_wire, encode
from kvstore.client import Client
from kvstore.client_wire import BodyTransport
from kvstore.codec.assembly import crc_matches
from kvstore.errors import ChecksumError, ServiceError, UnauthorizedError
from kvstore.protocol import READER_CHECKS_CRC, READER_CHECKS_HEADER, hash_hex

GEOMETRY_ARG = ",".join(map(str, SMALL.as_tuple()))


def test_default_transport_under_a_proxy_is_httpx(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    with Client("http://tlkv.invalid:8000") as c:
        assert not isinstance(c._http._transport, BodyTransport)
    monkeypatch.setenv("NO_PROXY", "tlkv.invalid")
    with Client("http://tlkv.invalid:8000") as c:
        assert isinstance(c._http._transport, BodyTransport)


def test_transport_retries_a_connection_the_server_dropped(fake: Any) -> None:
    def one_response_per_connection(sock: socket.socket, index: int) -> None:
        read_request(sock)
        sock.sendall(reply(b"first" if index == 0 else b"again"))
        read_request(sock)  # a second request on the kept-alive connection: dropped unanswered

    srv = fake(one_response_per_connection)
    with Client(srv.url) as c:
        assert c._ok("GET", "/a").content == b"first"
        assert c._ok("GET", "/b").content == b"again"
    assert srv.accepted == 2


def test_transport_skips_an_idle_connection_the_server_closed(fake: Any) -> None:
    def close_after_one(sock: socket.socket, index: int) -> None:
        read_request(sock)
        sock.sendall(reply(b"x%d" % index))

    srv = fake(close_after_one)
    with Client(srv.url) as c:
        assert c._ok("GET", "/a").content == b"x0"
        assert srv.closed.acquire(timeout=10)  # the server closed it: readable, not reused
        assert c._ok("GET", "/a").content == b"x1"


def test_transport_large_and_chunked_bodies(fake: Any) -> None:
    big = np.random.default_rng(5).integers(0, 256, (9 << 20) + 7, dtype=np.uint8).tobytes()

    def serve(sock: socket.socket, index: int) -> None:
        while True:
            head = read_request(sock)
            if b"/big" in head:  # head and body apart: no copy on this side either
                sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(big))
                sock.sendall(big)
            elif b"/chunked" in head:
                sock.sendall(
                    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                    b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
                )
            else:
                sock.sendall(reply(b""))

    srv = fake(serve)
    with Client(srv.url) as c:
        tracemalloc.start()
        try:
            got = c._ok("GET", "/big").content
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert type(got) is bytes and got == big
        assert peak < 1.25 * len(big)  # received into one buffer: no chunks joined
        assert c._ok("GET", "/chunked").content == b"hello world"
        assert c._ok("GET", "/empty").content == b""
        assert c._ok("GET", "/big").content == big
    assert srv.accepted == 1


def test_transport_errors_are_httpx_errors(fake: Any) -> None:
    def truncated(sock: socket.socket, index: int) -> None:
        read_request(sock)
        sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten b")

    def silent(sock: socket.socket, index: int) -> None:
        read_request(sock)
        time.sleep(2)  # never answers within the client's timeout: what is tested

    def garbage(sock: socket.socket, index: int) -> None:
        read_request(sock)
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")

    with Client(fake(truncated).url) as c, pytest.raises(httpx.RemoteProtocolError):
        c._ok("GET", "/")
    with Client(fake(silent).url, timeout=0.2) as c, pytest.raises(httpx.ReadTimeout):
        c._ok("GET", "/")
    with Client(fake(garbage).url) as c, pytest.raises(httpx.RemoteProtocolError):
        c._ok("GET", "/")
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    with Client(f"http://127.0.0.1:{port}") as c, pytest.raises(httpx.ConnectError):
        c._ok("GET", "/")


def test_a_block_read_sends_the_request_httpx_builds(fake: Any) -> None:
    """``Client.get`` skips httpx's request object, not any byte of the request: the
    same head as the same GET built by httpx (base path, model, auth, Host), and the
    header saying that it checks the envelope's CRC-32C itself."""
    heads: list[bytes] = []
    body = make_envelope()

    def recording(sock: socket.socket, index: int) -> None:
        while True:
            heads.append(read_request(sock))
            sock.sendall(reply(body))

    srv = fake(recording)
    with Client(srv.url + "/under/a/path/", token="t0k", model="m.1") as c:
        assert c._direct is not None
        assert c.get(0xABC) == body
        assert c._ok("GET", "/v1/blocks/0000000000000abc").content == body
    checks = f"{READER_CHECKS_HEADER}: {READER_CHECKS_CRC}\r\n".encode()
    assert heads[0] == heads[1][:-2] + checks + b"\r\n"
    assert heads[0].startswith(b"GET /under/a/path/v1/models/m.1/blocks/0000000000000abc HTTP/1.1")
    assert b"\r\nauthorization: Bearer t0k\r\n" in heads[0]


def _corrupt(envelope: bytes, at: int) -> bytes:
    damaged = bytearray(envelope)
    damaged[at] ^= 0x40
    return bytes(damaged)


@pytest.mark.parametrize("geometry", [SMALL, Geometry(16, 32, 8, 128)], ids=["small", "2MiB"])
def test_a_block_read_checks_the_envelope_as_it_arrives(fake: Any, geometry: Geometry) -> None:
    """``Client.get`` reads a 200 as an envelope and checks its CRC-32C on arrival: a
    corrupt one is asked for again without the reader-checks header (the server then
    checks it), and one that arrives corrupt after that raises ChecksumError. Damage in
    any part of a large answer (either side of a part's end) or in the trailer is found."""
    good = make_envelope(geometry, geometry.block_tokens)
    size = len(good)
    answers: dict[int, list[bytes]] = {}
    heads: list[bytes] = []

    def serve(sock: socket.socket, index: int) -> None:
        while True:
            head = read_request(sock)
            heads.append(head)
            h = int(head.split(b" ")[1].rsplit(b"/", 1)[1], 16)
            sock.sendall(reply(answers[h].pop(0)))

    part = client_wire._CHECK_PART
    places = [0, 29, part - 1, part, 2 * part + 3, size // 2, size - 5, size - 1]
    with Client(fake(serve).url) as c:
        for i, at in enumerate(p for p in places if p < size):
            answers[2 * i + 1] = [_corrupt(good, at), good]  # damaged once
            assert c.get(2 * i + 1) == good
            answers[2 * i + 2] = [_corrupt(good, at), _corrupt(good, at)]  # damaged twice
            with pytest.raises(ChecksumError, match=r"FORMAT\.md 2\.2"):
                c.get(2 * i + 2)
        answers[99] = [good[:-1] + bytes([good[-1] ^ 1]), good[:31]]  # not even an envelope
        with pytest.raises(ChecksumError):
            c.get(99)
    header = f"\r\n{READER_CHECKS_HEADER}: {READER_CHECKS_CRC}\r\n".encode()
    asked = [header in head for head in heads]
    assert asked == [True, False] * (len(heads) // 2)  # every second ask: the server checks


def test_a_stored_block_found_corrupt_by_the_client_is_quarantined(tmp_path: Path) -> None:
    """Against a real server (its background scrub off, so the read is what finds it): a
    block whose stored bytes rot is sent unchecked only to a reader that says it checks
    the CRC itself. ``Client.get`` and ``Client.prefix`` find the damage and ask again
    without the header; the server's check then quarantines the block: ``get`` answers
    None and the prefix ends before it, as for any other reader."""
    blocks = [marked_block(1.0, 11), marked_block(-3.5, 12), marked_block(6.5, 13)]
    args = ("--geometry", GEOMETRY_ARG, "--scrub-rate", "0")
    checks = {READER_CHECKS_HEADER: READER_CHECKS_CRC}
    for read in ("get", "prefix"):
        data = tmp_path / read
        with ServerProcess(data, *args) as srv:
            with Client(srv.url) as c:
                c.put(encode(SMALL, blocks))
            srv.stop()
            flip_on_disk(data, marker_bytes(-3.5), 7)
            srv.start()
            url = f"{srv.url}/v1/blocks/{hash_hex(12)}"
            hashes = np.array([11, 12, 13], dtype="<u8").tobytes()
            query = f"{srv.url}/v1/prefix"
            unchecked = httpx.get(url, headers=checks)
            assert unchecked.status_code == 200  # sent as stored: this reader checks it
            assert len(unchecked.content) == SMALL.envelope_bytes(1, 1)
            assert not crc_matches(unchecked.content)
            binary = {"content-type": "application/octet-stream"}
            whole = httpx.post(query, content=hashes, headers={**checks, **binary})
            assert len(whole.content) == SMALL.envelope_bytes(3, 1)  # all three, unchecked
            assert not crc_matches(whole.content)
            with Client(srv.url) as c:
                if read == "get":
                    assert c.get(11) == encode(SMALL, [blocks[0]])
                    assert c.get(12) is None
                else:
                    assert bytes(c.prefix(hashes=[11, 12, 13])) == encode(SMALL, [blocks[0]])
                assert httpx.get(url).status_code == 404  # quarantined by the second ask
                assert c.has_blocks([11, 12, 13]).present == [True, False, True]


@pytest.mark.parametrize("call", ["prefix", "prefix_into", "prefix_into_small"])
def test_a_prefix_is_checked_as_it_arrives(fake: Any, call: str) -> None:
    """``prefix`` and ``prefix_into`` (into a buffer that fits, or new bytes when it does
    not) check the answer's CRC-32C as it arrives, as ``get`` does: a corrupt answer is
    asked for again without the reader-checks header, a second one raises ChecksumError.
    Another transport sends no such header (nobody would check the answer)."""
    geometry = Geometry(16, 32, 8, 128)
    good = make_envelope(geometry, geometry.block_tokens * 3)  # three blocks, 6 MiB
    queue: list[bytes] = []
    heads: list[bytes] = []

    def serve(sock: socket.socket, index: int) -> None:
        while True:
            head, _body = read_request_with_body(sock)
            heads.append(head)
            sock.sendall(reply(queue.pop(0), b"x-tlkv-prefix-blocks: 3\r\n"))

    size = len(good)
    out = bytearray(size // 2 if call == "prefix_into_small" else size + 100)

    def ask(c: Client) -> Any:
        if call == "prefix":
            return c.prefix(hashes=[1, 2, 3])
        return c.prefix_into(out, hashes=[1, 2, 3])

    srv = fake(serve)
    with Client(srv.url) as c:
        for at in (0, client_wire._CHECK_PART, size // 2, size - 1):
            queue[:] = [_corrupt(good, at), good]
            assert bytes(ask(c)) == good
            queue[:] = [_corrupt(good, at), _corrupt(good, at)]
            with pytest.raises(ChecksumError, match=r"POST /v1/prefix"):
                ask(c)
        queue[:] = [good]
        answer = ask(c)
        assert bytes(answer) == good
        if call == "prefix_into":
            assert answer.obj is out  # type: ignore[union-attr]
    header = f"\r\n{READER_CHECKS_HEADER}: {READER_CHECKS_CRC}\r\n".encode()
    assert [header in h for h in heads] == [True, False] * 8 + [True]
    heads.clear()
    with Client(srv.url, transport=httpx.HTTPTransport()) as other:
        queue[:] = [good]
        assert bytes(other.prefix(hashes=[1, 2, 3])) == good
    assert [header in h for h in heads] == [False]


def test_a_block_reads_errors_are_the_same_as_any_calls(fake: Any) -> None:
    """The direct block read answers None for tlkv's 404, raises a typed error for other
    error answers, and an httpx error that names its request when the transport fails."""

    def answers(sock: socket.socket, index: int) -> None:
        while True:
            path = read_request(sock).split(b" ")[1]
            kind, status = (b"not_found", 404) if b"0001" in path else (b"unauthorized", 401)
            if b"0003" in path:
                sock.sendall(b"HTTP/1.1 404 Not Found\r\ncontent-length: 4\r\n\r\nnope")
                continue
            err = json.dumps({"error": {"kind": kind.decode(), "message": "m"}}).encode()
            sock.sendall(
                b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (status, len(err), err)
            )

    with Client(fake(answers).url) as c:
        assert c.get(1) is None
        with pytest.raises(UnauthorizedError):
            c.get(2)
        with pytest.raises(ServiceError, match="without the error shape"):
            c.get(3)  # a 404 that is not tlkv's is not taken for a missing block
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    with Client(f"http://127.0.0.1:{port}") as c, pytest.raises(httpx.ConnectError) as caught:
        c.get(5)
    assert caught.value.request.url.path == "/v1/blocks/0000000000000005"
    c.close()
    with pytest.raises(RuntimeError, match="closed"):
        c.get(5)
