"""Archives with real stores: byte-identical round trips, determinism, interop with the
real ``zstd`` and ``tar`` commands, random access, listing, partial restore."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from archive_helpers import LONG_NAME, frame_bounds, populate, snapshot
from conftest import SMALL, make_envelope

from kvstore import ArchiveError, ChecksumError, Geometry, ShapeError, decode
from kvstore import archive as ar
from kvstore.archive import writer as archive_writer
from kvstore.archive.frames import FrameReader
from kvstore.archive.tar import ustar_header
from kvstore.cli import main
from kvstore.errors import PinnedError
from kvstore.store.store import Store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(tmp_path / "src") as s:
        populate(s)
        yield s


@pytest.fixture
def small_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    """Frames of about 2 KiB: the small test blocks spread over many frames."""
    monkeypatch.setattr(archive_writer, "FRAME_TARGET", 2048)


@pytest.fixture
def archive_file(store: Store, tmp_path: Path, small_frames: None) -> Path:
    path = tmp_path / "state.tlkv.tar.zst"
    ar.create(store, path)
    assert len(frame_bounds(path)) > 10
    return path


def test_round_trip_every_get_equal(store: Store, archive_file: Path, tmp_path: Path) -> None:
    with Store(tmp_path / "dst") as dst:
        report = ar.restore(archive_file, dst)
        before, after = snapshot(store), snapshot(dst)
        assert after["blocks"] == before["blocks"]
        assert after["sequences"] == before["sequences"]
        assert after["stats"] == before["stats"]
        assert report.blocks == report.new_blocks == before["stats"]["blocks"]
        assert report.sequences == 4 and not report.problems
        with store.reader() as r:
            hashes = [h for h, _ in r.iter_blocks()]
        assert dst.get_many(hashes) == store.get_many(hashes)
        assert dst.geometry == SMALL


def test_archive_twice_is_byte_identical(store: Store, archive_file: Path, tmp_path: Path) -> None:
    again = tmp_path / "again.tar.zst"
    ar.create(store, again, threads=1)
    assert again.read_bytes() == archive_file.read_bytes()


def test_archive_restore_archive_is_byte_identical(archive_file: Path, tmp_path: Path) -> None:
    with Store(tmp_path / "dst") as dst:
        ar.restore(archive_file, dst)
        second = tmp_path / "second.tar.zst"
        ar.create(dst, second)
    assert second.read_bytes() == archive_file.read_bytes()


def test_zstd_and_tar_extract_byte_identical_files(
    store: Store, archive_file: Path, tmp_path: Path
) -> None:
    out = tmp_path / "x"
    out.mkdir()
    subprocess.run(f"zstd -q -dc '{archive_file}' | tar -x -C '{out}'", shell=True, check=True)
    subprocess.run(["zstd", "-q", "-t", str(archive_file)], check=True)
    with store.reader() as r:
        stored = {h: bytes(v) for h, v in r.iter_blocks()}
    files = sorted((out / "blocks").iterdir())
    assert [f.name for f in files] == [f"{h:016x}.tlkv" for h in sorted(stored)]
    for f in files:
        assert f.read_bytes() == store.get(int(f.stem, 16)) == stored[int(f.stem, 16)]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["geometry"] == {
        "block_tokens": 4,
        "head_dim": 8,
        "n_kv_heads": 2,
        "n_layers": 2,
    }
    assert manifest["blocks"] == len(stored) and manifest["sequences"] == 4
    for name in store.sequences():
        record = json.loads((out / "sequences" / f"{name}.json").read_text())
        env = decode(store.get_sequence(name))
        full = [f"{h:016x}" for h in env.hashes.tolist() if h]
        assert record == {"hashes": full, "name": name, "tail": len(full) < len(env)}
        tail = out / "sequences" / f"{name}.tail.tlkv"
        assert tail.exists() == record["tail"]
        if record["tail"]:
            assert decode(tail.read_bytes()).hashes[0] == 0
    assert (out / "sequences" / f"{LONG_NAME}.json").exists()  # the pax path record


def test_member_order_and_headers_seen_by_tarfile(archive_file: Path, tmp_path: Path) -> None:
    plain = tmp_path / "plain.tar"
    subprocess.run(f"zstd -q -dc '{archive_file}' > '{plain}'", shell=True, check=True)
    with tarfile.open(plain) as tf:
        members = tf.getmembers()
    names = [m.name for m in members]
    assert names[0] == "manifest.json"
    blocks = [n for n in names if n.startswith("blocks/")]
    assert blocks == sorted(blocks) and names[1 : 1 + len(blocks)] == blocks
    seqs = names[1 + len(blocks) :]
    assert seqs == [
        f"sequences/{LONG_NAME}.json",
        f"sequences/{LONG_NAME}.tail.tlkv",
        "sequences/chat-1.json",
        "sequences/chat-1.tail.tlkv",
        "sequences/chat-2.json",
        "sequences/v2-seq.json",
        "sequences/v2-seq.tail.tlkv",
    ]
    assert all(
        m.isreg() and m.mtime == 0 and m.uid == m.gid == 0 and m.mode == 0o644 for m in members
    )
    # Golden bytes of the first header (ARCHIVE.md 2.1).
    head = plain.read_bytes()[:512]
    assert head == ustar_header("manifest.json", members[0].size)
    assert head[:13] == b"manifest.json" and head[100:108] == b"0000644\0"
    assert (
        head[136:148] == b"00000000000\0"
        and head[156:157] == b"0"
        and head[257:265] == b"ustar\x0000"
    )


def test_extract_reads_one_block(store: Store, archive_file: Path, tmp_path: Path) -> None:
    with store.reader() as r:
        h = [h for h, _ in r.iter_blocks()][3]
    out = tmp_path / "one.tlkv"
    stored = store.get(h)
    assert stored is not None
    assert ar.extract(archive_file, h, out) == len(stored)
    assert out.read_bytes() == stored
    d = tmp_path / "dir"
    d.mkdir()
    ar.extract(archive_file, h, d)
    assert (d / f"{h:016x}.tlkv").read_bytes() == store.get(h)
    with pytest.raises(KeyError):
        ar.extract(archive_file, 12345, out)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_extract_reads_only_the_frame_holding_the_block(
    store: Store,
    archive_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With every other data frame damaged, extract of X (library and CLI) still yields
    get(X), reading frame 0 (the manifest) and X's frame only, while verify refuses the
    file; with X's own frame damaged, extract refuses too."""
    with ar.ArchiveReader(archive_file) as reader:
        table = reader.index.blocks
        home = dict(zip(table["hash"].tolist(), table["frame"].tolist()))  # hash -> frame
    hashes = sorted(home)
    x = hashes[len(hashes) // 2]
    bounds = frame_bounds(archive_file)  # data frames, then the index frame
    others = [i for i in range(1, len(bounds) - 1) if i != home[x]]
    assert 0 < home[x] < len(bounds) - 2
    assert len({home[h] for h in hashes} - {home[x]}) >= 3  # other frames hold blocks
    raw = bytearray(archive_file.read_bytes())

    def damaged(frames: list[int], name: str) -> Path:
        data = bytearray(raw)
        for i in frames:
            offset, size = bounds[i]
            data[offset + size // 2] ^= 0x55
        path = tmp_path / name
        path.write_bytes(bytes(data))
        return path

    bad = damaged(others, "others.tar.zst")
    read: list[int] = []
    real = FrameReader.read_frame

    def spy(self: FrameReader, i: int) -> bytes:
        read.append(i)
        return real(self, i)

    monkeypatch.setattr(FrameReader, "read_frame", spy)
    out = tmp_path / "x.tlkv"
    assert ar.extract(bad, x, out) == len(store.get(x) or b"")
    assert out.read_bytes() == store.get(x)
    assert read == [0, home[x]]
    cli_out = tmp_path / "cli.tlkv"
    assert main(["archive", "extract", str(bad), f"{x:016x}", "-o", str(cli_out)]) == 0
    assert cli_out.read_bytes() == store.get(x)
    with pytest.raises(ArchiveError):
        ar.verify(bad)
    capsys.readouterr()
    assert main(["archive", "verify", str(bad)]) == 3
    # Every other block sits in a damaged frame: extracting one of them fails.
    y = next(h for h in hashes if home[h] != home[x])
    with pytest.raises(ArchiveError):
        ar.extract(bad, y, tmp_path / "y.tlkv")

    own = damaged([home[x]], "own.tar.zst")
    with pytest.raises(ArchiveError):
        ar.extract(own, x, tmp_path / "own.tlkv")
    assert main(["archive", "extract", str(own), f"{x:016x}", "-o", str(tmp_path / "c")]) == 3
    assert not (tmp_path / "own.tlkv").exists() and not (tmp_path / "c").exists()
    assert ar.extract(own, y, tmp_path / "y.tlkv") == len(store.get(y) or b"")


def test_extract_all_equals_tar(archive_file: Path, tmp_path: Path) -> None:
    dest = tmp_path / "all"
    n = ar.extract_all(archive_file, dest)
    ref = tmp_path / "ref"
    ref.mkdir()
    subprocess.run(f"zstd -q -dc '{archive_file}' | tar -x -C '{ref}'", shell=True, check=True)
    ours = {p.relative_to(dest): p.read_bytes() for p in dest.rglob("*") if p.is_file()}
    theirs = {p.relative_to(ref): p.read_bytes() for p in ref.rglob("*") if p.is_file()}
    assert ours == theirs and n == len(ours)
    with pytest.raises(FileExistsError):
        ar.extract_all(archive_file, dest)


def test_list_and_verify(store: Store, archive_file: Path) -> None:
    listing = ar.list_archive(archive_file)
    with store.reader() as r:
        assert listing.hashes.tolist() == [h for h, _ in r.iter_blocks()]
    assert [s.name for s in listing.sequences] == store.sequences()
    assert {s.name: s.tail for s in listing.sequences} == {
        "chat-1": True,
        "chat-2": False,
        LONG_NAME: True,
        "v2-seq": True,
    }
    d = listing.to_dict()
    assert d["manifest"]["blocks"] == len(d["blocks"])
    report = ar.verify(archive_file, geometry=SMALL)
    assert report.blocks == store.stats()["blocks"] and report.sequences == 4
    with pytest.raises(ShapeError):
        ar.verify(archive_file, geometry=Geometry(4, 2, 2, 16))
    assert [h for h, _ in ar.iter_blocks(archive_file)] == listing.hashes.tolist()


def test_restore_dedupes_and_pins(archive_file: Path, store: Store, tmp_path: Path) -> None:
    with Store(tmp_path / "dst") as dst:
        first = ar.restore(archive_file, dst)
        second = ar.restore(archive_file, dst)
        assert second.new_blocks == 0 and second.blocks == first.blocks
        assert snapshot(dst) == snapshot(store)
        pinned = decode(dst.get_sequence("chat-1")).hashes[0]
        with pytest.raises(PinnedError):
            dst.delete(int(pinned))
        assert dst.stats()["pinned_blocks"] == store.stats()["pinned_blocks"] > 0


def test_restore_keeps_existing_content(archive_file: Path, store: Store, tmp_path: Path) -> None:
    with Store(tmp_path / "dst") as dst:
        populate(dst, seed=5)
        mine = snapshot(dst)
        ar.restore(archive_file, dst)
        after = snapshot(dst)
        assert mine["blocks"].items() <= after["blocks"].items()
        theirs = snapshot(store)
        assert theirs["blocks"].items() <= after["blocks"].items()
        # same-name sequences are replaced by the archive's
        assert after["sequences"] == theirs["sequences"]


def test_create_selected_sequences(store: Store, tmp_path: Path) -> None:
    path = tmp_path / "one.tar.zst"
    ar.create(store, path, sequences=["chat-2"])
    want = [h for h in decode(store.get_sequence("chat-2")).hashes.tolist() if h]
    listing = ar.list_archive(path)
    assert listing.hashes.tolist() == sorted(set(want))
    assert [s.name for s in listing.sequences] == ["chat-2"]
    with Store(tmp_path / "dst") as dst:
        ar.restore(path, dst)
        assert dst.get_sequence("chat-2") == store.get_sequence("chat-2")
        assert dst.sequences() == ["chat-2"]
    with pytest.raises(KeyError):
        ar.create(store, tmp_path / "none.tar.zst", sequences=["nope"])
    assert not (tmp_path / "none.tar.zst").exists()
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".none")] == []


def test_empty_store(tmp_path: Path) -> None:
    with Store(tmp_path / "empty") as s:
        ar.create(s, tmp_path / "e.tar.zst")
    assert ar.verify(tmp_path / "e.tar.zst").manifest.geometry is None
    with Store(tmp_path / "dst") as dst:
        assert ar.restore(tmp_path / "e.tar.zst", dst).blocks == 0
        assert dst.stats()["blocks"] == 0


def test_create_replaces_atomically(store: Store, archive_file: Path) -> None:
    old = archive_file.read_bytes()
    store.put(make_envelope(SMALL, 8, seed=99))
    ar.create(store, archive_file)
    assert archive_file.read_bytes() != old
    assert ar.verify(archive_file).blocks == store.stats()["blocks"]
    assert [p.name for p in archive_file.parent.iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.parametrize("command", ["create", "extract", "extract_all"])
def test_outputs_get_the_usual_permissions(
    command: str, store: Store, archive_file: Path, tmp_path: Path
) -> None:
    """Files (and extract --all's directory) are created as open() would under the umask."""
    old = os.umask(0o022)
    try:
        if command == "create":
            target = tmp_path / "made.tar.zst"
            ar.create(store, target)
            want = 0o644
        elif command == "extract":
            target = tmp_path / "one.tlkv"
            ar.extract(archive_file, int(ar.list_archive(archive_file).hashes[0]), target)
            want = 0o644
        else:
            target = tmp_path / "all"
            ar.extract_all(archive_file, target)
            want = 0o755
    finally:
        os.umask(old)
    assert oct(target.stat().st_mode & 0o777) == oct(want)


def test_create_quarantines_corrupt_blocks(store: Store, tmp_path: Path) -> None:
    with store.reader() as r:
        victim = next(h for h, _ in r.iter_blocks())
    # Corrupt the stored value on disk, as a bit rot would.
    good = store.get(victim)
    assert good is not None
    store.close()
    data = tmp_path / "src" / "data.mdb"
    raw = bytearray(data.read_bytes())
    at = raw.find(good[40:80])
    assert at > 0
    while at > 0:  # every copy (LMDB is copy-on-write: old pages may hold one too)
        raw[at] ^= 0xFF
        at = raw.find(good[40:80], at + 1)
    data.write_bytes(bytes(raw))
    with Store(tmp_path / "src") as s:
        summary = ar.create(s, tmp_path / "c.tar.zst")
        assert any(f"{victim:016x}" in line for line in summary.skipped)
        assert victim not in ar.list_archive(tmp_path / "c.tar.zst").hashes.tolist()
        ar.verify(tmp_path / "c.tar.zst")


def test_partial_restore_skips_a_damaged_frame(archive_file: Path, tmp_path: Path) -> None:
    bounds = frame_bounds(archive_file)
    raw = bytearray(archive_file.read_bytes())
    offset, size = bounds[1]  # the first frame of blocks
    raw[offset + size // 2] ^= 0x55
    bad = tmp_path / "bad.tar.zst"
    bad.write_bytes(bytes(raw))
    with Store(tmp_path / "dst") as dst:
        with pytest.raises(Exception):  # noqa: B017 - any refusal; the store stays empty
            ar.restore(bad, dst)
        assert dst.stats()["blocks"] == 0
        report = ar.restore(bad, dst, partial=True)
        assert report.problems and "frame 1" in str(report.problems[0])
        assert 0 < report.blocks < ar.list_archive(archive_file).hashes.size
        for item in ar.list_archive(archive_file).sequences:
            restored = dst.get_sequence(item.name)
            assert restored is None or decode(restored)
        assert os.path.exists(tmp_path / "dst")


def test_failed_commit_phase_is_undone(
    archive_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvstore import StoreFullError
    from kvstore.archive import importer as archive_importer

    monkeypatch.setattr(archive_importer, "COMMIT_BATCH_BYTES", 2000)  # many batches
    with Store(tmp_path / "dst") as dst:
        populate(dst, seed=9)
        before = snapshot(dst)
        real = dst.import_batch
        calls = [0]

        def flaky(*args: object, **kw: object) -> object:
            calls[0] += 1
            if calls[0] == 4:
                raise StoreFullError("the disk is full (simulated)")
            return real(*args, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(dst, "import_batch", flaky)
        with pytest.raises(StoreFullError):
            ar.restore(archive_file, dst)
        assert calls[0] == 4
        assert snapshot(dst) == before
        monkeypatch.setattr(dst, "import_batch", real)

        # A block's bytes change after the reader checked them (the file changed between
        # two passes, or under the one pass): the store's own CRC check refuses it.
        scan = ar.ArchiveReader.scan

        def tampered(self: ar.ArchiveReader, **kw: object) -> Iterator[object]:
            for i, item in enumerate(scan(self, **kw)):  # type: ignore[arg-type]
                if i == 7 and isinstance(item, ar.ArchiveBlock):
                    bad = bytearray(item.envelope)
                    bad[60] ^= 1
                    item = ar.ArchiveBlock(item.hash, memoryview(bytes(bad)))
                yield item

        monkeypatch.setattr(ar.ArchiveReader, "scan", tampered)
        with pytest.raises(ChecksumError):
            ar.restore(archive_file, dst)
        assert snapshot(dst) == before


def _flip_in_frame(path: Path, frame: int, out: Path) -> Path:
    raw = bytearray(path.read_bytes())
    offset, size = frame_bounds(path)[frame]
    raw[offset + size // 2] ^= 0x01
    out.write_bytes(bytes(raw))
    return out


def test_one_pass_restore_undoes_blocks_committed_before_a_late_refusal(
    archive_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Restore reads the archive once, committing blocks as they pass; a member refused
    near the end leaves the store exactly as it was (sequences untouched, blocks undone)."""
    from kvstore.archive import importer as archive_importer

    monkeypatch.setattr(archive_importer, "COMMIT_BATCH_BYTES", 2000)  # many batches
    with ar.ArchiveReader(archive_file) as reader:
        last_block_frame = int(reader.index.blocks["frame"].max())
    bad = _flip_in_frame(archive_file, last_block_frame, tmp_path / "late.tar.zst")
    scans = [0]
    scan = ar.ArchiveReader.scan

    def counted(self: ar.ArchiveReader, **kw: object) -> Iterator[object]:
        scans[0] += 1
        yield from scan(self, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(ar.ArchiveReader, "scan", counted)
    with Store(tmp_path / "dst") as dst:
        populate(dst, seed=9)
        # a sequence the archive replaces on success
        dst.put_sequence("chat-1", make_envelope(SMALL, 4 * 2, seed=4242))
        before = snapshot(dst)
        real = dst.import_batch
        committed = [0]

        def counting(*args: object, **kw: object) -> object:
            committed[0] += 1
            return real(*args, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(dst, "import_batch", counting)
        with pytest.raises(ArchiveError):
            ar.restore(bad, dst)
        assert scans[0] == 1  # one pass over the archive
        assert committed[0] >= 2  # blocks were committed before the refusal...
        assert snapshot(dst) == before  # ...and removed again
        scans[0] = 0
        report = ar.restore(archive_file, dst)  # the good archive, in one pass too
        assert scans[0] == 1
        assert report.sequences == 4
        with Store(tmp_path / "src2") as fresh:
            ar.restore(archive_file, fresh)
            assert dst.get_sequence("chat-1") == fresh.get_sequence("chat-1")


def test_restore_validates_first_when_it_could_evict(
    archive_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Into a store whose capacity the archive might exceed, a refused archive must not
    have evicted anything: restore validates everything before it writes."""
    with ar.ArchiveReader(archive_file) as reader:
        data_bytes = reader.index.data_bytes
    with Store(tmp_path / "dst") as dst:
        populate(dst, seed=9)
        used = int(dst.stats()["bytes"])  # type: ignore[arg-type]
    bad = _flip_in_frame(archive_file, 2, tmp_path / "early.tar.zst")
    with Store(tmp_path / "dst", capacity_bytes=used + data_bytes // 2) as dst:
        before = snapshot(dst)
        calls = [0]
        real = dst.import_batch

        def counting(*args: object, **kw: object) -> object:
            calls[0] += 1
            return real(*args, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(dst, "import_batch", counting)
        with pytest.raises(ArchiveError):
            ar.restore(bad, dst)
        assert calls[0] == 0  # refused by the validation pass: nothing written
        assert snapshot(dst) == before
        assert ar.restore(archive_file, dst).blocks == ar.verify(archive_file).blocks
