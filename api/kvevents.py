"""The KV event publisher of ``tlkv serve --kv-events-endpoint``: one process per server.

The workers (and any other process writing to the store) write their event batches into
the store's log in the transactions that change it (``kvstore/store/eventlog.py``), under
sequence numbers LMDB allocates; this process follows the log and sends each batch once,
in order, on a ZMQ PUB socket as ``[topic, seq, payload]`` (``kvstore.events.wire``; an
XPUB, which is a PUB to subscribers), and answers vLLM's replay protocol on a ROUTER
socket from the same log. So several workers publish one stream with no gap, the numbers
survive a restart or a ``kill -9`` (they are in LMDB), and a put never waits for the
network: publishing is a read of the log here, outside every write, at a lower priority
than the workers. A subscriber that is slow or away loses live batches (PUB
semantics: at most ``PUB_HWM`` queued for it) and catches up by replay, within the log's
bound (``--kv-events-replay-batches``).

``tlkv serve`` starts it (``PublisherProcess``) before the workers, starts it again if
it ends on its own, and it ends with the server: it watches the process that started it
and exits when that process is gone, however it ended. It starts at the log's end:
batches written while no publisher ran are served by replay only.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO

import zmq

from kvstore.events.wire import END_SEQ, SEQ, topic_for
from kvstore.store import Store

# Seconds between two looks at the log (one LMDB read transaction each): the first after
# a batch, doubled after each look that found nothing, up to the second: the latency a
# batch may wait for, traded against the CPU an idle server spends looking (~0.5 %).
# (Waking it from the writers after each commit was tried: published the instant after a
# commit, it preempted the next put on a busy 2-core machine, 0.45-0.97x.)
POLL_SECONDS = 0.002
POLL_IDLE_SECONDS = 0.025
READ_BATCHES = 1024  # batches read from the log at once
PUB_HWM = 100_000  # batches queued for one slow subscriber before it loses live ones
BIND_WAIT_SECONDS = 10.0  # a port still held by a publisher that is exiting: retry this long
READY = "ready"  # the line the publisher prints once its sockets are bound
PUBLISHER_NICENESS = 10


def _bind(sock: zmq.Socket, endpoint: str) -> None:
    """Bind (``tcp://*:port``, ``ipc://``) or connect (a named host), as vLLM's publisher
    does; a port in use is tried again for ``BIND_WAIT_SECONDS``."""
    if not ("*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))):
        sock.connect(endpoint)
        return
    deadline = time.monotonic() + BIND_WAIT_SECONDS
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


class Publisher:
    """Follows a store's event log and publishes it (see the module docstring)."""

    def __init__(
        self,
        store: Store,
        endpoint: str,
        replay_endpoint: str | None,
        *,
        node: str,
        topic: str,
    ) -> None:
        self.store = store
        self.node = node
        self.template = topic
        self._topics: dict[str, bytes] = {}
        self._ctx = zmq.Context()
        # XPUB: a PUB (SUB sockets cannot tell) that hands new subscriptions to the loop
        self.pub = self._ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.SNDHWM, PUB_HWM)
        _bind(self.pub, endpoint)
        self.replay = None
        if replay_endpoint is not None:
            self.replay = self._ctx.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.SNDHWM, 0)  # a replay is bounded by the log
            _bind(self.replay, replay_endpoint)
        self.next = store.events_bounds()[1]  # the log's end: new batches from here

    def close(self) -> None:
        """Close the sockets."""
        self.pub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)
        self._ctx.term()

    def _topic(self, model: str) -> bytes:
        topic = self._topics.get(model)
        if topic is None:
            topic = self._topics[model] = topic_for(self.template, self.node, model).encode()
        return topic

    def publish_new(self) -> int:
        """Send the batches logged since the last call; how many."""
        sent = 0
        while True:
            batches = self.store.read_events(self.next, READ_BATCHES)
            if batches:
                # libzmq takes in a (re)connected subscriber and its subscription only
                # inside a call on the socket: before sending, not after the first send.
                self.pub.getsockopt(zmq.EVENTS)
            for seq, model, payload in batches:
                self.pub.send_multipart([self._topic(model), SEQ.pack(seq), payload])
                self.next = seq + 1
            sent += len(batches)
            if len(batches) < READ_BATCHES:
                return sent

    def serve_replay(self) -> None:
        """Answer one replay request: every logged batch from its start, then the end."""
        assert self.replay is not None
        frames = self.replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != SEQ.size:
            return  # not vLLM's request ([identity, b"", 8-byte start]): ignored, as vLLM does
        client, _, start = frames
        at = SEQ.unpack(start)[0]
        while True:
            batches = self.store.read_events(at, READ_BATCHES)
            for seq, model, payload in batches:
                self.replay.send_multipart(
                    [client, b"", self._topic(model), SEQ.pack(seq), payload]
                )
            if len(batches) < READ_BATCHES:
                break
            at = batches[-1][0] + 1
        self.replay.send_multipart([client, b"", b"", END_SEQ, b""])

    def run(self, alive: Callable[[], bool] = lambda: True) -> None:
        """Publish until ``alive()`` is false (asked at least every 50 ms)."""
        poller = zmq.Poller()
        poller.register(self.pub, zmq.POLLIN)  # XPUB: a subscription arriving
        if self.replay is not None:
            poller.register(self.replay, zmq.POLLIN)
        last_check = time.monotonic()
        wait = POLL_SECONDS
        while True:
            sent = self.publish_new()
            wait = POLL_SECONDS if sent else min(2 * wait, POLL_IDLE_SECONDS)
            ready = dict(poller.poll(max(1, int(wait * 1000))))  # the wait between looks
            if self.pub in ready:  # libzmq takes subscriptions in only on a call
                _drain(lambda: self.pub.recv(zmq.NOBLOCK), zmq.Again)
            if self.replay is not None and self.replay in ready:
                self.publish_new()  # a replay answers up to the log's end: published first
                self.serve_replay()
            now = time.monotonic()
            if now - last_check > 0.05:
                last_check = now
                if not alive():
                    return


def _drain(receive: Callable[[], object], empty: type[Exception]) -> None:
    """Receive until nothing is left."""
    try:
        while True:
            receive()
    except empty:
        pass


def _parent_alive(parent: int) -> bool:
    return os.getppid() == parent


def main(argv: list[str] | None = None) -> int:
    """``python -m api.kvevents``: the publisher process ``start`` runs."""
    p = argparse.ArgumentParser(prog="python -m api.kvevents")
    p.add_argument("--data", required=True)
    p.add_argument("--endpoint", required=True)
    p.add_argument("--replay-endpoint", default=None)
    p.add_argument("--node", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--parent", type=int, required=True)
    args = p.parse_args(argv)
    with contextlib.suppress(OSError):
        # Publishing yields to the workers' puts on a busy machine.
        os.nice(PUBLISHER_NICENESS)
    store = Store(args.data)
    try:
        publisher = Publisher(
            store, args.endpoint, args.replay_endpoint, node=args.node, topic=args.topic
        )
    except zmq.ZMQError as exc:
        print(f"tlkv serve: KV events: cannot bind {exc}", file=sys.stderr)
        store.close()
        return 1
    print(READY, flush=True)
    try:
        publisher.run(lambda: _parent_alive(args.parent))
    except KeyboardInterrupt:
        pass
    finally:
        publisher.close()
        store.close()
    return 0


def _spawn(cmd: list[str]) -> subprocess.Popen[str]:
    """Run the publisher process; return once its sockets are bound.

    Raises:
        RuntimeError: it could not bind (its message, on stderr, says why).
    """
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    stdout: IO[str] | None = proc.stdout
    assert stdout is not None
    if stdout.readline().strip() != READY:
        proc.wait()
        raise RuntimeError(
            f"the KV event publisher did not start (exit code {proc.returncode}); see above"
        )
    return proc


class PublisherProcess:
    """The publisher process of one server: started once bound, started again (by a
    watching thread) if it ever ends on its own, stopped with ``stop``. A batch written
    meanwhile is not lost: the new process starts at the log's end, and replay has it."""

    def __init__(
        self, data: str, endpoint: str, replay_endpoint: str | None, node: str, topic: str
    ) -> None:
        cmd = [sys.executable, "-m", "api.kvevents", "--data", data, "--endpoint", endpoint]
        if replay_endpoint is not None:
            cmd += ["--replay-endpoint", replay_endpoint]
        self._cmd = [*cmd, "--node", node, "--topic", topic, "--parent", str(os.getpid())]
        self._proc = _spawn(self._cmd)
        self._stopping = threading.Event()
        self._watch = threading.Thread(target=self._keep, name="tlkv-kvevents", daemon=True)
        self._watch.start()

    def _keep(self) -> None:
        while True:
            code = self._proc.wait()
            if self._stopping.is_set():
                return
            print(
                f"tlkv serve: the KV event publisher ended ({code}); starting it again",
                file=sys.stderr,
            )
            time.sleep(1.0)
            try:
                self._proc = _spawn(self._cmd)
            except RuntimeError as exc:
                print(f"tlkv serve: {exc}", file=sys.stderr)

    def stop(self) -> None:
        """End the publisher (and stop watching it)."""
        self._stopping.set()
        self._proc.terminate()
        self._proc.wait()


if __name__ == "__main__":
    raise SystemExit(main())
