"""KV events of a running ``tlkv serve --kv-events-endpoint``: the frames on its PUB socket,
vLLM's replay protocol on its ROUTER socket, ``tlkv events``, token ids over HTTP and
tl.kv.v1 (refused when they do not hash to their block), ``POST /v1/lookup`` and
``Lookup``, numbers that survive ``kill -9``, several workers publishing one stream.

Payloads are read as raw msgpack maps here; their format is judged by vLLM's own classes
in ``tests/test_events_wire.py`` (the publisher sends the logged bytes verbatim).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import zmq
from event_node import Node, events_of, recv
from http_server import REPO, ServerProcess, assert_error, free_port
from prompts import prompt

from kvstore import Geometry, chain_hashes
from kvstore.client import Client
from kvstore.codec.tokens import chain_tokens, pack_records
from kvstore.events.subscriber import Message
from kvstore.events.wire import END_SEQ, SEQ
from kvstore.protocol import TOKEN_RECORDS_HEADER
from kvstore.transfer import TransferClient
from kvstore.transfer._tlkv_v1 import kv_pb2, kv_pb2_grpc


@pytest.fixture
def node(tmp_path: Path) -> Any:
    n = Node(tmp_path / "data")
    n.server.start()
    yield n
    n.server.stop()


def test_frames_topics_and_the_replay_protocol(node: Node) -> None:
    ids, hashes, env = prompt(22)
    sub = node.subscriber()
    try:
        with Client(node.server.url) as c, Client(node.server.url, model="llama/8b") as m:
            c.put(env, tokens=ids)
            m.put(env, tokens=ids)
            c.delete(hashes[4])
        got = recv(sub, 3)
    finally:
        sub.close()
    assert [(x.topic, x.seq) for x in got] == [
        ("kv@n1@default", 0),
        ("kv@n1@llama/8b", 1),
        ("kv@n1@default", 2),
    ]
    [stored] = events_of(got[0])
    assert stored["type"] == "BlockStored" and stored["block_hashes"] == hashes
    assert stored["token_ids"] == ids[:20] and stored["parent_block_hash"] is None
    assert events_of(got[2]) == [
        {"type": "BlockRemoved", "block_hashes": [hashes[4]], "medium": "STORAGE"}
    ]
    # vLLM's replay protocol, spoken by hand: [b"", start] -> every batch since, then END
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(node.replay)
    dealer.send_multipart([b"", SEQ.pack(1)])
    frames = []
    while True:
        assert dealer.poll(10_000)
        frames.append(dealer.recv_multipart())
        if frames[-1][2] == END_SEQ:
            break
    dealer.close(0)
    ctx.term()
    assert frames[-1] == [b"", b"", END_SEQ, b""]
    assert [(f[1], f[2]) for f in frames[:-1]] == [
        (b"kv@n1@llama/8b", (1).to_bytes(8, "big")),
        (b"kv@n1@default", (2).to_bytes(8, "big")),
    ]
    assert [f[3] for f in frames[:-1]] == [x.payload for x in got[1:]]


def test_tokens_over_http_are_checked_kept_and_read_back(node: Node) -> None:
    ids, hashes, env = prompt(20)
    bad = list(ids)
    bad[6] += 1  # block 1
    rows = chain_tokens(bad, hashes, 4)
    url = node.server.url
    headers = {"content-type": "application/vnd.tlkv", TOKEN_RECORDS_HEADER: "5"}
    r = httpx.put(f"{url}/v1/blocks", content=env + pack_records(rows), headers=headers)
    message = assert_error(r, 422, "token_mismatch")
    assert f"block 1 ({hashes[1]:016x})" in message
    with Client(url) as c:
        assert c.has_blocks(hashes).present == [False] * 5  # nothing stored
        r = httpx.put(f"{url}/v1/sequences/q", content=env + pack_records(rows), headers=headers)
        assert_error(r, 422, "token_mismatch")
        assert c.sequences() == []
        c.put_sequence("q", env, tokens=ids)
        envelope, (parent, got) = c.get_with_tokens(hashes[2])  # type: ignore[misc]
        assert bytes(envelope) == c.get(hashes[2])
        assert parent == hashes[1] and got.tolist() == ids[8:12]
        r = httpx.get(f"{url}/v1/blocks/{hashes[2]:016x}?tokens=1")
        assert r.headers[TOKEN_RECORDS_HEADER] == "1" and len(r.content) == len(envelope) + 24
        _ids2, hashes2, env2 = prompt(8, seed=4)
        c.put(env2)  # an old client's put: valid, no tokens, no event
        assert c.get_with_tokens(hashes2[0]) == (c.get(hashes2[0]), None)
        r = httpx.put(
            f"{url}/v1/blocks",
            content=env2,
            headers={"content-type": "application/vnd.tlkv", TOKEN_RECORDS_HEADER: "x"},
        )
        assert_error(r, 422, "invalid_request")


def test_tokens_over_grpc_are_checked_and_kept(tmp_path: Path) -> None:
    port = free_port()
    with ServerProcess(tmp_path / "g", "--grpc-port", str(port)) as srv:
        ids, hashes, env = prompt(16)
        bad = list(ids)
        bad[3] += 1
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = kv_pb2_grpc.KvTransferStub(channel)
            payload = _single(env)
            chunk = kv_pb2.KvChunk(
                block_hash=hashes[0],
                n_tokens=4,
                kv_format=1,
                payload=payload,
                crc32c=_crc(payload),
                parent_hash=0,
                token_ids=bad[:4],
            )
            with pytest.raises(grpc.RpcError) as exc:
                stub.PushKv(iter([chunk]))
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert dict(exc.value.trailing_metadata())["tlkv-error-kind"] == "token_mismatch"
        with TransferClient(f"127.0.0.1:{port}") as t, Client(srv.url) as c:
            assert t.has_blocks(hashes).present == [False] * 4
            assert t.push(env, tokens=ids).stored == 4
            assert c.get_with_tokens(hashes[3])[1][0] == hashes[2]  # type: ignore[index]
            got = t.lookup(tokens=[*ids, 1, 2])
            assert got == [
                {
                    "model": "default",
                    "block_tokens": 4,
                    "local_blocks": 4,
                    "local_tokens": 16,
                    "tier_blocks": 0,
                    "tier_tokens": 0,
                }
            ]


def _single(env: bytes) -> bytes:
    from kvstore import split

    return split(env)[0]


def _crc(data: bytes) -> int:
    from kvstore import crc32c

    return crc32c(data)


def test_tlkv_events_prints_json_lines_from_a_number(node: Node) -> None:
    with Client(node.server.url) as c:
        for seed in range(3):
            ids, _, env = prompt(8, seed=seed)
            c.put(env, tokens=ids)
    cmd = [sys.executable, "-m", "kvstore", "events", "--endpoint", node.endpoint]
    cmd += ["--replay-endpoint", node.replay, "--from", "1", "--count", "2", "--timeout", "10"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(x["seq"], x["topic"]) for x in lines] == [(1, "kv@n1@default"), (2, "kv@n1@default")]
    assert lines[0]["events"][0]["type"] == "BlockStored"
    assert lines[0]["events"][0]["token_ids"] == prompt(8, seed=1)[0]


def test_lookup_agrees_with_has_blocks_over_two_models(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    wide = Geometry(8, 2, 2, 8)
    with ServerProcess(tmp_path / "l", "--grpc-port", str(grpc_port := free_port())) as srv:
        a, b = Client(srv.url, model="a"), Client(srv.url, model="b")
        prompts = []
        for seed in range(12):
            ids, _, env = prompt(40, seed=seed)
            keep = int(rng.integers(0, 11))  # a random prefix of its 10 blocks
            if keep:
                a.put(_prefix(env, keep), tokens=ids[: 4 * keep])
            ids_b, _, env_b = prompt(0, seed=seed, geometry=wide, start=ids)
            keep_b = int(rng.integers(0, 6))
            if keep_b:
                b.put(_prefix(env_b, keep_b), tokens=ids_b[: 8 * keep_b])
            prompts.append(ids)
        with Client(srv.url) as root, TransferClient(f"127.0.0.1:{grpc_port}") as t:
            for i in range(1000):
                ids = list(prompts[int(rng.integers(0, 12))][: int(rng.integers(0, 41))])
                if ids and rng.random() < 0.3:
                    ids[int(rng.integers(0, len(ids)))] ^= 1  # a prompt that diverges
                got = {m["model"]: m for m in root.lookup(tokens=ids, models=["a", "b"])}
                for name, client, block in (("a", a, 4), ("b", b, 8)):
                    want = client.has_blocks(tokens=ids).prefix if len(ids) >= block else 0
                    assert got[name]["local_blocks"] == want, (i, name, ids)
                    assert got[name]["local_tokens"] == want * block
                    assert got[name]["block_tokens"] == block
                if i % 100 == 0:
                    assert t.lookup(tokens=ids, models=["a", "b"]) == list(got.values())
            hashes = chain_hashes(prompts[0], 4)
            by_hash = root.lookup(hashes=hashes, models=["a", "nope"])
            assert by_hash[0]["local_blocks"] == a.has_blocks(hashes).prefix
            assert by_hash[1] == {
                "model": "nope",
                "block_tokens": None,
                "local_blocks": 0,
                "local_tokens": 0,
                "tier_blocks": 0,
                "tier_tokens": 0,
            }
            assert {m["model"] for m in root.lookup(tokens=[1, 2, 3, 4])} == {"a", "b", "default"}
            r = httpx.post(f"{srv.url}/v1/lookup", json={"tokens": [1], "hashes": []})
            assert_error(r, 422, "invalid_request")
        a.close()
        b.close()


def _prefix(env: bytes, n: int) -> bytes:
    from kvstore import join, split

    return join(split(env)[:n])


@pytest.mark.slow
def test_numbers_survive_kill_9_and_replay_has_no_gap(tmp_path: Path) -> None:
    n = Node(tmp_path / "data")
    n.server.start()
    seen: list[int] = []
    sub = n.subscriber()
    try:
        with Client(n.server.url) as c:
            for seed in range(3):
                ids, _, env = prompt(8, seed=seed)
                c.put(env, tokens=ids)
            for seed in range(3, 5):
                ids, _, env = prompt(8, seed=seed)
                c.put(env, tokens=ids)
            seen += [m.seq for m in recv(sub, 5)]
            assert seen == [0, 1, 2, 3, 4]
        assert n.server.proc is not None
        os.kill(n.server.proc.pid, signal.SIGKILL)
        n.server.proc.wait()
        n.server.proc = None
        n.server.start()  # the same ports: the publisher of the killed server is gone
        # A subscriber reconnects (and subscribes again) inside its own calls, as a router
        # that keeps receiving does: a batch sent before that would be lost to it.
        assert sub.recv(0.5) is None
        with Client(n.server.url) as c:
            ids, _, env = prompt(8, seed=9)
            c.put(env, tokens=ids)
        live = recv(sub, 2, timeout=3)  # only the new batch: nothing is published twice
        assert [m.seq for m in live] == [5]  # above every number given before the kill
        replayed = sub.replay(1)
        assert [m.seq for m in replayed] == [1, 2, 3, 4, 5]
        assert [events_of(m)[0]["token_ids"] for m in replayed[2:4]] == [
            prompt(8, seed=3)[0],
            prompt(8, seed=4)[0],
        ]
    finally:
        sub.close()
        n.server.stop()


@pytest.mark.slow
def test_several_workers_publish_one_stream(tmp_path: Path) -> None:
    n = Node(tmp_path / "data", "--workers", "2")
    n.server.start()
    sub = n.subscriber()
    got: list[Message] = []

    def read() -> None:
        got.extend(recv(sub, 40, timeout=60))

    reader = threading.Thread(target=read)
    reader.start()
    try:

        def put(seeds: range) -> None:
            with Client(n.server.url) as c:
                for seed in seeds:
                    ids, _, env = prompt(8, seed=seed)
                    c.put(env, tokens=ids)

        threads = [threading.Thread(target=put, args=(range(k, 40, 4),)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        reader.join()
    finally:
        sub.close()
        n.server.stop()
    assert [m.seq for m in got] == list(range(40))
    announced = [h for m in got for e in events_of(m) for h in e["block_hashes"]]
    expected = {h for seed in range(40) for h in prompt(8, seed=seed)[1]}
    assert len(announced) == 80 and set(announced) == expected


def _publisher_pid(server_pid: int) -> int:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == server_pid and b"api.kvevents" in cmdline:
                return int(entry.name)
    raise AssertionError("no publisher process")


@pytest.mark.slow
def test_a_publisher_that_dies_is_started_again(node: Node) -> None:
    assert node.server.proc is not None
    first = _publisher_pid(node.server.proc.pid)
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while True:
        try:
            second = _publisher_pid(node.server.proc.pid)
            break
        except AssertionError:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    assert second != first
    sub = node.subscriber()
    try:
        with Client(node.server.url) as c:
            for seed in range(40):  # until the new publisher is bound and sends
                ids, hashes, env = prompt(8, seed=seed)
                c.put(env, tokens=ids)
                got = recv(sub, 1, timeout=0.5)
                if got:
                    break
        [m] = got
        assert m.seq == seed and events_of(m)[0]["block_hashes"] == hashes
        assert [x.seq for x in sub.replay(0)] == list(range(seed + 1))  # none lost
    finally:
        sub.close()
