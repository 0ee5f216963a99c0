"""NVIDIA Dynamo's KV router index fed with a node's KV events: run by the Python of a venv
holding ``ai-dynamo-runtime==1.6.1`` (``tests/test_events_dynamo.py`` starts it), one JSON
command per line on stdin, one JSON answer per line on stdout.

- ``{"op": "event", "worker": W, "event_id": N, "block_size": B, "event": {...}}``: one
  event as the msgpack map a node published (``"type": "BlockStored"``, ...), converted as
  Dynamo converts the events of vLLM's ZMQ stream (``lib/kv-router/src/zmq_wire/
  convert.rs``, ``convert_event`` and ``create_stored_blocks``) and applied to the
  ``dynamo._core.RadixTree``. Answers ``{"applied": bool}``.
- ``{"op": "match", "tokens": [...], "block_size": B}``: the prompt's blocks hashed as
  Dynamo's router hashes them (``compute_block_hash_for_seq``), matched by
  ``RadixTree.find_matches``. Answers ``{"scores": {"<worker>": <blocks matched>}}``.

The conversion, as convert.rs does it: an event whose ``locality`` is REMOTE (or unknown)
is dropped; a ``BlockStored`` whose hashes repeat (or repeat its parent) becomes an empty
removal; each of its blocks whose size is the router's ``block_size`` becomes
``{"block_hash": <the engine's hash>, "tokens_hash": compute_block_hash_for_seq(<its
tokens>, block_size)[0]}`` under ``parent_hash``, stopping at the first block of another
size or with too few tokens; ``BlockRemoved`` and ``AllBlocksCleared`` carry over. The
medium picks Dynamo's storage tier (``StorageTier::from_kv_medium``: ``STORAGE`` is its
Disk tier, ``EXTERNAL`` its External tier), each tier an index of its own: this index is
the node's disk, so events of another medium are not applied to it.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from dynamo._core import RadixTree, compute_block_hash_for_seq

INDEX_MEDIUM = "STORAGE"


def convert(raw: dict[str, Any], event_id: int, block_size: int) -> dict[str, Any] | None:
    """A vLLM wire event as Dynamo's ``KvCacheEvent`` (its JSON), or None when dropped."""
    if raw.get("locality") not in (None, "LOCAL"):
        return None
    kind = raw["type"]
    if kind != "AllBlocksCleared" and (raw.get("medium") or INDEX_MEDIUM) != INDEX_MEDIUM:
        return None
    if kind == "BlockStored":
        hashes, parent = raw["block_hashes"], raw.get("parent_block_hash")
        unique = {*hashes, *([] if parent is None else [parent])}
        if len(unique) != len(hashes) + (parent is not None):  # a self-reference: dropped
            data: dict[str, Any] = {"removed": {"block_hashes": []}}
        else:
            blocks = []
            tokens, at = raw["token_ids"], 0
            for h in hashes:
                if raw["block_size"] != block_size or at + block_size > len(tokens):
                    break
                toks = tokens[at : at + block_size]
                tokens_hash = compute_block_hash_for_seq(toks, block_size)[0]
                blocks.append({"block_hash": h, "tokens_hash": tokens_hash, "mm_extra_info": None})
                at += block_size
            data = {"stored": {"parent_hash": parent, "start_position": None, "blocks": blocks}}
    elif kind == "BlockRemoved":
        data = {"removed": {"block_hashes": raw["block_hashes"]}}
    elif kind == "AllBlocksCleared":
        return {"event_id": event_id, "data": "cleared", "dp_rank": 0}
    else:
        return None
    return {"event_id": event_id, "data": data, "dp_rank": 0}


def main() -> None:
    tree = RadixTree()
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "event":
            event = convert(cmd["event"], cmd["event_id"], cmd["block_size"])
            if event is not None:
                tree.apply_event(cmd["worker"], json.dumps(event).encode())
            answer: dict[str, Any] = {"applied": event is not None}
        else:
            hashes = compute_block_hash_for_seq(cmd["tokens"], cmd["block_size"])
            scores = tree.find_matches(hashes).scores
            answer = {"scores": {str(worker): n for (worker, _dp), n in scores.items()}}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
