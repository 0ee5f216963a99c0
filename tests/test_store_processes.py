"""The store across processes and time: persistence, map growth (also by another process),
multi-process use, fork, disk full and the background flush of read hits.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import SMALL, make_envelope
from store_helpers import (
    REPO,
    check_consistency,
    full_blocks,
    hashes_of,
)

import kvstore.store.lmdbenv as lmdbenv_module
import kvstore.store.state as state_module
from kvstore import (
    Block,
    Geometry,
    Store,
    StoreError,
    crc32c,
    decode,
    encode,
    split,
)
from kvstore.store.debug import pending_hits

# --- persistence, map growth, processes ---------------------------------------------------


def test_everything_survives_reopen_in_a_new_process(tmp_path: Path) -> None:
    envelope = make_envelope(SMALL, 13, seed=42)
    with Store(tmp_path / "s") as s:
        s.put(envelope)
        s.put_sequence("seq", envelope)
    script = textwrap.dedent(
        f"""
        import json
        from kvstore import Store, crc32c
        with Store({str(tmp_path / "s")!r}) as s:
            seq = s.get_sequence("seq")
            print(json.dumps({{"stats": s.stats(), "names": s.sequences(),
                               "seq": crc32c(seq), "has": s.has({hashes_of(envelope)!r})}}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    got = json.loads(out.stdout)
    assert got["names"] == ["seq"] and got["seq"] == crc32c(envelope)
    assert got["has"] == [True, True, True, False]
    assert got["stats"]["pinned_blocks"] == 3 and got["stats"]["blocks"] == 3


def test_the_map_grows_without_the_user_seeing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = Geometry(16, 4, 2, 64)  # 32 KiB blocks
    with Store(tmp_path / "s", map_bytes=1 << 20) as s:
        start = s.map_bytes
        stop = threading.Event()
        errors: list[BaseException] = []

        def read_loop() -> None:  # a concurrent reader thread: resizes must wait for it
            try:
                while not stop.is_set():
                    with s.reader() as r:
                        for _h, value in r.iter_blocks():
                            assert len(value) == g.envelope_bytes(1)
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        thread = threading.Thread(target=read_loop)
        thread.start()
        try:
            for i in range(8):
                s.put(encode(g, full_blocks(g, 16, seed=100 + i)))
        finally:
            stop.set()
            thread.join()
        assert not errors
        assert s.map_bytes > start
        assert s.stats()["blocks"] == 128


def test_map_full_inside_a_transaction_grows_and_retries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        lmdbenv_module.LmdbEnv, "map_room", lambda self: 1 << 62
    )  # no growing ahead
    g = Geometry(16, 4, 2, 64)
    envelope = encode(g, full_blocks(g, 64, seed=44))  # 2 MiB into a 1 MiB map
    with Store(tmp_path / "s", map_bytes=1 << 20) as s:
        assert s.put(envelope).stored == 64
        assert s.get_many(hashes_of(envelope)) == split(envelope)
        assert s.map_bytes > 1 << 20


def test_a_map_grown_by_another_process_is_adopted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = Geometry(16, 4, 2, 64)
    path = tmp_path / "s"
    with Store(path, geometry=g, map_bytes=1 << 20) as s:
        small = s.map_bytes
        script = textwrap.dedent(
            f"""
            import numpy as np
            from kvstore import Block, Geometry, Store, encode
            g = Geometry(16, 4, 2, 64)
            kv = np.ones(g.kv_shape, np.float32)
            with Store({str(path)!r}, map_bytes=1 << 20) as s:
                for i in range(4):
                    s.put(encode(g, [Block(1000 * i + j + 1, 16, kv) for j in range(32)]))
            """
        )
        subprocess.run(
            [sys.executable, "-c", script], check=True, env={**os.environ, "PYTHONPATH": str(REPO)}
        )
        assert s.has([1, 3032]) == [True, True]  # MapResizedError on begin: adopted
        assert s.map_bytes > small
        s.put(encode(g, full_blocks(g, 2, seed=45)))
        assert s.stats()["blocks"] == 130


def test_growing_while_this_thread_holds_a_reader_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = Geometry(16, 4, 2, 64)
    with Store(tmp_path / "s", map_bytes=1 << 20) as s:
        with s.reader(), pytest.raises(StoreError, match="reader"):
            s.put(encode(g, full_blocks(g, 64, seed=43)))
        assert s.stats()["blocks"] == 0
        s.put(encode(g, full_blocks(g, 64, seed=43)))  # fine once the reader is closed


def _mp_worker(path: str, me: int, rounds: int, queue: multiprocessing.Queue) -> None:
    """One of two processes writing and reading the same store at once."""
    g = Geometry(16, 2, 2, 64)
    try:
        with Store(path, map_bytes=1 << 20) as s:  # small: both processes grow it racing
            seen = 0
            for i in range(rounds):
                blocks = [
                    Block((me << 32) | (i * 4 + j + 1), 16, np.full(g.kv_shape, me + i, np.float32))
                    for j in range(4)
                ]
                s.put(encode(g, blocks))
                other = ((1 - me) << 32) | (i * 4 + 1)
                data = s.get(other)
                if data is not None:
                    assert decode(data)[0].hash == other
                    seen += 1
                if i % 5 == 0:
                    s.put_sequence(f"p{me}-{i}", encode(g, blocks[:2]))
                with s.reader() as r:
                    assert r.view((me << 32) | (i * 4 + 1)) is not None
            queue.put(("ok", me, seen))
    except BaseException as exc:  # reported to the parent
        queue.put(("error", me, repr(exc)))


def _filler(path: str, seconds: float, queue: multiprocessing.Queue) -> None:
    """Puts 32 KiB blocks into a store of a 1 MiB initial map for ``seconds``: its
    commits outgrow every map another process has just sized."""
    g = Geometry(16, 2, 4, 64)
    kv = np.ones(g.kv_shape, np.float16)
    n = 0
    try:
        with Store(path, map_bytes=1 << 20, sync=False) as s:
            queue.put("started")
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                n += 1
                s.put(encode(g, [Block(n, 16, kv)]))
        queue.put(n)
    except BaseException as exc:  # reported to the parent
        queue.put(repr(exc))


def test_a_store_opens_while_another_process_keeps_growing_it(tmp_path: Path) -> None:
    """LMDB sizes a new map to the pages in use; a commit elsewhere that outgrows it
    before py-lmdb's first transaction raises MapResizedError inside lmdb.open: Store()
    opens again, adopting the new size, instead of failing."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    path = str(tmp_path / "s")
    Store(path, map_bytes=1 << 20).close()
    filler = ctx.Process(target=_filler, args=(path, 3.0, queue))
    filler.start()
    assert queue.get(timeout=60) == "started"
    opened, errors = 0, []
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        try:
            Store(path, map_bytes=1 << 20).close()
            opened += 1
        except StoreError as exc:
            errors.append(str(exc))
    put = queue.get(timeout=60)
    filler.join(timeout=60)
    assert isinstance(put, int) and put > 100, put
    assert opened > 50 and errors == [], (opened, errors[:3], len(errors))


def test_two_processes_read_and_write_concurrently(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    path = str(tmp_path / "s")
    Store(path).close()
    rounds = 40
    procs = [ctx.Process(target=_mp_worker, args=(path, me, rounds, queue)) for me in (0, 1)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert all(r[0] == "ok" for r in results), results
    with Store(path) as s:
        assert s.stats()["blocks"] == 2 * 4 * rounds
        assert len(s.sequences()) == 2 * (rounds // 5)
        assert s.stats()["pinned_blocks"] == 2 * 2 * (rounds // 5)
        check_consistency(s)


def test_a_store_used_after_fork_refuses(tmp_path: Path) -> None:
    if not hasattr(os, "fork"):
        pytest.skip("no fork on this platform")
    with Store(tmp_path / "s") as s:
        s.put(make_envelope())
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: must refuse, not touch the parent's environment
            try:
                s.get(1)
                os.write(write_end, b"served")
            except StoreError:
                os.write(write_end, b"refused")
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert os.read(read_end, 16) == b"refused"
        assert s.stats()["blocks"] == 2  # the parent's store is untouched


def test_disk_full_is_store_full_and_stores_nothing(tmp_path: Path) -> None:
    if sys.platform == "win32":
        pytest.skip("RLIMIT_FSIZE is POSIX")
    script = textwrap.dedent(
        f"""
        import json, resource, signal
        import numpy as np
        from kvstore import Block, Geometry, Store, StoreFullError, encode
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a file-size limit: the disk is "full"
        resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20))
        g = Geometry(16, 4, 2, 64)
        kv = np.ones(g.kv_shape, np.float32)
        with Store({str(tmp_path / "s")!r}) as s:
            stored, h = [], 1
            try:
                while True:
                    hashes = list(range(h, h + 4))
                    s.put(encode(g, [Block(x, 16, kv) for x in hashes]))
                    stored += hashes
                    h += 4
            except StoreFullError as exc:
                failed = hashes
            print(json.dumps({{"stored": stored, "failed": failed,
                               "has_stored": all(s.has(stored)), "has_failed": any(s.has(failed)),
                               "blocks": s.stats()["blocks"], "get": s.get(1) is not None}}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["stored"] and got["has_stored"] and got["get"]
    assert not got["has_failed"]
    assert got["blocks"] == len(got["stored"])


def test_pending_hits_are_flushed_in_the_background(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(state_module, "_FLUSH_INTERVAL", 0.0)
    with Store(tmp_path / "s") as s:
        envelope = make_envelope(SMALL, 4)
        s.put(envelope)
        s.get(hashes_of(envelope)[0])
        deadline = time.monotonic() + 10
        while pending_hits(s) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not pending_hits(s)
