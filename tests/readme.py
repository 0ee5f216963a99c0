"""The README's code, as the tests that run it see it: fenced blocks with the marker line
above each.

Every ```python block is run by ``tests/test_readme_snippets.py`` unless the line above it
is ``<!-- snippet: run by tests/<file>.py -->``, naming the test that runs it instead
(found there by its marker). Shell blocks (```sh) run only where a test says so: a block
under ``<!-- recipe: NAME, STEP -->`` is run as written by the test of that recipe.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

README = Path(__file__).resolve().parent.parent / "README.md"
_FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
_MARKER = re.compile(r"^<!--\s*(.+?)\s*-->$")


class Block(NamedTuple):
    """One fenced block: its language, its text, the marker above it ("" for none) and
    the README line it starts on."""

    lang: str
    text: str
    marker: str
    line: int


def blocks(path: Path = README) -> list[Block]:
    """Every fenced block of the README (list items' indented ones too), in order."""
    lines = path.read_text().split("\n")
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m or not m.group(2):
            i += 1
            continue
        indent = len(m.group(1))
        above = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = _MARKER.match(above.strip())
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        text = "\n".join(line[indent:] for line in lines[i + 1 : end]) + "\n"
        out.append(Block(m.group(2), text, marker.group(1) if marker else "", i + 1))
        i = end + 1
    return out


def recipe(name: str, step: str) -> str:
    """The shell block under ``<!-- recipe: NAME, STEP -->``."""
    found = [b.text for b in blocks() if b.marker == f"recipe: {name}, {step}"]
    assert len(found) == 1, f"README: expected one block marked 'recipe: {name}, {step}'"
    return found[0]


def snippets_run_by(test_file: str) -> list[Block]:
    """The python blocks marked as run by ``tests/<test_file>``."""
    return [b for b in blocks() if b.marker == f"snippet: run by tests/{test_file}"]
