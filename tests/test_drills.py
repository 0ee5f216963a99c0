"""Drills as tests: a truly full filesystem under the server, a streamed /v1/prefix over
64 MiB while a writer evicts, SIGKILL during ``archive restore``, and ``tools/drill.py``
(SIGKILL a worker, then the server, under load) in a short run.

The full-filesystem drill mounts a small tmpfs (root only: CI runs as root); elsewhere it
is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from conftest import make_envelope
from http_server import REPO, ServerProcess, assert_error, free_port

from kvstore import Block, Geometry, decode, encode
from kvstore.store.store import Store

ENVELOPE = {"content-type": "application/vnd.tlkv"}


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` (skips the test where mounting is refused)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    path.mkdir(parents=True, exist_ok=True)
    ran = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if ran.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {ran.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


FULL_GEOMETRY = Geometry(16, 4, 2, 64)  # 16 KiB blocks


@pytest.mark.slow
def test_full_filesystem(tmp_path: Path) -> None:
    """Puts fail with 507 store_full, nothing of a refused put is stored, reads go on, and
    writes work again once space is freed."""
    with tmpfs(tmp_path / "mnt", "16m") as mnt:
        ballast = mnt / "ballast"
        ballast.write_bytes(b"\0" * (6 << 20))
        geometry = ",".join(map(str, FULL_GEOMETRY.as_tuple()))
        with ServerProcess(mnt / "store", "--geometry", geometry) as srv, srv.client() as http:
            stored: list[bytes] = []
            refused = None
            for seed in range(200):
                data = make_envelope(FULL_GEOMETRY, 16 * 8, seed=seed)
                r = http.put("/v1/blocks", content=data, headers=ENVELOPE)
                if r.status_code != 200:
                    assert "full" in assert_error(r, 507, "store_full")
                    refused = data
                    break
                stored.append(data)
            assert refused is not None and len(stored) > 10, len(stored)
            hashes = [f"{int(h):016x}" for h in decode(refused).hashes]
            r = http.post("/v1/has-blocks", json={"hashes": hashes})
            assert r.json()["present"] == [False] * len(hashes)  # nothing committed half
            for data in stored[:: max(1, len(stored) // 8)]:  # the server keeps serving reads
                h = f"{int(decode(data).hashes[0]):016x}"
                assert http.get(f"/v1/blocks/{h}").content == decode(data).single(0)
            assert http.get("/healthz").status_code == 200
            ballast.unlink()  # space freed: the same put now works
            r = http.put("/v1/blocks", content=refused, headers=ENVELOPE)
            assert r.status_code == 200, r.text
            assert len(r.json()["stored"]) == len(hashes)
            assert srv.alive()
        assert "Traceback" not in srv.log(), srv.log()[-3000:]
        with Store(mnt / "store") as s:  # a consistent store after all that
            assert s.stats()["blocks"] == 8 * (len(stored) + 1)


PREFIX_GEOMETRY = Geometry(16, 32, 8, 128)  # 2 MiB blocks: 40 blocks = 80 MiB


@pytest.mark.slow
def test_streamed_prefix_over_64_mib_under_an_evicting_writer(tmp_path: Path) -> None:
    """A /v1/prefix answer of 80 MiB streams (block by block) while another client keeps
    putting blocks into a store at capacity, evicting. The answer is either whole and
    valid, byte for byte the stored blocks, or cut short (a block was evicted mid-stream:
    the client sees a short body) -- never wrong bytes, never a 5xx after the header."""
    g = PREFIX_GEOMETRY
    rng = np.random.default_rng(1)
    kv = rng.standard_normal(g.kv_shape).astype(np.float16)
    n = 40
    prompt = encode(g, [Block(1000 + i, g.block_tokens, kv) for i in range(n)])
    blocks = {1000 + i: decode(prompt).single(i) for i in range(n)}
    capacity = str(int(g.envelope_bytes(1) * 48))  # the prompt and 2 writer puts
    geometry = ",".join(map(str, g.as_tuple()))
    args = ("--geometry", geometry, "--capacity", capacity, "--max-body", "96MiB")
    with ServerProcess(tmp_path / "store", *args) as srv, srv.client() as http:
        assert http.put("/v1/blocks", content=prompt, headers=ENVELOPE).status_code == 200
        stop = threading.Event()
        puts: list[int] = []

        def writer() -> None:
            i = 0
            with srv.client() as w:
                while not stop.is_set():
                    env = encode(
                        g, [Block(10**6 + i * 4 + j, g.block_tokens, kv) for j in range(4)]
                    )
                    puts.append(w.put("/v1/blocks", content=env, headers=ENVELOPE).status_code)
                    i += 1

        thread = threading.Thread(target=writer)
        thread.start()
        outcomes = []
        try:
            for _ in range(3):
                hashes = [f"{h:016x}" for h in blocks]
                try:
                    r = http.post("/v1/prefix", json={"hashes": hashes})
                except httpx.HTTPError as exc:  # cut short mid-stream
                    outcomes.append(f"cut: {type(exc).__name__}")
                    continue
                assert r.status_code == 200, r.text[:300]
                k = int(r.headers["x-tlkv-prefix-blocks"])
                env = decode(r.content)  # whole and valid: header, records, CRC
                assert len(env) == k
                for i in range(k):
                    assert env.single(i) == blocks[1000 + i]
                outcomes.append(f"whole: {k} blocks, {len(r.content)} bytes")
                http.put("/v1/blocks", content=prompt, headers=ENVELOPE)  # back for the next
        finally:
            stop.set()
            thread.join(timeout=60)
        assert puts and set(puts) <= {200}, set(puts)
        streamed = [o for o in outcomes if o.startswith("cut") or int(o.split()[1]) > 32]
        assert streamed, outcomes  # over 64 MiB: the streamed path, not the gathered one
        r = http.get("/metrics")
        assert 'status="5' not in r.text
        evictions = re.search(r"^tlkv_store_evictions_total (\S+)", r.text, re.M)
        assert evictions and float(evictions.group(1)) > 0
        assert srv.alive()
    # A stream cut short is aborted by raising (ASGI has no other way): uvicorn logs that
    # one traceback per cut, naming the vanished block. Nothing else may be in the log.
    aborts = srv.log().split("Exception in ASGI application")[1:]
    assert len(aborts) == sum(o.startswith("cut") for o in outcomes), srv.log()[-3000:]
    for abort in aborts:
        assert "vanished while streaming the prefix" in abort, abort[-2000:]
    assert "Traceback" not in srv.log().split("Exception in ASGI application")[0]


RESTORE_GEOMETRY = Geometry(16, 32, 8, 128)  # 2 MiB blocks: 48 blocks, 6 commit batches


@pytest.mark.slow
def test_sigkill_during_restore_is_all_or_nothing(tmp_path: Path) -> None:
    """SIGKILL ``tlkv archive restore`` while it commits: on reopening, the store holds
    nothing of the archive or all of it (the restore journal), and takes puts and reads."""
    import signal
    import sys
    import time

    from kvstore import archive as ar

    g = RESTORE_GEOMETRY
    rng = np.random.default_rng(2)
    kv = rng.standard_normal(g.kv_shape).astype(np.float16)
    archive = tmp_path / "a.tar.zst"
    with Store(tmp_path / "src", geometry=g) as src:
        for i in range(6):
            src.put(encode(g, [Block(7000 + 8 * i + j, g.block_tokens, kv) for j in range(8)]))
        ar.create(src, archive)
        total = src.stats()["blocks"]
    target = tmp_path / "dst"
    with Store(target, geometry=g) as dst:
        dst.put(encode(g, [Block(1, g.block_tokens, kv)]))  # the store had one block before
    cmd = [sys.executable, "-m", "kvstore", "archive", "restore", str(archive), "--data"]
    proc = subprocess.Popen([*cmd, str(target), "--quiet"], cwd=Path(__file__).parent.parent)
    seen = 1
    with Store(target) as watch:
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            seen = watch.stats()["blocks"]
            if seen > 1:  # a first batch committed: kill while the rest is on its way
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.002)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "restore finished before it could be killed"
    with Store(target) as after:
        blocks = after.stats()["blocks"]
        assert blocks in (1, 1 + total), f"{blocks - 1} of {total} archive blocks after SIGKILL"
        after.put(encode(g, [Block(2, g.block_tokens, kv)]))  # usable
        assert after.get(2) is not None and after.get(1) is not None
    assert not list(target.glob("restore-*.lock"))  # the killed restore's lock is gone too


@pytest.mark.slow
def test_drill_tool_short_run() -> None:
    """``tools/drill.py`` in a short run: both kills happen under load, every acknowledged
    put is intact after the restart, no 5xx."""
    cmd = [sys.executable, str(REPO / "tools" / "drill.py"), "--seconds", "4", "--clients", "2"]
    cmd += ["--case", "kill"]
    ran = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=180)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    summary = json.loads(ran.stdout.splitlines()[-1])
    assert summary["ok"] and summary["5xx"] == 0 and not summary["wrong_answers"]
    assert summary["acknowledged_blocks"] == summary["intact_blocks"] > 0
    assert [e.split()[0] for e in summary["events"]] == ["worker", "server"]
    assert set(summary["operations"]) == {"put", "get", "has-blocks", "prefix"}


def _drill(*args: str) -> dict[str, Any]:
    """``tools/drill.py ARGS --json`` run to its end with exit 0: its summary."""
    cmd = [sys.executable, str(REPO / "tools" / "drill.py"), *args, "--json"]
    ran = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    return json.loads(ran.stdout.splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.slow
def test_drill_tool_stalled_reader_and_model_cap_cases() -> None:
    """``tools/drill.py --case stalled-reader --case model-cap`` on a port it is given:
    two readers that never read are cut off within 33 s while puts growing the map never
    fail; 205 new models leave 200 created and 5 refused with 507 model_limit."""
    summary = _drill("--port", str(free_port()), "--case", "stalled-reader", "--case", "model-cap")
    stalled, cap = summary["stalled_reader"], summary["model_cap"]
    assert summary["ok"] and stalled["ok"] and cap["ok"], summary
    assert stalled["aborted"] >= 2 and stalled["aborted_after_seconds"] <= 33
    assert stalled["5xx"] == 0 and set(stalled["put_statuses"]) <= {"200", "503"}
    assert cap["created"] == 200 and cap["refused"] == {"model_limit": 5}
    assert "kill" not in summary["cases"] and "events" not in summary


@pytest.mark.slow
def test_drill_tool_slow_upload_and_foreign_models_cases() -> None:
    """``tools/drill.py --case slow-upload --case foreign-models``: eight tricklers are
    refused with 408 while every ordinary put answers 200 within 3 s; 64 models added to a
    ``--max-models 5`` server's store by other processes leave its listings at 200."""
    summary = _drill("--case", "slow-upload", "--case", "foreign-models")
    slow, foreign = summary["slow_upload"], summary["foreign_models"]
    assert summary["ok"] and slow["ok"] and foreign["ok"], summary
    assert slow["put_statuses"] == {"200": slow["ordinary_puts"]} and slow["ordinary_puts"] > 10
    assert set(slow["trickler_answers"]) == {"408 timeout"}
    assert foreign["answers"] == {"/v1/models": 200, "/metrics": 200, "/v1/status": 200}
    assert foreign["models_listed"] == 1 + 2 + 64


@pytest.mark.slow
def test_drill_check_finds_a_lost_block(tmp_path: Path) -> None:
    """The drill's final check can fail: a block gone is reported."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import drill
    finally:
        sys.path.remove(str(REPO / "tools"))
    geometry = ",".join(map(str, drill.GEOMETRY.as_tuple()))
    with ServerProcess(tmp_path / "store", "--geometry", geometry) as srv, srv.client() as http:
        seeds = [11, 12, 13]
        for seed in seeds:
            r = http.put("/v1/blocks", content=drill.envelope_for(seed), headers=ENVELOPE)
            assert r.status_code == 200
        blocks, intact, problems = drill.check_acked(srv.port, seeds)
        assert blocks == intact > 3 and problems == []
        victim = drill.block_hashes(drill.envelope_for(12))[0]
        assert http.delete(f"/v1/blocks/{victim}").status_code == 204
        blocks, intact, problems = drill.check_acked(srv.port, seeds)
        assert intact == blocks - 1 and len(problems) == 1 and victim in problems[0]
