"""The tier as a store sees it: block objects of one namespace, counters and health.

``Tier`` turns batches of hashes into batched concurrent object requests (reads, HEADs,
conditional creates) and keeps what the service shows: uploads done, tier errors,
read-through hits and refusals, and the tier's state. After a failure it is held
``unreachable`` for a backoff (0.5 s doubling to 30 s, reset by a success): reads and
HEADs meanwhile answer "absent" at once, so an unreachable tier never slows what is local.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
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
        self.state = STATE_UNKNOWN
        self.last_error = ""
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

    def available(self) -> bool:
        """False while the tier is backed off after a failure."""
        return time.monotonic() >= self._down_until

    def retry_in(self) -> float:
        """Seconds until the tier is tried again (0 when available)."""
        return max(0.0, self._down_until - time.monotonic())

    def _record(self, results: Sequence[Any]) -> None:
        failures = [r for r in results if isinstance(r, TierError)]
        with self._lock:
            if not failures:
                if results:
                    self.state, self._backoff = STATE_OK, 0.0
                return
            self.errors += len(failures)
            self.last_error = str(failures[0])
            if len(failures) < len(results):
                return  # some answered: a per-object failure, not a down tier
            if time.monotonic() < self._down_until:
                return  # requests started before the backoff began: no longer one
            self._backoff = min(BACKOFF_MAX, max(BACKOFF_FIRST, 2 * self._backoff))
            self._down_until = time.monotonic() + self._backoff
            if self.state != STATE_UNREACHABLE:
                log.warning("tier %s unreachable: %s", self.url, self.last_error)
            self.state = STATE_UNREACHABLE

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
        results = self.client.get_many([self.key(h, namespace) for h in hashes])
        self._record(results)
        return [None if isinstance(r, TierError) else r for r in results]

    def present(self, hashes: Sequence[int], namespace: str | None = None) -> list[bool]:
        """Whether each block has an object (concurrent HEADs); False where the tier failed."""
        if not hashes or not self.available():
            return [False] * len(hashes)
        results = self.client.exists_many([self.key(h, namespace) for h in hashes])
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

        def finished(future: concurrent.futures.Future[bool | TierError]) -> None:
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
