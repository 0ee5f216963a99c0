"""KV events: what a tlkv node tells routers about the blocks it holds.

``wire`` declares the stream's bytes once (vLLM 0.32.0's event classes and framing, the
topic, the replay protocol); the store writes its event log in those bytes
(``kvstore/store/eventlog.py``); ``api.kvevents`` publishes it; ``subscriber`` reads a
node's stream (``tlkv events``). ``docs/events.md`` is the operator's page.
"""

from .wire import (
    MEDIUM_STORAGE,
    MEDIUM_TIER,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
    topic_for,
)

__all__ = [
    "MEDIUM_STORAGE",
    "MEDIUM_TIER",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEventBatch",
    "decode_batch",
    "encode_batch",
    "topic_for",
]
