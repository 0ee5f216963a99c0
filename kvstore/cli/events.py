"""``tlkv events``: print a node's KV events as JSON lines, resuming from a sequence number.

One line per batch: ``{"seq", "topic", "ts", "events"}``, each event as vLLM's class
encodes it (``{"type": "BlockStored", "block_hashes": [...], ...}``; hashes as JSON
integers). ``--from N`` first replays every batch numbered N or above that the node's
replay socket still holds, then follows the live stream without a repeat or a gap
(``kvstore.events.subscriber``).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from .common import EXIT_OK


def _line(topic: str, seq: int, payload: bytes) -> str:
    import msgspec

    from ..events.wire import decode_batch

    batch = decode_batch(payload)
    events = msgspec.to_builtins(batch.events)
    return json.dumps(
        {"seq": seq, "topic": topic, "ts": batch.ts, "events": events}, separators=(",", ":")
    )


def _cmd_events(args: argparse.Namespace) -> int:
    from ..events.subscriber import Subscriber

    if args.start is not None and args.replay_endpoint is None:
        raise ValueError("--from needs --replay-endpoint (the node's replay socket)")
    count = 0
    with Subscriber(args.endpoint, args.replay_endpoint, topic=args.topic) as sub:
        for m in sub.stream(args.start, timeout=args.timeout):
            print(_line(m.topic, m.seq, m.payload), flush=True)
            count += 1
            if args.count is not None and count >= args.count:
                break
    return EXIT_OK


def register(sub: Any) -> None:
    """Add ``events`` to the ``tlkv`` subcommands."""
    p = sub.add_parser(
        "events", help="print a node's KV events (tlkv serve --kv-events-endpoint) as JSON lines"
    )
    p.add_argument("--endpoint", required=True, help="the node's PUB socket, tcp://host:5557")
    p.add_argument(
        "--replay-endpoint", default=None, help="the node's replay socket, tcp://host:5558"
    )
    p.add_argument(
        "--from",
        dest="start",
        type=int,
        default=None,
        metavar="SEQ",
        help="replay from this sequence number first (needs --replay-endpoint)",
    )
    p.add_argument("--topic", default="", help="only topics starting with this (default: all)")
    p.add_argument("--count", type=int, default=None, help="stop after this many batches")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="stop after this many seconds without a batch (default: never)",
    )
    p.set_defaults(func=_cmd_events)
