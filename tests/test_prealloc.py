"""Preallocation (``Store(preallocate_bytes=)``): room past the data file's last page, on
disk and in the page cache, that never changes what the store holds.

Page-cache residency is read with ``mincore`` over a private map of the file's range: a
range allocated but never read shows as not resident, so the checks tell the two apart.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from store_helpers import elsewhere
from waiting import wait_until

from kvstore import Block, Geometry, Store, encode
from kvstore.store.lmdbenv import check_data_file
from kvstore.store.prealloc import Preallocation

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="mincore and fallocate as Linux has them"
)

G = Geometry(16, 4, 4, 64)  # 32 KiB of KV per block
ROOM = 4 << 20


def _blocks(first: int, n: int) -> list[Block]:
    """``n`` full blocks with hashes ``first``.. and random KV."""
    rng = np.random.default_rng(first)
    return [
        Block(h, 16, rng.standard_normal(G.kv_shape).astype(np.float16))
        for h in range(first, first + n)
    ]


def _used(store: Store) -> int:
    """Bytes up to LMDB's last page in use."""
    env = store._h.env.lmdb.env
    return (int(env.info()["last_pgno"]) + 1) * int(env.stat()["psize"])


def _data(store: Store) -> str:
    return os.path.join(store.path, "data.mdb")


def _resident(path: str, start: int, end: int) -> float:
    """The fraction of the file's pages in ``[start, end)`` that sit in the page cache."""
    page = mmap.PAGESIZE
    start -= start % page
    n = -(-(end - start) // page)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, n * page, access=mmap.ACCESS_COPY, offset=start)
    finally:
        os.close(fd)
    try:
        anchor = ctypes.c_char.from_buffer(mm)
        vec = ctypes.create_string_buffer(n)
        if libc.mincore(ctypes.addressof(anchor), n * page, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        del anchor
        return sum(b & 1 for b in vec.raw) / n
    finally:
        mm.close()


def test_residency_check_tells_an_unread_range_from_a_read_one(tmp_path: Path) -> None:
    path = tmp_path / "f"
    with open(path, "wb"):
        pass
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, 2 << 20)
        assert _resident(str(path), 0, 2 << 20) == 0.0  # allocated, never read
        os.pread(fd, 1 << 20, 1 << 20)  # the second MiB (readahead runs forward only)
        assert _resident(str(path), 1 << 20, 2 << 20) == 1.0
        assert _resident(str(path), 0, 1 << 20) == 0.0
    finally:
        os.close(fd)


def test_open_makes_the_room_and_reads_it_before_returning(tmp_path: Path) -> None:
    with Store(tmp_path / "s", geometry=G, preallocate_bytes=ROOM) as s:
        size = os.path.getsize(_data(s))
        assert size >= _used(s) + ROOM
        assert s._h.env.lmdb.prealloc.extensions == 1
        assert _resident(_data(s), _used(s), size) == 1.0
    with Store(tmp_path / "plain", geometry=G) as s:  # without it the file ends at its pages
        assert os.path.getsize(_data(s)) <= _used(s)
        assert s._h.env.lmdb.prealloc.extensions == 0


def test_puts_keep_half_the_room_and_every_block_reads_back(tmp_path: Path) -> None:
    puts = [_blocks(1000 * i, 40) for i in range(1, 9)]  # 8 puts of 1.25 MiB: the room moves on
    with Store(tmp_path / "s", geometry=G, preallocate_bytes=ROOM) as s:
        for blocks in puts:
            s.put(encode(G, blocks))
            assert os.path.getsize(_data(s)) - _used(s) >= ROOM // 2
        pre = s._h.env.lmdb.prealloc
        assert pre.extensions >= 2 and pre.failures == 0
        size = os.path.getsize(_data(s))
        wait_until(lambda: _resident(_data(s), _used(s), size) == 1.0, "the room read", 30)
    check_data_file(str(tmp_path / "s"))
    with Store(tmp_path / "s") as s:  # reopened without preallocation: the same bytes
        assert s.stats()["blocks"] == 8 * 40
        for blocks in puts:
            for b in blocks:
                assert s.get(b.hash) == encode(G, [b])


def test_two_processes_preallocating_one_store_keep_every_block(tmp_path: Path) -> None:
    path = str(tmp_path / "s")
    Store(path, geometry=G).close()
    code = """
        import sys
        sys.path.insert(0, "tests")
        from test_prealloc import G, ROOM, _blocks
        from kvstore import Store, encode
        with Store(sys.argv[1], preallocate_bytes=ROOM) as s:
            for i in range(1, 9):
                s.put(encode(G, _blocks(100_000 + 1000 * i, 40)))
        """
    import subprocess

    other = subprocess.Popen(
        [sys.executable, "-c", __import__("textwrap").dedent(code), path],
        cwd=Path(__file__).resolve().parent.parent,
    )
    mine = [_blocks(1000 * i, 40) for i in range(1, 9)]
    with Store(path, preallocate_bytes=ROOM) as s:
        for blocks in mine:
            s.put(encode(G, blocks))
    assert other.wait(timeout=120) == 0
    theirs = [_blocks(100_000 + 1000 * i, 40) for i in range(1, 9)]
    with Store(path) as s:
        assert s.stats()["blocks"] == 16 * 40
        for blocks in mine + theirs:
            for b in blocks:
                assert s.get(b.hash) == encode(G, [b])


def test_threads_putting_at_once_start_one_helper_and_keep_every_block(tmp_path: Path) -> None:
    import threading

    batches = [[_blocks(10_000 * t + 1000 * i, 20) for i in range(1, 7)] for t in range(1, 5)]
    with Store(tmp_path / "s", geometry=G, preallocate_bytes=ROOM) as s:

        def put_all(mine: list[list[Block]]) -> None:
            for blocks in mine:
                s.put(encode(G, blocks))

        threads = [threading.Thread(target=put_all, args=(b,)) for b in batches]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        helpers = [t for t in threading.enumerate() if t.name == "tlkv-store-prealloc"]
        assert len(helpers) == 1
        assert s.stats()["blocks"] == 4 * 6 * 20
        for mine in batches:
            for blocks in mine:
                for b in blocks:
                    assert s.get(b.hash) == encode(G, [b])


@pytest.mark.parametrize(
    ("value", "error"), [(-1, ValueError), (True, TypeError), (1.5, TypeError), ("1GiB", TypeError)]
)
def test_a_bad_preallocation_is_refused_before_anything_is_made(
    tmp_path: Path, value: object, error: type[Exception]
) -> None:
    with pytest.raises(error, match="preallocate_bytes"):
        Store(tmp_path / "s", preallocate_bytes=value)  # type: ignore[arg-type]
    assert not (tmp_path / "s").exists()


def test_a_full_disk_skips_the_room_and_puts_go_on_until_the_store_is_full(
    tmp_path: Path,
) -> None:
    out = elsewhere(
        """
        import json, resource, signal, sys
        sys.path.insert(0, "tests")
        from test_prealloc import G, _blocks
        from kvstore import Store, StoreFullError, encode
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file-size limit: the disk is "full"
        resource.setrlimit(resource.RLIMIT_FSIZE, (6 << 20, 6 << 20))
        with Store(sys.argv[1], geometry=G, preallocate_bytes=64 << 20) as s:
            pre = s._h.env.lmdb.prealloc
            stored, first = [], 1000
            try:
                while True:
                    blocks = _blocks(first, 8)
                    s.put(encode(G, blocks))
                    stored += [b.hash for b in blocks]
                    first += 1000
            except StoreFullError:
                failed = [b.hash for b in blocks]
            print(json.dumps({"stored": stored, "failed": failed, "failures": pre.failures,
                              "extensions": pre.extensions, "has": all(s.has(stored)),
                              "has_failed": any(s.has(failed))}))
        """,
        str(tmp_path / "s"),
    )
    import json

    got = json.loads(out)
    assert got["failures"] >= 1 and got["extensions"] == 0  # 64 MiB never fit under 6 MiB
    assert len(got["stored"]) >= 8 * 8 and got["has"] and not got["has_failed"]


def test_close_stops_the_helper_and_closes_the_file(tmp_path: Path) -> None:
    s = Store(tmp_path / "s", geometry=G, preallocate_bytes=ROOM)
    for i in range(1, 5):
        s.put(encode(G, _blocks(1000 * i, 40)))
    pre = s._h.env.lmdb.prealloc
    thread = pre._thread
    assert thread is not None and thread.is_alive()
    fds = len(os.listdir("/proc/self/fd"))
    s.close()
    assert not thread.is_alive()
    assert len(os.listdir("/proc/self/fd")) < fds


def test_off_it_makes_no_thread_and_opens_nothing(tmp_path: Path) -> None:
    data = tmp_path / "f"
    data.write_bytes(b"")
    pre = Preallocation(str(data), 0, 4096)
    assert pre.extend(10, 1 << 20) is None
    assert pre.extensions == 0 and pre._thread is None and pre._fd == -1
    assert data.stat().st_size == 0


def test_serve_preallocate_keeps_room_and_serves_every_block(tmp_path: Path) -> None:
    from http_server import ServerProcess

    from kvstore.client import Client

    puts = [_blocks(1000 * i, 40) for i in range(1, 5)]
    with (
        ServerProcess(tmp_path / "store", "--preallocate", "4MiB") as srv,
        Client(srv.url) as client,
    ):
        data = tmp_path / "store" / "data.mdb"
        assert os.path.getsize(data) >= ROOM  # the workers made the room at open
        for blocks in puts:
            client.put(encode(G, blocks))
        with Store(tmp_path / "store") as s:
            assert os.path.getsize(data) - _used(s) >= ROOM // 2
        for blocks in puts:
            for b in blocks:
                assert client.get(b.hash) == encode(G, [b])


def test_settings_read_the_preallocation_and_refuse_a_bad_one() -> None:
    from api.settings import ENV_PREALLOCATE, Settings

    assert Settings.from_env({}).preallocate_bytes == 0
    assert Settings.from_env({ENV_PREALLOCATE: "1GiB"}).preallocate_bytes == 1 << 30
    with pytest.raises(ValueError, match="size"):
        Settings.from_env({ENV_PREALLOCATE: "lots"})


def test_a_data_file_it_cannot_open_leaves_it_off(tmp_path: Path) -> None:
    pre = Preallocation(str(tmp_path / "missing" / "data.mdb"), ROOM, 4096)
    assert pre.nbytes == 0 and pre._fd == -1
    assert pre.extend(10, 1 << 20) is None
    pre.close()


def _unwritten(path: str, start: int, end: int) -> int:
    """Bytes of ``[start, end)`` in extents the file system holds as allocated but never
    written (``FIEMAP_EXTENT_UNWRITTEN``); 0 where it keeps no such extents."""
    import fcntl
    import struct

    fs_ioc_fiemap, unwritten, n = 0xC020660B, 0x800, 256
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = bytearray(struct.pack("=QQIIII", start, end - start, 1, 0, n, 0) + bytes(56 * n))
        try:
            fcntl.ioctl(fd, fs_ioc_fiemap, buf)
        except OSError:
            pytest.skip("the file system has no FIEMAP")
    finally:
        os.close(fd)
    total = 0
    for i in range(struct.unpack_from("=I", buf, 20)[0]):
        logical, _, length = struct.unpack_from("=QQQ", buf, 32 + 56 * i)
        if struct.unpack_from("=I", buf, 32 + 56 * i + 40)[0] & unwritten:
            total += min(end, logical + length) - max(start, logical)
    return total


def test_a_durable_stores_room_is_written_one_without_sync_only_allocated(
    tmp_path: Path,
) -> None:
    """Durable: the room holds written zeros, so a commit into it flushes no new extents
    (BENCHMARKS.md, "Durable writes by kind of space"); without sync it is left allocated
    and only read. Puts move the room on; the helper writes each new range too."""
    if _unwritten_is_unknown(tmp_path):
        pytest.skip("the file system reports no unwritten extents")
    with Store(tmp_path / "d", geometry=G, preallocate_bytes=ROOM) as s:
        size = os.path.getsize(_data(s))
        assert _unwritten(_data(s), _used(s), size) == 0
        assert _resident(_data(s), _used(s), size) == 1.0
        pre = s._h.env.lmdb.prealloc
        for i in range(1, 9):
            s.put(encode(G, _blocks(1000 * i, 40)))
        assert pre.extensions >= 2
        wait_until(lambda: pre.filled == pre.extensions, "the helper wrote every range", 30)
        size = os.path.getsize(_data(s))
        assert _unwritten(_data(s), 0, size) == 0
    with Store(tmp_path / "f", geometry=G, preallocate_bytes=ROOM, sync=False) as s:
        size = os.path.getsize(_data(s))
        assert _unwritten(_data(s), _used(s), size) >= ROOM // 2
        assert _resident(_data(s), _used(s), size) == 1.0


def _unwritten_is_unknown(tmp_path: Path) -> bool:
    """Whether this file system shows a fresh ``fallocate``d range as unwritten."""
    probe = tmp_path / "probe"
    fd = os.open(probe, os.O_RDWR | os.O_CREAT)
    try:
        os.posix_fallocate(fd, 0, 1 << 20)
    finally:
        os.close(fd)
    try:
        return _unwritten(str(probe), 0, 1 << 20) == 0
    finally:
        probe.unlink()


def test_zeros_never_reach_a_committed_page_when_a_put_outgrows_the_room(
    tmp_path: Path,
) -> None:
    """Each put (1.25 MiB) is larger than the room (256 KiB): every extension's new range
    starts inside what that very commit writes. The helper writes zeros only above LMDB's
    last page in use when it holds the writer lock, so every block reads back, here and
    after reopening, and the data file checks out."""
    room = 256 << 10
    puts = [_blocks(1000 * i, 40) for i in range(1, 13)]
    with Store(tmp_path / "s", geometry=G, preallocate_bytes=room) as s:
        pre = s._h.env.lmdb.prealloc
        for blocks in puts:
            s.put(encode(G, blocks))
        assert pre.extensions == 1 + len(puts)  # open, then every put
        wait_until(lambda: pre.filled == pre.extensions, "the helper wrote every range", 30)
        for blocks in puts:
            for b in blocks:
                assert s.get(b.hash) == encode(G, [b])
    check_data_file(str(tmp_path / "s"))
    with Store(tmp_path / "s") as s:
        assert s.stats()["blocks"] == len(puts) * 40
        for blocks in puts:
            for b in blocks:
                assert s.get(b.hash) == encode(G, [b])
