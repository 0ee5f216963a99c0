"""The vLLM connector's saver: one thread that stores the blocks gathered at the end of a
step, so that the engine never waits on a store or a server."""

from __future__ import annotations

import atexit
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Saver"]

# Queued saves are finished before the interpreter's thread pools stop taking work (a large
# put writes through the store's helper pool): ``threading._register_atexit`` runs its
# callbacks before that, ``atexit`` after it. Where the former is missing, the latter.
_at_exit = getattr(threading, "_register_atexit", atexit.register)
_SAVE_QUEUE_BYTES = 1 << 30  # gathered blocks waiting for the saver; beyond, saves drop


class Saver:
    """One thread that runs ``save(model, hashes, blocks, *rest)`` for queued saves, in order.

    At most ``_SAVE_QUEUE_BYTES`` wait (``submit`` returns False beyond: the save is
    dropped); ``close`` (called by the connector's ``shutdown`` and at interpreter exit)
    finishes what is queued.
    """

    def __init__(self, save: Callable[..., None]) -> None:
        self._save = save
        self._queue: queue.Queue[Any] = queue.Queue()
        self._bytes = 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, model: str, hashes: list[int], blocks: Any, *rest: Any) -> bool:
        """Queue a save of ``blocks`` (an array with ``nbytes``; ``rest``: what else the
        save function takes, such as the blocks' token ids); False: the queue is full and
        the save is dropped."""
        with self._lock:
            if self._bytes + blocks.nbytes > _SAVE_QUEUE_BYTES:
                return False
            self._bytes += blocks.nbytes
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tlkv-saver", daemon=True)
                self._thread.start()
                _at_exit(self.close)
        self._queue.put((model, hashes, blocks, *rest))
        return True

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._save(*item)
            finally:
                with self._lock:
                    self._bytes -= item[2].nbytes

    def close(self) -> None:
        """Finish the queued saves and stop the thread."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()
