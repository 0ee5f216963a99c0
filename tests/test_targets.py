"""kvstore.engines.targets: the engine target contract (``kvstore.testing.TargetTests``)
run against every target tlkv ships -- a store directory (``open_target``), an open
``Store`` (``as_target``), a real ``tlkv serve`` over HTTP and over tl.kv.v1 -- and the
rules of the base class (a block under another hash ends the prefix, ``as_target``)."""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from http_server import ServerProcess, free_port

from kvstore import Geometry, Store, decode, encode
from kvstore.client import Client
from kvstore.engines import Target, as_target, open_target
from kvstore.engines.server_targets import GrpcTarget, HttpTarget
from kvstore.engines.targets import StoreTarget
from kvstore.errors import InvalidRequestError
from kvstore.testing import ArraySlots, TargetTests
from kvstore.testing._blocks import random_blocks
from kvstore.transfer import TransferClient

_names = itertools.count()


def _fresh() -> str:
    """A namespace no other test of the module uses."""
    return f"contract/{next(_names)}"


def _flip_payload(data_file: Path, target: Target, block_hash: int) -> None:
    """Flip a bit of the held block's payload in ``data_file`` (LMDB's file) in place,
    every copy of it (copy-on-write leaves stale ones in free pages)."""
    with target.views([block_hash]) as views:
        pattern = views[0].kv.tobytes()[8:40]
    fd = os.open(data_file, os.O_RDWR)
    try:
        data = data_file.read_bytes()
        at = data.find(pattern)
        assert at >= 0
        while at >= 0:
            os.pwrite(fd, bytes([data[at + 3] ^ 0x10]), at + 3)
            at = data.find(pattern, at + 1)
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("targets") / "tlkv-data"


class TestStoreDirectory(TargetTests):
    """``open_target(directory, model=...)``: the process's shared store."""

    @pytest.fixture
    def target(self, shared_dir: Path) -> Iterator[Target]:
        target = open_target(shared_dir, model=_fresh())
        assert isinstance(target, StoreTarget)
        yield target
        target.close()

    @pytest.fixture
    def corrupt(self, shared_dir: Path) -> Callable[[Target, int], None]:
        return lambda target, h: _flip_payload(shared_dir / "data.mdb", target, h)


class TestOpenStore(TargetTests):
    """``as_target(store)``: an open ``Store`` of the caller's."""

    @pytest.fixture
    def target(self, tmp_path: Path) -> Iterator[Target]:
        with Store(tmp_path / "s") as store:
            yield as_target(store)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    grpc_port = free_port()
    data = tmp_path_factory.mktemp("served") / "data"
    with ServerProcess(data, "--grpc-port", str(grpc_port)) as server:
        server.grpc_port = grpc_port  # type: ignore[attr-defined]
        yield server


def _served_corrupt(server: ServerProcess) -> Callable[[Target, int], None]:
    return lambda target, h: _flip_payload(server.data / "data.mdb", target, h)


class TestHttp(TargetTests):
    """``open_target("http://...", model=...)``: a ``tlkv serve``."""

    @pytest.fixture
    def target(self, server: ServerProcess) -> Iterator[Target]:
        target = open_target(server.url, model=_fresh())
        assert isinstance(target, HttpTarget)
        yield target
        target.close()

    @pytest.fixture
    def corrupt(self, server: ServerProcess) -> Callable[[Target, int], None]:
        return _served_corrupt(server)


class TestGrpc(TargetTests):
    """``open_target("grpc://...", model=...)``: the same server over tl.kv.v1."""

    @pytest.fixture
    def target(self, server: ServerProcess) -> Iterator[Target]:
        target = open_target(f"grpc://127.0.0.1:{server.grpc_port}", model=_fresh())  # type: ignore[attr-defined]
        assert isinstance(target, GrpcTarget) and not target.knows_geometry
        yield target
        target.close()

    @pytest.fixture
    def corrupt(self, server: ServerProcess) -> Callable[[Target, int], None]:
        return _served_corrupt(server)


G = Geometry(block_tokens=4, n_layers=2, n_kv_heads=2, head_dim=8)


class _Liar(Target):
    """Holds blocks but answers each hash with the block of ``swap[hash]`` when given:
    what a confused server or another namespace's block would look like."""

    def __init__(self, envelope: bytes, swap: dict[int, int]) -> None:
        self.env = decode(envelope)
        self.by_hash = {bv.hash: i for i, bv in enumerate(self.env)}
        self.swap = swap

    def geometry(self) -> Geometry | None:
        return self.env.geometry

    def has(self, hashes: Any) -> list[bool]:
        return [h in self.by_hash for h in hashes]

    def put(self, envelope: Any, tokens: Any = None) -> int:
        return 0

    @contextlib.contextmanager
    def held_views(self, hashes: Any) -> Iterator[list[Any]]:
        out = []
        for h in hashes:
            if h not in self.by_hash:
                break
            out.append(self.env[self.by_hash[self.swap.get(h, h)]])
        yield out


def test_a_block_under_another_hash_ends_the_prefix() -> None:
    tokens, hashes, blocks = random_blocks(G, 4)
    liar = _Liar(encode(G, blocks), {hashes[2]: hashes[3]})
    with liar.views(hashes) as views:
        assert [bv.hash for bv in views] == hashes[:2]
    slots = ArraySlots(G, 4)
    assert liar.load(hashes, slots, range(4))[0] == 2
    assert slots.written == [0, 1]
    with liar.views_for_tokens(tokens) as views:
        assert len(views) == 2
    assert liar.longest_prefix(hashes) == 4  # has() is per hash: the lie shows on load


def test_as_target_wraps_the_clients_and_passes_a_target_through(tmp_path: Path) -> None:
    with Store(tmp_path / "s") as store:
        target = as_target(store)
        assert isinstance(target, StoreTarget) and as_target(target) is target
    with Client("http://127.0.0.1:9") as client:
        http = as_target(client)
        assert isinstance(http, HttpTarget)
        http.close()  # the caller's client stays open
        assert not client._http.is_closed
    with TransferClient("127.0.0.1:9") as transfer:
        assert isinstance(as_target(transfer), GrpcTarget)
    with pytest.raises(TypeError, match="Store, Client, TransferClient or a Target"):
        as_target(str(tmp_path))


def test_a_target_that_cannot_tell_its_geometry_needs_one_to_ask_by_tokens() -> None:
    class Blind(_Liar):
        knows_geometry = False

    _, _, blocks = random_blocks(G, 2)
    blind = Blind(encode(G, blocks), {})
    with (
        pytest.raises(InvalidRequestError, match="pass config= and block_tokens="),
        blind.views_for_tokens([1, 2, 3, 4, 5]),
    ):
        pass


def test_open_target_shares_one_store_per_directory(tmp_path: Path) -> None:
    a = open_target(tmp_path / "d", model="a")
    b = open_target(str(tmp_path / "d"), model="b")
    assert isinstance(a, StoreTarget) and isinstance(b, StoreTarget)
    _, hashes, blocks = random_blocks(G, 2)
    assert a.put(encode(G, blocks)) == 2
    assert b.has(hashes) == [False, False]  # another namespace of the same store
    assert isinstance(a.store, Store) and isinstance(b.store, Store)
    assert a.store.path == b.store.path and (a.store.model_id, b.store.model_id) == ("a", "b")
    with Store(tmp_path / "other") as other:  # the caller's own store is not shared
        assert as_target(other).has(hashes) == [False, False]
    assert np.array_equal(a.has(hashes), [True, True])


def test_a_store_target_without_sync_is_one_setting_per_directory(tmp_path: Path) -> None:
    def store_of(target: Target) -> Store:
        assert isinstance(target, StoreTarget) and isinstance(target.store, Store)
        return target.store

    fast = open_target(tmp_path / "d", model="a", sync=False)
    assert store_of(fast).sync is False
    _, hashes, blocks = random_blocks(G, 2)
    assert fast.put(encode(G, blocks)) == 2
    assert store_of(open_target(tmp_path / "d", model="b", sync=False)).sync is False
    with pytest.raises(ValueError, match=r"open in this process with sync=False.*sync=True"):
        open_target(tmp_path / "d", model="c")  # a durable target cannot share it
    assert store_of(open_target(tmp_path / "e")).sync is True
    assert fast.has(hashes) == [True, True]


def test_the_server_targets_are_still_importable_from_targets() -> None:
    import kvstore.engines.targets as targets

    assert targets.HttpTarget is HttpTarget and targets.GrpcTarget is GrpcTarget
    with pytest.raises(AttributeError, match="no attribute 'SocketTarget'"):
        _ = targets.SocketTarget


def test_store_options_of_an_engine_config() -> None:
    """The store-directory keys the vLLM connector and the SGLang backend share: defaults,
    the values taken, and every other value refused naming its key."""
    from kvstore.engines.targets import StoreOptions, store_options

    assert store_options({}) == StoreOptions(sync=True, preallocate=0)
    assert store_options({"sync": 0, "preallocate": 1 << 30}) == (False, 1 << 30)
    assert store_options({"sync": True, "target": "x"}) == (True, 0)
    for value in (2, -1, "0", None, 0.5):
        with pytest.raises(ValueError, match="tlkv 'sync' must be 1 or 0"):
            store_options({"sync": value})
    for value in (-1, "1GiB", 1.5, True, None):
        with pytest.raises(ValueError, match="tlkv 'preallocate' must be an int of bytes >= 0"):
            store_options({"preallocate": value})
