"""The code of the README and the documentation site, as the tests that run it see it:
fenced blocks with the marker line above each.

The pages are README.md and the pages of ``mkdocs.yml``'s nav, in that order. A block
with no marker is run by ``tests/test_readme_snippets.py`` (python, sh, console; a toml or
json block is a token table, loaded as ``tlkv serve --token-file`` loads one). The marker
line above a block says who else runs it:

- ``<!-- snippet: run by tests/<file>.py -->``: that test (found there by its marker);
- ``<!-- recipe: NAME, STEP -->``: the test of that recipe, as written;
- ``<!-- server: URL -->``: a command that serves; started with its ports moved to free
  ones, asked for ``/healthz``, then stopped (``tests/test_readme_snippets.py``);
- ``<!-- run by .ci/run -->``: every command of the block appears verbatim in ``.ci/run``;
- ``<!-- not run: needs a GPU (...) -->``: an engine launch that needs a GPU, the one
  kind of block CI cannot run.

Text a page includes from another file (``--8<-- "FILE"``: FORMAT.md, ARCHITECTURE.md,
BENCHMARKS.md, sections of the README) is read where it is written, once.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import NamedTuple

import yaml

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
_FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
_MARKER = re.compile(r"^<!--\s*(.+?)\s*-->$")


class Block(NamedTuple):
    """One fenced block: its language, its text, the marker above it ("" for none), the
    line it starts on and the page it is on."""

    lang: str
    text: str
    marker: str
    line: int
    page: Path = README

    @property
    def where(self) -> str:
        """``page:line``, for messages and tracebacks."""
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def pages() -> list[Path]:
    """README.md, then every page of the documentation site in its nav order."""
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    return [README, *(DOCS / next(iter(item.values())) for item in nav)]


def blocks(path: Path = README) -> list[Block]:
    """Every fenced block of a page (list items' indented ones too), in order."""
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
        found = marker.group(1) if marker and not marker.group(1).startswith("--8<--") else ""
        out.append(Block(m.group(2), text, found, i + 1, path))
        i = end + 1
    return out


def all_blocks() -> list[Block]:
    """Every fenced block of every page, page by page."""
    return [b for page in pages() for b in blocks(page)]


def recipe(name: str, step: str) -> str:
    """The shell block under ``<!-- recipe: NAME, STEP -->``."""
    found = [b.text for b in all_blocks() if b.marker == f"recipe: {name}, {step}"]
    assert len(found) == 1, f"docs: expected one block marked 'recipe: {name}, {step}'"
    return found[0]


def snippets_run_by(test_file: str, lang: str = "python") -> list[Block]:
    """The blocks of ``lang`` marked as run by ``tests/<test_file>``."""
    marker = f"snippet: run by tests/{test_file}"
    return [b for b in all_blocks() if b.marker == marker and b.lang == lang]


def bash(script: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A shell block run as a reader runs it: bash, stopping at the first failure."""
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def start(script: str, cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen[str]:
    """A shell block that serves, started in bash in a session of its own (so that the
    server and its children stop as one group), everything it writes going to ``log``."""
    with open(log, "w") as out:
        return subprocess.Popen(
            ["bash", "-euo", "pipefail", "-c", script],
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
