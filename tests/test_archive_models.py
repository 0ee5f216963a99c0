"""Archives of models: the manifest records the model, restore keeps it (or renames it with
``--as``), and version-1 archives (written before models) restore into ``default``."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from archive_helpers import populate, snapshot
from conftest import SMALL, make_blocks

from kvstore import Block, Store, encode
from kvstore.archive.operations import create, list_archive, restore
from kvstore.cli import main

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
