"""Archives of models: the manifest records the model (version 2) or the models (version 3,
each model's members under ``models/<n>/``), restore keeps them (or renames them with
``--as``), and version-1 archives (written before models) restore into ``default``."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from archive_helpers import Raw, craft, populate, snapshot, valid_members
from conftest import SMALL, make_blocks, make_envelope

from kvstore import Block, Geometry, Store, encode
from kvstore.archive.manifest import BLOCK_NAME, MANIFEST_NAME, Manifest, Section, canonical_json
from kvstore.archive.operations import create, extract, list_archive, restore, verify
from kvstore.cli import main
from kvstore.errors import ArchiveError, ShapeError, UnsafeArchiveError

REPO = Path(__file__).resolve().parent.parent
VECTORS = REPO / "tests" / "vectors"


def test_two_models_round_trip_apart(tmp_path: Path) -> None:
    blocks = make_blocks(SMALL, 4 * 3 + 1, seed=4)
    with Store(tmp_path / "src") as src:
        a, b = src.model("org/a@1"), src.model("b")
        populate(a, seed=1)
        a.put_sequence("same", encode(SMALL, blocks))
        b.put_sequence("same", encode(SMALL, [Block(x.hash, x.n_tokens, x.kv * 3) for x in blocks]))
        want_a, want_b = snapshot(a), snapshot(b)
        create(a, tmp_path / "a.tar.zst")
        create(b, tmp_path / "b.tar.zst")
    assert list_archive(tmp_path / "a.tar.zst").manifest.model == "org/a@1"
    with Store(tmp_path / "dst") as dst:
        restore(tmp_path / "a.tar.zst", dst)
        restore(tmp_path / "b.tar.zst", dst)
        assert dst.models() == ["b", "default", "org/a@1"]
        assert snapshot(dst.model("org/a@1")) == want_a and snapshot(dst.model("b")) == want_b
        assert dst.stats()["blocks"] == 0
        restore(tmp_path / "b.tar.zst", dst, model="b-copy")  # restore --as
        assert snapshot(dst.model("b-copy")) == want_b


def test_cli_create_model_and_restore_as(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with Store(tmp_path / "src") as src:
        populate(src.model("m"), seed=2)
        want = snapshot(src.model("m"))
    out = str(tmp_path / "m.tar.zst")
    assert (
        main(["archive", "create", "--data", str(tmp_path / "src"), "--model", "m", "-o", out]) == 0
    )
    assert main(["archive", "ls", out]) == 0
    assert "model m," in capsys.readouterr().out
    assert main(["archive", "restore", out, "--data", str(tmp_path / "dst"), "--as", "n/2"]) == 0
    with Store(tmp_path / "dst") as dst:
        assert dst.models() == ["default", "n/2"] and snapshot(dst.model("n/2")) == want
    assert main(["archive", "restore", out, "--data", str(tmp_path / "dst"), "--as", "a b"]) == 2


def test_an_archive_written_before_models_restores_into_default(tmp_path: Path) -> None:
    want = json.loads((VECTORS / "format1.json").read_text())
    archive = tmp_path / "old.tar.zst"
    shutil.copy(VECTORS / "archive-format1.tar.zst", archive)
    listing = list_archive(archive)
    assert (listing.manifest.archive_version, listing.manifest.model) == (1, "default")
    with Store(tmp_path / "dst") as dst:
        dst.model("other").put(encode(SMALL, make_blocks(SMALL, 8, seed=1)))
        restore(archive, dst)
        assert dst.models() == ["default", "other"]
        with dst.reader() as r:
            got = {f"{h:016x}": hashlib.sha256(bytes(v)).hexdigest() for h, v in r.iter_blocks()}
        assert got == want["blocks"]
        seqs = {n: hashlib.sha256(dst.get_sequence(n) or b"").hexdigest() for n in dst.sequences()}
        assert seqs == want["sequences"]


# --- several models in one archive (format version 3) ---------------------------------------

WIDE = Geometry(block_tokens=4, n_layers=1, n_kv_heads=1, head_dim=16)


def two_models(root: Store) -> list[Block]:
    """``base`` and ``ft`` (same geometry, same prompt, other KV), ``wide`` (another
    geometry); returns the shared prompt's blocks."""
    blocks = make_blocks(SMALL, 4 * 3 + 1, seed=5)
    base, ft = root.model("base"), root.model("ft")
    populate(base, seed=3)
    base.put_sequence("same", encode(SMALL, blocks))
    ft.put_sequence("same", encode(SMALL, [Block(x.hash, x.n_tokens, x.kv * 2) for x in blocks]))
    root.model("wide").put_sequence("w", make_envelope(WIDE, 4 * 2 + 1, seed=6))
    return blocks


def test_several_models_round_trip_apart(tmp_path: Path) -> None:
    with Store(tmp_path / "src") as src:
        shared = two_models(src)
        want = {m: snapshot(src.model(m)) for m in src.models()}
        summary = create(src, tmp_path / "all.tar.zst")  # default: every model
    assert summary.manifest.archive_version == 3
    assert [x.model for x in summary.manifest.sections()] == ["base", "default", "ft", "wide"]
    names = subprocess.run(
        ["tar", "-I", "zstd", "-tf", str(tmp_path / "all.tar.zst")],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    h = f"{shared[0].hash:016x}"
    assert names[0] == "manifest.json" and names[-1] == "models/3/sequences/w.tail.tlkv"
    assert f"models/0/blocks/{h}.tlkv" in names and f"models/2/blocks/{h}.tlkv" in names
    assert {n.split("/")[1] for n in names[1:]} == {"0", "2", "3"}  # default holds nothing
    with Store(tmp_path / "dst") as dst:
        report = restore(tmp_path / "all.tar.zst", dst)
        assert report.sequences == 4 + 1 + 1 + 1
        assert dst.models() == ["base", "default", "ft", "wide"]
        assert {m: snapshot(dst.model(m)) for m in dst.models()} == want
        assert dst.model("base").get(shared[0].hash) != dst.model("ft").get(shared[0].hash)
        assert dst.model("wide").geometry == WIDE
        create(dst, tmp_path / "again.tar.zst")
    assert (tmp_path / "again.tar.zst").read_bytes() == (tmp_path / "all.tar.zst").read_bytes()
    verify(tmp_path / "all.tar.zst")
    listing = list_archive(tmp_path / "all.tar.zst")
    assert {(s.model, s.name) for s in listing.sequences} == {
        *(("base", n) for n in want["base"]["sequences"]),
        ("ft", "same"),
        ("wide", "w"),
    }
    got = {}
    for model in ("base", "ft"):
        out = tmp_path / f"{model}.tlkv"
        extract(tmp_path / "all.tar.zst", shared[0].hash, out, model=model)
        got[model] = out.read_bytes()
    with Store(tmp_path / "src") as src:
        assert got == {m: src.model(m).get(shared[0].hash) for m in ("base", "ft")}
    with pytest.raises(ValueError, match="name one"):
        extract(tmp_path / "all.tar.zst", shared[0].hash, tmp_path / "x.tlkv")
    with pytest.raises(KeyError):
        extract(tmp_path / "all.tar.zst", shared[0].hash, tmp_path / "x.tlkv", model="wide")


def test_cli_repeatable_model_and_rename(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = str(tmp_path / "src")
    with Store(data) as src:
        shared = two_models(src)
        want = {m: snapshot(src.model(m)) for m in ("base", "ft")}
    out = str(tmp_path / "two.tar.zst")
    create_args = ["archive", "create", "--data", data, "--model", "ft", "--model", "base"]
    assert main([*create_args, "-o", out]) == 0
    assert main(["archive", "ls", out]) == 0
    listed = capsys.readouterr().out
    assert "# models/0/: model base," in listed and "# models/1/: model ft," in listed
    assert f"models/1/blocks/{shared[0].hash:016x}.tlkv" in listed
    dst = str(tmp_path / "dst")
    with Store(dst) as s:
        s.model("ft").put(encode(SMALL, make_blocks(SMALL, 4, seed=9)))
        before = snapshot(s.model("ft"))
    assert main(["archive", "restore", out, "--data", dst, "--as", "only"]) != 0
    assert main(["archive", "restore", out, "--data", dst, "--as", "nope=x"]) == 1
    assert main(["archive", "restore", out, "--data", dst, "--as", "ft=base"]) != 0  # two into one
    with Store(dst) as s:
        assert s.models() == ["default", "ft"] and snapshot(s.model("ft")) == before
    assert main(["archive", "restore", out, "--data", dst, "--as", "ft=ft/2"]) == 0
    with Store(dst) as s:
        assert s.models() == ["base", "default", "ft", "ft/2"]
        assert snapshot(s.model("base")) == want["base"]
        assert snapshot(s.model("ft/2")) == want["ft"] and snapshot(s.model("ft")) == before
    h = f"{shared[0].hash:016x}"
    one = tmp_path / "one.tlkv"
    assert main(["archive", "extract", out, h, "--model", "ft", "-o", str(one)]) == 0
    with Store(data) as src:
        assert one.read_bytes() == src.model("ft").get(shared[0].hash)
    assert main(["archive", "extract", out, h, "-o", str(one)]) != 0
    capsys.readouterr()
    assert main(["archive", "verify", out]) == 0
    assert "model base:" in capsys.readouterr().out


def test_an_archive_of_format_2_restores_into_its_model(tmp_path: Path) -> None:
    want = json.loads((VECTORS / "format2.json").read_text())
    archive = tmp_path / "v2.tar.zst"
    shutil.copy(VECTORS / "archive-format2.tar.zst", archive)
    listing = list_archive(archive)
    assert (listing.manifest.archive_version, listing.manifest.model) == (2, want["model"])
    for target in (want["model"], "renamed"):
        with Store(tmp_path / target.replace("/", "_")) as dst:
            restore(archive, dst, model=None if target == want["model"] else target)
            m = dst.model(target)
            assert dst.models() == sorted(["default", target])
            with m.reader() as r:
                got = {
                    f"{h:016x}": hashlib.sha256(bytes(v)).hexdigest() for h, v in r.iter_blocks()
                }
            assert got == want["blocks"]
            seqs = {n: hashlib.sha256(m.get_sequence(n) or b"").hexdigest() for n in m.sequences()}
            assert seqs == want["sequences"]


# --- hostile archives of several models -----------------------------------------------------


def craft_models(path: Path, sections: list[tuple[str, Geometry, list[Raw]]]) -> Path:
    """A version-3 archive: the manifest, then one frame per model of its members (already
    named under ``models/<n>/``), with the index listing the blocks per model in order."""
    counts = []
    for _, _, members in sections:
        blocks = sum(bool(BLOCK_NAME.fullmatch(m.name.split("/", 2)[2])) for m in members)
        counts.append((blocks, sum(m.name.endswith(".json") for m in members)))
    manifest = Manifest.of_models(
        [Section(model, g, b, s) for (model, g, _), (b, s) in zip(sections, counts)]
    )
    index = []
    for i, (_, _, members) in enumerate(sections):
        offset = 0
        for m in members:
            found = BLOCK_NAME.fullmatch(m.name.split("/", 2)[2])
            if found:
                index.append((int(found.group(1), 16), i + 1, offset))
            offset += len(m.encode())
    frames = [[Raw(MANIFEST_NAME, manifest.to_json())], *(m for _, _, m in sections)]
    return craft(path, frames, index_blocks=index)


def under(n: int, members: list[Raw]) -> list[Raw]:
    """The members renamed into the directory of the n-th model."""
    return [Raw(f"models/{n}/{m.name}", m.data) for m in members]


def test_crafted_two_model_archive_is_valid(tmp_path: Path) -> None:
    _, b, s = valid_members(seed=1)
    path = craft_models(
        tmp_path / "ok.tar.zst", [("a", SMALL, under(0, [*b, *s])), ("b", SMALL, under(1, b))]
    )
    assert verify(path).manifest.archive_version == 3


@pytest.mark.parametrize(
    "case",
    [
        "unknown model number",
        "model directory not a canonical number",
        "model 0 after model 1",
        "geometry of another model",
        "late refusal",
    ],
)
def test_hostile_multi_model_archive_leaves_the_store_unchanged(case: str, tmp_path: Path) -> None:
    _, b, s = valid_members(seed=1)
    a_members = under(0, [*b, *s])
    b_members = under(1, b)
    wide_blocks = under(1, valid_members(WIDE, seed=2)[1])
    bad, error = {
        "unknown model number": (
            [("a", SMALL, a_members), ("b", SMALL, [*b_members, *under(2, s)])],
            UnsafeArchiveError,
        ),
        "model directory not a canonical number": (
            [("a", SMALL, a_members), ("b", SMALL, [Raw("models/01/" + b[0].name, b[0].data)])],
            UnsafeArchiveError,
        ),
        "model 0 after model 1": (
            [("a", SMALL, b_members[:1]), ("b", SMALL, [*b_members[1:], *under(0, b[1:])])],
            ArchiveError,
        ),
        "geometry of another model": (
            [("a", SMALL, a_members), ("b", SMALL, wide_blocks)],
            ShapeError,
        ),
        # model b's record names a block model b does not hold (model a does): refused at
        # the end, after model a's blocks were committed
        "late refusal": (
            [("a", SMALL, a_members), ("b", SMALL, [*b_members[:1], *under(1, s)])],
            ArchiveError,
        ),
    }[case]
    path = craft_models(tmp_path / "bad.tar.zst", bad)
    with Store(tmp_path / "dst") as dst:
        dst.model("a").put(encode(SMALL, make_blocks(SMALL, 4, seed=8)))
        before = {m: snapshot(dst.model(m)) for m in ("a", "b", "default")}
        with pytest.raises(error):
            restore(path, dst)
        assert {m: snapshot(dst.model(m)) for m in ("a", "b", "default")} == before
        assert not list(Path(tmp_path / "dst").glob("restore-*.lock"))
    with pytest.raises(error):
        verify(path)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda m: m.update(models=m["models"][:1]), "2.."),
        (lambda m: m["models"].reverse(), "ascending"),
        (lambda m: m.update(blocks=m["blocks"] + 1), "totals"),
        (lambda m: m["models"][1].update(model="a b"), "a model id is"),
        (lambda m: m["models"][0].pop("geometry"), "keys"),
        (lambda m: m.update(geometry=None), "keys"),
    ],
)
def test_manifest_v3_rules(edit: Any, match: str) -> None:
    manifest = Manifest.of_models([Section("a", SMALL, 2, 1), Section("b", WIDE, 1, 0)])
    obj = manifest.to_dict()
    assert Manifest.from_json(canonical_json(obj)) == manifest
    edit(obj)
    with pytest.raises(ArchiveError, match=match):
        Manifest.from_json(canonical_json(obj))


def test_a_restore_of_several_models_dying_before_its_last_commit_is_undone_in_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every model's blocks and sequences are committed, then the process "dies" before
    the one commit that keeps them all: the next open removes them from every model."""
    from kvstore.archive.importer import Importer

    with Store(tmp_path / "src") as src:
        two_models(src)
        create(src, tmp_path / "all.tar.zst", models=["base", "ft", "wide"])
    with Store(tmp_path / "dst") as dst:
        dst.model("ft").put(encode(SMALL, make_blocks(SMALL, 4, seed=9)))
        before = {m: snapshot(dst.model(m)) for m in ("base", "ft", "wide")}
    committed = {}

    def die(self: Store, journals: Any) -> None:
        committed.update({m: snapshot(self.model(m)) for m in ("base", "ft", "wide")})
        raise KeyboardInterrupt  # stands for SIGKILL: nothing after this runs

    def dead(self: Importer) -> None:
        self._join()
        self.journal.release(unlink=False)  # the kernel drops a dead process's lock

    monkeypatch.setattr(Store, "keep_restores", die)
    monkeypatch.setattr(Importer, "undo", dead)
    with Store(tmp_path / "dst") as dst, pytest.raises(KeyboardInterrupt):
        restore(tmp_path / "all.tar.zst", dst)
    assert all(committed[m] != before[m] for m in before)  # every model had been written
    monkeypatch.undo()
    with Store(tmp_path / "dst") as dst:
        assert {m: snapshot(dst.model(m)) for m in before} == before
    assert not list((tmp_path / "dst").glob("restore-*.lock"))


def test_partial_restore_of_several_models_skips_only_the_refused_members(
    tmp_path: Path,
) -> None:
    _, b, s = valid_members(seed=1)
    damaged = bytearray(b[1].data)
    damaged[-5] ^= 1  # a payload byte: the envelope's CRC fails
    b_members = under(1, [b[0], Raw(b[1].name, bytes(damaged)), *b[2:]])
    path = craft_models(
        tmp_path / "p.tar.zst", [("a", SMALL, under(0, [*b, *s])), ("b", SMALL, b_members)]
    )
    with Store(tmp_path / "dst") as dst:
        report = restore(path, dst, partial=True)
        assert [p.where for p in report.problems] == [b_members[1].name]
        bad = int(BLOCK_NAME.fullmatch(b[1].name).group(1), 16)  # type: ignore[union-attr]
        assert dst.model("a").has([bad]) == [True] and dst.model("b").has([bad]) == [False]
        assert dst.model("b").stats()["blocks"] == len(b) - 1
        assert dst.model("a").sequences() == ["s"] and dst.model("b").sequences() == []
