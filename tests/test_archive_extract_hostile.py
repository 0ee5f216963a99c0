"""Extract from hostile archives: a member named outside the destination is refused and
nothing is written; an index or manifest that disagrees with the members is said (library
findings, CLI exit 6) while the block read, which is valid, is still written."""

from __future__ import annotations

from pathlib import Path

import pytest
from archive_helpers import Raw, craft, manifest_member, run_tlkv, valid_members
from conftest import SMALL

from kvstore import ArchiveError
from kvstore import archive as ar
from kvstore.archive.operations import extract_checked
from kvstore.errors import UnsafeArchiveError


def test_extract_never_writes_outside(tmp_path: Path) -> None:
    m, b, s = valid_members()
    h = int(b[0].name[7:23], 16)
    evil = [m, [Raw("blocks/../../../escaped.tlkv", b[0].data, index_hash=h)], b[1:], s]
    path = craft(tmp_path / "evil.tar.zst", evil)
    dest = tmp_path / "inner" / "out"
    dest.parent.mkdir()
    before = sorted(p for p in tmp_path.rglob("*"))
    with pytest.raises(UnsafeArchiveError):
        ar.extract_all(path, dest)
    assert sorted(p for p in tmp_path.rglob("*")) == before
    assert not (tmp_path / "escaped.tlkv").exists() and not dest.exists()


def test_extract_reports_an_inconsistent_index(tmp_path: Path) -> None:
    """The block read is valid, but the index or manifest disagrees where extract looked:
    the block is written, the findings are said, the exit code is 6 (library: findings)."""
    m, b, s = valid_members()
    hashes = [int(x.name[7:23], 16) for x in b]
    offsets = [i * len(b[0].encode()) for i in range(len(b))]
    consistent = [(h, 1, off) for h, off in zip(hashes, offsets)]
    cases = {
        # the second block's entry points past it; the third is listed in no frame
        "moved": [consistent[0], (hashes[1], 1, 9 * 512), *consistent[3:], (hashes[2], 2, 0)],
        "unlisted": [consistent[0], *consistent[2:], (2**63 + 5, 1, 7 * 512)],
    }
    for name, table in cases.items():
        path = craft(tmp_path / f"{name}.tar.zst", [m, b, s], index_blocks=sorted(table))
        with pytest.raises(ArchiveError):
            ar.verify(path)
        done = extract_checked(path, hashes[0], tmp_path / f"{name}.tlkv")
        assert (tmp_path / f"{name}.tlkv").read_bytes() == b[0].data
        assert done.findings, name
        out = tmp_path / f"{name}-cli.tlkv"
        ran = run_tlkv("archive", "extract", str(path), f"{hashes[0]:016x}", "-o", str(out))
        assert ran.code == 6, ran
        assert "inconsistent" in ran.err and out.read_bytes() == b[0].data
    # The manifest's block count disagrees with the index: said, not fatal for extract.
    counted = manifest_member(SMALL, len(b) + 1, 1)
    path = craft(tmp_path / "count.tar.zst", [counted, b, s])
    done = extract_checked(path, hashes[0], tmp_path / "count.tlkv")
    assert any("the manifest" in f for f in done.findings), done.findings
    # A consistent archive: no finding, exit code 0.
    path = craft(tmp_path / "fine.tar.zst", [m, b, s])
    assert extract_checked(path, hashes[0], tmp_path / "fine.tlkv").findings == []
    ran = run_tlkv("archive", "extract", str(path), f"{hashes[0]:016x}", "-o", str(tmp_path / "f"))
    assert ran.code == 0 and "inconsistent" not in ran.err, ran
