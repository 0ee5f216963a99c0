"""A subscriber to a node's KV event stream: live batches from its PUB socket, missed ones
from its replay socket, in sequence order (``tlkv events``, the tests, ``tools/bench.py``).

``Subscriber.stream(start)`` subscribes first, then replays from ``start`` until the end
marker, then goes on with the live batches, skipping those replayed already; a gap in the
live numbers (the PUB socket dropped batches for a slow reader) is filled by asking the
replay socket again. The numbers are the node's, shared by its topics (one per model): a
subscriber to one model's topic sees increasing numbers with holes where other models'
batches went, so gaps are filled only when it subscribes to every topic. Batches come as
``Message(topic, seq, payload)``; ``kvstore.events.wire.decode_batch`` decodes a payload.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import NamedTuple

import zmq

from .wire import END_SEQ, SEQ

__all__ = ["Message", "Subscriber"]


class Message(NamedTuple):
    """One batch: its topic, sequence number and ``msgpack(KVEventBatch)`` payload."""

    topic: str
    seq: int
    payload: bytes


class Subscriber:
    """A SUB socket connected to ``endpoint`` (topics starting with ``topic``), and a
    DEALER to the replay socket at ``replay_endpoint`` (None: no replay).

    Use it from one thread (ZMQ sockets are not thread-safe); ``close`` when done.
    """

    def __init__(
        self, endpoint: str, replay_endpoint: str | None = None, *, topic: str = ""
    ) -> None:
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, 0)  # keep every batch the node sent us
        self._sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self.topic = topic

    def close(self) -> None:
        """Close the sockets."""
        self._sub.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def recv(self, timeout: float | None = None) -> Message | None:
        """The next live batch, or None after ``timeout`` seconds (None: wait)."""
        ms = -1 if timeout is None else max(0, int(timeout * 1000))
        if not self._sub.poll(ms):
            return None
        topic, seq, payload = self._sub.recv_multipart()
        return Message(topic.decode("utf-8"), SEQ.unpack(seq)[0], payload)

    def replay(self, start: int, timeout: float = 10.0) -> list[Message]:
        """Every batch the node's replay socket holds from ``start`` on, in order (those of
        any topic starting with ``topic``).

        Raises:
            TimeoutError: no end marker within ``timeout`` seconds of the last frame.
            RuntimeError: there is no replay endpoint.
        """
        if self._replay_endpoint is None:
            raise RuntimeError("this subscriber has no replay endpoint")
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVHWM, 0)
        try:
            dealer.connect(self._replay_endpoint)
            dealer.send_multipart([b"", SEQ.pack(start)])
            out: list[Message] = []
            while True:
                if not dealer.poll(int(timeout * 1000)):
                    raise TimeoutError(
                        f"replay from {self._replay_endpoint}: no end marker within {timeout} s"
                    )
                frames = dealer.recv_multipart()
                _empty, topic, seq, payload = frames[-4:]
                if seq == END_SEQ:
                    return out
                name = topic.decode("utf-8")
                if name.startswith(self.topic):
                    out.append(Message(name, SEQ.unpack(seq)[0], payload))
        finally:
            dealer.close(linger=0)

    def stream(
        self, start: int | None = None, *, timeout: float | None = None, settle: float = 0.2
    ) -> Iterator[Message]:
        """Batches in sequence order: replayed from ``start`` (None: live only), then live.

        ``settle``: seconds to wait after subscribing before the first replay, so that
        the subscription is in place when the replay ends (PUB drops what a SUB is not yet
        subscribed for). A live gap is filled from the replay socket when this subscriber
        takes every topic. Ends after ``timeout`` seconds without a batch (None: never).
        """
        fill_gaps = self._replay_endpoint is not None and not self.topic
        expected = None
        if start is not None and self._replay_endpoint is not None:
            time.sleep(settle)
            for m in self.replay(start):
                yield m
                expected = m.seq + 1
            expected = start if expected is None else expected
        while True:
            got = self.recv(timeout)
            if got is None:
                return
            m = got
            if expected is not None and m.seq < expected:
                continue  # replayed already
            if expected is not None and m.seq > expected and fill_gaps:
                for r in self.replay(expected):
                    if r.seq >= m.seq:
                        break
                    yield r
            yield m
            expected = m.seq + 1
