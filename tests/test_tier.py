"""The object-store tier behind a Store, against moto's S3 API on loopback and file://."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import SMALL, make_envelope
from s3_server import CREDENTIALS, S3Process, S3Server, free_port, set_credentials
from waiting import wait_until

from kvstore import Geometry, Store, split
from kvstore.errors import ShapeError, StoreFullError, TierError
from kvstore.tier import ObjectClient, Tier, block_key, parse_url
from kvstore.tier.layout import is_object_url
from kvstore.tier.uploader import LOCK_FILE

OTHER = Geometry(block_tokens=4, n_layers=2, n_kv_heads=2, head_dim=16)


def _hashes(envelope: bytes) -> list[int]:
    from kvstore import decode

    return [int(h) for h in decode(envelope).hashes if h]


@pytest.fixture
def bucket_url(s3_server: S3Server) -> str:
    return f"s3://{s3_server.new_bucket()}/fleet/a"


def _flock_held(path: Path) -> bool:
    """Whether another open file holds an exclusive ``flock`` on ``path``."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing releases a lock this probe took
    return False


def _tier(store: Store) -> dict[str, Any]:
    """The store's ``tier_info()`` (it has a tier)."""
    info = store.tier_info()
    assert info is not None
    return info


def _store(path: Path, url: str, server: S3Server | None, **kw: Any) -> Store:
    return Store(path, tier=url, tier_endpoint=None if server is None else server.endpoint, **kw)


def test_layout_and_urls() -> None:
    assert block_key("default", 0x0123456789ABCDEF) == "default/blocks/0123456789abcdef.tlkv"
    assert parse_url("s3://b/p/q/") == ("s3", "b", "p/q")
    assert parse_url("file:///srv/tier") == ("file", "", "/srv/tier")
    assert is_object_url("s3://b/x") and not is_object_url("/tmp/x.tlkv")
    for bad in ("http://x/y", "s3:///nobucket", "file://host/x", "s3://b/p?x=1"):
        with pytest.raises(ValueError):
            parse_url(bad)
    with pytest.raises(ValueError):
        Tier("file:///tmp/x", namespace="../up")


def test_a_bad_tier_url_leaves_the_store_closed(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="s3://bucket/prefix"):
        Store(tmp_path / "s", tier="gs://elsewhere/x")
    with Store(tmp_path / "s") as s:  # not left open by the failed attempt
        assert s.tier is None and s.tier_info() is None


def test_two_nodes_share_a_bucket(tmp_path: Path, s3_server: S3Server, bucket_url: str) -> None:
    envelope = make_envelope(SMALL, 4 * 12, seed=1)
    hashes = _hashes(envelope)
    with _store(tmp_path / "a", bucket_url, s3_server) as a:
        assert a.put(envelope).stored == len(hashes)
        assert _tier(a)["pending_uploads"] > 0 or _tier(a)["uploads"] > 0
        assert a.wait_uploaded(20)
        originals = a.get_many(hashes)
        assert _tier(a)["uploads"] == len(hashes)
    # The objects are the verbatim single-block envelopes, under the documented keys.
    url = parse_url(bucket_url)
    s3 = s3_server.client()
    for h, data in zip(hashes, originals):
        key = f"{url.path}/default/blocks/{h:016x}.tlkv"
        assert s3.get_object(Bucket=url.bucket, Key=key)["Body"].read() == data  # type: ignore[attr-defined]
    with _store(tmp_path / "b", bucket_url, s3_server) as b:
        assert b.stats()["blocks"] == 0
        assert b.get(hashes[0]) == originals[0]
        assert b.wait_uploaded(20)
        assert b.get_many(hashes) == originals
        assert b.wait_uploaded(20)  # the local copies are committed in the background
        info = _tier(b)
        assert info["read_through_hits"] == len(hashes)
        assert info["pending_uploads"] == 0  # read-through blocks are not uploaded again
        assert b.stats()["blocks"] == len(hashes)
        assert b.get_many(hashes) == originals  # local now: no second read
        assert _tier(b)["read_through_hits"] == len(hashes)
        with b.reader() as r:
            assert bytes(r.envelope(hashes[3]) or b"") == originals[3]
        assert b.get(12345) is None


def test_prefix_read_through_and_tier_queries(
    tmp_path: Path, s3_server: S3Server, bucket_url: str
) -> None:
    envelope = make_envelope(SMALL, 4 * 20, seed=2)
    hashes = _hashes(envelope)
    with _store(tmp_path / "a", bucket_url, s3_server) as a:
        a.put(envelope)
        assert a.wait_uploaded(20)
    with _store(tmp_path / "b", bucket_url, s3_server) as b:
        b.put(split(envelope)[3])  # one block local in the middle
        chain = [*hashes, 777]
        assert b.longest_prefix(chain) == 0
        assert b.longest_prefix(chain, tier=True) == len(hashes)
        assert b.has(chain) == [i == 3 for i in range(len(chain))]
        assert b.has(chain, tier=True) == [True] * len(hashes) + [False]
        assert b.stats()["blocks"] == 1  # queries read nothing through
        assert b.read_through(chain) == len(hashes)
        assert _tier(b)["read_through_hits"] == len(hashes) - 1
        assert b.longest_prefix(chain) == len(hashes)


def test_corrupt_and_foreign_objects_are_refused(
    tmp_path: Path, s3_server: S3Server, bucket_url: str
) -> None:
    client = ObjectClient(bucket_url, endpoint=s3_server.endpoint)
    good = split(make_envelope(SMALL, 4 * 3, seed=3))
    h_bad, h_moved, h_foreign = (_hashes(e)[0] for e in good)
    flipped = bytearray(good[0])
    flipped[40] ^= 0x01
    client.put_new(block_key("default", h_bad), bytes(flipped))
    client.put_new(block_key("default", h_moved), good[2])  # another block's bytes
    foreign = [e for e in split(make_envelope(OTHER, 4 * 2, seed=4)) if _hashes(e)]
    h_other = _hashes(foreign[0])[0]
    client.put_new(block_key("default", h_other), foreign[0])
    with _store(tmp_path / "b", bucket_url, s3_server, geometry=SMALL) as b:
        assert b.get_many([h_bad, h_moved, h_other]) == [None, None, None]
        assert _tier(b)["refused"] == 3
        assert _tier(b)["read_through_hits"] == 0
        assert b.stats()["blocks"] == 0
        assert b.read_through([h_bad]) == 0
    # a store that runs with a tier never overwrites an object: the first writer wins
    with _store(tmp_path / "c", bucket_url, s3_server) as c:
        c.put(good[0])
        assert c.wait_uploaded(20)
    assert client.get(block_key("default", h_bad)) == bytes(flipped)
    assert h_foreign


def test_restart_resumes_pending_uploads(tmp_path: Path, s3_server: S3Server) -> None:
    name = f"late-{time.time_ns()}"
    url = f"s3://{name}/p"
    envelope = make_envelope(SMALL, 4 * 10, seed=5)
    hashes = _hashes(envelope)
    with _store(tmp_path / "a", url, s3_server) as a:  # the bucket does not exist yet
        a.put(envelope)
        assert not a.wait_uploaded(1.0)
        info = _tier(a)
        assert info["pending_uploads"] == len(hashes)
        assert info["errors"] > 0
    with Store(tmp_path / "a") as plain:  # without a tier the set is kept as it is
        assert plain.get(hashes[0]) is not None
    s3_server.client().create_bucket(Bucket=name)  # type: ignore[attr-defined]
    with _store(tmp_path / "a", url, s3_server) as a:
        assert _tier(a)["pending_uploads"] == len(hashes)
        assert a.wait_uploaded(20)
        assert _tier(a)["uploads"] == len(hashes)
    client = ObjectClient(url, endpoint=s3_server.endpoint)
    assert all(client.exists_many([block_key("default", h) for h in hashes]))


def test_eviction_never_drops_pending_blocks(tmp_path: Path, s3_server: S3Server) -> None:
    name = f"later-{time.time_ns()}"
    url = f"s3://{name}"
    envs = split(make_envelope(SMALL, 4 * 16, seed=6))
    size = len(envs[0])
    with _store(tmp_path / "a", url, s3_server, capacity_bytes=8 * size) as a:
        for e in envs[:8]:
            a.put(e)
        with pytest.raises(StoreFullError, match="pending upload"):
            a.put(envs[8])  # every block is pending: none may go
        assert a.stats()["evictions"] == 0
        s3_server.client().create_bucket(Bucket=name)  # type: ignore[attr-defined]
        assert a.wait_uploaded(30)
        a.put(envs[8])  # uploaded blocks are evictable again
        assert a.stats()["evictions"] == 1


@pytest.mark.slow  # a moto process, killed and started again
def test_tier_down_mid_run(tmp_path: Path) -> None:
    set_credentials()
    server = S3Process()
    server.start()
    try:
        bucket = server.new_bucket()
        url = f"s3://{bucket}/x"
        first, second = (make_envelope(SMALL, 4 * 8, seed=s) for s in (7, 8))
        with _store(tmp_path / "a", url, server) as a:
            a.put(first)
            assert a.wait_uploaded(20)
            local = _hashes(first)
            server.stop()
            t0 = time.perf_counter()
            assert a.put(second).stored == len(_hashes(second))  # local commit, upload waits
            assert a.get(9999) is None  # a miss the tier cannot answer is a miss
            assert a.longest_prefix([9999], tier=True) == 0
            t_first = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in range(50):
                assert all(x is not None for x in a.get_many(local))
                assert a.get(9998) is None  # backed off: no request at all
            t_local = time.perf_counter() - t0
            info = _tier(a)
            assert info["state"] == "unreachable" and info["errors"] > 0
            assert info["pending_uploads"] == len(_hashes(second))
            assert t_local < 1.0, t_local
            assert t_first < 15, t_first
            server.start()  # back, empty: the bucket is made again
            server.client().create_bucket(Bucket=bucket)  # type: ignore[attr-defined]
            assert a.wait_uploaded(60)
            assert _tier(a)["state"] == "ok"
        client = ObjectClient(url, endpoint=server.endpoint)
        keys = [block_key("default", h) for h in _hashes(second)]
        assert client.exists_many(keys) == [True] * len(keys)
    finally:
        server.stop()


def test_file_tier(tmp_path: Path) -> None:
    url = (tmp_path / "shared").as_uri()
    envelope = make_envelope(SMALL, 4 * 6, seed=9)
    hashes = _hashes(envelope)
    with Store(tmp_path / "a", tier=url) as a:
        a.put(envelope)
        assert a.wait_uploaded(20)
        originals = a.get_many(hashes)
    for h, data in zip(hashes, originals):
        assert (tmp_path / "shared" / block_key("default", h)).read_bytes() == data
    with Store(tmp_path / "b", tier=url) as b:
        assert b.get_many(hashes) == originals
        assert b.wait_uploaded(20)
        assert _tier(b)["read_through_hits"] == len(hashes)


def test_object_client_errors(tmp_path: Path, s3_server: S3Server) -> None:
    client = ObjectClient(f"s3://nosuch-{time.time_ns()}", endpoint=s3_server.endpoint)
    with pytest.raises(TierError):
        client.put_new("x", b"data")  # no such bucket
    nobody = ObjectClient("s3://b", endpoint=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(TierError):
        nobody.get("x")
    assert isinstance(nobody.get_many(["x"])[0], TierError)
    local = ObjectClient((tmp_path / "o").as_uri())
    assert local.get("absent") is None
    assert local.put_new("k", b"one") and not local.put_new("k", b"two")
    assert local.get("k") == b"one"
    assert np.frombuffer(local.get_range("k", 1, 2), np.uint8).tobytes() == b"ne"


def test_read_through_blocks_are_evictable(
    tmp_path: Path, s3_server: S3Server, bucket_url: str
) -> None:
    envs = split(make_envelope(SMALL, 4 * 8, seed=13))
    hashes = [_hashes(e)[0] for e in envs]
    with _store(tmp_path / "a", bucket_url, s3_server) as a:
        for e in envs:
            a.put(e)
        assert a.wait_uploaded(20)
    with _store(tmp_path / "b", bucket_url, s3_server, capacity_bytes=4 * len(envs[0])) as b:
        for h, e in zip(hashes, envs):
            assert b.get(h) == e
            assert b.wait_uploaded(20)
        stats = b.stats()
        assert stats["blocks"] == 4 and stats["evictions"] == 4
        assert _tier(b)["pending_uploads"] == 0


@pytest.mark.slow  # a second process
def test_one_uploader_per_store_directory(
    tmp_path: Path, s3_server: S3Server, bucket_url: str
) -> None:
    envelope = make_envelope(SMALL, 4 * 12, seed=14)
    n = len(_hashes(envelope))
    (tmp_path / "e.tlkv").write_bytes(envelope)
    child = (
        "import sys; from kvstore import Store\n"
        "with Store(sys.argv[1], tier=sys.argv[2], tier_endpoint=sys.argv[3]) as s:\n"
        "    s.put(open(sys.argv[4], 'rb').read())\n"
        "    assert s.wait_uploaded(30)\n"
        "    print(s.tier_info()['uploads'])\n"
    )
    with _store(tmp_path / "a", bucket_url, s3_server) as first:
        lock = tmp_path / "a" / LOCK_FILE  # its uploader holds it from its first round
        wait_until(lambda: _flock_held(lock), "the first store's uploader to take its lock")
        args = [str(tmp_path / "a"), bucket_url, s3_server.endpoint, str(tmp_path / "e.tlkv")]
        out = subprocess.run(
            [sys.executable, "-c", child, *args], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        assert int(out.stdout) == 0  # the second process found the lock taken
        assert first.wait_uploaded(20)
        assert _tier(first)["uploads"] == n


def test_models_have_their_own_namespaces_in_the_tier(tmp_path: Path) -> None:
    """Two models with the same hashes and other KV: each model's blocks go to its own
    namespace (the model id percent-encoded into one segment) and read through into that
    model only."""
    from conftest import make_blocks

    from kvstore import Block, decode, encode
    from kvstore.tier import namespace_of

    url = (tmp_path / "shared").as_uri()
    model_id = "meta-llama/Llama-3.1-8B@5206a32/bf16"
    assert namespace_of(model_id) == "meta-llama%2FLlama-3.1-8B%405206a32%2Fbf16"
    assert namespace_of("default") == "default"
    blocks = make_blocks(SMALL, 4 * 3, seed=21)
    base = encode(SMALL, blocks)
    tuned = encode(SMALL, [Block(b.hash, b.n_tokens, b.kv + 1) for b in blocks])
    hashes = _hashes(base)
    with Store(tmp_path / "a", tier=url) as a:
        a.model(model_id).put(tuned)
        a.put(base)
        assert a.wait_uploaded(20) and a.model(model_id).wait_uploaded(20)
        assert _tier(a.model(model_id))["namespace"] == namespace_of(model_id)
    shared = tmp_path / "shared"
    for i, h in enumerate(hashes):
        assert (shared / block_key("default", h)).read_bytes() == decode(base).single(i)
        tuned_key = block_key(namespace_of(model_id), h)
        assert (shared / tuned_key).read_bytes() == decode(tuned).single(i)
    with Store(tmp_path / "b", tier=url) as b:
        m = b.model(model_id)
        assert m.get_many(hashes) == [decode(tuned).single(i) for i in range(3)]
        assert b.get_many(hashes) == [decode(base).single(i) for i in range(3)]
        assert b.model("nobody").get(hashes[0]) is None  # no namespace of its own: a miss


def test_a_namespace_geometry_is_written_beside_its_blocks_and_learned(
    tmp_path: Path, s3_server: S3Server, bucket_url: str
) -> None:
    import json

    envelope = make_envelope(SMALL, 4 * 12, seed=7)
    hashes = _hashes(envelope)
    with _store(tmp_path / "a", bucket_url, s3_server) as a:
        a.model("org/m@1").put(envelope)
        assert a.model("org/m@1").wait_uploaded(30)
    raw = ObjectClient(bucket_url, endpoint=s3_server.endpoint).get("org%2Fm%401/geometry.json")
    assert raw is not None and json.loads(raw) == SMALL.as_dict()
    with _store(tmp_path / "b", bucket_url, s3_server) as b:  # an empty node, no geometry
        assert b.geometry is None  # the default namespace has none in the tier either
        m = b.model("org/m@1")
        assert m.geometry == SMALL  # learned from the tier
        assert m.read_through(hashes) == len(hashes)
        with pytest.raises(ShapeError, match="expected"):
            m.put(make_envelope(OTHER, 8, seed=1))  # the namespace's geometry is the tier's
    with Store(tmp_path / "b") as b:  # adopted locally by the read-through
        assert b.model("org/m@1").geometry == SMALL


def test_a_request_with_no_answer_marks_the_tier_down_for_every_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An endpoint that accepts connections and never answers: once a request has had no
    answer for REQUEST_STALL_SECONDS the tier is unreachable, and another Tier sharing the
    store directory (another worker, which sent nothing) says so too."""
    import socket
    import threading

    import kvstore.tier.tier as tier_module

    # 2 s: the "unknown" check right after the accept holds on a machine running other
    # suites beside this one; the wait for "unreachable" below allows 5 s.
    monkeypatch.setattr(tier_module, "REQUEST_STALL_SECONDS", 2.0)
    monkeypatch.setattr(tier_module, "_WATCH_EVERY", 0.1)
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)
    endpoint = f"http://127.0.0.1:{hung.getsockname()[1]}"
    asking = Tier("s3://hung/p", endpoint=endpoint)
    other = Tier("s3://hung/p", endpoint=endpoint)
    asking.share_state(str(tmp_path))
    other.share_state(str(tmp_path))
    accepted: list[socket.socket] = []
    try:
        assert asking.state == other.state == "unknown"
        threading.Thread(target=asking.present, args=([1],), daemon=True).start()
        hung.settimeout(10)
        accepted.append(hung.accept()[0])  # the request reached the endpoint: never answered
        assert asking.state == "unknown"  # outstanding, not for long yet
        deadline = time.monotonic() + 5
        while other.state != "unreachable":
            assert time.monotonic() < deadline, (asking.state, other.state)
            time.sleep(0.05)
        assert asking.state == "unreachable"
        assert "no answer" in asking.info()["last_error"]
        assert "no answer" in other.info()["last_error"]
    finally:
        asking.stop_sharing()
        other.stop_sharing()
        for conn in accepted:
            conn.close()
        hung.close()


def test_the_io_loop_is_closed_at_exit_not_left_to_its_finalizer() -> None:
    """The object store's asyncio loop, stopped at interpreter exit, is closed there too:
    a loop left to its finalizer during interpreter exit may find its self-pipe gone and
    print "Exception ignored ... Invalid file descriptor: -1" after a CLI's last line."""
    from store_helpers import elsewhere

    out = elsewhere(
        """
        from kvstore.tier.objects import _Loop, _run

        async def one():
            return 1

        assert _run(one()) == 1
        loop = _Loop.get()
        _Loop.shutdown()
        print(loop.is_closed())
        """
    )
    assert out.split() == ["True"]
