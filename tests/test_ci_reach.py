"""``.ci/run`` reaches every test module: the other steps select tests by marker over the
whole suite, but the SGLang step names its files, so a module marked ``sglang`` that the
step does not name would run nowhere (every other venv lacks SGLang and skips it)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_sglang_module_is_named_by_the_sglang_step() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    step = re.search(r"\.venv-sglang/bin/python -m pytest -m sglang (.*?)--basetemp", ci, re.S)
    assert step, ".ci/run has no SGLang pytest step"
    named = set(re.findall(r"tests/(test_\w+\.py)", step.group(1)))
    marked = {
        p.name
        for p in (ROOT / "tests").glob("test_*.py")
        if re.search(r"^pytestmark = .*pytest\.mark\.sglang", p.read_text(), re.M)
    }
    assert marked, "no module is marked sglang"
    assert marked <= named, f".ci/run's SGLang step does not run {sorted(marked - named)}"
    assert all((ROOT / "tests" / name).is_file() for name in named), named
