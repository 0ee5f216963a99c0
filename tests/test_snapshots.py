"""kvstore.store.snapshots.Snapshots: held and lingering read transactions on a real LMDB
environment end exactly when the memory exported from them is released."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from kvstore.store.snapshots import Snapshots


def _env(path: Path) -> Any:
    env = lmdb.open(str(path), map_size=1 << 20, max_readers=8)
    with env.begin(write=True) as txn:
        txn.put(b"a", b"A" * 100)
        txn.put(b"b", b"B" * 50)
    return env


def _readers(env: Any) -> int:
    """Read transactions open in ``env``: reader slots with a snapshot's txnid (LMDB's
    table prints "-" for a slot whose transaction has ended)."""
    rows = env.readers().splitlines()[1:]
    return sum(1 for row in rows if row.split()[-1] != "-")


def test_a_held_read_ends_when_its_last_view_is_released(tmp_path: Path) -> None:
    env, snaps = _env(tmp_path / "e"), Snapshots()
    txn = env.begin(buffers=True)
    values = [txn.get(b"a"), txn.get(b"b")]
    views = snaps.hold(txn, values)
    del values
    assert views is not None and [bytes(v) for v in views] == [b"A" * 100, b"B" * 50]
    assert all(v.readonly for v in views)
    count, age = snaps.held()
    assert count == 1 and 0 <= age < 5 and _readers(env) == 1
    first = views.pop(0)
    del first
    assert snaps.held()[0] == 1  # one view still out
    kept = np.frombuffer(views[0], np.uint8)  # made from a view: keeps it alive
    views.clear()
    assert snaps.held()[0] == 1
    del kept
    gc.collect()
    assert snaps.held() == (0, 0.0) and not snaps.any_held
    assert _readers(env) == 0
    env.close()


def test_while_refusing_nothing_is_held(tmp_path: Path) -> None:
    env, snaps = _env(tmp_path / "e"), Snapshots()
    with snaps.refusing():
        txn = env.begin(buffers=True)
        assert snaps.hold(txn, [txn.get(b"a")]) is None  # the caller copies and ends it
        txn.abort()
    assert snaps.held() == (0, 0.0)
    txn = env.begin(buffers=True)
    assert snaps.hold(txn, []) is None  # nothing to hold: nothing would ever end it
    assert snaps.held() == (0, 0.0)
    views = snaps.hold(txn, [txn.get(b"a")])
    assert views is not None and snaps.held()[0] == 1
    del views
    assert snaps.held() == (0, 0.0)
    env.close()


def test_drain_waits_for_a_release_in_another_thread(tmp_path: Path) -> None:
    env, snaps = _env(tmp_path / "e"), Snapshots()
    txn = env.begin(buffers=True)
    views = snaps.hold(txn, [txn.get(b"a")])
    assert views is not None
    box = [views]
    del views

    def release() -> None:
        time.sleep(0.2)
        box.clear()

    t = threading.Thread(target=release)
    started = time.monotonic()
    t.start()
    snaps.drain(time.monotonic() + 10)
    waited = time.monotonic() - started
    t.join()
    assert not snaps.any_held and 0.15 < waited < 5
    txn = env.begin(buffers=True)
    views = snaps.hold(txn, [txn.get(b"b")])
    started = time.monotonic()
    snaps.drain(time.monotonic() + 0.1)  # a deadline passes with the body still held
    assert 0.05 < time.monotonic() - started < 5 and snaps.any_held
    assert snaps.pinned() == 1
    del views
    assert snaps.pinned() == 0
    env.close()


def test_a_lingering_read_ends_at_the_first_reap_after_its_arrays_die(tmp_path: Path) -> None:
    env, snaps = _env(tmp_path / "e"), Snapshots()
    txn = env.begin(buffers=True)
    array = np.frombuffer(txn.get(b"a"), np.uint8)
    snaps.linger(txn, [weakref.ref(array)])
    assert snaps.any_lingering and snaps.lingering() == 1
    assert snaps.reap() == 1 and snaps.pinned() == 1  # still referenced
    assert _readers(env) == 1
    del array
    assert snaps.reap() == 0 and snaps.lingering() == 0 and snaps.pinned() == 0
    assert _readers(env) == 0
    env.close()
