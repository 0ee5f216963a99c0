"""Test helper: a ``tlkv serve`` publishing KV events, and reading what it publishes."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
from conftest import SMALL
from http_server import ServerProcess, free_port

from kvstore.events.subscriber import Message, Subscriber


class Node:
    """A ``tlkv serve`` publishing KV events, with the endpoints a router uses."""

    def __init__(self, data: Path, *args: str, node: str = "n1") -> None:
        self.pub_port, self.replay_port = free_port(), free_port()
        self.server = ServerProcess(
            data,
            "--geometry",
            ",".join(map(str, SMALL.as_tuple())),
            "--kv-events-endpoint",
            f"tcp://*:{self.pub_port}",
            "--kv-events-replay-endpoint",
            f"tcp://*:{self.replay_port}",
            "--node-id",
            node,
            *args,
        )

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.pub_port}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def subscriber(self, topic: str = "") -> Subscriber:
        sub = Subscriber(self.endpoint, self.replay, topic=topic)
        time.sleep(0.3)  # PUB drops what is sent before the subscription arrives
        return sub


def events_of(m: Message) -> list[dict[str, Any]]:
    """The events of a batch as the raw msgpack maps a router reads."""
    _ts, events, *_ = msgspec.msgpack.decode(m.payload)
    return list(events)


def recv(sub: Subscriber, n: int, timeout: float = 10.0) -> list[Message]:
    """Up to ``n`` live batches, waiting at most ``timeout`` seconds."""
    out: list[Message] = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        m = sub.recv(0.2)
        if m is not None:
            out.append(m)
    return out
