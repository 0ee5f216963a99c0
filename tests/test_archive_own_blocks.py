"""Sequences that keep blocks of their own (their blocks were first stored in another
format version, or with other bytes): archived as version 4 (ARCHIVE.md 1.6) by every
archive path, and restored byte for byte."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import SMALL, make_blocks, make_envelope
from s3_server import S3Server

from kvstore import Block, decode, encode, split
from kvstore import archive as ar
from kvstore.archive import writer as archive_writer
from kvstore.store.store import Store


def _other_bytes(seed: int) -> bytes:
    """The blocks of ``make_envelope(SMALL, 4 * 3 + 1, seed=seed)`` with other KV bytes
    (the same hashes)."""
    blocks = make_blocks(SMALL, 4 * 3 + 1, seed=seed)
    return encode(SMALL, [Block(b.hash, b.n_tokens, b.kv[::-1].copy()) for b in blocks])


def _v1_then_v2(s: Any) -> None:
    s.put(make_envelope(SMALL, 4 * 3, version=1, seed=1))
    s.put_sequence("a-v2", make_envelope(SMALL, 4 * 3 + 2, version=2, seed=1))


def _v2_then_v1(s: Any) -> None:
    s.put(make_envelope(SMALL, 4 * 2, version=2, seed=2))
    s.put_sequence("b-v1", make_envelope(SMALL, 4 * 3, version=1, seed=2))  # 2 own, 1 not


def _other_bytes_first(s: Any) -> None:
    s.put(_other_bytes(3))
    s.put_sequence("c-bytes", make_envelope(SMALL, 4 * 3 + 1, seed=3))


def _repeated_hash(s: Any) -> None:
    blocks = make_blocks(SMALL, 4 * 2, seed=4)
    s.put(encode(SMALL, blocks, 2))
    s.put_sequence("d-repeat", encode(SMALL, [blocks[0], blocks[1], blocks[0]], 1))


def _deleted_from_the_block_space(s: Any) -> None:
    s.put(make_envelope(SMALL, 4 * 2, version=1, seed=5))
    s.put_sequence("e-gone", make_envelope(SMALL, 4 * 2 + 3, version=2, seed=5))
    for h in decode(make_envelope(SMALL, 4 * 2, seed=5)).hashes.tolist():
        s.delete(h)  # its own copies stay in its record; the archive has no such block


CASES: dict[str, Callable[[Any], None]] = {
    "v1 then v2": _v1_then_v2,
    "v2 then v1": _v2_then_v1,
    "other bytes": _other_bytes_first,
    "a hash repeated": _repeated_hash,
    "deleted from the block space": _deleted_from_the_block_space,
}


def _sequences(s: Any) -> dict[str, bytes]:
    return {name: s.get_sequence(name) for name in s.sequences()}


def _blocks(s: Any) -> dict[int, str]:
    with s.reader() as r:
        return {h: hashlib.sha256(bytes(v)).hexdigest() for h, v in r.iter_blocks()}


@pytest.fixture
def small_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    """Frames of about 2 KiB: a sequence's members spread over several frames."""
    monkeypatch.setattr(archive_writer, "FRAME_TARGET", 2048)


@pytest.mark.parametrize("case", sorted(CASES))
def test_restored_byte_identical(case: str, tmp_path: Path, small_frames: None) -> None:
    """Archived (version 4) with its own blocks, the sequence comes back byte for byte in
    every restore mode (one pass, validate-then-import, partial) into an empty store."""
    with Store(tmp_path / "src") as src:
        CASES[case](src)
        src.put_sequence("plain", make_envelope(SMALL, 4 * 2 + 1, seed=50))
        before, blocks = _sequences(src), _blocks(src)
        pinned = src.stats()["pinned_blocks"]
        path = tmp_path / "a.tar.zst"
        summary = ar.create(src, path, allow_skipped=False)
    assert summary.skipped == []
    assert summary.manifest.archive_version == 4 and summary.manifest.own_blocks >= 1
    assert ar.verify(path).sequences == len(before)
    data_bytes = ar.ArchiveReader(path).index.data_bytes
    modes: dict[str, tuple[dict[str, Any], int | None]] = {
        "one pass": ({}, None),
        "validate, then import": ({}, data_bytes - 1),
        "partial": ({"partial": True}, None),
    }
    for mode, (kw, capacity) in modes.items():
        with Store(tmp_path / mode, capacity_bytes=capacity) as dst:
            report = ar.restore(path, dst, **kw)
            assert report.problems == [] and report.sequences == len(before), mode
            assert _sequences(dst) == before, mode
            if case != "deleted from the block space":  # there restore stores its blocks
                assert _blocks(dst) == blocks, mode
                assert dst.stats()["pinned_blocks"] == pinned, mode
    with Store(tmp_path / "one pass") as dst:  # archive -> restore -> archive: same bytes
        again = tmp_path / "again.tar.zst"
        ar.create(dst, again)
        if case != "deleted from the block space":
            assert again.read_bytes() == path.read_bytes()
        else:
            assert ar.list_archive(again).manifest.archive_version == 2  # referenced now


def test_listed_extracted_and_selected(tmp_path: Path) -> None:
    """``ls`` shows the own positions, ``extract --all`` writes the own block members as
    they are in the archive, and ``--sequence`` archives one with its own blocks."""
    with Store(tmp_path / "src") as src:
        _v1_then_v2(src)
        _other_bytes_first(src)
        src.put_sequence("plain", make_envelope(SMALL, 4 * 2 + 1, seed=50))
        want = src.get_sequence("c-bytes")
        path = tmp_path / "a.tar.zst"
        ar.create(src, path)
        one = tmp_path / "one.tar.zst"
        ar.create(src, one, sequences=["c-bytes"])
    listing = ar.list_archive(path).to_dict()
    own = {s["name"]: s.get("own") for s in listing["sequences"]}
    assert own == {"a-v2": [0, 1, 2], "c-bytes": [0, 1, 2], "plain": None}
    ar.extract_all(path, tmp_path / "x")
    member = tmp_path / "x" / "sequences" / "c-bytes.1.tlkv"
    assert member.read_bytes() == split(want)[1]  # the sequence's bytes, not the block space's
    selected = ar.list_archive(one)
    assert [s.name for s in selected.sequences] == ["c-bytes"]
    assert selected.manifest.own_blocks == 3 and len(selected.hashes) == 0  # all its own
    with Store(tmp_path / "dst") as dst:
        ar.restore(one, dst)
        assert _sequences(dst) == {"c-bytes": want}


def test_several_models(tmp_path: Path) -> None:
    """A whole-store archive of several models (version 4 with ``models``) carries each
    model's own blocks under its directory and restores each byte for byte."""
    with Store(tmp_path / "src") as src:
        _v1_then_v2(src)
        ft = src.model("ft")
        _other_bytes_first(ft)
        ft.put_sequence("plain", make_envelope(SMALL, 4 * 2 + 1, seed=50))
        before = {m: _sequences(src.model(m)) for m in src.models()}
        path = tmp_path / "a.tar.zst"
        summary = ar.create(src, path, allow_skipped=False)
    m = summary.manifest
    assert m.archive_version == 4 and [x.own_blocks for x in m.sections()] == [3, 3]
    ar.verify(path)
    with Store(tmp_path / "dst") as dst:
        ar.restore(path, dst)
        assert {x: _sequences(dst.model(x)) for x in dst.models()} == before


def test_through_s3(tmp_path: Path, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The s3:// archive path writes and restores the own blocks too."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    url = f"s3://{s3_server.new_bucket()}/own.tlkv"
    with Store(tmp_path / "src") as src:
        _v2_then_v1(src)
        before = _sequences(src)
        ar.create(src, url, allow_skipped=False)
    assert ar.verify(url).manifest.archive_version == 4
    with Store(tmp_path / "dst") as dst:
        ar.restore(url, dst)
        assert _sequences(dst) == before
