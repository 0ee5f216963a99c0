"""The scrub (kvstore/store/scrub.py, `tlkv scrub`): a byte flipped inside LMDB's data file
is found within one pass, quarantined, and repaired from a moto tier."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import make_envelope
from s3_server import S3Server
from waiting import wait_until

from kvstore import Geometry, Store, decode
from kvstore.cli.common import parse_rate
from kvstore.store.scrub import Scrubber, scrub_pass

# Blocks of 16 KiB: LMDB keeps each on overflow pages of its own, as real KV blocks.
GEOMETRY = Geometry(block_tokens=16, n_layers=4, n_kv_heads=2, head_dim=32)


def _hashes(envelope: bytes) -> list[int]:
    return [int(h) for h in decode(envelope).hashes if h]


def _flip(data_dir: Path, block: bytes) -> None:
    """Flip one payload byte of ``block``'s stored copy inside LMDB's data file."""
    path = data_dir / "data.mdb"
    raw = path.read_bytes()
    needle = block[100:164]  # a slice of the payload, unique to this block
    at = raw.find(needle)
    assert at >= 0 and raw.find(needle, at + 1) < 0
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([raw[at + 10] ^ 0x40]), at + 10)
    finally:
        os.close(fd)


@pytest.fixture
def tiered(tmp_path: Path, s3_server: S3Server) -> tuple[Path, str, list[int], list[bytes]]:
    """A store whose 12 blocks are all uploaded to a fresh bucket, closed."""
    url = f"s3://{s3_server.new_bucket()}/scrub"
    envelope = make_envelope(GEOMETRY, 16 * 12, seed=7)
    hashes = _hashes(envelope)
    with Store(tmp_path / "s", tier=url, tier_endpoint=s3_server.endpoint) as s:
        s.put(envelope)
        assert s.wait_uploaded(20)
        blocks = s.get_many(hashes)
    return tmp_path / "s", url, hashes, [b for b in blocks if b is not None]


def test_rates_parse() -> None:
    assert parse_rate("64MiB/s") == 64 << 20
    assert parse_rate("0") == 0
    assert parse_rate("1GB/s") == 10**9
    with pytest.raises(ValueError):
        parse_rate("fast")


def test_a_flipped_byte_is_found_and_repaired_from_the_tier(
    tiered: tuple[Path, str, list[int], list[bytes]], s3_server: S3Server
) -> None:
    data, url, hashes, blocks = tiered
    _flip(data, blocks[5])
    with Store(data, tier=url, tier_endpoint=s3_server.endpoint) as s:
        report = scrub_pass(s)
        assert (report.blocks, report.found, report.repaired) == (12, 1, 1)
        assert report.bytes == sum(map(len, blocks))
        assert report.unrepaired == []
        assert s.stats()["corrupt"] == 1
        assert s.get_many(hashes) == blocks  # the repaired copy is byte-identical
        assert scrub_pass(s).found == 0  # and sound on the next pass


def test_without_a_tier_the_block_stays_quarantined(
    tiered: tuple[Path, str, list[int], list[bytes]],
) -> None:
    data, _, hashes, blocks = tiered
    _flip(data, blocks[2])
    with Store(data) as s:
        report = scrub_pass(s)
        assert (report.found, report.repaired) == (1, 0)
        assert report.unrepaired == [("default", hashes[2])]
        assert s.get(hashes[2]) is None  # quarantined: never served
        assert s.stats()["blocks"] == 11
        for bad in ({"rate": 0}, {"period": 0}):
            with pytest.raises(ValueError):
                Scrubber(s, **bad)  # type: ignore[arg-type]


def _tlkv(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_cli_exit_codes(
    tiered: tuple[Path, str, list[int], list[bytes]], s3_server: S3Server
) -> None:
    data, url, hashes, blocks = tiered
    clean = _tlkv("scrub", "--data", str(data))
    assert clean.returncode == 0, clean.stderr
    assert "12 blocks" in clean.stderr and "0 corrupt" in clean.stderr
    _flip(data, blocks[0])
    _flip(data, blocks[1])
    repaired = _tlkv(
        "scrub", "--data", str(data), "--repair-from", url, "--tier-endpoint", s3_server.endpoint
    )
    assert repaired.returncode == 0, repaired.stderr
    assert "2 corrupt, 2 repaired" in repaired.stderr
    _flip(data, blocks[3])
    lost = _tlkv("scrub", "--data", str(data), "--rate", "64MiB/s")
    assert lost.returncode == 1
    assert f"block {hashes[3]:016x} of model 'default': corrupt" in lost.stderr
    assert _tlkv("scrub", "--data", str(data), "--rate", "fast").returncode == 2
    assert _tlkv("scrub", "--data", str(data / "nothing")).returncode == 1
    for bad in (("--scrub-rate", "fast"), ("--scrub-period", "0"), ("--scrub-period", "x")):
        refused = _tlkv("serve", "--data", str(data), *bad)
        assert refused.returncode == 2 and bad[0] in refused.stderr


def test_background_scrub_repairs_within_a_pass_and_never_blocks_a_put(
    tiered: tuple[Path, str, list[int], list[bytes]], s3_server: S3Server
) -> None:
    data, url, hashes, blocks = tiered
    with Store(data, tier=url, tier_endpoint=s3_server.endpoint) as s:
        _flip(data, blocks[9])  # while open: LMDB's map sees the page cache's bytes
        passes: list[tuple[int, int]] = []
        under_way = threading.Event()
        done = threading.Event()
        rate = 64 << 10  # 12 x 16 KiB at 64 KiB/s: a pass of about 3 s

        def on_pass(report: object, end: float) -> None:
            passes.append((report.found, report.repaired))  # type: ignore[attr-defined]
            done.set()

        scrubber = Scrubber(
            s, rate=rate, period=3600, on_batch=lambda *_: under_way.set(), on_pass=on_pass
        )
        try:
            assert under_way.wait(10)  # a first batch is checked: the pass is under way, paced
            assert not done.is_set()
            t0 = time.monotonic()
            s.put(make_envelope(GEOMETRY, 16 * 4, seed=8))
            put_seconds = time.monotonic() - t0
            assert put_seconds < 1.0  # never waits for the scrub
            assert done.wait(20)
        finally:
            scrubber.stop()
        assert passes == [(1, 1)]
        assert s.get(hashes[9]) == blocks[9]
        # A second scrubber of the same directory defers to the lock's holder.
        first = Scrubber(s, rate=rate, period=3600)
        second = Scrubber(s, rate=rate, period=3600)
        try:
            wait_until(lambda: max(first._lock_fd, second._lock_fd) >= 0, "a scrubber's lock")
            holder, other = (first, second) if first._lock_fd >= 0 else (second, first)
            assert not other._own_lock()  # what its thread asks each round: refused
            assert holder._lock_fd >= 0 and other._lock_fd < 0
        finally:
            first.stop()
            second.stop()
