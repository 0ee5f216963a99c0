"""Crash safety with real processes: a writer is SIGKILLed at random moments.

The writer (a separate Python process) puts multi-block envelopes and sequences in a loop
with ``sync=True`` (into a growing file, or with room preallocated ahead), printing each
put's hashes before it starts and a line after it returns. After every kill the store is
reopened: every block reported committed is present and passes its CRC, the put in flight
is all or nothing, every reported sequence comes back byte-identical, and no stored block
fails its CRC.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvstore import Store, crc32c, decode

REPO = Path(__file__).resolve().parent.parent
ROUNDS = 24

WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    import kvstore.store.writebehind
    from kvstore import Block, Geometry, Store, crc32c, encode

    kvstore.store.writebehind.MIN_BYTES = 0  # every commit writes behind: kills land mid-way
    path, seed, room = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    g = Geometry(16, 4, 2, 64)  # 32 KiB payloads
    kv = np.random.default_rng(seed).standard_normal(g.kv_shape).astype(np.float16)

    def report(*words):
        # One write per line: under PYTHONUNBUFFERED, print() writes each word on its
        # own, and a kill between two writes would leave a line cut short.
        sys.stdout.write(" ".join(map(str, words)) + "\\n")
        sys.stdout.flush()

    # A small map: its growth happens under fire too; with room, so do the extensions.
    with Store(path, map_bytes=1 << 20, preallocate_bytes=room) as s:
        report("ready")
        i = 0
        while True:
            hashes = [(seed << 40) | (i << 4) | j for j in range(1, 2 + i % 6)]
            envelope = encode(g, [Block(h, 16, kv + h % 7) for h in hashes])
            report("B", *hashes)
            s.put(envelope)
            report("C")
            if i % 5 == 2:
                name = f"w{seed}-{i}"
                s.put_sequence(name, envelope)
                report("S", name, crc32c(envelope))
            i += 1
    """
)


def _run_writer(script: Path, path: Path, seed: int, rng: random.Random, room: int) -> list[str]:
    proc = subprocess.Popen(
        [sys.executable, str(script), str(path), str(seed), str(room)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    assert first == "ready\n", proc.stderr.read()
    time.sleep(rng.uniform(0.01, 0.25))  # the kill lands at a random moment of the writes
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    out = proc.stdout.read().splitlines(keepends=True)
    err = proc.stderr.read()
    assert "Traceback" not in err, err
    # A line the kill cut short reports nothing: only newline-terminated lines count.
    return [line for line in out if line.endswith("\n")]


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL is POSIX")
@pytest.mark.parametrize("room", [0, 256 << 10], ids=["growing", "preallocated"])
def test_sigkilled_writers_never_lose_or_corrupt_committed_blocks(
    tmp_path: Path, room: int
) -> None:
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    path = tmp_path / "store"
    rng = random.Random(20240611)
    committed: set[int] = set()
    sequences: dict[str, int] = {}
    kills_mid_put = 0
    for seed in range(1, ROUNDS + 1):
        lines = _run_writer(script, path, seed, rng, room)
        in_flight: list[int] = []
        for line in lines:
            kind, *rest = line.split()
            if kind == "B":
                in_flight = [int(x) for x in rest]
            elif kind == "C":
                committed.update(in_flight)
                in_flight = []
            elif kind == "S":
                sequences[rest[0]] = int(rest[1])
        kills_mid_put += bool(in_flight)

        with Store(path) as s:
            assert all(s.has(sorted(committed)))
            present = s.has(in_flight)
            assert all(present) or not any(present), "a put was torn"
            for h in sorted(committed)[-40:]:  # get verifies the CRC; spot-check recent ones
                data = s.get(h)
                assert data is not None and decode(data)[0].hash == h
            for name, crc in sequences.items():
                envelope = s.get_sequence(name)
                assert envelope is not None and crc32c(envelope) == crc
            with s.reader() as r:
                for h, value in r.iter_blocks():
                    assert decode(value)[0].hash == h  # raises ChecksumError if torn
            stats = s.stats()
            assert stats["corrupt"] == 0
            assert stats["sequences"] == len(s.sequences()) >= len(sequences)
    assert len(committed) > ROUNDS
    assert kills_mid_put > 0  # the kills did land inside puts
