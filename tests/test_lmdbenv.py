"""kvstore.store.lmdbenv.LmdbEnv: map growth, adopting another handle's size, errors typed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvstore.errors import StoreError
from kvstore.store.lmdbenv import MAP_ALIGN, LmdbEnv


def open_env(path: Path, map_size: int = 1 << 20) -> tuple[LmdbEnv, Any]:
    env = LmdbEnv(str(path), map_size=map_size, sync=False, grow_floor=1 << 20)
    return env, env.open(lambda txn, dbs: None)


def test_writes_past_the_map_grow_it(tmp_path: Path) -> None:
    env, dbs = open_env(tmp_path / "e")
    before = env.env.info()["map_size"]
    value = b"v" * (64 << 10)

    def fill(txn: Any) -> None:
        for i in range(64):  # 4 MiB into a 1 MiB map
            txn.put(i.to_bytes(8, "big"), value, db=dbs.blocks)

    env.write(fill)
    after = env.env.info()["map_size"]
    assert after > before and after % MAP_ALIGN == 0
    txn = env.begin_read(True)
    try:
        assert bytes(txn.get((63).to_bytes(8, "big"), None, dbs.blocks)) == value
    finally:
        env.end_read(txn)
    env.close(sync=False)


def test_map_room_and_growth_ahead_of_a_large_write(tmp_path: Path) -> None:
    env, dbs = open_env(tmp_path / "e")
    room = env.map_room()
    assert 0 < room <= env.env.info()["map_size"]
    need = 8 << 20  # more than the whole map: grown before the transaction starts
    env.write(lambda txn: txn.put(b"big", b"z" * need, db=dbs.blocks), need)
    assert env.env.info()["map_size"] >= need
    env.close(sync=False)


def test_a_failing_body_writes_nothing(tmp_path: Path) -> None:
    env, dbs = open_env(tmp_path / "e")

    def body(txn: Any) -> None:
        txn.put(b"k", b"v", db=dbs.blocks)
        raise RuntimeError("abort")

    with pytest.raises(RuntimeError):
        env.write(body)
    txn = env.begin_read(True)
    try:
        assert txn.get(b"k", None, dbs.blocks) is None
    finally:
        env.end_read(txn)
    env.close(sync=False)


def test_a_file_in_the_way_is_a_store_error(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("not a directory")
    with pytest.raises(StoreError):
        open_env(tmp_path / "f")
