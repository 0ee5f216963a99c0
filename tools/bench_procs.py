"""Bench processes: an object built in a process of its own (spawned, as engines and clients
are), whose methods the bench calls by name over a pipe.

``BenchProcess(ctx, factory, *args)`` spawns a process that builds ``factory(*args)`` (a
module-level callable, so that spawn can pickle it) and answers ``"ready"`` or why it
failed; ``send`` then ``result`` (or ``call``, both) run one of its methods; ``stop`` closes
it. Several processes are driven at once by sending to each before reading any result.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any


def _serve(conn: Connection, factory: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """The process's loop: build the object, then run the methods named until "stop"."""
    os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's INFO lines, per process
    try:
        side = factory(*args)
    except Exception as exc:
        conn.send(f"{type(exc).__name__}: {exc}")
        return
    conn.send("ready")
    try:
        while True:
            name, call_args = conn.recv()
            if name == "stop":
                break
            try:
                conn.send(("ok", getattr(side, name)(*call_args)))
            except Exception as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        side.close()


class BenchProcess:
    """One spawned process holding ``factory(*args)`` (its ``close`` runs at ``stop``)."""

    def __init__(self, ctx: Any, factory: Callable[..., Any], *args: Any) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, factory, args), daemon=True)
        self.proc.start()

    def ready(self, timeout: float = 300) -> None:
        """Wait until the object is built; raise with the reason when it was not."""
        if not self.conn.poll(timeout):
            raise RuntimeError("a bench process did not start")
        status = self.conn.recv()
        if status != "ready":
            raise RuntimeError(f"a bench process failed: {status}")

    def send(self, name: str, *args: Any) -> None:
        """Start method ``name`` in the process (its answer is read by ``result``)."""
        self.conn.send((name, args))

    def result(self) -> Any:
        """The answer of the method last sent; raises with the process's error."""
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def call(self, name: str, *args: Any) -> Any:
        """Run method ``name`` and return its answer."""
        self.send(name, *args)
        try:
            return self.result()
        except RuntimeError as exc:
            raise RuntimeError(f"{name}: {exc}") from None

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.send(("stop", ()))
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
