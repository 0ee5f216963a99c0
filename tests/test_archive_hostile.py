"""Hostile archives: every one is refused cleanly, by ``verify`` and by ``restore``, and the
target store is left exactly as it was (ARCHIVE.md section 5)."""

from __future__ import annotations

import json
import resource
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zstandard
from archive_helpers import (
    Raw,
    compress,
    craft,
    frame_bounds,
    manifest_member,
    populate,
    snapshot,
    valid_members,
    valid_own_members,
)
from conftest import SMALL, make_envelope

from kvstore import (
    ArchiveError,
    ChecksumError,
    FormatError,
    Geometry,
    ShapeError,
    TlkvError,
    UnsupportedVersionError,
    encode,
    split,
)
from kvstore import archive as ar
from kvstore.archive.manifest import canonical_json
from kvstore.archive.sequences import SequenceRecord
from kvstore.archive.tar import END_OF_ARCHIVE, USTAR_HEADER, ustar_header
from kvstore.errors import TruncatedArchiveError, UnsafeArchiveError
from kvstore.store.store import Store

OTHER = Geometry(2, 2, 2, 16)  # same envelope sizes as SMALL, another shape


@pytest.fixture
def target(tmp_path: Path) -> Iterator[Store]:
    """A populated store that every refused restore must leave unchanged."""
    with Store(tmp_path / "target") as s:
        populate(s, seed=3)
        yield s


def refused(path: Path, store: Store, error: type[BaseException]) -> BaseException:
    """``verify`` and ``restore`` both raise ``error``; the store does not change."""
    before = snapshot(store)
    with pytest.raises(error) as exc_info:
        ar.verify(path)
    with pytest.raises(error):
        ar.restore(path, store)
    assert snapshot(store) == before
    return exc_info.value


def header(member: str, size: int, **fields: bytes) -> bytes:
    """A ustar header for ``member`` with some fields replaced (checksum recomputed)."""
    values = list(USTAR_HEADER.unpack(ustar_header(member, size)))
    order = ["name", "mode", "uid", "gid", "size", "mtime", "chksum", "typeflag", "linkname"]
    for key, value in fields.items():
        values[order.index(key)] = value
    values[6] = b" " * 8
    raw = bytearray(USTAR_HEADER.pack(*values))
    raw[148:156] = b"%06o\0 " % sum(raw)
    return bytes(raw)


# --- container: truncation and flipped bytes ---------------------------------------------


@pytest.fixture
def good(tmp_path: Path) -> Path:
    m, b, s = valid_members()
    return craft(tmp_path / "good.tar.zst", [m, b[:2], b[2:], s])


def test_good_archive_is_accepted(good: Path, tmp_path: Path) -> None:
    assert ar.verify(good).blocks == 5
    with Store(tmp_path / "fresh") as s:
        assert ar.restore(good, s).sequences == 1


def test_truncated_anywhere(good: Path, target: Store, tmp_path: Path) -> None:
    data = good.read_bytes()
    cuts = {0, 1, 7, len(data) - 1, len(data) - 8, len(data) - 17}
    for offset, size in frame_bounds(good):
        cuts |= {offset, offset + 1, offset + size // 2, offset + size - 1}
    for cut in sorted(c for c in cuts if 0 <= c < len(data)):
        bad = tmp_path / f"cut{cut}.tar.zst"
        bad.write_bytes(data[:cut])
        refused(bad, target, ArchiveError)
    bad = tmp_path / "cut.tar.zst"
    bad.write_bytes(data[: frame_bounds(good)[-1][0]])  # exactly the index cut off
    assert isinstance(refused(bad, target, TruncatedArchiveError), TruncatedArchiveError)


def test_flipped_byte_in_every_frame(good: Path, target: Store, tmp_path: Path) -> None:
    data = good.read_bytes()
    bounds = frame_bounds(good)
    assert len(bounds) == 6  # manifest, 2 block frames, sequences, end, index
    for i, (offset, size) in enumerate(bounds):
        for at in sorted({offset, offset + 4, offset + size // 2, offset + size - 1}):
            for mask in (0x01, 0x80):
                raw = bytearray(data)
                raw[at] ^= mask
                bad = tmp_path / f"flip{i}_{at}_{mask}.tar.zst"
                bad.write_bytes(bytes(raw))
                refused(bad, target, TlkvError)


def test_own_blocks_archive_cut_or_flipped(target: Store, tmp_path: Path) -> None:
    """A version-4 archive (a sequence keeping a block of its own) cut anywhere, or with
    a byte flipped in any frame, is refused and changes nothing; whole, it restores the
    sequence byte for byte."""
    m, b, s = valid_own_members()
    good = craft(tmp_path / "own.tar.zst", [m, b, s])
    with Store(tmp_path / "fresh") as fresh:
        assert ar.restore(good, fresh).sequences == 1
        assert fresh.get_sequence("s") == make_envelope(SMALL, 4 * 3 + 2, version=2, seed=7)
    data = good.read_bytes()
    bounds = frame_bounds(good)
    for i, (offset, size) in enumerate(bounds):
        for at in sorted({offset, offset + 1, offset + size // 2, offset + size - 1}):
            bad = tmp_path / f"cut{at}.tar.zst"
            bad.write_bytes(data[:at])
            refused(bad, target, ArchiveError)
            raw = bytearray(data)
            raw[at] ^= 0x40
            bad = tmp_path / f"flip{i}_{at}.tar.zst"
            bad.write_bytes(bytes(raw))
            refused(bad, target, TlkvError)


def test_appended_garbage(good: Path, target: Store, tmp_path: Path) -> None:
    bad = tmp_path / "tail.tar.zst"
    bad.write_bytes(good.read_bytes() + b"\0" * 100)
    refused(bad, target, TruncatedArchiveError)


# --- a table of hostile member lists ---------------------------------------------------


def _cases() -> dict[str, tuple[Callable[[], list[list[Raw] | bytes]], type[BaseException]]]:
    m, b, s = valid_members()
    h0 = b[0].name[7:23]
    h0i = int(h0, 16)
    envelope = b[0].data
    other = split(make_envelope(OTHER, 4, seed=1))[0]
    other_hash = other[28:36][::-1].hex()
    tail_raw = s[1].data
    two = make_envelope(SMALL, 8, seed=3)
    two_hash = two[28:36][::-1].hex()
    empty = encode(SMALL, [])

    def renamed(name: str) -> list[list[Raw] | bytes]:
        return [m, [Raw(name, envelope, index_hash=h0i)], *[[x] for x in b[1:]], s]

    def bad_header(**fields: bytes) -> list[list[Raw] | bytes]:
        size = 0 if "typeflag" in fields else len(envelope)
        data = b"" if "typeflag" in fields else envelope
        raw = header(b[0].name, size, **fields)
        return [m, [Raw(b[0].name, data, raw, index_hash=h0i)], b[1:], s]

    cases: dict[str, tuple[Callable[[], list[list[Raw] | bytes]], type[BaseException]]] = {
        "duplicate block": (lambda: [m, [b[0], b[0]], b[1:], s], ArchiveError),
        "duplicate manifest": (lambda: [m, [m[0], *b], s], ArchiveError),
        "duplicate sequence": (lambda: [m, b, [*s, *s]], ArchiveError),
        "blocks out of order": (lambda: [m, list(reversed(b)), s], ArchiveError),
        "manifest not first": (lambda: [b, m, s], ArchiveError),
        "block after sequences": (lambda: [m, b[1:], s, [b[0]]], ArchiveError),
        "dot-dot name": (lambda: renamed("blocks/../../evil.tlkv"), UnsafeArchiveError),
        "absolute name": (lambda: renamed("/etc/evil.tlkv"), UnsafeArchiveError),
        "nested name": (lambda: renamed(f"blocks/x/{h0}.tlkv"), UnsafeArchiveError),
        "upper-case hash": (lambda: renamed(f"blocks/{h0.upper()}.tlkv"), UnsafeArchiveError),
        "unexpected name": (lambda: renamed("notes.txt"), UnsafeArchiveError),
        "sequence dot-dot": (
            lambda: [m, b, [Raw("sequences/../s.json", s[0].data), s[1]]],
            UnsafeArchiveError,
        ),
        "symlink": (
            lambda: bad_header(typeflag=b"2", linkname=b"/etc/passwd"),
            UnsafeArchiveError,
        ),
        "hard link": (lambda: bad_header(typeflag=b"1", linkname=b"x"), UnsafeArchiveError),
        "directory": (lambda: bad_header(typeflag=b"5"), UnsafeArchiveError),
        "device": (lambda: bad_header(typeflag=b"3"), UnsafeArchiveError),
        "fifo": (lambda: bad_header(typeflag=b"6"), UnsafeArchiveError),
        "non-canonical mtime": (lambda: bad_header(mtime=b"14000000000\0"), ArchiveError),
        "non-canonical mode": (lambda: bad_header(mode=b"0004755\0"), ArchiveError),
        "non-canonical owner": (lambda: bad_header(uid=b"0001750\0"), ArchiveError),
        "member larger than the geometry allows": (
            lambda: [m, [Raw(b[0].name, envelope + b"\0" * 600)], b[1:], s],
            UnsafeArchiveError,
        ),
        "member size claims a gigabyte": (
            lambda: [
                m,
                [Raw(b[0].name, b"", header(b[0].name, 1 << 30), index_hash=h0i)],
                b[1:],
                s,
            ],
            UnsafeArchiveError,
        ),
        "huge sequence record": (
            lambda: [m, b, [Raw("sequences/s.json", b" " * (17 << 20))]],
            UnsafeArchiveError,
        ),
        "name differs from the hash": (lambda: renamed(f"blocks/{'1' * 16}.tlkv"), ArchiveError),
        "block of another geometry": (
            lambda: [manifest_member(SMALL, 1, 0), [Raw(f"blocks/{other_hash}.tlkv", other)]],
            ShapeError,
        ),
        "two blocks in one member": (
            lambda: [manifest_member(SMALL, 6, 1), [Raw(f"blocks/{two_hash}.tlkv", two)], b, s],
            UnsafeArchiveError,  # larger than a single-block envelope may be
        ),
        "zero blocks in a member": (
            lambda: [m, [Raw(b[0].name, empty, index_hash=h0i)], b[1:], s],
            FormatError,
        ),
        "bad block CRC": (
            lambda: [m, [Raw(b[0].name, envelope[:-1] + bytes([envelope[-1] ^ 1]))], b[1:], s],
            ChecksumError,
        ),
        "sequence references a missing block": (
            lambda: [manifest_member(SMALL, 4, 1), b[1:], s],
            ArchiveError,
        ),
        "tail missing": (lambda: [m, b, [s[0]]], ArchiveError),
        "tail with a hash": (lambda: [m, b, [s[0], Raw(s[1].name, envelope)]], ArchiveError),
        "tail of a block": (lambda: [m, [*b, Raw(s[1].name, tail_raw)], s], ArchiveError),
        "count mismatch": (lambda: [manifest_member(SMALL, 9, 1), b, s], ArchiveError),
        "future archive version": (
            lambda: [manifest_member(SMALL, 5, 1, archive_version=6), b, s],
            UnsupportedVersionError,
        ),
        "unknown manifest key": (
            lambda: [manifest_member(SMALL, 5, 1, extra=1), b, s],
            ArchiveError,
        ),
        "non-canonical manifest": (
            lambda: [[Raw("manifest.json", m[0].data.replace(b",", b", "))], b, s],
            ArchiveError,
        ),
        "non-canonical sequence": (
            lambda: [
                m,
                b,
                [Raw("sequences/s.json", s[0].data.replace(b'"name"', b' "name"')), s[1]],
            ],
            ArchiveError,
        ),
        "sequence names another": (
            lambda: [
                m,
                b,
                [
                    Raw(
                        "sequences/s.json",
                        canonical_json({"hashes": [], "name": "t", "tail": True}),
                    ),
                    s[1],
                ],
            ],
            ArchiveError,
        ),
        "sequence with hash zero": (
            lambda: [
                m,
                b,
                [Raw("sequences/s.json", SequenceRecord("s", [0], tail_raw).to_json()), s[1]],
            ],
            ArchiveError,
        ),
        "non-ascii name": (
            lambda: bad_header(name="blocks/\u00e9.tlkv".encode("latin-1")),
            UnsafeArchiveError,
        ),
        "stray zero block": (lambda: [m, b, bytes(512), s], ArchiveError),
        "end marker before the end": (lambda: [m, b, END_OF_ARCHIVE, s], ArchiveError),
    }
    cases.update(_own_cases())
    return cases


def _own_cases() -> dict[str, tuple[Callable[[], list[list[Raw] | bytes]], type[BaseException]]]:
    """Hostile version-4 archives: the blocks a sequence keeps of its own (ARCHIVE.md 1.6)."""
    m, b, s = valid_own_members()
    record, own, tail = s
    data = own.data
    other = split(make_envelope(SMALL, 4 * 3, version=2, seed=99))[0]  # another hash
    v1_own = next(x for x in b if x.name == "blocks/" + own.data[28:36][::-1].hex() + ".tlkv")
    hashes = json.loads(record.data)["hashes"]

    def changed(raw: Raw, changes: dict[str, object]) -> Raw:
        """``raw``'s JSON with keys replaced (None: removed), canonical."""
        obj = json.loads(raw.data) | changes
        return Raw(raw.name, canonical_json({k: v for k, v in obj.items() if v is not None}))

    def with_record(**changes: object) -> Raw:
        return changed(record, changes)

    def own_manifest(**changes: object) -> list[Raw]:
        return [changed(m[0], changes)]

    return {
        "own block truncated": (
            lambda: [m, b, [record, Raw(own.name, data[:-100]), tail]],
            FormatError,
        ),
        "own block bad CRC": (
            lambda: [m, b, [record, Raw(own.name, data[:-1] + bytes([data[-1] ^ 1])), tail]],
            ChecksumError,
        ),
        "own block name escapes": (
            lambda: [m, b, [record, Raw("sequences/../s.0.tlkv", data), tail]],
            UnsafeArchiveError,
        ),
        "own block name nested": (
            lambda: [m, b, [record, Raw("sequences/s/0.tlkv", data), tail]],
            UnsafeArchiveError,
        ),
        "own block hash disagrees with the record": (
            lambda: [m, b, [record, Raw(own.name, other), tail]],
            ArchiveError,
        ),
        "record's hash disagrees with its own block": (
            lambda: [m, b, [with_record(hashes=["1" * 16, *hashes[1:]]), own, tail]],
            ArchiveError,
        ),
        "own block at another position": (
            lambda: [m, b, [record, Raw("sequences/s.1.tlkv", data), tail]],
            ArchiveError,
        ),
        "own position past the hashes": (
            lambda: [m, b, [with_record(own=[3]), Raw("sequences/s.3.tlkv", data), tail]],
            ArchiveError,
        ),
        "own positions not ascending": (
            lambda: [m, b, [with_record(own=[0, 0]), own, own, tail]],
            ArchiveError,
        ),
        "own list empty": (lambda: [m, b, [with_record(own=[]), tail]], ArchiveError),
        "own block missing": (lambda: [m, b, [record, tail]], ArchiveError),
        "own block after the tail": (lambda: [m, b, [record, tail, own]], ArchiveError),
        "own block in another version": (
            lambda: [m, b, [record, Raw(own.name, v1_own.data), tail]],
            ArchiveError,
        ),
        "own blocks in a version-2 archive": (
            lambda: [own_manifest(archive_version=2, own_blocks=None), b, s],
            ArchiveError,
        ),
        "own record in a version-2 archive": (
            lambda: [manifest_member(SMALL, 3, 1), b, [record, tail]],
            ArchiveError,
        ),
        "own member name in a version-2 archive": (
            lambda: [
                manifest_member(SMALL, 3, 1),
                b,
                [with_record(own=None), Raw(own.name, data), tail],
            ],
            UnsafeArchiveError,
        ),
        "own block count mismatch": (lambda: [own_manifest(own_blocks=2), b, s], ArchiveError),
        "version 4 without own blocks": (
            lambda: [own_manifest(own_blocks=0), b, s],
            ArchiveError,
        ),
        "own blocks count claims a bomb": (
            lambda: [own_manifest(own_blocks=1 << 31), b, s],
            ArchiveError,
        ),
    }


CASES = _cases()


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_members(case: str, target: Store, tmp_path: Path) -> None:
    build, error = CASES[case]
    path = craft(tmp_path / "hostile.tar.zst", build())
    refused(path, target, error)


def test_wrong_geometry_archive(target: Store, tmp_path: Path) -> None:
    m, b, s = valid_members(OTHER)
    path = craft(tmp_path / "other.tar.zst", [m, b, s])
    assert ar.verify(path).manifest.geometry == OTHER  # valid on its own
    before = snapshot(target)
    with pytest.raises(ShapeError):
        ar.restore(path, target)
    with pytest.raises(ShapeError):
        ar.verify(path, geometry=SMALL)
    assert snapshot(target) == before


def test_index_disagreeing_with_members(target: Store, tmp_path: Path) -> None:
    m, b, s = valid_members()
    h = int(b[0].name[7:23], 16)
    path = craft(tmp_path / "idx.tar.zst", [m, b, s], index_blocks=[(h, 1, 512)])
    refused(path, target, ArchiveError)
    path = craft(tmp_path / "idx2.tar.zst", [m, b, s], index_blocks=[])
    refused(path, target, ArchiveError)


# --- decompression bombs -----------------------------------------------------------------


def _bounded(fn: Callable[[], object], error: type[BaseException]) -> None:
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    with pytest.raises(error):
        fn()
    assert time.perf_counter() - t0 < 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 128 * 1024  # KiB


def test_bomb_index_declares_a_huge_frame(target: Store, tmp_path: Path) -> None:
    m, b, s = valid_members()
    chunks = zstandard.ZstdCompressor(level=1, write_checksum=True).compressobj(size=1 << 30)
    zeros = b"".join(chunks.compress(bytes(1 << 24)) for _ in range(64)) + chunks.flush()
    path = craft(tmp_path / "bomb1.tar.zst", [m, b, s], raw_frames={1: (zeros, 1 << 30)})
    before = snapshot(target)
    _bounded(lambda: ar.restore(path, target), UnsafeArchiveError)
    _bounded(lambda: ar.verify(path), UnsafeArchiveError)
    assert snapshot(target) == before


def test_bomb_frame_bigger_than_declared(target: Store, tmp_path: Path) -> None:
    m, b, s = valid_members()
    # No content size in the frame header, a gigabyte inside, 512 bytes in the index.
    cctx = zstandard.ZstdCompressor(level=1, write_checksum=True, write_content_size=False)
    chunks = cctx.compressobj()
    zeros = b"".join(chunks.compress(bytes(1 << 24)) for _ in range(64)) + chunks.flush()
    path = craft(tmp_path / "bomb2.tar.zst", [m, b, s], raw_frames={1: (zeros, 512)})
    _bounded(lambda: ar.restore(path, target), ArchiveError)
    # A frame whose header lies about its size: 1 KiB declared, 64 KiB inside.
    lie = bytearray(compress(bytes(65536)))
    real = compress(bytes(1024))
    fake = real[:6] + bytes(lie[6:])  # 1 KiB content-size field, 64 KiB of blocks
    path = craft(tmp_path / "bomb3.tar.zst", [m, b, s], raw_frames={1: (fake, 1024)})
    _bounded(lambda: ar.verify(path), ArchiveError)


def test_bomb_huge_window(target: Store, tmp_path: Path) -> None:
    m, b, s = valid_members()
    content = b"".join(x.encode() for x in b)
    frame = bytearray(compress(content))
    # Rewrite the frame header: clear Single_Segment, add a 2 GiB Window_Descriptor.
    descriptor = frame[4]
    assert descriptor & 0x20
    fcs_flag = descriptor >> 6
    new = bytes([(descriptor & ~0x20) & 0xFF, 21 << 3])
    if fcs_flag == 1:  # a 2-byte FCS is only allowed with Single_Segment; keep 4 bytes
        value = int.from_bytes(frame[5:7], "little") + 256
        new = bytes([((descriptor & ~0x20) & 0x3F) | 0x80, 21 << 3]) + value.to_bytes(4, "little")
        frame = frame[:4] + new + frame[7:]
    else:
        frame = frame[:4] + new + frame[5:]
    path = craft(
        tmp_path / "bomb4.tar.zst", [m, b, s], raw_frames={1: (bytes(frame), len(content))}
    )
    _bounded(lambda: ar.restore(path, target), UnsafeArchiveError)


def test_bomb_total_beyond_manifest(target: Store, tmp_path: Path) -> None:
    m, b, s = valid_members()
    zeros = compress(bytes(8 << 20))
    frames: list[list[Raw] | bytes] = [m, b, s]
    raw = {i: (zeros, 8 << 20) for i in range(3, 40)}
    path = craft(tmp_path / "bomb5.tar.zst", [*frames, *[bytes(512)] * 37], raw_frames=raw)
    _bounded(lambda: ar.verify(path), UnsafeArchiveError)
