"""tl.kv.v1 and HTTP on a v1-only server (``tlkv serve --formats 1``, ops.04) beside one that
takes both formats, and two workers taking concurrent pushes across a restart: real servers
in subprocesses, status codes checked with a client generated from the .proto."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_server import (
    G_ARG,
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
from http_server import assert_error

from kvstore import Block, Geometry, chain_hashes, decode, encode, join, split
from kvstore.codec.layout import HEADER_SIZE, RECORD_SIZE
from kvstore.transfer import TransferClient

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
def v1_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GrpcServer]:
    data = tmp_path_factory.mktemp("grpc_v1") / "store"
    with GrpcServer(data, "--geometry", G_ARG, "--formats", "1", "--workers", "2") as srv:
        yield srv


# --- ops.04: a v1-only decode side ------------------------------------------------------


def test_ops04_v1_only_server_refuses_v2(v1_server: GrpcServer, pb: SimpleNamespace) -> None:
    tokens, v2 = prompt(2 * G.block_tokens + 1, version=2)
    with grpc.insecure_channel(v1_server.target) as channel:
        stub = pb.kv_pb2_grpc.KvTransferStub(channel)
        good = fresh_block()
        for bad in (chunk(pb, split(v2)[0]), chunk(pb, split(v2)[0], kv_format=1)):
            with pytest.raises(grpc.RpcError) as exc:
                stub.PushKv(iter([chunk(pb, good), bad]))
            assert_status(exc, grpc.StatusCode.FAILED_PRECONDITION)
            assert held(stub, pb, good) == [False]
        with pytest.raises(grpc.RpcError) as exc:
            list(stub.FetchKv(pb.kv_pb2.FetchKvRequest(tokens=tokens, kv_format=2)))
        assert_status(exc, grpc.StatusCode.FAILED_PRECONDITION)
    with v1_server.client() as http:
        response = http.put(
            "/v1/blocks", content=v2, headers={"content-type": "application/vnd.tlkv"}
        )
        assert_error(response, 415, "version")
        response = http.put(
            "/v1/sequences/x", content=v2, headers={"content-type": "application/vnd.tlkv"}
        )
        assert_error(response, 415, "version")
        assert http.get("/v1/info").json()["formats"] == [1]


def test_ops04_v1_only_server_takes_v1_puts_by_every_rule(v1_server: GrpcServer) -> None:
    """On a v1-only server the version check decodes a put's envelope and the store takes
    that decoding: a good v1 sequence or block is stored byte for byte, and the rules the
    version check leaves to the store still refuse (the CRC, the store's geometry)."""
    _, v1 = prompt(2 * G.block_tokens + 1, version=1)
    damaged = bytearray(v1)
    damaged[HEADER_SIZE + RECORD_SIZE + 3] ^= 0x01  # a KV byte: only the CRC notices
    other = Geometry(block_tokens=4, n_layers=1, n_kv_heads=2, head_dim=8)
    foreign = encode(other, [Block(0, 2, np.zeros(other.kv_shape, np.float32))], 1)
    headers = {"content-type": "application/vnd.tlkv"}
    with v1_server.client() as http:
        assert http.put("/v1/sequences/v1-put", content=v1, headers=headers).status_code == 201
        assert http.get("/v1/sequences/v1-put").content == v1
        put = http.put("/v1/blocks", content=v1, headers=headers)
        assert put.status_code == 200, put.text
        for part, h in zip(split(v1), decode(v1).hashes.tolist(), strict=True):
            if h:  # the full blocks, each stored byte for byte
                assert http.get(f"/v1/blocks/{h:016x}").content == part
        for url in ("/v1/sequences/v1-bad", "/v1/blocks"):
            assert "CRC" in assert_error(
                http.put(url, content=bytes(damaged), headers=headers), 422, "format"
            )
            assert_error(http.put(url, content=foreign, headers=headers), 422, "shape")
        assert http.get("/v1/sequences/v1-bad").status_code == 404


def test_ops04_v1_only_server_never_sends_v2(v1_server: GrpcServer, pb: SimpleNamespace) -> None:
    """Reads asking for v2 are refused (HTTP 415 ``version``, gRPC FAILED_PRECONDITION);
    a block or sequence stored as v2 (by another writer of the same store) is sent as v1."""
    from kvstore.store.store import Store

    tokens, v2 = prompt(2 * G.block_tokens, version=2)
    with Store(v1_server.data) as other:  # another writer of the same store
        other.put(v2)
        other.put_sequence("v2-state", v2)
    hashes = [f"{h:016x}" for h in chain_hashes(tokens, G.block_tokens)]
    with v1_server.client() as http:
        assert_error(http.get(f"/v1/blocks/{hashes[0]}?format=2"), 415, "version")
        r = http.post("/v1/prefix?format=2", json={"hashes": hashes})
        assert_error(r, 415, "version")
        for url in (f"/v1/blocks/{hashes[0]}", f"/v1/blocks/{hashes[0]}?format=1"):
            r = http.get(url)
            assert r.status_code == 200 and decode(r.content).version == 1
            assert decode(r.content)[0].hash == int(hashes[0], 16)
        r = http.post("/v1/prefix", json={"hashes": hashes})
        assert r.status_code == 200 and r.headers["x-tlkv-prefix-blocks"] == "2"
        as_v1 = decode(r.content)
        assert as_v1.version == 1 and len(as_v1) == 2
        assert http.get("/v1/sequences/v2-state").content == r.content
    with grpc.insecure_channel(v1_server.target) as channel:
        stub = pb.kv_pb2_grpc.KvTransferStub(channel)
        for kv_format in (2, 7):
            request = pb.kv_pb2.FetchKvRequest(tokens=tokens, kv_format=kv_format)
            with pytest.raises(grpc.RpcError) as exc:
                list(stub.FetchKv(request))
            assert_status(exc, grpc.StatusCode.FAILED_PRECONDITION)
        for kv_format in (0, 1):
            chunks = list(
                stub.FetchKv(pb.kv_pb2.FetchKvRequest(tokens=tokens, kv_format=kv_format))
            )
            assert [c.kv_format for c in chunks] == [1, 1]
            assert join([c.payload for c in chunks]) == r.content


def test_ops04_both_ways(server: GrpcServer, v1_server: GrpcServer) -> None:
    """A v2 reader takes both formats; a v1-only one takes the v2 side's blocks as v1."""
    tokens, v2 = prompt(3 * G.block_tokens, version=2)
    _, v1 = prompt(2 * G.block_tokens, version=1)
    with (
        TransferClient(server.target, token=TOKEN) as both,
        TransferClient(v1_server.target) as v1_only,
    ):
        assert both.push(v2).stored == 3 and both.push(v1).stored == 2
        with pytest.raises(Exception) as exc:
            v1_only.push(v2)
        assert type(exc.value).__name__ == "UnsupportedVersionError"
        as_v1 = both.fetch(tokens=tokens, kv_format=1)
        assert decode(as_v1).version == 1
        assert v1_only.push(as_v1).stored == 3
        assert v1_only.fetch(tokens=tokens) == as_v1


# --- two workers: concurrent pushes, restart ---------------------------------------------


@pytest.mark.slow
def test_two_workers_concurrent_pushes_and_restart(v1_server: GrpcServer) -> None:
    """Last in the module: it restarts the (two-worker, v1-only) server."""
    shared, shared_kv = prompt(4 * G.block_tokens)  # the same prefix, the same KV
    prompts = []
    for i in range(6):
        tokens, data = prompt(0, tokens=shared + prompt(3 * G.block_tokens + i)[0])
        prompts.append((tokens, join(split(shared_kv) + split(data)[4:])))

    def push(i: int) -> Any:
        with TransferClient(v1_server.target) as c:
            return c.push(prompts[i][1], sequence=f"p{i}")

    with ThreadPoolExecutor(6) as pool:
        reports = list(pool.map(push, range(6)))
    distinct = {h for tokens, _ in prompts for h in chain_hashes(tokens, G.block_tokens)}
    # every distinct block stored exactly once, whoever won the race
    assert sum(r.stored for r in reports) == len(distinct)
    v1_server.restart()
    with TransferClient(v1_server.target) as c, v1_server.client() as http:
        for i, (tokens, data) in enumerate(prompts):
            n_full = len(tokens) // G.block_tokens
            assert c.fetch(tokens=tokens) == join(split(data)[:n_full])
            assert http.get(f"/v1/sequences/p{i}").content == data
