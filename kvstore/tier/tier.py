"""The tier as a store sees it: block objects of one namespace, counters and health.

``Tier`` turns batches of hashes into batched concurrent object requests (reads, HEADs,
conditional creates) and keeps what the service shows: uploads done, tier errors,
read-through hits and refusals, and the tier's state. After a failure it is held
``unreachable`` for a backoff (0.5 s doubling to 30 s, reset by a success). Requests
outstanding with none answered for ``REQUEST_STALL_SECONDS`` (an endpoint that accepts
connections and never answers) make the tier ``unreachable`` too, for as long as they are
outstanding. While the tier is ``unreachable`` (in this process's view or, through the
shared state, another worker's), reads and HEADs answer "absent" at once, without a
request, so an unreachable tier never slows what is local; after each backoff one probe
(a HEAD of the namespace's geometry object) runs in the background, at most one at a
time, and its answer makes the tier ``ok`` again (or doubles the backoff).

Shared state (``share_state``): the workers of one store see one tier state. Each writes
its latest observation (state, wall time, error) to a small file beside the store when it
differs from what the file says, and a watch thread writes a stalled request's state the
moment it passes the bound; every worker answers the newer of its own observation and the
file's, so a worker that never talked to the tier still reports it down.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..codec.geometry import Geometry
from ..errors import TierError
from .layout import DEFAULT_NAMESPACE, block_key, check_namespace, geometry_key
from .objects import DEFAULT_CONCURRENCY, ObjectClient

log = logging.getLogger("tlkv.tier")

BACKOFF_FIRST = 0.5  # seconds the tier is left alone after its first failure
BACKOFF_MAX = 30.0

STATE_OK = "ok"
STATE_UNKNOWN = "unknown"  # no request answered yet
STATE_UNREACHABLE = "unreachable"

REQUEST_STALL_SECONDS = 30.0  # a request unanswered this long marks the tier unreachable
_WATCH_EVERY = 1.0  # seconds between the watch thread's looks at outstanding requests
_SHARED_FRESH = 0.5  # seconds a read of the shared state file is reused


class Tier:
    """Block objects of ``namespace`` under ``url`` (see :mod:`kvstore.tier.layout`); the
    batch calls take another ``namespace`` (a store's other models share one ``Tier``: its
    connections, state and counters).

    Args:
        url: ``s3://bucket/prefix`` or ``file:///path``.
        endpoint: an S3-compatible server's URL (else ``AWS_ENDPOINT_URL`` or AWS itself).
        namespace: the key space of this store's blocks (``default``).
        concurrency: requests in flight per batch (reads, HEADs, uploads).
    """

    def __init__(
        self,
        url: str,
        *,
        endpoint: str | None = None,
        namespace: str = DEFAULT_NAMESPACE,
        concurrency: int = DEFAULT_CONCURRENCY,
    ) -> None:
        self.namespace = check_namespace(namespace)
        self.client = ObjectClient(url, endpoint=endpoint, concurrency=concurrency)
        self.url = url
        self._lock = threading.Lock()
        self._backoff = 0.0
        self._down_until = 0.0
        self._state = STATE_UNKNOWN
        self._state_at = 0.0  # wall time of the state's observation
        self._error = ""
        self._outstanding: dict[int, float] = {}  # request id -> monotonic start
        self._last_answer = 0.0  # monotonic time the latest request ended
        self._ids = itertools.count()
        self._probing = False  # a probe of an unreachable tier is in flight
        self._shared_path: str | None = None
        self._shared: tuple[float, str, float, str] = (0.0, STATE_UNKNOWN, 0.0, "")
        self._watch_stop = threading.Event()
        self.uploads = 0
        self.errors = 0
        self.read_hits = 0
        self.refused = 0

    def __repr__(self) -> str:
        return f"Tier({self.url!r}, namespace={self.namespace!r}, {self.state})"

    def key(self, block_hash: int, namespace: str | None = None) -> str:
        """The object key of a block of ``namespace`` (default: the tier's own)."""
        return block_key(self.namespace if namespace is None else namespace, block_hash)

    # --- health -----------------------------------------------------------------------------

    @property
    def state(self) -> str:
        """``ok``, ``unknown`` (no answer yet) or ``unreachable`` (see the module doc)."""
        return self._view()[0]

    @property
    def last_error(self) -> str:
        """The latest failure (or stalled request) behind ``state`` ("" when none)."""
        return self._view()[1]

    def _stalled(self) -> str:
        """Why the tier counts as stalled ("" when it does not): requests are outstanding
        and none has started or ended for ``REQUEST_STALL_SECONDS`` (queued uploads behind
        ones that keep finishing are not stalled)."""
        with self._lock:
            if not self._outstanding:
                return ""
            since = max(min(self._outstanding.values()), self._last_answer)
        age = time.monotonic() - since
        if age < REQUEST_STALL_SECONDS:
            return ""
        return f"a request has had no answer for {age:.0f} s (bound {REQUEST_STALL_SECONDS:.0f} s)"

    def _view(self) -> tuple[str, str]:
        stalled = self._stalled()
        if stalled:
            return STATE_UNREACHABLE, stalled
        _read, state, at, error = self._read_shared()
        if at > self._state_at:
            return state, error
        return self._state, self._error

    def share_state(self, directory: str) -> None:
        """Share the tier's state with the other processes using ``directory`` (the
        store's): write observations to ``tier-state.json`` there and read theirs."""
        self._shared_path = os.path.join(directory, "tier-state.json")
        threading.Thread(target=self._watch, name="tlkv-tier-watch", daemon=True).start()

    def stop_sharing(self) -> None:
        """End the watch thread (the store is closing)."""
        self._watch_stop.set()

    def _watch(self) -> None:
        published = ""
        while not self._watch_stop.wait(_WATCH_EVERY):
            stalled = self._stalled()
            if stalled and not published:
                with self._lock:
                    self._state, self._state_at, self._error = (
                        STATE_UNREACHABLE,
                        time.time(),
                        stalled,
                    )
                self._publish()
            published = stalled

    def _read_shared(self) -> tuple[float, str, float, str]:
        path = self._shared_path
        if path is None:
            return self._shared
        now = time.monotonic()
        if now - self._shared[0] < _SHARED_FRESH:
            return self._shared
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
            state, at, error = str(raw["state"]), float(raw["at"]), str(raw["error"])
            if raw["url"] != self.url:  # written while the store had another tier
                state, at, error = STATE_UNKNOWN, 0.0, ""
        except (OSError, ValueError, KeyError, TypeError):
            state, at, error = STATE_UNKNOWN, 0.0, ""
        self._shared = (now, state, at, error)
        return self._shared

    def _publish(self) -> None:
        """Write this process's observation where the other workers read it, when the
        file says otherwise."""
        path = self._shared_path
        if path is None:
            return
        with self._lock:
            mine = {"state": self._state, "at": self._state_at, "error": self._error}
            mine["url"] = self.url
        if self._read_shared()[1] == mine["state"]:
            return
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(mine, f)
            os.replace(tmp, path)
        except OSError as exc:  # the state stays this worker's own
            log.warning("tier state not shared through %s: %s", path, exc)
        self._shared = (0.0, *self._shared[1:])  # read it again next time

    def _begin(self) -> int:
        request = next(self._ids)
        with self._lock:
            self._outstanding[request] = time.monotonic()
        return request

    def _end(self, request: int) -> None:
        with self._lock:
            self._outstanding.pop(request, None)
            self._last_answer = time.monotonic()

    def available(self) -> bool:
        """Whether a request may go to the tier now: not while it is backed off after a
        failure, nor while it counts as unreachable (a stalled request, or another worker's
        observation); then a probe starts in the background, unless one is in flight."""
        if time.monotonic() < self._down_until:
            return False
        if self._view()[0] != STATE_UNREACHABLE:
            return True
        self._probe()
        return False

    def _probe(self) -> None:
        """Ask the tier whether it answers again, without waiting (one probe at a time)."""
        with self._lock:
            if self._probing:
                return
            self._probing = True
        request = self._begin()

        def finished(future: concurrent.futures.Future[bool | TierError]) -> None:
            self._end(request)
            self._record([future.result()])
            with self._lock:
                self._probing = False

        self.client.submit_exists(geometry_key(self.namespace)).add_done_callback(finished)

    def retry_in(self) -> float:
        """Seconds until the tier is tried again (0 when available)."""
        return max(0.0, self._down_until - time.monotonic())

    def _record(self, results: Sequence[Any]) -> None:
        failures = [r for r in results if isinstance(r, TierError)]
        with self._lock:
            if not failures:
                if results:
                    self._state, self._state_at, self._backoff = STATE_OK, time.time(), 0.0
                    self._error = ""
            else:
                self.errors += len(failures)
                self._error = str(failures[0])
                if len(failures) < len(results):
                    return  # some answered: a per-object failure, not a down tier
                if time.monotonic() < self._down_until:
                    return  # requests started before the backoff began: no longer one
                self._backoff = min(BACKOFF_MAX, max(BACKOFF_FIRST, 2 * self._backoff))
                self._down_until = time.monotonic() + self._backoff
                if self._state != STATE_UNREACHABLE:
                    log.warning("tier %s unreachable: %s", self.url, self._error)
                self._state, self._state_at = STATE_UNREACHABLE, time.time()
        if results:
            self._publish()

    def info(self) -> dict[str, Any]:
        """The tier's state and counters (the service's /v1/info and /metrics)."""
        return {
            "url": self.url,
            "namespace": self.namespace,
            "state": self.state,
            "last_error": self.last_error or None,
            "uploads": self.uploads,
            "errors": self.errors,
            "read_through_hits": self.read_hits,
            "refused": self.refused,
        }

    # --- batches ----------------------------------------------------------------------------

    def fetch(self, hashes: Sequence[int], namespace: str | None = None) -> list[bytes | None]:
        """The raw (unvalidated) objects of ``hashes``, concurrently; None where absent or
        the tier failed (failures are counted)."""
        if not hashes or not self.available():
            return [None] * len(hashes)
        request = self._begin()
        try:
            results = self.client.get_many([self.key(h, namespace) for h in hashes])
        finally:
            self._end(request)
        self._record(results)
        return [None if isinstance(r, TierError) else r for r in results]

    def present(self, hashes: Sequence[int], namespace: str | None = None) -> list[bool]:
        """Whether each block has an object (concurrent HEADs); False where the tier failed."""
        if not hashes or not self.available():
            return [False] * len(hashes)
        request = self._begin()
        try:
            results = self.client.exists_many([self.key(h, namespace) for h in hashes])
        finally:
            self._end(request)
        self._record(results)
        return [r is True for r in results]

    def submit_upload(
        self,
        block_hash: int,
        data: Any,
        done: Callable[[int, bool], None],
        namespace: str | None = None,
    ) -> None:
        """Start creating a block's object (at most ``concurrency`` at once); ``done(hash,
        ok)`` is called on the I/O thread when it ends (ok: the object exists now)."""

        request = self._begin()

        def finished(future: concurrent.futures.Future[bool | TierError]) -> None:
            self._end(request)
            result = future.result()
            self._record([result])
            if result is True:
                with self._lock:
                    self.uploads += 1
            done(block_hash, not isinstance(result, TierError))

        self.client.submit_put_new(self.key(block_hash, namespace), data).add_done_callback(
            finished
        )

    # --- a namespace's geometry -------------------------------------------------------------

    def put_geometry(self, geometry: Geometry, namespace: str | None = None) -> bool:
        """Create the namespace's geometry object unless it exists (the first writer wins);
        True when it exists now, False when the tier failed (counted)."""
        key = geometry_key(self.namespace if namespace is None else namespace)
        data = json.dumps(geometry.as_dict(), sort_keys=True).encode()
        if not self.available():
            return False
        try:
            self.client.put_new(key, data)
        except TierError as exc:
            self._record([exc])
            return False
        self._record([True])
        return True

    def get_geometry(self, namespace: str | None = None) -> Geometry | None:
        """The namespace's geometry from its object; None when absent, unreadable
        (counted as refused) or the tier failed."""
        key = geometry_key(self.namespace if namespace is None else namespace)
        if not self.available():
            return None
        try:
            data = self.client.get(key)
        except TierError as exc:
            self._record([exc])
            return None
        self._record([True])
        if data is None:
            return None
        try:
            return Geometry.from_dict(json.loads(data))
        except (ValueError, TypeError) as exc:
            with self._lock:
                self.refused += 1
            log.warning("tier object %s refused: %s", key, exc)
            return None
