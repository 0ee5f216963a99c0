"""``tlkv archive``: create, restore, verify, ls, extract; exit codes; progress bar."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from archive_helpers import (
    REPO,
    Raw,
    craft,
    frame_bounds,
    manifest_member,
    populate,
    run_tlkv,
    snapshot,
    valid_members,
)
from conftest import SMALL, make_envelope

from kvstore import Geometry, decode
from kvstore.archive import list_archive
from kvstore.cli import main
from kvstore.cli.archive import ProgressBar
from kvstore.store.store import Store


@pytest.fixture
def data(tmp_path: Path) -> Path:
    path = tmp_path / "store"
    with Store(path) as s:
        populate(s)
    return path


@pytest.fixture
def archive_file(data: Path, tmp_path: Path) -> Path:
    path = tmp_path / "a.tar.zst"
    assert main(["archive", "create", "--data", str(data), "-o", str(path), "--quiet"]) == 0
    return path


def tlkv(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["archive", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
def test_subprocess_round_trip(data: Path, tmp_path: Path) -> None:
    out = tmp_path / "sub.tar.zst"
    ran = subprocess.run(
        [sys.executable, "-m", "kvstore", "archive", "create", "--data", str(data), "-o", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert ran.returncode == 0, ran.stderr
    assert "blocks" in ran.stdout and ran.stderr == ""  # no progress bar: not a terminal
    r = run_tlkv("archive", "restore", str(out), "--data", str(tmp_path / "dst"))
    assert r.code == 0, r.err
    assert "restored" in r.out and r.err == ""
    with Store(data) as a, Store(tmp_path / "dst") as b:
        assert snapshot(a) == snapshot(b)
    assert run_tlkv("archive", "verify", str(out), "--quiet").out == ""


def test_verify_ls_extract(
    archive_file: Path, data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = tlkv(capsys, "verify", str(archive_file))
    assert code == 0 and out.startswith("ok: ")
    code, out, _ = tlkv(capsys, "verify", str(archive_file), "--geometry", "4,2,2,16")
    assert code == 4
    code, out, _ = tlkv(capsys, "ls", str(archive_file), "--json")
    listing = json.loads(out)
    assert code == 0 and listing["manifest"]["format"] == "tlkv-archive"
    code, text, _ = tlkv(capsys, "ls", str(archive_file))
    assert code == 0 and f"blocks/{listing['blocks'][0]}.tlkv" in text
    assert "sequences/chat-1.json" in text
    h = listing["blocks"][2]
    one = tmp_path / "one.tlkv"
    code, out, _ = tlkv(capsys, "extract", str(archive_file), h, "-o", str(one))
    assert code == 0
    with Store(data) as s:
        assert one.read_bytes() == s.get(int(h, 16))
    code, _, err = tlkv(capsys, "extract", str(archive_file), "0" * 15 + "1", "-o", str(one))
    assert code == 1 and "not in the archive" in err
    code, _, _ = tlkv(capsys, "extract", str(archive_file), "--all", "-o", str(tmp_path / "all"))
    assert (
        code == 0 and (tmp_path / "all" / "blocks" / f"{h}.tlkv").read_bytes() == one.read_bytes()
    )


def test_exit_codes(archive_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw = bytearray(archive_file.read_bytes())
    offset, size = frame_bounds(archive_file)[1]
    raw[offset + size // 2] ^= 1
    bad = tmp_path / "bad.tar.zst"
    bad.write_bytes(bytes(raw))
    code, _, err = tlkv(capsys, "verify", str(bad))
    assert code == 3 and "ArchiveError" in err
    code, _, err = tlkv(capsys, "restore", str(bad), "--data", str(tmp_path / "x"))
    assert code == 3
    with Store(tmp_path / "x") as s:
        assert s.stats()["blocks"] == 0
    # wrong geometry: exit 4, the store unchanged
    with Store(tmp_path / "other", geometry=Geometry(4, 2, 2, 16)):
        pass
    code, _, err = tlkv(capsys, "restore", str(archive_file), "--data", str(tmp_path / "other"))
    assert code == 4 and "ShapeError" in err
    # a future archive version: exit 5
    m, b, seqs = valid_members()
    future = craft(
        tmp_path / "v6.tar.zst", [manifest_member(SMALL, 5, 1, archive_version=6), b, seqs]
    )
    assert tlkv(capsys, "verify", str(future))[0] == 5
    # an unsafe member: exit 3, and extract --all writes nothing
    h = int(b[0].name[7:23], 16)
    evil = craft(
        tmp_path / "e.tar.zst", [m, [Raw("blocks/../x.tlkv", b[0].data, index_hash=h)], b[1:], seqs]
    )
    code, _, err = tlkv(capsys, "extract", str(evil), "--all", "-o", str(tmp_path / "ex"))
    assert code == 3 and "UnsafeArchiveError" in err and not (tmp_path / "ex").exists()
    assert tlkv(capsys, "verify", str(tmp_path / "missing.tar.zst"))[0] == 1


def test_partial_restore(
    archive_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    m, b, s = valid_members()
    bad_block = Raw(b[1].name, b[1].data[:-1] + bytes([b[1].data[-1] ^ 1]))
    path = craft(tmp_path / "p.tar.zst", [m, [b[0]], [bad_block], b[2:], s])
    dst = tmp_path / "dst"
    code, _, err = tlkv(capsys, "restore", str(path), "--data", str(dst))
    assert code == 3
    with Store(dst) as st:
        assert st.stats()["blocks"] == 0
    code, out, err = tlkv(capsys, "restore", str(path), "--data", str(dst), "--partial")
    assert code == 3 and "ChecksumError" in err and b[1].name in err
    assert "restored 4 blocks" in out
    with Store(dst) as st:
        assert st.stats()["blocks"] == 4
        assert st.sequences() == []  # its block 1 was refused, so the sequence is too
        assert decode(st.get(int(b[0].name[7:23], 16)))


def test_create_selected_sequence(
    data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sel.tar.zst"
    code, _, _ = tlkv(
        capsys, "create", "--data", str(data), "-o", str(out), "--sequence", "chat-2", "--quiet"
    )
    assert code == 0
    code, text, _ = tlkv(capsys, "ls", str(out), "--json")
    assert [s["name"] for s in json.loads(text)["sequences"]] == ["chat-2"]
    code, _, err = tlkv(capsys, "create", "--data", str(data), "-o", str(out), "--sequence", "nope")
    assert code != 0 and "nope" in err


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal_only() -> None:
    tty = _Tty()
    bar = ProgressBar("restore", stream=tty)
    bar.start(10)
    bar.last = -1.0
    bar.update(5, 5 << 20)
    bar.close()
    text = tty.getvalue()
    assert text.startswith("\rrestore [" + "#" * 12 + "." * 12 + "]") and "5/10 blocks" in text
    assert "MB/s" in text and "ETA" in text and text.endswith("\n")
    quiet = _Tty()
    bar = ProgressBar("restore", stream=quiet, enabled=False)
    bar.start(1)
    bar.update(1, 1)
    bar.close()
    pipe = io.StringIO()
    bar = ProgressBar("restore", stream=pipe)
    bar.start(1)
    bar.last = -1.0
    bar.update(1, 1)
    bar.close()
    assert quiet.getvalue() == pipe.getvalue() == ""


def _last_draw(lines: list[str]) -> str:
    return lines[-1].rsplit("\r", 1)[-1]


@pytest.mark.parametrize("command", ["create", "verify", "restore"])
def test_progress_bar_of_the_real_commands_ends_full(
    command: str, data: Path, archive_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each phase's bar counts the same blocks its total counts: it ends at N/N, all '#'."""
    import kvstore.cli.archive as cli_archive

    monkeypatch.setattr(cli_archive, "REFRESH_SECONDS", 0.0)  # draw on every update
    tty = _Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    argv = {
        "create": ["create", "--data", str(data), "-o", str(tmp_path / "p.tar.zst")],
        "verify": ["verify", str(archive_file)],
        "restore": [
            "restore",
            str(archive_file),
            "--data",
            str(tmp_path / "fresh"),
        ],
    }[command]
    assert main(["archive", *argv]) == 0
    with Store(data) as s:
        n = s.stats()["blocks"]
    lines = [line for line in tty.getvalue().split("\n") if line.startswith("\r")]
    phases = {"restore": ["restore (validating and importing)"]}.get(command, [command])
    assert len(lines) == len(phases)
    for line, label in zip(lines, phases):
        last = _last_draw([line])
        assert last.startswith(f"{label} [" + "#" * 24 + "]"), last
        assert f" {n}/{n} blocks" in last and "ETA 0:00" in last


def test_refused_restore_into_a_new_directory_leaves_nothing(
    archive_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.tar.zst"
    raw = bytearray(archive_file.read_bytes())
    raw[len(raw) // 3] ^= 0xFF
    bad.write_bytes(bytes(raw))
    target = tmp_path / "new-store"
    code, _, err = tlkv(capsys, "restore", str(bad), "--data", str(target), "--quiet")
    assert code == 3 and err and not target.exists()
    code, _, _ = tlkv(capsys, "restore", str(archive_file), "--data", str(target), "--quiet")
    assert code == 0 and target.is_dir()


def test_create_archives_a_sequence_keeping_its_own_blocks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A sequence whose blocks were first stored in another version keeps its own copies;
    ``create`` archives them (version 4, ARCHIVE.md 1.6) and exits 0, and ``restore``
    into an empty store brings the sequence back byte-identical. Its blocks count as
    pinned."""
    data = tmp_path / "store"
    with Store(data) as s:
        s.put(make_envelope(SMALL, 8, version=1, seed=3))
        s.put_sequence("own", make_envelope(SMALL, 8, version=2, seed=3))  # same hashes
        s.put_sequence("plain", make_envelope(SMALL, 9, version=1, seed=4))
        assert s.stats()["pinned_blocks"] == 2 + 2  # own's 2 kept copies, plain's 2 blocks
        before = {name: s.get_sequence(name) for name in s.sequences()}
    out = tmp_path / "a.tar.zst"
    code, _, err = tlkv(capsys, "create", "--data", str(data), "-o", str(out), "--quiet")
    assert code == 0 and "skipped" not in err, err
    listing = list_archive(out)
    assert listing.manifest.archive_version == 4 and listing.manifest.own_blocks == 2
    assert [(x.name, x.own) for x in listing.sequences] == [("own", [0, 1]), ("plain", [])]
    assert tlkv(capsys, "verify", str(out))[0] == 0
    restored = tmp_path / "restored"
    code, _, err = tlkv(capsys, "restore", str(out), "--data", str(restored), "--quiet")
    assert code == 0, err
    with Store(restored) as s:
        assert {name: s.get_sequence(name) for name in s.sequences()} == before
        assert s.stats()["pinned_blocks"] == 2 + 2


def _flip_on_disk(data: Path, record: bytes) -> None:
    """Flip bytes of every copy of ``record`` (random KV: unique on disk) in the store's
    file, as a bit rot would (LMDB is copy-on-write: old pages may hold one too)."""
    mdb = data / "data.mdb"
    raw = bytearray(mdb.read_bytes())
    at = raw.find(record[64:104])
    assert at > 0
    while at > 0:
        raw[at] ^= 0xFF
        at = raw.find(record[64:104], at + 1)
    mdb.write_bytes(bytes(raw))


def test_create_refuses_to_leave_a_damaged_sequence_record_out_silently(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A sequence record failing its CRC (here in the tail it keeps) cannot be archived:
    ``create`` exits 7 naming it; with ``--allow-skipped`` the rest is archived."""
    data = tmp_path / "store"
    damaged = make_envelope(SMALL, 4 + 3, seed=6)
    with Store(data) as s:
        s.put_sequence("damaged", damaged)
        s.put_sequence("fine", make_envelope(SMALL, 8, seed=7))
    _flip_on_disk(data, bytes(decode(damaged)[1].raw))
    out = tmp_path / "a.tar.zst"
    code, _, err = tlkv(capsys, "create", "--data", str(data), "-o", str(out), "--quiet")
    assert code == 7 and "'damaged'" in err and "fails its CRC" in err, err
    assert not out.exists()
    code, _, err = tlkv(
        capsys, "create", "--data", str(data), "-o", str(out), "--quiet", "--allow-skipped"
    )
    assert code == 0 and "skipped sequence 'damaged'" in err, err
    assert [x.name for x in list_archive(out).sequences] == ["fine"]


def test_create_refuses_to_leave_a_corrupt_block_out_silently(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A block failing its CRC cannot be archived: ``create`` exits 7 naming it and
    writes nothing; with ``--allow-skipped`` it writes the rest and reports the block and
    the sequence using it as left out."""
    data = tmp_path / "store"
    victim_env = make_envelope(SMALL, 9, version=1, seed=4)
    with Store(data) as s:
        s.put_sequence("plain", victim_env)
        s.put_sequence("other", make_envelope(SMALL, 8, version=1, seed=5))
    victim = int(decode(victim_env).hashes[0])
    _flip_on_disk(data, bytes(decode(victim_env)[0].raw))
    out = tmp_path / "a.tar.zst"
    code, _, err = tlkv(capsys, "create", "--data", str(data), "-o", str(out), "--quiet")
    assert code == 7, err
    assert f"{victim:016x}" in err and "--allow-skipped" in err
    assert not out.exists() and list(tmp_path.glob("a.tar.zst*")) == []
    code, _, err = tlkv(
        capsys, "create", "--data", str(data), "-o", str(out), "--quiet", "--allow-skipped"
    )
    assert code == 0 and "skipped sequence 'plain'" in err, err
    assert [x.name for x in list_archive(out).sequences] == ["other"]
