"""The scrub beyond blocks (``kvstore/store/scrub.py``, ``tlkv scrub``), run as the
operator runs it, on real LMDB files and a moto tier: sequence records are checked
(a flipped byte in one is found, reported, exit 1); a sequence whose pinned block was
quarantined is made whole again from the tier; a later ``--repair-from`` puts back what
an earlier scrub quarantined; a damaged ``data.mdb`` is refused before it is opened."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_envelope
from s3_server import S3Server
from test_scrub import GEOMETRY, _flip, _hashes

from kvstore import Store, decode
from kvstore.store.scrub import scrub_pass

REPO = Path(__file__).resolve().parent.parent


def _tlkv(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def _sequence_store(path: Path) -> tuple[bytes, list[int]]:
    """A store holding one pinned sequence of 5 full blocks and a partial tail (kept in
    the sequence record itself); the envelope and its full blocks' hashes."""
    envelope = make_envelope(GEOMETRY, 16 * 5 + 7, seed=21)
    with Store(path) as s:
        s.put_sequence("agent-7", envelope)
    return envelope, _hashes(envelope)


def _uploaded(
    tmp_path: Path, s3_server: S3Server, n: int, seed: int
) -> tuple[Path, str, list[int], list[bytes]]:
    """A closed store of ``n`` blocks, all uploaded to a fresh bucket: its directory, the
    tier's URL, the blocks' hashes and their stored bytes."""
    url = f"s3://{s3_server.new_bucket()}/t"
    data = tmp_path / "s"
    envelope = make_envelope(GEOMETRY, 16 * n, seed=seed)
    hashes = _hashes(envelope)
    with Store(data, tier=url, tier_endpoint=s3_server.endpoint) as s:
        s.put(envelope)
        assert s.wait_uploaded(20)
        blocks = [b for b in s.get_many(hashes) if b is not None]
    return data, url, hashes, blocks


def test_a_flipped_byte_in_a_sequence_record_is_found(tmp_path: Path) -> None:
    """Before, the scrub walked blocks only: "0 corrupt", exit 0, and the next read
    deleted the sequence. Now the pass finds the record, quarantines it as that read
    would, names it and exits 1; the next pass still reports it, until it is put again."""
    data = tmp_path / "s"
    envelope, _ = _sequence_store(data)
    tail = decode(envelope).single(5)  # the partial tail: inside the sequence record only
    _flip(data, tail)
    first = _tlkv("scrub", "--data", str(data))
    assert first.returncode == 1, first.stderr
    assert "sequence 'agent-7' of model 'default': its record failed its CRC-32C" in first.stderr
    assert "1 sequences, 1 damaged" in first.stderr
    with Store(data) as s:
        assert scrub_pass(s).lost == [("default", "agent-7")]  # still reported
        assert s.get_sequence("agent-7") is None and s.stats()["corrupt"] == 1
        s.put_sequence("agent-7", envelope)  # put again: whole, and no longer reported
        report = scrub_pass(s)
        assert (report.sequences, report.lost, report.incomplete) == (1, [], [])
    forgotten = tmp_path / "f"
    _sequence_store(forgotten)
    _flip(forgotten, tail)
    gone = _tlkv("scrub", "--data", str(forgotten), "--forget-unrepaired")
    assert gone.returncode == 0 and "forgotten" in gone.stderr, gone.stderr
    with Store(forgotten) as s:
        assert scrub_pass(s).lost == []


def test_a_sequence_missing_a_pinned_block_is_repaired_from_the_tier(
    tmp_path: Path, s3_server: S3Server
) -> None:
    """A pinned block quarantined by an earlier scrub without a tier leaves its sequence
    unreadable (reported, exit 1); a scrub with the tier reads the block back and the
    sequence is whole again, byte for byte."""
    url = f"s3://{s3_server.new_bucket()}/seq"
    data = tmp_path / "s"
    envelope = make_envelope(GEOMETRY, 16 * 5 + 7, seed=22)
    with Store(data, tier=url, tier_endpoint=s3_server.endpoint) as s:
        s.put_sequence("agent-8", envelope)
        assert s.wait_uploaded(20)
    _flip(data, decode(envelope).single(2))
    lost = _tlkv("scrub", "--data", str(data))
    assert lost.returncode == 1
    assert "sequence 'agent-8' of model 'default': 1 of its blocks are not stored" in lost.stderr
    with Store(data, tier=url, tier_endpoint=s3_server.endpoint) as s:
        report = scrub_pass(s)
        assert report.earlier == 1 and report.repaired == 1
        assert report.unrepaired == [] and report.incomplete == [] and report.lost == []
        assert s.get_sequence("agent-8") == envelope


def test_a_later_repair_puts_back_what_an_earlier_scrub_quarantined(
    tmp_path: Path, s3_server: S3Server
) -> None:
    """Issue 34: ``tlkv scrub`` without a tier quarantines a corrupt block (exit 1); a later
    ``tlkv scrub --repair-from`` puts it back from the tier, byte for byte (exit 0; before,
    it no longer knew the block and did nothing); the pass after is clean."""
    data, url, hashes, blocks = _uploaded(tmp_path, s3_server, 6, seed=23)
    _flip(data, blocks[4])
    first = _tlkv("scrub", "--data", str(data))
    assert first.returncode == 1 and f"block {hashes[4]:016x}" in first.stderr
    with Store(data) as s:  # the record of it: still reported by a pass without a tier
        (model, block), *more = [(m, h) for m, h in scrub_pass(s).unrepaired]
        assert (model, block, more) == ("default", hashes[4], [])
    repair = _tlkv(
        "scrub", "--data", str(data), "--repair-from", url, "--tier-endpoint", s3_server.endpoint
    )
    assert repair.returncode == 0, repair.stderr
    assert "0 corrupt, 1 quarantined earlier, 1 repaired" in repair.stderr
    with Store(data) as s:
        assert s.get_many(hashes) == blocks
        report = scrub_pass(s)
        assert (report.found, report.earlier, report.repaired, report.unrepaired) == (0, 0, 0, [])


def test_a_block_quarantined_by_a_read_is_repaired_by_the_scrub(
    tmp_path: Path, s3_server: S3Server
) -> None:
    """Whoever quarantined it (here a read), the next scrub with the tier puts it back."""
    data, url, hashes, blocks = _uploaded(tmp_path, s3_server, 3, seed=24)
    _flip(data, blocks[1])
    with Store(data) as s:
        assert s.get(hashes[1]) is None  # found by the read: quarantined
    with Store(data, tier=url, tier_endpoint=s3_server.endpoint) as s:
        report = scrub_pass(s)
        assert (report.found, report.earlier, report.repaired) == (0, 1, 1)
        assert s.get(hashes[1]) == blocks[1]


@pytest.mark.parametrize("damage", ["truncated", "empty", "missing"])
def test_a_damaged_data_file_is_refused_before_it_is_opened(tmp_path: Path, damage: str) -> None:
    """Before: a truncated ``data.mdb`` killed ``tlkv scrub`` with SIGBUS and no message,
    and an empty one was re-created as a new store and reported clean (exit 0). Now each
    is a clear error, exit 1, and the file is left as it was."""
    data = tmp_path / "s"
    with Store(data, geometry=GEOMETRY) as s:
        for seed in range(8):
            s.put(make_envelope(GEOMETRY, 16 * 4, seed=30 + seed))
    path = data / "data.mdb"
    size = path.stat().st_size
    if damage == "truncated":
        os.truncate(path, size // 2)
    elif damage == "empty":
        os.truncate(path, 0)
    else:
        path.unlink()
    before = path.stat().st_size if path.exists() else None
    ran = _tlkv("scrub", "--data", str(data))
    assert ran.returncode == 1, (ran.returncode, ran.stderr)
    expected = {"truncated": "is truncated", "empty": "is empty", "missing": "no store in"}
    assert expected[damage] in ran.stderr, ran.stderr
    assert (path.stat().st_size if path.exists() else None) == before
    if damage == "missing":
        assert not path.exists()
    shutil.rmtree(data)
