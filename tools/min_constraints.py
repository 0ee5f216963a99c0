"""Write a pip constraints file pinning each direct dependency to its declared minimum.

``.ci/run`` installs the project with these constraints into a separate venv and runs the
tests there, so every lower bound in ``pyproject.toml`` is one CI has run. A dependency
is pinned to the version its ``>=`` (or ``==``) specifier names; a direct dependency
without a lower bound is an error (its minimum would be whatever pip picks).

Usage: ``python tools/min_constraints.py [--extras hf,docs] [pyproject.toml] > constraints.txt``
(``--extras``: the dependencies of those optional groups are pinned to their minimum too).
"""

from __future__ import annotations

import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent


def minimum_pins(requirements: list[str]) -> list[str]:
    """``name==version`` for each requirement, at the version its lower bound names.

    Raises:
        ValueError: a requirement without a ``>=`` or ``==`` specifier.
    """
    pins = []
    for text in requirements:
        req = Requirement(text)
        lows = [s.version for s in req.specifier if s.operator in (">=", "==")]
        if len(lows) != 1:
            raise ValueError(f"{text!r}: expected one '>=' or '==' lower bound, found {lows}")
        # Extras ([standard]) are not allowed in a constraints file; the pin holds for
        # the package whichever extras pull it in.
        pins.append(f"{req.name}=={lows[0]}")
    return pins


def main(argv: list[str]) -> int:
    """Print the constraints of the project's ``[project].dependencies`` and of the
    optional groups ``--extras`` names."""
    args = argv[1:]
    extras: list[str] = []
    if args[:1] == ["--extras"]:
        extras, args = args[1].split(","), args[2:]
    path = Path(args[0]) if args else ROOT / "pyproject.toml"
    project = tomllib.loads(path.read_text())["project"]
    optional = project.get("optional-dependencies", {})
    print(f"# the declared minimum of each direct dependency of {path.name}", end="")
    print(f" and of its extras {', '.join(extras)}" if extras else "")
    requirements = list(project["dependencies"])
    for extra in extras:
        requirements += optional[extra]
    for pin in minimum_pins(requirements):
        print(pin)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
