"""SGLang's real HiCache pieces on CPU, for the tests and ``tools/bench.py sglang``: a
device pool and a host pool of SGLang's own classes, a ``HiCacheStorageConfig``, a backend
made by SGLang's ``StorageBackendFactory`` and registered as SGLang's cache controller
does, page keys, and SGLang's controller calls.

Needs SGLang's storage layer (``sglang==0.5.23``, torch 2.14.1): see ``docs/sglang.md``.
As a script (``python tools/sglang_demo.py write|read SPEC.json``) it writes or reads pages
in a process of its own, for the tests' restart and other-process cases.
"""

from __future__ import annotations

import hashlib
import json
import sys
from types import SimpleNamespace
from typing import Any

import numpy as np

TLKV_CONFIG = {
    "backend_name": "tlkv",
    "module_path": "kvstore.engines.sglang",
    "class_name": "TlkvHiCacheStorage",
}


def make_pool(
    layout: str = "layer_first",
    *,
    dtype: str = "float16",
    page: int = 16,
    layers: int = 4,
    heads: int = 2,
    head_dim: int = 64,
    tokens: int = 4096,
) -> Any:
    """A host pool of SGLang's ``MHATokenToKVPoolHost`` over a CPU ``MHATokenToKVPool``
    (as SGLang's own aibrix unit test builds one), holding about ``tokens`` tokens."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    device = MHATokenToKVPool(tokens, page, getattr(torch, dtype), heads, head_dim, layers,
                              "cpu", False, start_layer=0, end_layer=layers - 1)  # fmt: skip
    return MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        2.0,
        0,
        page,
        layout,
        device_capacity_tokens=device.size,
        start_layer=device.start_layer,
        end_layer=device.end_layer,
        write_back_staging=device.hicache_write_back_staging,
        pin_memory=False,
    )


def storage_config(
    pool: Any, model: str | None = "tiny", extra: dict[str, Any] | None = None, **fields: Any
) -> Any:
    """SGLang's ``HiCacheStorageConfig`` of one rank (tp 0 of 1 unless ``fields`` say)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    values: dict[str, Any] = {
        "tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "attn_cp_rank": 0,
        "attn_cp_size": 1, "is_mla_model": False, "enable_storage_metrics": True,
        "is_page_first_layout": pool.layout == "page_first", "model_name": model,
        "extra_config": extra,
    }  # fmt: skip
    values.update(fields)
    return HiCacheStorageConfig(**values)


def make_backend(pool: Any, target: str, *, model_name: str | None = "tiny", **options: Any) -> Any:
    """tlkv's backend as SGLang's controller attaches a ``dynamic`` one: created by
    ``StorageBackendFactory``, then ``register_mem_pool_host(pool)``. ``options``: more
    extra config (``interface_v1``, ``format``...), or ``fields=`` of the config."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    fields = options.pop("fields", {})
    extra = {**TLKV_CONFIG, "target": target, **options}
    backend = StorageBackendFactory.create_backend(
        "dynamic", storage_config(pool, model_name, extra, **fields), pool
    )
    backend.register_mem_pool_host(pool)
    return backend


def make_file_backend(pool: Any, path: str, **extra: Any) -> Any:
    """SGLang's own ``HiCacheFile`` (``--hicache-storage-backend file``) on ``path``;
    ``extra``: more of its extra config (``enable_metadata_cache``...)."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    backend = StorageBackendFactory.create_backend(
        "file", storage_config(pool, "tiny", {"file_storage_path": path, **extra}), pool
    )
    backend.register_mem_pool_host(pool)
    return backend


def page_keys(n: int, seed: int = 0) -> list[str]:
    """``n`` page keys of SGLang's form (64 lowercase hex digits of a SHA-256)."""
    return [hashlib.sha256(f"{seed}:{i}".encode()).hexdigest() for i in range(n)]


def fill_pages(pool: Any, n: int, seed: int = 0) -> Any:
    """Allocate ``n`` pages of ``pool`` and fill them with random values; their token
    indices (SGLang's ``host_indices``)."""
    import torch

    indices = pool.alloc(n * pool.page_size)
    assert indices is not None, "host pool full"
    gen = torch.Generator().manual_seed(seed)
    for i in range(n):
        page = pool.get_data_page(int(indices[i * pool.page_size]), flat=False)
        page.copy_(torch.randn(page.shape, generator=gen).to(pool.dtype))
    return indices


def blocks_of(pool: Any, indices: Any) -> np.ndarray:
    """A copy of the pages at ``indices`` as ``[n][L][2][Hkv][B][D]`` (layout-free)."""
    from kvstore.engines._sglang_pages import HostPages

    pages = HostPages(pool)
    starts = pages.page_starts(indices, len(indices) // pool.page_size)
    return np.stack([pages.page(s).copy() for s in starts])


def controller(backend: Any, pool: Any) -> Any:
    """The state SGLang's ``HiCacheController`` page methods read, so that its own
    ``_page_get_zero_copy``/``_generic_page_get``/``_page_set_zero_copy``/
    ``_generic_page_set`` run on ``backend`` unchanged (``controller_call``)."""
    return SimpleNamespace(
        storage_backend=backend, storage_host_pool=pool, page_size=pool.page_size
    )


def controller_call(name: str, state: Any, *args: Any) -> Any:
    """SGLang's ``HiCacheController.<name>(state, *args)``: the controller's own code."""
    from sglang.srt.managers.cache_controller import HiCacheController

    return getattr(HiCacheController, name)(state, *args)


def operation(request_id: str = "r") -> Any:
    """A stand-in for the prefetch operation ``_generic_page_get`` checks."""
    return SimpleNamespace(request_id=request_id, is_terminated=lambda: False)


def _child(mode: str, spec: dict[str, Any]) -> None:
    """Write (``write``) or read (``read``) pages in this process, as a restarted or
    another engine would; the blocks go to or come from ``spec["blocks"]`` (.npy)."""
    pool = make_pool(spec["layout"])
    backend = make_backend(pool, spec["target"], interface_v1=1)
    keys = page_keys(spec["pages"], spec["seed"])
    if mode == "write":
        indices = fill_pages(pool, spec["pages"], spec["seed"])
        assert all(backend.batch_set_v1(keys, indices))
        np.save(spec["blocks"], blocks_of(pool, indices))
    else:
        assert backend.batch_exists(keys) == len(keys)
        indices = pool.alloc(len(keys) * pool.page_size)
        assert all(backend.batch_get_v1(keys, indices))
        assert np.array_equal(
            blocks_of(pool, indices).view(np.uint16), np.load(spec["blocks"]).view(np.uint16)
        )
    backend.close()
    print(json.dumps(backend.stats()))


if __name__ == "__main__":
    _child(sys.argv[1], json.loads(sys.argv[2]))
