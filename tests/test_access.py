"""api.access: token files (bare, JSON, TOML) and what each token may read and write."""

from __future__ import annotations

from pathlib import Path

import pytest

from api.access import parse_tokens, read_tokens
from api.settings import Settings

JSON = (
    '{"tokens": [{"token": "a", "read": ["*"], "write": ["m/x"]}, {"token": "b", "read": ["m/x"]}]}'
)
TOML = """
[[tokens]]
token = "a"
read = ["*"]
write = ["m/x"]

[[tokens]]
token = "b"
read = ["m/x"]
"""


@pytest.mark.parametrize("text", [JSON, TOML], ids=["json", "toml"])
def test_tables(text: str) -> None:
    table = parse_tokens(text)
    a, b = table.lookup(b"a"), table.lookup(b"b")
    assert a is not None and b is not None and table.lookup(b"c") is None
    assert a.can_read("anything") and a.can_write("m/x") and not a.can_write("default")
    assert b.can_read("m/x") and not b.can_read("default") and not b.can_write("m/x")
    assert b.readable(["default", "m/x", "y"]) == ["m/x"]
    assert table.bare is None


def test_a_bare_token_keeps_its_meaning(tmp_path: Path) -> None:
    (tmp_path / "t").write_text("  s3cret=+/x \n")
    table = read_tokens(tmp_path / "t")
    access = table.lookup(b"s3cret=+/x")
    assert table.bare == "s3cret=+/x" and access is not None
    assert access.can_read("any") and access.can_write("any")
    settings = Settings.from_env({"TLKV_TOKEN_FILE": str(tmp_path / "t")})
    assert settings.token == "s3cret=+/x" and settings.tokens is not None


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "empty"),
        ("{", "JSON"),
        ('{"tokens": []}', "non-empty"),
        ('{"tokens": [{"read": ["*"]}]}', "string"),
        ('{"tokens": [{"token": "a", "read": "*"}]}', "list"),
        ('{"tokens": [{"token": "a", "read": ["a b"]}]}', "model id"),
        ('{"tokens": [{"token": "a"}, {"token": "a"}]}', "repeated"),
        ('{"tokens": [{"token": "a", "admin": true}]}', "unknown"),
        ("[[tokens]]\ntoken = ", "TOML"),
    ],
)
def test_malformed_files_are_refused(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_tokens(text)


def test_quotas_from_the_environment() -> None:
    settings = Settings.from_env({"TLKV_QUOTAS": "org/m@1=2MiB, default=1000"})
    assert settings.quotas == (("default", 1000), ("org/m@1", 2 << 20))
    for bad in ("m", "a b=1", "m=1,m=2", "m=lots"):
        with pytest.raises(ValueError):
            Settings.from_env({"TLKV_QUOTAS": bad})
