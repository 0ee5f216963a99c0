"""The copy a save starts with (``copy_out``): with one rank, into a buffer the paged
cache keeps; under tensor parallelism, the ranks' heads joined into whole blocks.

Every rank runs the same saves in the same step, and every rank takes part in every
collective of a save whatever its own copy out of the paged cache did: a rank that
skipped one would leave the others waiting in it for ever (vLLM's ``RPC call to
execute_model timed out``). So the ranks first join one flag each (its copy succeeded),
then, only when every flag is up, the parts themselves.

The join is an ``all_gather``, the collective vLLM's own forward runs every step, not a
``gather`` to rank 0: on the CPU build's shared-memory communicator a ``gather`` returns
on the other ranks before rank 0 has read their parts, and a rank that runs two
collectives ahead of a slow rank 0 (its core busy with the saver) leaves both waiting
for ever (BENCHMARKS.md, vllm).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["PeerCopyError", "copy_out", "join_heads"]


class PeerCopyError(RuntimeError):
    """Another rank could not copy its heads of a save out of its paged cache: the save
    is dropped on every rank (a block is stored whole or not at all)."""


def join_heads(part: Any, dtype: Any, device: Any) -> Any:
    """Every rank's heads of one save, joined in rank order on every rank: a tensor
    ``[n][L][2][Hkv][B][D]`` (``part``: this rank's ``[n][L][2][h][B][D]``, or None when
    its copy failed; ``dtype`` and ``device``: its paged cache's).

    Raises:
        PeerCopyError: a rank's copy failed (its ranks named); raised on every rank, after
            the same collectives on every rank.
    """
    import torch
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    flag = torch.full((1,), 0.0 if part is None else 1.0, dtype=dtype, device=device)
    flags = group.all_gather(flag, dim=0).float().tolist()
    failed = [rank for rank, ok in enumerate(flags) if ok != 1.0]
    if failed:
        raise PeerCopyError(
            f"rank(s) {failed} could not copy their heads out of the paged cache: "
            f"the save is dropped on every rank"
        )
    return group.all_gather(part.to(device), dim=3)


def copy_out(
    paged: Any, block_ids: list[int], tp_size: int, failed: Callable[[str, BaseException], None]
) -> tuple[Any, Callable[[], None] | None]:
    """The blocks ``block_ids`` of ``paged`` (a ``PagedCache``), every head, copied out of
    the paged cache (under tensor parallelism: on every rank, after the same joins on
    every rank; a rank's own failure goes to ``failed``), and the function that gives
    their buffer back (None: nothing to give back).

    Raises:
        PeerCopyError: a rank's copy failed (that rank logs its own error).
    """
    if tp_size == 1:
        return paged.gather_kept(block_ids)  # type: ignore[no-any-return]
    part = None
    try:
        part = paged.gather(block_ids)
    except Exception as exc:  # logged here; the join then fails on every rank
        failed("save", exc)
    whole = join_heads(part, paged.dtype, paged.device)
    return whole.cpu(), None  # [n][L][2][Hkv][B][D], the ranks' heads in order
