"""tl.kv.v1 against the real server: ``tlkv serve --grpc-port`` in a subprocess.

The calls that check status codes use a client generated here, at test time, from
``api/proto/tl/kv/v1/kv.proto`` with grpcio-tools (not our ``TransferClient``), as another
implementation would. Every failing stream carries a valid new block first, and the test
checks that it was not stored.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_server import (
    AUTH,
    OPTIONS,
    TOKEN,
    G,
    GrpcServer,
    assert_status,
    capped_server,
    chunk,
    fresh_block,
    generated_pb,
    held,
    prompt,
)
from waiting import wait_until

from kvstore import Block, Geometry, chain_hashes, crc32c, decode, encode, join, split
from kvstore.cli import main as cli_main
from kvstore.errors import UnsupportedVersionError
from kvstore.transfer import MAX_CHUNK_PAYLOAD, HasResult, TransferClient

SINGLE_V1 = G.envelope_bytes(1, 1)
HAS = "/tl.kv.v1.KvTransfer/HasBlocks"  # the method label of /metrics
PUSH = "/tl.kv.v1.KvTransfer/PushKv"


# --- fixtures ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    with generated_pb(tmp_path_factory.mktemp("gen")) as modules:
        yield modules


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GrpcServer]:
    with capped_server(tmp_path_factory.mktemp("grpc") / "store") as srv:
        yield srv


@pytest.fixture(scope="module")
def stub(server: GrpcServer, pb: SimpleNamespace) -> Iterator[Any]:
    with grpc.insecure_channel(server.target, options=OPTIONS) as channel:
        yield pb.kv_pb2_grpc.KvTransferStub(channel)


@pytest.fixture()
def client(server: GrpcServer) -> Iterator[TransferClient]:
    with TransferClient(f"grpc://{server.target}", token=TOKEN) as c:
        yield c


# --- HasBlocks, PushKv, FetchKv ---------------------------------------------------------


def test_health_serving(server: GrpcServer) -> None:
    with grpc.insecure_channel(server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "tl.kv.v1.KvTransfer"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.slow
def test_grpc_host_and_not_serving_on_graceful_stop(tmp_path: Path) -> None:
    """``--grpc-host`` binds gRPC apart from HTTP; on SIGTERM the health service reports
    NOT_SERVING to its watchers before the server goes away."""
    import signal

    with GrpcServer(tmp_path / "s", "--grpc-host", "127.0.0.2") as srv:
        assert srv.url.startswith("http://127.0.0.1:")  # HTTP stays on --host
        with grpc.insecure_channel(f"127.0.0.1:{srv.grpc_port}") as channel:
            with pytest.raises(grpc.RpcError) as exc:
                health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=2
                )
            assert_status(exc, grpc.StatusCode.UNAVAILABLE)
        with grpc.insecure_channel(f"127.0.0.2:{srv.grpc_port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            watches = [
                health.Watch(health_pb2.HealthCheckRequest(service=name), timeout=30)
                for name in ("", "tl.kv.v1.KvTransfer")
            ]
            for watch in watches:
                assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            assert srv.proc is not None
            srv.proc.send_signal(signal.SIGTERM)
            for watch in watches:
                assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert srv.stop() in (0, -signal.SIGTERM)  # one worker: uvicorn re-raises SIGTERM
        assert "Traceback" not in srv.log(), srv.log()[-3000:]


def test_has_blocks_and_prefix(stub: Any, pb: SimpleNamespace, client: TransferClient) -> None:
    tokens, data = prompt(5 * G.block_tokens)
    hashes = chain_hashes(tokens, G.block_tokens)
    client.push(join(split(data)[:2]))
    reply = stub.HasBlocks(pb.kv_pb2.HasBlocksRequest(block_hashes=hashes), metadata=AUTH)
    assert list(reply.present) == [True, True, False, False, False]
    assert reply.prefix_blocks == 2
    reply = stub.HasBlocks(pb.kv_pb2.HasBlocksRequest(), metadata=AUTH)
    assert list(reply.present) == [] and reply.prefix_blocks == 0
    expected = ([True, True, False, False, False], 2)
    assert client.has_blocks(np.array(hashes, dtype=np.uint64)) == expected
    assert client.has_blocks([f"{h:016x}" for h in hashes]) == expected
    with pytest.raises(ValueError):
        client.has_blocks([-1])


def test_push_sends_only_missing_blocks_and_the_tail(
    server: GrpcServer, stub: Any, pb: SimpleNamespace, client: TransferClient
) -> None:
    n, k = 6, 4
    tokens, data = prompt(n * G.block_tokens + 3)
    parts = split(data)
    first = client.push(join(parts[:k]))
    assert first == (k, 0, k, 0, k * SINGLE_V1)
    report = client.push(data)
    assert report.payload_bytes == (n - k + 1) * SINGLE_V1  # the spec's bytes moved
    assert (report.blocks, report.referenced, report.stored, report.duplicate) == (
        n + 1,
        k,
        n - k,
        0,
    )
    reply = stub.HasBlocks(
        pb.kv_pb2.HasBlocksRequest(block_hashes=chain_hashes(tokens, G.block_tokens)),
        metadata=AUTH,
    )
    assert reply.prefix_blocks == n
    assert client.fetch(tokens=tokens) == join(parts[:n])


def test_push_sequence_reads_back_byte_identical(
    server: GrpcServer, client: TransferClient
) -> None:
    _, data = prompt(3 * G.block_tokens + 2)
    client.push(join(split(data)[:1]))  # one block held: it travels as a reference
    report = client.push(data, sequence="grpc-seq.1")
    assert (report.blocks, report.referenced, report.stored) == (4, 1, 2)
    with server.client() as http:
        assert http.get("/v1/sequences/grpc-seq.1").content == data


def test_generated_client_push_and_duplicates(stub: Any, pb: SimpleNamespace) -> None:
    a, b = fresh_block(), fresh_block()
    tail = split(prompt(2)[1])[0]
    reply = stub.PushKv(iter([chunk(pb, a), chunk(pb, b), chunk(pb, tail)]), metadata=AUTH)
    assert (reply.blocks, reply.referenced, reply.stored, reply.duplicate) == (3, 0, 2, 0)
    assert reply.payload_bytes == len(a) + len(b) + len(tail)
    h = decode(a)[0].hash
    ref = pb.kv_pb2.KvChunk(block_hash=h, n_tokens=G.block_tokens, kv_format=1)
    reply = stub.PushKv(iter([chunk(pb, b), ref]), metadata=AUTH)
    assert (reply.blocks, reply.referenced, reply.stored, reply.duplicate) == (2, 1, 0, 1)
    assert reply.payload_bytes == len(b)
    assert stub.PushKv(iter([]), metadata=AUTH) == pb.kv_pb2.PushKvResponse()


def test_fetch(stub: Any, pb: SimpleNamespace, client: TransferClient) -> None:
    tokens, data = prompt(3 * G.block_tokens + 1)
    parts = split(data)
    client.push(data)
    hashes = chain_hashes(tokens, G.block_tokens)
    chunks = list(stub.FetchKv(pb.kv_pb2.FetchKvRequest(tokens=tokens), metadata=AUTH))
    assert [c.payload for c in chunks] == parts[:3]
    assert all(c.crc32c == crc32c(c.payload) for c in chunks)
    assert [(c.block_hash, c.n_tokens, c.kv_format) for c in chunks] == [
        (h, G.block_tokens, 1) for h in hashes
    ]
    # the longest present prefix only; an absent first block is an empty stream
    request = pb.kv_pb2.FetchKvRequest(block_hashes=[hashes[0], hashes[1], 12345, hashes[2]])
    assert len(list(stub.FetchKv(request, metadata=AUTH))) == 2
    request = pb.kv_pb2.FetchKvRequest(block_hashes=[12345, *hashes])
    assert list(stub.FetchKv(request, metadata=AUTH)) == []
    v2 = client.fetch(hashes=hashes, kv_format=2)
    assert decode(v2).version == 2 and len(decode(v2)) == 3
    with pytest.raises(grpc.RpcError) as exc:
        list(
            stub.FetchKv(
                pb.kv_pb2.FetchKvRequest(block_hashes=hashes, tokens=tokens), metadata=AUTH
            )
        )
    assert_status(exc, grpc.StatusCode.INVALID_ARGUMENT)
    with pytest.raises(grpc.RpcError) as exc:
        list(stub.FetchKv(pb.kv_pb2.FetchKvRequest(tokens=tokens, kv_format=3), metadata=AUTH))
    assert_status(exc, grpc.StatusCode.FAILED_PRECONDITION)
    assert client.fetch(hashes=[777]) == b""


def test_fetch_blocks_streams_the_checked_blocks(client: TransferClient) -> None:
    tokens, data = prompt(3 * G.block_tokens + 1)
    parts = split(data)
    client.push(data)
    hashes = chain_hashes(tokens, G.block_tokens)
    envs = list(client.fetch_blocks(tokens=tokens))
    assert [bytes(e.data) for e in envs] == parts[:3]
    assert [(len(e), e[0].hash, e.version) for e in envs] == [(1, h, 1) for h in hashes]
    assert join([bytes(e.data) for e in envs]) == client.fetch(tokens=tokens)
    assert [bytes(e.data) for e in client.fetch_blocks(hashes=[*hashes[:2], 777])] == parts[:2]
    v2 = [e.version for e in client.fetch_blocks(hashes=hashes, kv_format=2)]
    assert v2 == [2, 2, 2]
    assert list(client.fetch_blocks(hashes=[777])) == []
    # stopping early cancels the call; the channel goes on serving
    stream = client.fetch_blocks(hashes=hashes)
    assert next(stream)[0].hash == hashes[0]
    stream.close()
    assert len(list(client.fetch_blocks(hashes=hashes))) == 3
    with pytest.raises(ValueError, match="exactly one"):
        next(client.fetch_blocks())
    with pytest.raises(UnsupportedVersionError):
        next(client.fetch_blocks(hashes=hashes, kv_format=3))


@pytest.mark.parametrize("reserve", [0, 1000, 1 << 30])
def test_fetch_envelope_grows_past_its_reservation(
    client: TransferClient, monkeypatch: pytest.MonkeyPatch, reserve: int
) -> None:
    import kvstore.transfer.limits

    tokens, data = prompt(4 * G.block_tokens + 1)
    client.push(data)
    monkeypatch.setattr(kvstore.transfer.limits, "FETCH_RESERVE_BYTES", reserve)
    expected = join(split(data)[:4])
    assert client.fetch(tokens=tokens) == expected
    assert client.fetch(hashes=chain_hashes(tokens, G.block_tokens)) == expected
    # fewer blocks held than asked for: the reservation is trimmed
    assert client.fetch(tokens=[*tokens[: 2 * G.block_tokens], 1, 2, 3] * 9) == join(
        split(data)[:2]
    )


# --- status codes, nothing stored on failure ------------------------------------------


def _bad_chunks(pb: SimpleNamespace) -> list[tuple[str, Any, grpc.StatusCode, str]]:
    block = fresh_block()
    bad_crc_byte = bytearray(block)
    bad_crc_byte[100] ^= 1
    other_geometry = encode(Geometry(4, 1, 2, 8), [Block(5, 4, np.zeros((1, 2, 2, 4, 8)))])
    two = join([fresh_block(), fresh_block()])
    zero = encode(G, [])
    over = b"\0" * (MAX_CHUNK_PAYLOAD + 1)
    h = decode(block)[0].hash
    dl, fp = grpc.StatusCode.DATA_LOSS, grpc.StatusCode.FAILED_PRECONDITION
    ia, re_ = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED
    return [
        ("crc field", chunk(pb, block, crc32c=crc32c(block) ^ 1), dl, "crc32c"),
        ("payload crc", chunk(pb, bytes(bad_crc_byte), crc32c=crc32c(bad_crc_byte)), dl, "CRC"),
        (
            "bad magic",
            pb.kv_pb2.KvChunk(
                payload=b"XLKV" + block[4:],
                crc32c=crc32c(b"XLKV" + block[4:]),
                block_hash=h,
                n_tokens=4,
                kv_format=1,
            ),
            dl,
            "magic",
        ),
        (
            "truncated",
            pb.kv_pb2.KvChunk(
                payload=block[:-1], crc32c=crc32c(block[:-1]), block_hash=h, n_tokens=4, kv_format=1
            ),
            dl,
            "length",
        ),
        ("hash field", chunk(pb, block, block_hash=h ^ 1), dl, "disagree"),
        ("n_tokens field", chunk(pb, block, n_tokens=3), dl, "disagree"),
        ("kv_format field", chunk(pb, block, kv_format=2), dl, "disagree"),
        ("geometry", chunk(pb, other_geometry), dl, "receiving pool"),
        ("empty crc", pb.kv_pb2.KvChunk(block_hash=h, n_tokens=4, kv_format=1, crc32c=5), dl, "0"),
        ("unknown format", chunk(pb, block, kv_format=3), fp, "kv_format 3"),
        (
            "unheld reference",
            pb.kv_pb2.KvChunk(block_hash=0xDEADBEEF12345678, n_tokens=4, kv_format=1),
            fp,
            "deadbeef12345678",
        ),
        (
            "two blocks",
            pb.kv_pb2.KvChunk(payload=two, crc32c=crc32c(two), kv_format=1),
            ia,
            "n_blocks=2",
        ),
        (
            "zero blocks",
            pb.kv_pb2.KvChunk(payload=zero, crc32c=crc32c(zero), kv_format=1),
            ia,
            "n_blocks=0",
        ),
        ("tail reference", pb.kv_pb2.KvChunk(block_hash=0, n_tokens=2, kv_format=1), ia, "partial"),
        ("bad sequence name", chunk(pb, block, sequence="no/slash"), ia, "sequence name"),
        (
            "over 4 MiB",
            pb.kv_pb2.KvChunk(
                payload=over, crc32c=crc32c(over), kv_format=1, block_hash=h, n_tokens=4
            ),
            re_,
            "v2",
        ),
    ]


def test_status_codes_and_nothing_stored(stub: Any, pb: SimpleNamespace) -> None:
    for name, bad, code, words in _bad_chunks(pb):
        good = fresh_block()
        with pytest.raises(grpc.RpcError) as exc:
            stub.PushKv(iter([chunk(pb, good), bad]), metadata=AUTH)
        details = assert_status(exc, code)
        assert words in details, (name, details)
        assert held(stub, pb, good) == [False], name


def test_a_reference_without_kv_format_is_invalid(stub: Any, pb: SimpleNamespace) -> None:
    """A reference chunk (empty payload) to a block the server holds names its format
    too: kv_format 0 (proto3's unset value) is INVALID_ARGUMENT, naming the rule."""
    stored = fresh_block()
    stub.PushKv(iter([chunk(pb, stored)]), metadata=AUTH)
    h = decode(stored)[0].hash
    good = fresh_block()
    for fmt, code in ((0, grpc.StatusCode.INVALID_ARGUMENT), (1, None)):
        ref = pb.kv_pb2.KvChunk(block_hash=h, n_tokens=G.block_tokens, kv_format=fmt)
        if code is None:
            assert stub.PushKv(iter([ref]), metadata=AUTH).referenced == 1
            continue
        with pytest.raises(grpc.RpcError) as exc:
            stub.PushKv(iter([chunk(pb, good), ref]), metadata=AUTH)
        assert "kv_format is one of 1, 2" in assert_status(exc, code)
        assert held(stub, pb, good) == [False]


def test_store_full_is_resource_exhausted(stub: Any, pb: SimpleNamespace) -> None:
    blocks = [fresh_block() for _ in range(600)]  # 600 x 556 bytes > the 256 KiB capacity
    with pytest.raises(grpc.RpcError) as exc:
        stub.PushKv(iter([chunk(pb, b) for b in blocks]), metadata=AUTH)
    assert_status(exc, grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert held(stub, pb, blocks[0], blocks[-1]) == [False, False]


@pytest.mark.parametrize(
    "metadata", [(), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)]
)
def test_auth(stub: Any, pb: SimpleNamespace, metadata: Any) -> None:
    block = fresh_block()
    calls = [
        lambda: stub.HasBlocks(pb.kv_pb2.HasBlocksRequest(block_hashes=[1]), metadata=metadata),
        lambda: stub.PushKv(iter([chunk(pb, block)]), metadata=metadata),
        lambda: list(stub.FetchKv(pb.kv_pb2.FetchKvRequest(block_hashes=[1]), metadata=metadata)),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as exc:
            call()
        assert_status(exc, grpc.StatusCode.UNAUTHENTICATED)
    assert held(stub, pb, block) == [False]


def test_cancelled_stream_stores_nothing(
    server: GrpcServer, stub: Any, pb: SimpleNamespace
) -> None:
    blocks = [fresh_block() for _ in range(3)]
    sent_two = threading.Event()
    release = threading.Event()

    def chunks() -> Iterator[Any]:
        yield chunk(pb, blocks[0])
        yield chunk(pb, blocks[1])
        sent_two.set()  # gRPC asks for the third: the first two are on their way
        release.wait(10)  # the stream stays open, never half-closed
        yield chunk(pb, blocks[2])

    future = stub.PushKv.future(chunks(), metadata=AUTH)
    assert sent_two.wait(10), "the first two chunks were never sent"
    future.cancel()
    release.set()
    with pytest.raises(grpc.FutureCancelledError):
        future.result()
    with server.client() as http:
        wait_until(lambda: _counted(http, PUSH, "CANCELLED"), "the server to count the cancel", 5)
    assert held(stub, pb, *blocks) == [False, False, False]


def _counted(http: httpx.Client, method: str, code: str) -> bool:
    """Whether /metrics counts at least one call of ``method`` that ended with ``code``."""
    for line in _calls(http, code).splitlines():
        labels, _, value = line.rpartition(" ")
        if f'method="{method}"' in labels and f'code="{code}"' in labels:
            return float(value) >= 1
    return False


def _calls(http: httpx.Client, code: str) -> str:
    lines = http.get("/metrics").text.splitlines()
    return "\n".join(x for x in lines if x.startswith("tlkv_grpc_requests_total") and code in x)


def test_metrics_count_calls_by_method_and_code(
    server: GrpcServer, stub: Any, pb: SimpleNamespace
) -> None:
    stub.HasBlocks(pb.kv_pb2.HasBlocksRequest(block_hashes=[1]), metadata=AUTH)
    with pytest.raises(grpc.RpcError):
        stub.PushKv(iter([chunk(pb, fresh_block(), kv_format=2)]), metadata=AUTH)
    with server.client() as http:
        assert _counted(http, HAS, "OK")
        assert _counted(http, PUSH, "DATA_LOSS")


def test_client_resends_when_a_referenced_block_was_evicted(
    server: GrpcServer, client: TransferClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, data = prompt(2 * G.block_tokens)
    hashes = [decode(p)[0].hash for p in split(data)]
    client.push(data)
    with server.client() as http:
        assert http.delete(f"/v1/blocks/{hashes[0]:016x}").status_code == 204
    # HasBlocks answered before the eviction: the first push references a missing block
    monkeypatch.setattr(client, "has_blocks", lambda hs: HasResult([True] * len(hs), len(hs)))
    report = client.push(data)
    assert report.referenced == 0 and report.stored == 1 and report.duplicate == 1


# --- the CLI --------------------------------------------------------------------------


def test_cli_put_get_has_over_grpc(
    server: GrpcServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.setenv("TLKV_TOKEN", TOKEN)
    tokens, data = prompt(2 * G.block_tokens + 1)
    path = tmp_path / "p.tlkv"
    path.write_bytes(data)
    url = f"grpc://{server.target}"
    assert cli_main(["put", url, str(path)]) == 0
    assert '"stored": 2' in capsys.readouterr().out
    args = ["has", url, "--block-tokens", "4", "--tokens", *map(str, tokens)]
    assert cli_main(args) == 0
    assert "prefix 2/2" in capsys.readouterr().out
    h = chain_hashes(tokens, G.block_tokens)[1]
    out = tmp_path / "b.tlkv"
    assert cli_main(["get", url, f"{h:016x}", "-o", str(out)]) == 0
    assert out.read_bytes() == split(data)[1]
