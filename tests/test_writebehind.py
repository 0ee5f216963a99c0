"""Write-behind during durable commits: the helper runs exactly while a large commit does.

The helper only asks the kernel to start writing dirty pages (``sync_file_range``); it
never decides durability, so these tests check when it runs and that it stays out of the
way: not for small or non-durable commits, not after ``close``, not in the way of a put.
"""

from __future__ import annotations

import gc
import os
import sys
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
from waiting import wait_until

from kvstore import Block, Geometry, Store, encode
from kvstore.store.writebehind import INTERVAL, MIN_BYTES, WriteBehind

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="sync_file_range is Linux-only"
)
syscalls = pytest.importorskip("kvstore.fileio._syscalls")


def _dirty_file(path: Path, nbytes: int) -> None:
    with open(path, "wb") as f:
        f.write(os.urandom(nbytes))


def test_start_writeback_accepts_a_file_and_refuses_a_closed_descriptor(tmp_path: Path) -> None:
    path = tmp_path / "f"
    _dirty_file(path, 1 << 20)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert syscalls.start_writeback(fd) is True
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        syscalls.start_writeback(fd)  # closed: EBADF, not a crash


def test_helper_runs_only_inside_a_large_commit(tmp_path: Path) -> None:
    path = tmp_path / "data"
    _dirty_file(path, 1 << 20)
    wb = WriteBehind(str(path))
    try:
        with wb.during(MIN_BYTES):
            wait_until(lambda: wb.requests >= 3, "three writeback requests during the commit")
        during = wb.requests
        # Observation windows: a helper still running would make ~20 requests in each.
        time.sleep(20 * INTERVAL)
        after = wb.requests
        assert after <= during + 1  # at most the request in flight when the block ended
        time.sleep(20 * INTERVAL)
        assert wb.requests == after
    finally:
        wb.close()


def test_small_and_disabled_commits_do_not_start_the_helper(tmp_path: Path) -> None:
    path = tmp_path / "data"
    _dirty_file(path, 1 << 20)
    small = WriteBehind(str(path))
    disabled = WriteBehind(str(path), enabled=False)
    try:
        with small.during(MIN_BYTES - 1), disabled.during(1 << 30):
            assert small.thread is None and disabled.thread is None  # no helper to request
        assert small.requests == 0 and disabled.requests == 0
        assert small.thread is None and disabled.thread is None
    finally:
        small.close()
        disabled.close()


def test_close_stops_the_helper_and_later_commits_skip_it(tmp_path: Path) -> None:
    path = tmp_path / "data"
    _dirty_file(path, 1 << 20)
    wb = WriteBehind(str(path))
    with wb.during(MIN_BYTES):
        wait_until(lambda: wb.requests >= 1, "a writeback request during the commit")
    thread = wb.thread
    assert thread is not None and thread.is_alive()
    wb.close()
    assert not thread.is_alive()
    count = wb.requests
    with wb.during(MIN_BYTES):
        assert wb.thread is thread and not thread.is_alive()  # no helper started again
    assert wb.requests == count
    wb.close()  # twice is fine


def test_an_unclosed_write_behind_is_collected_and_its_thread_ends(tmp_path: Path) -> None:
    path = tmp_path / "data"
    _dirty_file(path, 1 << 20)
    wb = WriteBehind(str(path))
    with wb.during(MIN_BYTES):
        pass
    thread = wb.thread
    assert thread is not None and thread.is_alive()
    ref = weakref.ref(wb)
    del wb
    gc.collect()
    assert ref() is None
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_a_missing_file_disables_it_quietly(tmp_path: Path) -> None:
    wb = WriteBehind(str(tmp_path / "absent"))
    with wb.during(MIN_BYTES):
        pass
    assert wb.requests == 0 and wb.thread is None
    wb.close()


@pytest.mark.parametrize("sync", [True, False])
def test_store_writes_behind_only_durable_large_puts(tmp_path: Path, sync: bool) -> None:
    g = Geometry(16, 8, 4, 128)  # 512 KiB per block
    kv = np.random.default_rng(0).standard_normal(g.kv_shape).astype(np.float16)
    small = encode(g, [Block(1, 16, kv)])
    large = encode(g, [Block(h, 16, kv) for h in range(2, 2 + MIN_BYTES // kv.nbytes + 1)])
    assert len(small) < MIN_BYTES <= len(large)
    with Store(tmp_path / "s", sync=sync) as store:
        wb = store._h.env.lmdb._write_behind
        store.put(small)
        assert wb.thread is None
        store.put(large)
        assert (wb.thread is not None) is sync
        assert store.get(2) == encode(g, [Block(2, 16, kv)])
    assert wb.thread is None or not wb.thread.is_alive()  # stopped with the store
