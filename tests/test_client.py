"""``kvstore.client.Client`` and the ``tlkv put/get/has`` commands against a live server.

The server runs with a token (the commands read it from ``TLKV_TOKEN``); a recording
transport counts what goes over the wire, so ``push``'s byte accounting is checked on the
actual request bodies.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from conftest import SMALL, make_blocks, make_envelope
from http_server import ServerProcess, assert_error

from kvstore import (
    Block,
    FormatError,
    Geometry,
    ShapeError,
    StoreFullError,
    UnsupportedVersionError,
    chain_hashes,
    crc32c,
    decode,
    encode,
    join,
    split,
)
from kvstore.cli import main
from kvstore.client import Client, HasResult
from kvstore.client_wire import BodyTransport, ReceivePool
from kvstore.codec.layout import TRAILER
from kvstore.errors import (
    InvalidRequestError,
    NotFoundError,
    PinnedError,
    TooLargeError,
    UnauthorizedError,
)

TOKEN = "client-test-token"
GEOMETRY_ARG = ",".join(map(str, SMALL.as_tuple()))


class Recorder(httpx.HTTPTransport):
    """An httpx transport that records (method, path, body bytes) of every request."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[tuple[str, str, int]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = request.read()
        self.requests.append((request.method, request.url.path, len(body)))
        return super().handle_request(request)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data = tmp_path_factory.mktemp("client") / "store"
    args = ("--geometry", GEOMETRY_ARG, "--max-body", "64KiB")
    with ServerProcess(data, *args, token=TOKEN) as srv:
        yield srv


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def client(server: ServerProcess, recorder: Recorder) -> Iterator[Client]:
    with Client(server.url, token=TOKEN, transport=recorder) as c:
        yield c


def _prompt(n_tokens: int, seed: int, version: int = 1) -> tuple[list[int], bytes]:
    """Tokens and the envelope of their KV: full blocks hashed by the chain, tail hash 0."""
    rng = np.random.default_rng(seed)
    tokens = [int(t) for t in rng.integers(0, 2**32, n_tokens, dtype=np.uint64)]
    hashes = chain_hashes(tokens, SMALL.block_tokens)
    blocks = make_blocks(SMALL, n_tokens, seed=seed)
    blocks = [
        Block(hashes[i] if i < len(hashes) else 0, b.n_tokens, b.kv) for i, b in enumerate(blocks)
    ]
    return tokens, encode(SMALL, blocks, version)


def test_info_and_health(client: Client) -> None:
    assert client.health()
    info = client.info()
    assert info["geometry"]["block_tokens"] == 4 and info["formats"] == [1, 2]
    assert "tlkv_http_requests_total" in client.metrics()


def test_put_get_delete(client: Client) -> None:
    data = make_envelope(SMALL, 10, seed=1)
    hashes = [int(h) for h in decode(data).hashes if h]
    result = client.put(data)
    assert result.stored == hashes and result.duplicate == [] and result.partial == 1
    again = client.put(memoryview(data))
    assert again.stored == [] and again.duplicate == hashes
    parts = split(data)
    assert client.get(hashes[0]) == parts[0]
    assert client.get(f"{hashes[1]:016x}") == parts[1]
    assert client.get(np.uint64(hashes[1])) == parts[1]
    assert decode(client.get(hashes[0], format=2)).version == 2
    assert client.get(12345) is None
    assert client.delete(hashes[0]) is True
    assert client.delete(hashes[0]) is False
    assert client.get(hashes[0]) is None
    with pytest.raises(ValueError):
        client.get("ABC")
    with pytest.raises(ValueError):
        client.get(-1)


def test_has_blocks_and_prefix(client: Client) -> None:
    tokens, data = _prompt(22, seed=2)  # 5 full blocks + 2 tokens
    hashes = [int(h) for h in decode(data).hashes if h]
    client.put(_first_blocks(data, 3))
    expected = HasResult([True, True, True, False, False], 3)
    assert client.has_blocks(hashes=hashes) == expected
    assert client.has_blocks(hashes=[f"{h:016x}" for h in hashes]) == expected
    assert client.has_blocks(hashes=np.array(hashes, dtype=np.uint64)) == expected
    assert client.has_blocks(tokens=tokens) == expected
    assert client.has_blocks(hashes=[]) == HasResult([], 0)
    with pytest.raises(ValueError):
        client.has_blocks()
    with pytest.raises(ValueError):
        client.has_blocks(hashes=[1], tokens=[1])
    env = decode(client.prefix(tokens=tokens))
    assert [int(h) for h in env.hashes] == hashes[:3]
    assert client.prefix(hashes=hashes) == client.prefix(tokens=tokens)
    assert decode(client.prefix(hashes=hashes, format=2)).version == 2
    assert len(client.prefix(hashes=hashes[3:])) == 32


def test_has_blocks_takes_every_hash_form_and_names_a_bad_one(client: Client) -> None:
    """Plain ints take the compiled one-pass conversion; a list or tuple mixing in hex
    strings or numpy integers takes the general path; either way the answer is the same,
    and a hash that is not a u64 is refused by name before anything is sent."""
    _tokens, data = _prompt(22, seed=23)
    hashes = [int(h) for h in decode(data).hashes if h]
    client.put(_first_blocks(data, 3))
    expected = HasResult([True, True, True, False, False], 3)
    mixed = [hashes[0], f"{hashes[1]:016x}", np.uint64(hashes[2]), *hashes[3:]]
    assert client.has_blocks(hashes=tuple(hashes)) == expected
    assert client.has_blocks(hashes=mixed) == expected
    assert client.has_blocks(hashes=iter(hashes)) == expected
    bad_hashes: list[tuple[Any, str]] = [
        (-1, "must fit u64"),
        (1 << 64, "must fit u64"),
        (True, "is an integer"),
        (1.0, "is an integer"),
        ("0123", "16 lowercase hex digits"),
    ]
    for bad, rule in bad_hashes:
        with pytest.raises(ValueError, match=rule):
            client.has_blocks(hashes=[*hashes[:2], bad])


def test_an_answer_is_freed_when_the_caller_drops_it(server: ServerProcess) -> None:
    """On tlkv's transport no reference cycle holds a response: a block read and then
    dropped is freed at once, not at the garbage collector's next run (so the next read
    reuses warm memory instead of faulting in fresh pages)."""
    _tokens, data = _prompt(8, seed=24)  # 2 full blocks
    client = Client(server.url, token=TOKEN)
    client.put(data)
    hashes = [int(h) for h in decode(data).hashes]

    def live_responses() -> int:
        return sum(1 for o in gc.get_objects() if type(o) is httpx.Response)

    gc.collect()
    gc.disable()
    try:
        before = live_responses()
        for _ in range(3):
            assert client.get(hashes[0]) is not None
            assert client.has_blocks(hashes=hashes).prefix == 2
            assert client.get(1) is None  # a 404 answer too
        assert live_responses() == before
    finally:
        gc.enable()
        client.close()


def test_a_closed_client_sends_nothing(server: ServerProcess) -> None:
    c = Client(server.url, token=TOKEN)
    assert c.health()
    c.close()
    with pytest.raises(RuntimeError, match="closed"):
        c.health()


def test_prefix_answers_are_never_overwritten_while_held(
    server: ServerProcess, client: Client
) -> None:
    """``prefix`` on tlkv's transport: a read-only view of a receive buffer used again
    only once nothing references the answer; answers held (as views, slices or arrays)
    keep their bytes through later calls, from several threads at once."""
    _tokens, data = _prompt(33, seed=13)  # 8 full blocks + 1 token
    hashes = [int(h) for h in decode(data).hashes if h]
    client.put(_first_blocks(data, 8))
    want = [bytes(client.prefix(hashes=hashes[:k])) for k in (2, 5, 8)]
    fast = Client(server.url, token=TOKEN)
    first = fast.prefix(hashes=hashes[:2])
    assert isinstance(first, memoryview) and first.readonly and first == want[0]
    array = np.frombuffer(fast.prefix(hashes=hashes[:5]), np.uint8)  # held by an array
    part = fast.prefix(hashes=hashes)[:100]  # held by a slice
    assert first == want[0] and array.tobytes() == want[1] and part == want[2][:100]
    del first, array, part
    answer = fast.prefix(hashes=hashes)
    assert isinstance(answer, memoryview)
    buffer = id(answer.obj)  # an id: a reference would keep it held
    del answer
    for _ in range(5):  # nothing held: the same buffer serves them all
        answer = fast.prefix(hashes=hashes)
        assert isinstance(answer, memoryview) and answer == want[2]
        assert id(answer.obj) == buffer
        del answer
    assert len(fast._answers._bufs) <= ReceivePool._KEPT
    assert decode(fast.prefix(hashes=hashes)).hashes.tolist() == hashes

    def reader(k: int) -> list[bytes]:
        held = [fast.prefix(hashes=hashes[:k]) for _ in range(20)]
        return [bytes(h) for h in held]

    with ThreadPoolExecutor(4) as pool:
        for k, got in zip((2, 5, 8, 2), pool.map(reader, (2, 5, 8, 2))):
            assert got == [want[(2, 5, 8).index(k)]] * 20
    fast.close()


def test_prefix_into_fills_the_callers_buffer_or_answers_new_bytes(
    server: ServerProcess, client: Client
) -> None:
    """``prefix_into``: the answer read into the caller's buffer when it fits (the filled
    part returned, the rest untouched), new bytes when it does not or when the client
    runs on another transport (the test's recording one); errors as ``prefix``."""
    tokens, data = _prompt(17, seed=12)  # 4 full blocks + 1 token
    hashes = [int(h) for h in decode(data).hashes if h]
    client.put(_first_blocks(data, 2))
    want = client.prefix(hashes=hashes)
    other = client.prefix_into(np.empty(len(want), np.uint8), hashes=hashes)
    assert isinstance(other, bytes) and other == want
    client = Client(server.url, token=TOKEN)  # tlkv's own transport
    out = np.full(len(want) + 7, 0xAB, np.uint8)
    got = client.prefix_into(out, hashes=hashes)
    assert isinstance(got, memoryview) and bytes(got) == want
    assert np.shares_memory(np.frombuffer(got, np.uint8), out)
    assert (out[len(want) :] == 0xAB).all()
    again = client.prefix_into(out, tokens=tokens)  # the same buffer, used again
    assert bytes(again) == want
    small = bytearray(len(want) - 1)
    got = client.prefix_into(small, hashes=hashes)
    assert isinstance(got, bytes) and got == want and small == bytearray(len(want) - 1)
    v2 = client.prefix_into(out, hashes=hashes, format=2)
    assert bytes(v2) == client.prefix(hashes=hashes, format=2)
    with pytest.raises(ValueError):
        client.prefix_into(out)
    with pytest.raises(InvalidRequestError):
        client.prefix_into(out, hashes=hashes, format=7)
    client.close()


def _first_blocks(data: bytes, n: int) -> bytes:
    return join(split(data)[:n])


def test_push_sends_only_missing_full_blocks(client: Client, recorder: Recorder) -> None:
    _tokens, data = _prompt(22, seed=3, version=2)
    g = SMALL
    client.put(_first_blocks(data, 2))
    recorder.requests.clear()
    sent = client.push(data)
    assert sent == g.envelope_bytes(3, 2)  # blocks 2, 3, 4; never the partial tail
    puts = [r for r in recorder.requests if r[0] == "PUT"]
    assert puts == [("PUT", "/v1/blocks", sent)]
    assert [r[1] for r in recorder.requests] == ["/v1/has-blocks", "/v1/blocks"]
    # Everything is there now: nothing sent, no PUT at all.
    recorder.requests.clear()
    assert client.push(data) == 0
    assert [r[0] for r in recorder.requests] == ["POST"]
    assert client.has_blocks(hashes=[int(h) for h in decode(data).hashes if h]).prefix == 5


def test_push_all_missing_and_only_partial(client: Client, recorder: Recorder) -> None:
    _tokens, data = _prompt(8, seed=4)  # exactly 2 full blocks
    assert client.push(data) == len(data) == SMALL.envelope_bytes(2, 1)
    _tokens, tail = _prompt(3, seed=5)  # a partial block only
    recorder.requests.clear()
    assert client.push(tail) == 0
    assert recorder.requests == []


def test_push_refuses_bad_envelopes_locally(client: Client, recorder: Recorder) -> None:
    data = make_envelope(SMALL, 8, seed=6)
    with pytest.raises(FormatError):
        client.push(data[:-1])
    assert recorder.requests == []


def _bad_crc(data: bytes) -> bytes:
    return data[:-4] + TRAILER.pack(crc32c(data[:-4]) ^ 1)


def test_errors_map_to_typed_exceptions(client: Client, server: ServerProcess) -> None:
    data = make_envelope(SMALL, 8, seed=7)
    with pytest.raises(FormatError, match="CRC"):
        client.put(_bad_crc(data))
    with pytest.raises(ShapeError):
        client.put(make_envelope(Geometry(4, 2, 2, 16), 4, seed=7))
    v9 = bytearray(data)
    v9[4] = 9
    with pytest.raises(UnsupportedVersionError):
        client.put(bytes(v9[:-4]) + TRAILER.pack(crc32c(bytes(v9[:-4]))))
    with pytest.raises(TooLargeError):
        client.put(b"\0" * (64 * 1024 + 1))
    with pytest.raises(InvalidRequestError):
        client.get(1, format=3)  # the server refuses the parameter
    client.put_sequence("pinning", data)
    with pytest.raises(PinnedError):
        client.delete(int(decode(data).hashes[0]))
    assert client.delete_sequence("pinning") is True
    assert client.delete(int(decode(data).hashes[0])) is True
    with Client(server.url, token="wrong") as bad, pytest.raises(UnauthorizedError):
        bad.info()
    with Client(server.url) as anonymous, pytest.raises(UnauthorizedError):
        anonymous.get(1)
    with pytest.raises(NotFoundError):
        client._ok("GET", "/no/such/route")


def test_sequences(client: Client) -> None:
    data = make_envelope(SMALL, 14, seed=8, version=2)
    assert client.get_sequence("s.1") is None
    client.put_sequence("s.1", data)
    assert client.get_sequence("s.1") == data
    assert "s.1" in client.sequences()
    assert client.delete_sequence("s.1") is True
    assert client.delete_sequence("s.1") is False
    assert client.get_sequence("s.1") is None
    for name in (".", "..", "-", "_.-" * 42 + "ab"):  # dot segments are escaped in the URL
        client.put_sequence(name, data)
        assert client.get_sequence(name) == data
        assert name in client.sequences()
        assert client.delete_sequence(name) is True
    for bad in ("", "a/b", "x" * 129, "é"):
        with pytest.raises(ValueError):
            client.put_sequence(bad, data)


@pytest.mark.slow
def test_store_full(tmp_path: Path) -> None:
    one = SMALL.envelope_bytes(1, 1)
    with (
        ServerProcess(tmp_path / "store", "--capacity", str(8 * one)) as srv,
        Client(srv.url) as client,
    ):
        client.put_sequence("all", make_envelope(SMALL, 24, seed=9))  # 6 pinned blocks
        more = make_envelope(SMALL, 16, seed=10)  # 4 more blocks: cannot fit
        with srv.client() as http:
            r = http.put(
                "/v1/blocks", content=more, headers={"content-type": "application/vnd.tlkv"}
            )
            assert_error(r, 507, "store_full")
        with pytest.raises(StoreFullError):
            client.put(more)
        assert client.has_blocks(hashes=[int(h) for h in decode(more).hashes]).prefix == 0


# --- the tlkv put / get / has commands --------------------------------------------------


def test_cli_put_get_has(
    server: ServerProcess,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("TLKV_TOKEN", TOKEN)
    tokens, data = _prompt(10, seed=11)
    src = tmp_path / "in.tlkv"
    src.write_bytes(data)
    hashes = [f"{int(h):016x}" for h in decode(data).hashes if h]

    assert main(["put", server.url, str(src)]) == 0
    reply = json.loads(capsys.readouterr().out)
    assert reply == {"stored": hashes, "duplicate": [], "partial": 1}

    out = tmp_path / "out.tlkv"
    assert main(["get", server.url, hashes[0], "-o", str(out)]) == 0
    assert out.read_bytes() == split(data)[0]
    assert main(["get", server.url, hashes[0], "-o", str(out), "--format", "2"]) == 0
    assert decode(out.read_bytes()).version == 2

    capsys.readouterr()
    assert main(["has", server.url, *hashes, "0000000000000001"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        f"{hashes[0]} present",
        f"{hashes[1]} present",
        "0000000000000001 absent",
        "prefix 2/3",
    ]
    assert main(["has", server.url, "--json", "--tokens", *map(str, tokens)]) == 0
    assert json.loads(capsys.readouterr().out) == {"present": [True, True], "prefix": 2}
    # A prompt shorter than a block has no block to look up, and the answer says so.
    assert main(["has", server.url, "--tokens", "1"]) == 0
    assert (
        capsys.readouterr().out
        == "prefix 0/0: the prompt (1 tokens) is shorter than a block, nothing to look up\n"
    )


def test_cli_errors(
    server: ServerProcess,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("TLKV_TOKEN", TOKEN)
    out = tmp_path / "out"
    assert main(["get", server.url, "00000000000000aa", "-o", str(out)]) == 1
    assert "not found" in capsys.readouterr().err
    bad = tmp_path / "bad.tlkv"
    bad.write_bytes(_bad_crc(make_envelope(SMALL, 4, seed=12)))
    assert main(["put", server.url, str(bad)]) == 3  # a format error, as for tlkv verify
    assert "CRC" in capsys.readouterr().err
    assert main(["get", server.url, "XYZ", "-o", str(out)]) == 2
    assert main(["has", server.url]) == 2
    monkeypatch.delenv("TLKV_TOKEN")
    assert main(["has", server.url, "0000000000000001"]) == 1
    assert "UnauthorizedError" in capsys.readouterr().err
    token_file = tmp_path / "tok"
    token_file.write_text(TOKEN)
    assert main(["has", server.url, "0000000000000001", "--token-file", str(token_file)]) == 0
    assert main(["has", "http://127.0.0.1:9", "0000000000000001"]) == 1  # nobody listens


# --- the default transport (http.client keep-alive, bodies received in place) ------------


def test_default_transport_round_trip(
    server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    connects: list[object] = []
    real_connect = BodyTransport._connect

    def counting(self: BodyTransport, origin: object, timeout: object) -> object:
        connects.append(origin)
        return real_connect(self, origin, timeout)  # type: ignore[arg-type]

    monkeypatch.setattr(BodyTransport, "_connect", counting)
    tokens, data = _prompt(22, seed=20)
    hashes = [int(h) for h in decode(data).hashes if h]
    with Client(server.url, token=TOKEN) as c:
        assert isinstance(c._http._transport, BodyTransport)
        assert c.put(data).stored == hashes
        got = c.get(hashes[0])
        assert type(got) is bytes and got == split(data)[0]
        assert c.get(12345) is None
        prefix = c.prefix(tokens=tokens)
        assert type(prefix) is memoryview and prefix.readonly  # a receive buffer's view
        assert prefix == _first_blocks(data, 5)
        assert c.has_blocks(tokens=tokens).prefix == 5
        c.put_sequence("rt", data)
        assert c.get_sequence("rt") == data and c.get_sequence("nope") is None
        with pytest.raises(InvalidRequestError):
            c.get(1, format=3)
        with pytest.raises(NotFoundError):
            c._ok("GET", "/no/such/route")
        assert c._ok("HEAD", f"/v1/blocks/{hashes[0]:016x}").content == b""
        assert c.delete_sequence("rt") and c.delete(hashes[0])
    assert len(connects) == 1  # one keep-alive connection served every request


def test_default_transport_auth(server: ServerProcess) -> None:
    with Client(server.url) as anonymous, pytest.raises(UnauthorizedError):
        anonymous.get(1)
    with Client(server.url, token="wrong") as bad, pytest.raises(UnauthorizedError):
        bad.prefix(hashes=[1])
