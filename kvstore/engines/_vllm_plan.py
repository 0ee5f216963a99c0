"""The vLLM connector's scheduler-side plan: each request's blocks, and each step's
loads and saves (``TlkvMetadata``, handed to the workers).

A request's full prompt blocks are named by their chained hashes once, at its first
lookup. Each step, ``Plan.build`` turns vLLM's ``SchedulerOutput`` into the loads the
lookups planned (for requests vLLM allocated for: new ones, and ones resumed after a
preemption with a load planned by a new lookup) and the saves of prompt blocks whose
every token is computed by the end of the step, each block saved once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ..codec.hashing import chain_hashes

__all__ = ["Plan", "Request", "TlkvMetadata"]


@dataclass
class Load:
    """Blocks to copy into the paged cache before this step's forward."""

    req_id: str
    model: str
    hashes: list[int]
    block_ids: list[int]


@dataclass
class Save:
    """Blocks to copy out of the paged cache after this step's forward, and store."""

    model: str
    hashes: list[int]
    block_ids: list[int]
    tokens: list[int] = field(default_factory=list)  # the blocks' token ids, in order
    parent: int = 0  # the hash of the block before the first (0: the prompt's start)


@dataclass
class TlkvMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Scheduler -> worker, one step: blocks to load into which block ids, and to save."""

    loads: list[Load] = field(default_factory=list)
    saves: list[Save] = field(default_factory=list)


@dataclass
class Request:
    """What the scheduler side knows of one request."""

    model: str
    hashes: list[int]  # every full block of the prompt
    tokens: list[int] = field(default_factory=list)  # the prompt's token ids
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0  # leading blocks saved, loaded or known held: never saved again
    load_start: int = 0  # first block to load (vLLM holds those before it)
    load: int = 0  # blocks to load


class Plan:
    """The requests the scheduler side follows, by request id."""

    def __init__(self) -> None:
        self._reqs: dict[str, Request] = {}

    def request(self, req_id: str, model: str, prompt: list[int], block_tokens: int) -> Request:
        """The request ``req_id`` (its blocks named once; again when its namespace
        ``model`` changed)."""
        req = self._reqs.get(req_id)
        if req is None or req.model != model:
            req = Request(model, chain_hashes(prompt, block_tokens), list(prompt))
            self._reqs[req_id] = req
        return req

    def get(self, req_id: str) -> Request | None:
        """The request ``req_id``, if followed."""
        return self._reqs.get(req_id)

    def forget(self, req_id: str) -> None:
        """Stop following ``req_id`` (finished)."""
        self._reqs.pop(req_id, None)

    def build(self, scheduler_output: Any, block_tokens: int, save_on: bool) -> TlkvMetadata:
        """This step's loads (requests with a planned load that vLLM allocated for) and,
        when ``save_on``, saves (prompt blocks whose every token is computed by the end
        of this step)."""
        meta = TlkvMetadata()
        b = block_tokens
        steps = scheduler_output.num_scheduled_tokens
        progress: list[tuple[str, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            req = self._reqs.get(new.req_id)
            if req is None:
                continue
            req.block_ids = list(new.block_ids[0])
            if req.load:
                _plan_load(meta, new.req_id, req)
            progress.append((new.req_id, new.num_computed_tokens + steps.get(new.req_id, 0)))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            req = self._reqs.get(req_id)
            if req is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    req.block_ids = list(new_ids[0])
                else:
                    req.block_ids.extend(new_ids[0])
            if req.load:  # resumed after a preemption, with a load planned by a new lookup
                _plan_load(meta, req_id, req)
            progress.append((req_id, cached.num_computed_tokens[i] + steps.get(req_id, 0)))
        if save_on:
            for req_id, done in progress:
                req = self._reqs[req_id]
                full = min(done // b, len(req.hashes), len(req.block_ids))
                if full > req.saved:
                    s = req.saved
                    meta.saves.append(
                        Save(
                            req.model,
                            req.hashes[s:full],
                            req.block_ids[s:full],
                            req.tokens[s * b : full * b],
                            req.hashes[s - 1] if s else 0,
                        )
                    )
                    req.saved = full
        return meta


def _plan_load(meta: TlkvMetadata, req_id: str, req: Request) -> None:
    start, end = req.load_start, req.load_start + req.load
    meta.loads.append(Load(req_id, req.model, req.hashes[start:end], req.block_ids[start:end]))
    req.load = 0
