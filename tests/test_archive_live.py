"""``archive create`` on a live store: consistent snapshots while another process writes,
and a create killed at any moment never leaves a half archive under the final name."""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from archive_helpers import REPO, live_hashes, live_sequence, populate
from conftest import SMALL, make_envelope

from kvstore import Geometry, decode
from kvstore import archive as ar
from kvstore.store.store import Store

TESTS = Path(__file__).resolve().parent
WINDOW = 3  # the writer keeps the newest WINDOW (+1 while it turns over) live sequences

# Another process writing to the store: puts sequence live-<k>, then drops live-<k-WINDOW>
# and deletes its (now unpinned) blocks one transaction at a time, until STOP exists.
_WRITER = """
import os, sys
sys.path.insert(0, sys.argv[1])
from archive_helpers import live_hashes, live_sequence
from kvstore.store.store import Store

data, stop, window = sys.argv[2], sys.argv[3], int(sys.argv[4])
with Store(data, sync=False) as store:
    k = 0
    while not os.path.exists(stop):
        store.put_sequence(f"live-{k:06d}", live_sequence(k))
        if k >= window:
            store.delete_sequence(f"live-{k - window:06d}")
            for h in live_hashes(k - window):
                store.delete(h)
        k += 1
        if k == window + 2:
            print("ready", flush=True)
print(k, flush=True)
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _newest_live(store: Store) -> int:
    return max(int(n[5:]) for n in store.sequences() if n.startswith("live-"))


def _check_live_snapshot(path: Path, base_blocks: set[int], base_seq: bytes) -> int:
    """The archive verifies, its counts match its members, and it is one state the writer
    committed: whole sequences, a contiguous window of them, and no block of a sequence
    outside it except those of the one being retired. Returns the newest live index."""
    report = ar.verify(path, geometry=SMALL)
    listing = ar.list_archive(path)
    blocks = [h for h, _ in ar.iter_blocks(path)]
    assert blocks == listing.hashes.tolist()
    assert report.blocks == listing.manifest.blocks == len(blocks)
    assert report.sequences == listing.manifest.sequences == len(listing.sequences)
    present = set(blocks)
    assert base_blocks <= present
    live: list[int] = []
    for seq in listing.sequences:
        assert set(seq.hashes) <= present, seq.name
        assert seq.tail
        if seq.name == "base":
            continue
        assert re.fullmatch(r"live-\d{6}", seq.name), seq.name
        live.append(int(seq.name[5:]))
        assert seq.hashes == live_hashes(live[-1])
    lo, hi = live[0], live[-1]
    assert live == list(range(lo, hi + 1)) and len(live) in (WINDOW, WINDOW + 1), live
    orphans = present - base_blocks - {h for k in live for h in live_hashes(k)}
    retiring = set(live_hashes(lo - 1)) if len(live) == WINDOW else set()
    assert orphans <= retiring, f"blocks of no sequence in window {lo}..{hi}"
    with Store(path.parent / f"{path.name}.restored") as dst:
        ar.restore(path, dst)
        assert dst.get_sequence("base") == base_seq
        for k in live:
            assert dst.get_sequence(f"live-{k:06d}") == live_sequence(k)
    return hi


@pytest.mark.slow
def test_create_while_another_process_writes(tmp_path: Path) -> None:
    """Archives made while a writer process keeps putting and retiring sequences each
    verify and each hold one consistent point-in-time state (library and CLI)."""
    data = tmp_path / "store"
    baseline = make_envelope(SMALL, 4 * 1000, seed=1)  # enough blocks for create to take a while
    base_seq = make_envelope(SMALL, 4 * 5 + 2, seed=2)
    base_blocks = {int(h) for env in (baseline, base_seq) for h in decode(env).hashes if h}
    with Store(data) as s:
        s.put(baseline)
        s.put_sequence("base", base_seq)
    stop = tmp_path / "stop"
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(TESTS), str(data), str(stop), str(WINDOW)],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None
        assert select.select([writer.stdout], [], [], 60)[0], "the writer does not start"
        assert writer.stdout.readline() == "ready\n", writer.communicate(timeout=10)[1]
        progressed = 0
        with Store(data) as store:
            for run in range(6):
                path = tmp_path / f"live-{run}.tar.zst"
                before = _newest_live(store)
                if run < 5:
                    assert ar.create(store, path).skipped == []
                else:
                    argv = ["archive", "create", "--data", str(data), "-o", str(path)]
                    ran = subprocess.run(
                        [sys.executable, "-m", "kvstore", *argv, "--quiet"],
                        cwd=REPO,
                        env=_env(),
                        capture_output=True,
                        text=True,
                        timeout=60,
                    )
                    assert ran.returncode == 0 and ran.stderr == "", ran.stderr
                after = _newest_live(store)
                progressed += after > before
                assert before <= _check_live_snapshot(path, base_blocks, base_seq) <= after
        assert progressed >= 3, "the writer hardly ran while create did"
        stop.touch()
        out, err = writer.communicate(timeout=30)
        assert writer.returncode == 0, err
        assert int(out.split()[-1]) > WINDOW + 2
    finally:
        stop.touch()
        if writer.poll() is None:
            writer.kill()
            writer.wait()


# --- killed mid-create ----------------------------------------------------------------------

BIG = Geometry(16, 8, 4, 64)  # 128 KiB v1 blocks


def _spawn_create(data: Path, out: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvstore",
            "archive",
            "create",
            *("--data", str(data)),
            "-o",
            str(out),
        ],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _temps(out: Path) -> list[Path]:
    """atomic_file's sibling temp files for ``out``: ``.<name>.<random>.tmp``."""
    return [
        p
        for p in out.parent.iterdir()
        if p.name.startswith(f".{out.name}.") and p.name.endswith(".tmp")
    ]


def _temp_bytes(out: Path) -> int:
    """Bytes in the temp file (-1 while there is none)."""
    sizes = [-1]
    for p in _temps(out):
        with contextlib.suppress(FileNotFoundError):  # renamed or removed meanwhile
            sizes.append(p.stat().st_size)
    return max(sizes)


def _written(pid: int) -> int:
    """Bytes the process has written so far, to any file (``wchar``; -1 once it is gone)."""
    try:
        with open(f"/proc/{pid}/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))
    except (OSError, StopIteration, ValueError):
        return -1


def _digest(path: Path) -> str | None:
    """SHA-256 of a file's bytes; None when there is no file."""
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


@pytest.mark.slow
def test_killed_create_never_leaves_a_half_archive(tmp_path: Path) -> None:
    """``tlkv archive create`` SIGKILLed before and while it writes: the final name holds
    nothing or the previous complete archive (or, killed after the rename, the new
    complete one), never a partial file; only ``.<name>.*.tmp`` files are left over."""
    data = tmp_path / "store"
    with Store(data, sync=False) as store:
        for i in range(6):
            store.put(make_envelope(BIG, 16 * 50, seed=i))  # 300 blocks, ~39 MB
    folder = tmp_path / "out"
    folder.mkdir()
    out = folder / "state.tlkv.tar.zst"
    start = time.monotonic()
    probe = _spawn_create(data, tmp_path / "probe.tar.zst")
    assert probe.communicate(timeout=60)[1] == b"" and probe.returncode == 0
    duration = time.monotonic() - start  # of a whole run, interpreter start included
    complete = _digest(tmp_path / "probe.tar.zst")  # what every run writes
    full = (tmp_path / "probe.tar.zst").stat().st_size
    ar.verify(tmp_path / "probe.tar.zst")
    with Store(tmp_path / "other") as other:
        populate(other)
        ar.create(other, tmp_path / "other.tar.zst")
    previous_archive = _digest(tmp_path / "other.tar.zst")  # a complete archive
    rng = random.Random(5)
    # (kill once this holds of the process and the seconds since its spawn, a complete
    # archive at OUT before)
    rounds: list[tuple[Callable[[int, float], bool], bool]] = [
        (lambda pid, t: True, False),  # at once: before it writes anything
        (lambda pid, t: _temp_bytes(out) >= 0, True),  # its temp file was just created
        (lambda pid, t: _written(pid) >= 1 << 20, False),  # mid-write, wherever it writes
        (lambda pid, t: _written(pid) >= full // 2, True),
        (lambda pid, t: _written(pid) >= full * 9 // 10, True),
        (lambda pid, t: _temp_bytes(out) >= full, True),  # all written: syncing, renaming
    ]

    def after(delay: float) -> Callable[[int, float], bool]:
        return lambda pid, t: t >= delay

    for _ in range(3):  # random moments
        rounds.append((after(rng.uniform(0.0, duration)), rng.random() < 0.5))
    mid_write = 0
    for round_no, (when, keep_previous) in enumerate(rounds):
        previous = previous_archive if keep_previous else None
        if previous is None:
            out.unlink(missing_ok=True)
        else:
            shutil.copyfile(tmp_path / "other.tar.zst", out)
        start = time.monotonic()
        proc = _spawn_create(data, out)
        try:
            while proc.poll() is None and not when(proc.pid, time.monotonic() - start):
                assert time.monotonic() - start < 30, "create hangs"
                time.sleep(0.0005)
            at_kill = _written(proc.pid)
            proc.send_signal(signal.SIGKILL)
            err = proc.communicate(timeout=30)[1]
            code = proc.returncode
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert code in (0, -signal.SIGKILL), err
        if code == -signal.SIGKILL and 1 << 20 <= at_kill < full:
            mid_write += 1
        temps = _temps(out)
        assert set(folder.iterdir()) - {out} == set(temps)  # nothing else beside OUT
        final = _digest(out)
        assert final in (previous, complete), f"round {round_no}: OUT holds a partial file"
        for p in temps:
            p.unlink()
    assert mid_write >= 3, f"only {mid_write} kills landed while the archive was being written"
