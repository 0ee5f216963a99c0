"""The bytes of a node's KV event stream, declared once: vLLM 0.32.0's wire format.

A node publishes on a ZMQ PUB socket multipart messages ``[topic, seq, payload]``: the
topic (UTF-8, ``kv@<node id>@<model>`` by default, ``topic_for``), the batch's sequence
number as 8 bytes big-endian (``SEQ``), and ``msgpack(KVEventBatch)``. The classes below
encode exactly as ``vllm.distributed.kv_events`` (vLLM 0.32.0) does: the batch an array
``[ts, events]`` (``data_parallel_rank`` omitted while None), each event a map tagged
``"type": "<class name>"`` with its fields in vLLM's order, the defaulted ones omitted
(``tests/test_events_wire.py`` decodes them with vLLM's own classes and re-encodes them
to the same bytes).

The replay protocol (vLLM's ``ZmqEventPublisher``): a client sends to the ROUTER socket
``[b"", start seq]`` (a DEALER; a REQ adds the empty frame itself) and receives, for each
batch with a number at or above it, ``[b"", topic, seq, payload]``, then the end marker
``[b"", b"", END_SEQ, b""]``.

Media (``BlockStored.medium``/``BlockRemoved.medium``): ``"STORAGE"`` (vLLM's
``MEDIUM_STORAGE``) for the node's disk, ``"EXTERNAL"`` for the shared object-store tier
(any node on that tier reads the block through; NVIDIA Dynamo's router reads it as its
``External`` storage tier).
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

__all__ = [
    "END_SEQ",
    "MEDIUM_STORAGE",
    "MEDIUM_TIER",
    "SEQ",
    "TOPIC_TEMPLATE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEventBatch",
    "decode_batch",
    "encode_batch",
    "topic_for",
]

MEDIUM_STORAGE = "STORAGE"  # vllm.distributed.kv_events.MEDIUM_STORAGE: the node's disk
MEDIUM_TIER = "EXTERNAL"  # the shared object-store tier behind the node

SEQ = struct.Struct(">Q")  # a batch's sequence number: 8 bytes, big-endian
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker (vLLM's END_SEQ)
TOPIC_TEMPLATE = "kv@{node}@{model}"  # llm-d's topic: kv@<pod or node>@<model>


class EventBatch(
    msgspec.Struct,
    array_like=True,  # type: ignore[call-arg]
    omit_defaults=True,  # type: ignore[call-arg]
    gc=False,  # type: ignore[call-arg]
):
    """vLLM's ``EventBatch``: a timestamp and the events, encoded as an array."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(
    msgspec.Struct,
    omit_defaults=True,  # type: ignore[call-arg]
    gc=False,  # type: ignore[call-arg]
    tag=True,
):
    """vLLM's ``KVCacheEvent``: a map tagged with its class name under ``"type"``."""


class BlockStored(KVCacheEvent):
    """Blocks stored on ``medium``: a chain from ``parent_block_hash`` (None: the start of
    a sequence), ``block_size`` token ids per block in ``token_ids``."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    """Blocks no longer on ``medium``."""

    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """Every block of the topic's model is gone (a model dropped or cleared)."""


class KVEventBatch(EventBatch):
    """vLLM's ``KVEventBatch``: the payload of one message."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(ts: float, events: list[BlockStored | BlockRemoved | AllBlocksCleared]) -> bytes:
    """``msgpack(KVEventBatch(ts, events, 0))``: one message's payload, with the data
    parallel rank 0 that vLLM's publisher writes into every batch of a single engine."""
    return _encoder.encode(KVEventBatch(ts=ts, events=events, data_parallel_rank=0))


def decode_batch(payload: Any) -> KVEventBatch:
    """A payload as a ``KVEventBatch``.

    Raises:
        msgspec.DecodeError: the bytes are not one.
    """
    return _decoder.decode(payload)


def topic_for(template: str, node: str, model: str) -> str:
    """A model's topic: ``template`` with ``{node}`` and ``{model}`` filled in."""
    return template.replace("{node}", node).replace("{model}", model)
