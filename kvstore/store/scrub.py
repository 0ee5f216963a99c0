"""The scrub: re-check every stored block's CRC-32C within a byte rate, quarantine the bad
ones as a read would, and repair them from the store's tier when it holds a valid copy.

One pass walks every model's ``blocks`` sub-database in key order, a batch at a time
(``BATCH_BLOCKS`` blocks or ``BATCH_BYTES``), each batch in a short read transaction of its
own: the scrub never takes the write lock to look, and never keeps a snapshot open while it
sleeps to stay within its rate. A block that fails its CRC goes through the store's own
quarantine (``Handle.quarantine``: checked again inside the write transaction, removed,
counted in ``stats()['corrupt']``); then, with a tier, it is read through from the tier
(``TierLink.fetch``: every reader rule, the CRC and the key's hash are checked before it
is stored again). A block the tier lacks, or holds no valid copy of, stays quarantined and
is reported as unrepaired.

:class:`Scrubber` runs passes on a daemon thread for ``tlkv serve --scrub-rate``: one pass
per ``period`` (the next starts ``period`` seconds after the previous one started, or at
once when a pass took longer: the scrub is then behind schedule). Among the processes that
open one store directory only the holder of ``scrub.lock`` scrubs. ``tlkv scrub`` runs one
pass in the foreground (:func:`scrub_pass`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..codec.assembly import crc_matches
from .diskformat import BLOCK_KEY
from .state import Handle
from .store import Store

log = logging.getLogger("tlkv.scrub")

BATCH_BLOCKS = 64  # blocks checked per read transaction, at most
BATCH_BYTES = 16 << 20  # ... and bytes (a batch ends after the block that reaches it)
LOCK_FILE = "scrub.lock"  # in the store directory: one scrubbing process per store
DEFAULT_RATE = 64 << 20  # bytes per second of ``tlkv serve --scrub-rate``
DEFAULT_PERIOD = 24 * 3600.0  # seconds from one pass's start to the next's


@dataclass
class ScrubReport:
    """What one pass did (a running pass's figures so far)."""

    blocks: int = 0  # blocks checked
    bytes: int = 0  # envelope bytes checked
    found: int = 0  # blocks that failed their CRC (quarantined)
    repaired: int = 0  # ... of which a valid copy was read back from the tier
    seconds: float = 0.0
    unrepaired: list[tuple[str, int]] = field(default_factory=list)  # (model, hash)


# Called after every batch: (blocks, bytes, found, repaired) added by that batch.
OnBatch = Callable[[int, int, int, int], None]


class _Pace:
    """After each batch, sleeps until the bytes read since the pace began (or since it was
    last idle) fit within ``rate`` bytes per second: no burst, even at a pass's start."""

    def __init__(self, rate: float, stop: threading.Event) -> None:
        self.rate = rate
        self.stop = stop
        self.t0 = time.monotonic()
        self.next_ok = self.t0

    def add(self, nbytes: int) -> None:
        if self.rate > 0:
            now = time.monotonic()
            self.next_ok = max(self.next_ok, now) + nbytes / self.rate
            if self.next_ok > now:
                self.stop.wait(self.next_ok - now)


def _batch(handle: Handle, after: int) -> tuple[list[int], int, int, int]:
    """Check the blocks after hash ``after`` in one read transaction: the corrupt hashes,
    the blocks and bytes checked, and the last hash seen (-1: none left)."""
    bad: list[int] = []
    n = size = 0
    last = -1
    more = False
    txn = handle.begin_read(True)
    try:
        cursor = txn.cursor(db=handle.dbs.blocks)
        found = cursor.set_range(BLOCK_KEY.pack(after + 1)) if after >= 0 else cursor.first()
        while found:
            last = BLOCK_KEY.unpack(cursor.key())[0]
            value = cursor.value()
            if not crc_matches(value):
                bad.append(last)
            n += 1
            size += len(value)
            if n >= BATCH_BLOCKS or size >= BATCH_BYTES:
                more = cursor.next()
                break
            found = cursor.next()
    finally:
        handle.end_read(txn)
    return bad, n, size, (last if more else -1)


def _repair(handle: Handle, bad: list[int]) -> list[int]:
    """Quarantine ``bad`` as a read would, then read them back from the tier; the hashes
    repaired."""
    handle.quarantine(bad)
    if handle.tier is None:
        return []
    fetched = handle.tier.fetch(bad, wait=True)
    return [h for h in bad if h in fetched]


def scrub_pass(
    store: Store,
    *,
    rate: float = 0,
    stop: threading.Event | None = None,
    on_batch: OnBatch | None = None,
) -> ScrubReport:
    """Check every block of every model once (see the module docstring).

    Args:
        store: an open store (its tier, if any, repairs what is found).
        rate: bytes per second at most (0: as fast as the disk allows).
        stop: set to end the pass early (the report covers what was checked).
        on_batch: told what each batch added, as it ends (progress, metrics).
    """
    stop = stop or threading.Event()
    report = ScrubReport()
    pace = _Pace(rate, stop)
    for model in store.models():
        handle = store.model(model)._h  # the model's state (``state.Handle``)
        after = -1
        while not stop.is_set():
            bad, n, size, last = _batch(handle, after)
            repaired = _repair(handle, bad) if bad else []
            report.blocks += n
            report.bytes += size
            report.found += len(bad)
            report.repaired += len(repaired)
            report.unrepaired += [(model, h) for h in bad if h not in repaired]
            if on_batch is not None:
                on_batch(n, size, len(bad), len(repaired))
            pace.add(size)
            if last < 0:
                break
            after = last
    report.seconds = time.monotonic() - pace.t0
    return report


class Scrubber:
    """Background passes of :func:`scrub_pass` over ``store`` on a daemon thread.

    Args:
        store: the open store to scrub (the caller closes it after :meth:`stop`).
        rate: bytes per second at most (> 0).
        period: seconds from one pass's start to the next one's.
        on_batch: as :func:`scrub_pass`'s (on the scrub's thread).
        on_pass: called with each finished pass's report and its end (Unix seconds).
    """

    def __init__(
        self,
        store: Store,
        *,
        rate: float = DEFAULT_RATE,
        period: float = DEFAULT_PERIOD,
        on_batch: OnBatch | None = None,
        on_pass: Callable[[ScrubReport, float], None] | None = None,
    ) -> None:
        if rate <= 0:
            raise ValueError(f"scrub rate must be > 0 bytes/s, found {rate}")
        if period <= 0:
            raise ValueError(f"scrub period must be > 0 seconds, found {period}")
        self.store = store
        self.rate = rate
        self.period = period
        self.on_batch = on_batch
        self.on_pass = on_pass
        self.passes = 0
        self.last: ScrubReport | None = None
        self._stop = threading.Event()
        self._lock_fd = -1
        self.thread = threading.Thread(target=self._run, name="tlkv-scrub", daemon=True)
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """End the pass in progress at its next batch, then release the lock."""
        self._stop.set()
        self.thread.join(timeout)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # closing releases the flock
            self._lock_fd = -1

    def _own_lock(self) -> bool:
        if self._lock_fd >= 0:
            return True
        fd = os.open(os.path.join(self.store.path, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._lock_fd = fd
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._own_lock():  # another process scrubs this store
                self._stop.wait(min(self.period, 60.0))
                continue
            started = time.monotonic()
            try:
                report = scrub_pass(
                    self.store, rate=self.rate, stop=self._stop, on_batch=self.on_batch
                )
            except Exception as exc:  # the scrub must outlive any one failure
                log.warning("scrub pass failed: %s: %s", type(exc).__name__, exc)
                self._stop.wait(min(self.period, 60.0))
                continue
            if self._stop.is_set():
                return  # an interrupted pass is not a pass
            self.passes += 1
            self.last = report
            if report.found:
                log.warning(
                    "%s: scrub found %d corrupt block(s), repaired %d from the tier",
                    self.store.path,
                    report.found,
                    report.repaired,
                )
            if self.on_pass is not None:
                self.on_pass(report, time.time())
            self._stop.wait(max(0.0, started + self.period - time.monotonic()))
