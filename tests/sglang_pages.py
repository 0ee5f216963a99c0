"""Pages through SGLang's own controller code for the SGLang backend's tests: a round trip,
a byte-for-byte check, and a question to a store asked from a process of its own.

Import it after the test module's SGLang skip: it imports ``tools/sglang_demo``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
from http_server import REPO

sys.path.insert(0, str(REPO / "tools"))
from sglang_demo import blocks_of, controller, controller_call, fill_pages, operation


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Byte for byte."""
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def in_store(path: Path, code: str) -> Any:
    """``code``'s JSON answer about the store at ``path`` (``store``), read in a process of
    its own: this one keeps its one ``Store`` per path (LMDB's rule) inside the backend."""
    script = f"import json; from kvstore import Store\nstore = Store({str(path)!r})\n{code}"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def round_trip(backend: Any, pool: Any, keys: list[str], v1: bool, seed: int = 0) -> Any:
    """Pages written and read back through SGLang's own controller code (zero-copy with
    ``v1``, else flat pages); the blocks written and the blocks read."""
    state = controller(backend, pool)
    written = fill_pages(pool, len(keys), seed)
    if v1:
        assert controller_call("_page_set_zero_copy", state, keys, written) is True
    else:
        assert controller_call("_generic_page_set", state, keys, written) is True
    read = pool.alloc(len(keys) * pool.page_size)
    name = "_page_get_zero_copy" if v1 else "_generic_page_get"
    assert controller_call(name, state, operation(), keys, read) == len(keys)
    return blocks_of(pool, written), blocks_of(pool, read)
