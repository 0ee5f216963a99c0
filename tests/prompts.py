"""Test helpers for token ids and KV events: prompts as (token ids, hashes, envelope), and a
store's event log read back as plain events.

``log_events`` decodes the log's batches with msgspec's schema-less msgpack decoder (the
raw maps a router reads), not with tlkv's own classes; the tests that judge the wire format
decode with vLLM's classes (``tests/test_events_wire.py``).
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
from conftest import SMALL

from kvstore import Block, Geometry, Store, chain_hashes, encode


def prompt(
    n_tokens: int, seed: int = 0, geometry: Geometry = SMALL, start: list[int] | None = None
) -> tuple[list[int], list[int], bytes]:
    """Random token ids (after ``start``), the hashes of their full blocks, and an envelope
    of those full blocks (random KV)."""
    rng = np.random.default_rng(seed)
    ids = (start or []) + rng.integers(0, 50_000, n_tokens, dtype=np.int64).tolist()
    hashes = chain_hashes(ids, geometry.block_tokens)
    kv = [rng.standard_normal(geometry.kv_shape).astype(np.float32) for _ in hashes]
    env = encode(geometry, [Block(h, geometry.block_tokens, k) for h, k in zip(hashes, kv)])
    return ids, hashes, env


def log_events(store: Store, start: int = 0) -> list[tuple[int, str, list[dict[str, Any]]]]:
    """``(seq, model, events)`` of every logged batch from ``start``, events as raw maps."""
    out = []
    for seq, model, payload in store.read_events(start, 1 << 20):
        _ts, events, *_rest = msgspec.msgpack.decode(payload)
        out.append((seq, model, events))
    return out


def flat(batches: list[tuple[int, str, list[dict[str, Any]]]]) -> list[tuple[str, Any, Any]]:
    """Every event of ``batches`` as ``(type, hashes, medium)``."""
    return [(e["type"], e.get("block_hashes"), e.get("medium")) for _, _, ev in batches for e in ev]
