"""kvstore.protocol: each wire rule once, and every command and route applies the same one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvstore
from kvstore import errors
from kvstore.protocol import (
    ERROR_KINDS,
    check_sequence_name,
    error_for_kind,
    hash_hex,
    is_hash_hex,
    is_sequence_name,
    parse_hash_hex,
)

VALID_HEX = ["0000000000000001", "a91ab0c1027b9366", "ffffffffffffffff"]
INVALID_HEX = [
    "0x12",
    "12",
    "A91AB0C1027B9366",  # upper case
    "a91ab0c1027b936",  # 15 digits
    "a91ab0c1027b93660",  # 17 digits
    " a91ab0c1027b936",
    "0xa91ab0c1027b93",
    "+91ab0c1027b9366",
    "a91ab0c1027b936g",
    "",
    None,
    12,
]


@pytest.mark.parametrize("text", VALID_HEX)
def test_hash_hex_valid(text: str) -> None:
    assert is_hash_hex(text)
    assert hash_hex(parse_hash_hex(text)) == text


@pytest.mark.parametrize("text", INVALID_HEX)
def test_hash_hex_invalid(text: object) -> None:
    assert not is_hash_hex(text)
    with pytest.raises(ValueError, match="16 lowercase hex digits"):
        parse_hash_hex(text)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1, "0000000000000001"),
        (np.uint64(2**64 - 1), "ffffffffffffffff"),
        ("00000000000000ff",) * 2,
    ],
)
def test_hash_hex_of_values(value: object, expected: str) -> None:
    assert hash_hex(value) == expected


@pytest.mark.parametrize("value", [-1, 2**64, True, 1.0, "0x01"])
def test_hash_hex_refuses(value: object) -> None:
    with pytest.raises(ValueError):
        hash_hex(value)


@pytest.mark.parametrize("name", ["a", "chat-1", "A.b_c-9", "." * 2, "x" * 128])
def test_sequence_name_valid(name: str) -> None:
    assert is_sequence_name(name) and check_sequence_name(name) == name


@pytest.mark.parametrize("name", ["", "x" * 129, "a/b", "a b", "é", "a\n", None, 3])
def test_sequence_name_invalid(name: object) -> None:
    assert not is_sequence_name(name)
    with pytest.raises(ValueError, match=r"1-128 characters of \[A-Za-z0-9._-\]"):
        check_sequence_name(name)


def test_error_kinds_name_their_classes() -> None:
    for kind, cls in ERROR_KINDS.items():
        assert cls.kind == kind and issubclass(cls, errors.TlkvError)
        assert isinstance(error_for_kind(kind, "m"), cls)
    assert type(error_for_kind("no-such-kind", "m")) is errors.ServiceError


def test_each_kind_is_declared_once_and_is_an_error_kind() -> None:
    """No two error classes of tlkv (the library's and the service's modules, loaded
    all) declare the same kind, and every declared kind is in ``ERROR_KINDS``: a class
    of a module of its own that repeated a kind would make the kind name two classes."""
    import importlib
    import pkgutil

    import api

    for package in (kvstore, api):
        for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            if info.name.endswith(".__main__"):  # runs the CLI
                continue
            try:
                importlib.import_module(info.name)
            except ImportError:  # an optional engine (vLLM) that is not installed
                continue
    declared: dict[str, list[str]] = {}
    stack: list[type] = [errors.TlkvError]
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if "kind" in cls.__dict__ and cls.__module__.startswith(("kvstore.", "api.")):
            declared.setdefault(cls.__dict__["kind"], []).append(cls.__qualname__)
    assert {k: v for k, v in declared.items() if len(v) > 1} == {}
    assert set(declared) == set(ERROR_KINDS)
    assert {"format", "shape", "version", "not_found", "cache_layout"} <= set(ERROR_KINDS)
    assert ERROR_KINDS["format"] is errors.FormatError


@pytest.mark.parametrize("spelling", ["0x12", "12", "A91AB0C1027B9366"])
def test_every_command_refuses_the_same_spellings(
    spelling: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every command that takes a block hash (``tlkv archive extract`` as ``tlkv get``)
    refuses the same spellings: 16 lowercase hex digits only."""
    from kvstore.cli import main

    archive = tmp_path / "a.tlkvar"
    archive.write_bytes(b"")  # never opened: the hash is refused first
    code = main(["archive", "extract", str(archive), spelling, "-o", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code != 0 and "16 lowercase hex digits" in err
    code = main(["get", "http://127.0.0.1:9", spelling, "-o", str(tmp_path / "o")])
    assert code != 0
    assert "16 lowercase hex digits" in capsys.readouterr().err
