"""A fault a test injects into an engine's processes (this directory first on their
``PYTHONPATH``, so that every process vLLM starts, its spawned workers included, runs
this at start-up): ``TLKV_FAULT_COPY_ON_RANK=r`` makes tensor-parallel rank ``r``'s first
copy of blocks out of its paged cache raise (``PagedCache.gather``)."""

from __future__ import annotations

import os
from typing import Any


def _fail_first_copy(rank: int) -> None:
    from kvstore.engines import _vllm_paged

    gather = _vllm_paged.PagedCache.gather
    failed: list[bool] = []

    def failing_gather(self: Any, block_ids: Any, out: Any = None) -> Any:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        if not failed and get_tensor_model_parallel_rank() == rank:
            failed.append(True)
            raise MemoryError(f"injected: rank {rank}'s copy out of the paged cache failed")
        return gather(self, block_ids, out)

    _vllm_paged.PagedCache.gather = failing_gather  # type: ignore[method-assign]


if os.environ.get("TLKV_FAULT_COPY_ON_RANK"):
    _fail_first_copy(int(os.environ["TLKV_FAULT_COPY_ON_RANK"]))
