"""The SGLang HiCache backend's options on SGLang's real classes: bf16 and format-2 pages,
``sync`` 0, ``keep_freed_memory``, ``preallocate``, the namespace a config names (model,
ranks), and the configurations and layouts it refuses by name (``tools/sglang_demo.py``
builds the pieces).

Skipped where SGLang is not installed (``docs/sglang.md``; ``.ci/run`` builds its venv).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from http_server import REPO

pytestmark = pytest.mark.sglang
if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (see docs/sglang.md)", allow_module_level=True)

sys.path.insert(0, str(REPO / "tools"))
from sglang_demo import make_backend, make_pool, page_keys  # noqa: E402
from sglang_pages import round_trip, same  # noqa: E402

from kvstore.errors import CacheLayoutError, ShapeError  # noqa: E402


def test_bf16_pages_round_trip_through_f16(tmp_path: Path) -> None:
    """bf16 values within f16's normal range are exact through a v1 block."""
    pool = make_pool(dtype="bfloat16")
    backend = make_backend(pool, str(tmp_path / "kv"))
    assert backend.namespace == "tiny@sglang-tp0of1/bfloat16"
    written, read = round_trip(backend, pool, page_keys(3), v1=True)
    assert same(written, read)


def test_format_2_pages_load_dequantized(tmp_path: Path) -> None:
    pool = make_pool()
    backend = make_backend(pool, str(tmp_path / "kv"), format=2)
    written, read = round_trip(backend, pool, page_keys(3), v1=True)
    w, r = written.astype(np.float32), read.astype(np.float32)
    scale = np.abs(w).max(axis=(4, 5), keepdims=True)  # one scale per (layer, K/V, head)
    assert np.all(np.abs(w - r) <= scale / 16 + 1e-3)  # E4M3: 3 mantissa bits
    assert not same(written, read)


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"is_mla_model": True}, "MLA"),
        ({"should_split_heads": True}, "split by heads"),
    ],
)
def test_configs_that_cannot_be_read_are_refused(
    tmp_path: Path, fields: dict[str, Any], reason: str
) -> None:
    with pytest.raises(CacheLayoutError, match=reason):
        make_backend(make_pool(), str(tmp_path / "kv"), fields=fields)


def test_sync_0_stores_pages_without_an_fsync_and_other_values_are_refused(
    tmp_path: Path,
) -> None:
    pool = make_pool()
    backend = make_backend(pool, str(tmp_path / "kv"), interface_v1=1, sync=0)
    keys = page_keys(4)
    written, read = round_trip(backend, pool, keys, True)
    assert same(written, read)
    target = backend._target(backend.namespace)._target  # the backend's store target
    assert target.store.sync is False
    with pytest.raises(ValueError, match="'sync' must be 1 or 0"):
        make_backend(make_pool(), str(tmp_path / "kv2"), sync="no")


_FREED_HEAP = """
import ctypes, sys, tempfile
sys.path.insert(0, "tools")
from sglang_demo import controller, controller_call, fill_pages, make_backend, make_pool, page_keys

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    ).split()]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
pool = make_pool(layers=32, heads=8, head_dim=128, tokens=16 * 48)  # 2 MiB pages
with tempfile.TemporaryDirectory() as tmp:
    backend = make_backend(pool, tmp + "/kv", interface_v1=1, **OPTIONS)
    saved = controller_call(
        "_page_set_zero_copy", controller(backend, pool), page_keys(16), fill_pages(pool, 16, 1)
    )
    print(saved, libc.mallinfo2().fordblks)
    backend.close()
"""


@pytest.mark.parametrize("keep", [None, 1, 0])
def test_a_store_directory_backend_keeps_a_saves_freed_memory_unless_told_not_to(
    keep: int | None,
) -> None:
    """A save of 16 pages of 2 MiB ``malloc``s 32 MiB of LMDB dirty pages in this process;
    with ``keep_freed_memory`` (the default) they stay in the heap, free, for the next
    save; with 0 glibc hands them back to the kernel. Each case in a process of its own
    (the setting is process-wide)."""
    options = {} if keep is None else {"keep_freed_memory": keep}
    script = f"OPTIONS = {options!r}\n{_FREED_HEAP}"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    saved, free = out.stdout.split()
    assert saved == "True"
    if keep == 0:
        assert int(free) < 32 << 20, free
    else:
        assert int(free) >= 32 << 20, free


def test_keep_freed_memory_takes_1_or_0(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'keep_freed_memory' must be 1 or 0"):
        make_backend(make_pool(), str(tmp_path / "kv"), keep_freed_memory="yes")


def test_preallocate_keeps_room_in_the_store_directory(tmp_path: Path) -> None:
    pool = make_pool()
    backend = make_backend(pool, str(tmp_path / "kv"), interface_v1=1, preallocate=4 << 20)
    written, read = round_trip(backend, pool, page_keys(4), True)
    assert same(written, read)
    store = backend._target(backend.namespace)._target.store
    assert store.preallocate_bytes == 4 << 20
    env = store._h.env.lmdb.env
    used = (int(env.info()["last_pgno"]) + 1) * int(env.stat()["psize"])
    assert (tmp_path / "kv" / "data.mdb").stat().st_size - used >= 2 << 20


@pytest.mark.parametrize("value", [-1, True, 1.5, "1GiB"])
def test_preallocate_takes_an_int_of_bytes(tmp_path: Path, value: object) -> None:
    with pytest.raises(ValueError, match="'preallocate' must be an int of bytes"):
        make_backend(make_pool(), str(tmp_path / "kv"), preallocate=value)


def test_no_model_name_is_refused_unless_the_config_names_one(tmp_path: Path) -> None:
    with pytest.raises(CacheLayoutError, match="no model name"):
        make_backend(make_pool(), str(tmp_path / "kv"), model_name=None)
    backend = make_backend(make_pool(), str(tmp_path / "kv"), model_name=None, model="m")
    assert backend.namespace == "m@sglang-tp0of1/float16"


def test_ranks_get_namespaces_of_their_own(tmp_path: Path) -> None:
    pool = make_pool()
    fields = {"tp_rank": 1, "tp_size": 2, "pp_rank": 0, "pp_size": 2}
    backend = make_backend(pool, str(tmp_path / "kv"), fields=fields)
    assert backend.namespace == "tiny@sglang-tp1of2-pp0of2/float16"


@pytest.mark.parametrize("layout", ["page_first_direct", "page_head"])
def test_other_layouts_are_refused_by_name(tmp_path: Path, layout: str) -> None:
    with pytest.raises(CacheLayoutError, match=f"layout '{layout}' is not read"):
        make_backend(make_pool(layout), str(tmp_path / "kv"))


def test_a_namespace_of_another_geometry_stops_the_backend(tmp_path: Path) -> None:
    make_backend(make_pool(page=16), str(tmp_path / "kv")).batch_set_v1(
        page_keys(1), make_pool(page=16).alloc(16)
    )
    with pytest.raises(ShapeError, match="holds geometry"):
        make_backend(make_pool(page=8), str(tmp_path / "kv"))
