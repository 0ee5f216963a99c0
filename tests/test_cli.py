"""The ``tlkv`` codec commands: hash, inspect, verify, and their exit codes."""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SMALL, make_envelope

from kvstore import __version__, crc32c
from kvstore.cli import main
from kvstore.codec import checksum


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_hash_spec_example(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["hash", "--block-tokens", "2", "1", "2", "3", "4", "5"], capsys)
    assert code == 0
    assert out == "a91ab0c1027b9366\n03df829571605c60\n"


def test_hash_from_stdin(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("1 2\n3\t4 5\n"))
    code, out, _ = run(["hash", "--block-tokens", "2"], capsys)
    assert (code, out) == (0, "a91ab0c1027b9366\n03df829571605c60\n")


def test_hash_bad_token_is_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["hash", "--block-tokens", "2", "1", str(2**32)], capsys)
    assert code == 2 and "u32" in err


def test_hash_token_ids_are_decimal(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["hash", "--block-tokens", "2", "010", "02"], capsys)
    assert (code, out) == (0, run(["hash", "--block-tokens", "2", "10", "2"], capsys)[1])
    code, _, err = run(["hash", "--block-tokens", "2", "0x10", "2"], capsys)
    assert code == 2 and "integers" in err


def test_verify_of_an_unreadable_file_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(["verify", str(tmp_path / "missing.tlkv")], capsys)
    assert code == 1 and "missing.tlkv" in err and len(err.strip().splitlines()) == 1


def test_inspect_text_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "e.tlkv"
    f.write_bytes(make_envelope(SMALL, 10, 2))
    code, out, _ = run(["inspect", str(f)], capsys)
    assert code == 0 and out.startswith("TLKV v2 e4m3 B=4 L=2 Hkv=2 D=8 blocks=3")
    assert len(out.strip().splitlines()) == 4
    code, out, _ = run(["inspect", str(f), "--json"], capsys)
    doc = json.loads(out)
    assert doc["n_blocks"] == 3 and doc["blocks"][2]["n_tokens"] == 2
    assert doc["blocks"][2]["hash"] == "0" * 16 and doc["blocks"][0]["k_absmax"] > 0


def _recrc(buf: bytes) -> bytes:
    return buf[:-4] + struct.pack("<I", crc32c(buf[:-4]))


@pytest.mark.parametrize(
    ("mutate", "extra", "code", "word"),
    [
        (lambda b: b, [], 0, ""),
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), [], 3, "CRC"),
        (lambda b: b[:40], [], 3, "length"),
        (lambda b: _recrc(b"TLKX" + b[4:]), [], 3, "magic"),
        (lambda b: b, ["--geometry", "4,2,2,16"], 4, "receiving pool"),
        (lambda b: b, ["--versions", "2"], 5, "version"),
        (lambda b: b, ["--geometry", "nonsense"], 2, "geometry"),
    ],
)
def test_verify_exit_codes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mutate, extra, code, word
) -> None:
    f = tmp_path / "e.tlkv"
    f.write_bytes(mutate(make_envelope(SMALL, 10, 1)))
    got, _, err = run(["verify", str(f), *extra], capsys)
    assert got == code
    if code:
        assert word in err
    if code in (3, 4, 5):  # a verification failure is one line naming the rule
        assert len(err.strip().splitlines()) == 1


def test_version_names_the_crc_kernel(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"tlkv {__version__} (CRC-32C: {checksum.KERNEL})\n"


def test_console_script_runs_as_module(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvstore", "hash", "--block-tokens", "2", "1", "2"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert proc.stdout == "a91ab0c1027b9366\n"


def test_serve_comes_from_the_service_through_the_entry_point(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """kvstore never imports api: `tlkv serve` is the service's command, found through the
    `tlkv.commands` entry point of the installed package."""
    from importlib.metadata import entry_points

    assert {ep.value for ep in entry_points(group="tlkv.commands")} >= {"api.serve:register"}
    assert main(["serve", "--help"]) == 0
    assert "--grpc-port" in capsys.readouterr().out


def test_stats_of_a_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvstore import Store

    with Store(tmp_path / "s") as s:
        s.model("org/m@1").put(make_envelope(SMALL, 12, seed=1))
    data = str(tmp_path / "s")
    code, out, _ = run(["stats", "--data", data, "--model", "org/m@1", "--json"], capsys)
    assert code == 0 and json.loads(out)["blocks"] == 3
    code, out, _ = run(["stats", "--data", data, "--json"], capsys)
    assert code == 0 and json.loads(out)["blocks"] == 0
    assert main(["stats", "--data", data, "--model", "a b"]) == 2
    assert "model id" in capsys.readouterr().err


def test_stats_of_a_grpc_server_is_a_clear_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "grpc://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert "tl.kv.v1 (grpc://) has no stats call" in err and "http://HOST:PORT" in err


@pytest.mark.parametrize(
    "command",
    [
        ["archive", "ls", "{archive}"],
        ["inspect", "{envelope}"],
    ],
    ids=["archive-ls", "inspect"],
)
def test_a_closed_pipe_ends_a_command_quietly(tmp_path: Path, command: list[str]) -> None:
    import shlex

    from kvstore import Store
    from kvstore.archive import create

    envelope = make_envelope(SMALL, 4 * 4000, seed=3)  # 4,000 blocks: far over a pipe's buffer
    (tmp_path / "e.tlkv").write_bytes(envelope)
    with Store(tmp_path / "s") as store:
        store.put(envelope)
        create(store, tmp_path / "a.tlkv.tar.zst")
    args = [
        a.format(archive=tmp_path / "a.tlkv.tar.zst", envelope=tmp_path / "e.tlkv") for a in command
    ]
    line = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "kvstore", *args])
    done = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {line} | head -n 1 >/dev/null"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stderr == ""
    assert done.returncode == 141


def test_serve_help_shows_every_default(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from api.serve import register

    sub = argparse.ArgumentParser(prog="tlkv").add_subparsers()
    register(sub)
    serve = sub.choices["serve"]
    for action in serve._actions:
        if action.option_strings and action.default not in (None, False, [], argparse.SUPPRESS):
            assert action.help, f"{action.option_strings[0]} has a default and no help"
    assert main(["serve", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "HTTP port (default 8000)" in text and "worker processes (default 1)" in text
