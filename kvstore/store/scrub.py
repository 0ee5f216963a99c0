"""The scrub: re-check every stored block's CRC-32C and every sequence within a byte rate,
quarantine what fails as a read would, and repair it from the store's tier when the tier
holds a valid copy.

One pass walks, model by model:

1. what the model quarantined earlier and has not stored again (``quarantine.py``: a
   read, an earlier scrub or another process found it): a block stored again since is
   forgotten, the rest is read through from the tier when it has a valid copy (so a later
   ``tlkv scrub --repair-from`` puts back what an earlier scrub quarantined), and what
   stays missing is reported again;
2. the ``blocks`` sub-database in key order, a batch at a time (``BATCH_BLOCKS`` blocks or
   ``BATCH_BYTES``), each batch in a short read transaction of its own: the scrub never
   takes the write lock to look, and never keeps a snapshot open while it sleeps to stay
   within its rate. A block that fails its CRC goes through the store's own quarantine
   (``Handle.quarantine``: checked again inside the write transaction, removed, counted
   in ``stats()['corrupt']``, recorded); then, with a tier, it is read through from the
   tier (``TierLink.fetch``: every reader rule, the CRC and the key's hash are checked
   before it is stored again);
3. the ``seqs`` sub-database the same way: a sequence record that fails its CRC or its
   structure is quarantined as a read would (removed, every pin recounted, recorded); a
   sound one whose pinned blocks are not all stored is damaged too (``get_sequence``
   answers None), and its missing blocks are read through from the tier. A record cannot
   be repaired from the tier (it holds blocks only): it is reported until the sequence is
   put again.

What the tier lacks, or holds no valid copy of, stays quarantined and is reported as
unrepaired; ``forget_unrepaired`` drops the records of what stays (the operator accepts
the loss); a sequence missing blocks stays reported until they are stored or it is
deleted.

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
from typing import Any

from ..codec.assembly import crc_matches
from . import quarantine
from .diskformat import BLOCK_KEY, parse_sequence
from .reads import quarantine_sequence
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
    bytes: int = 0  # envelope and sequence record bytes checked
    found: int = 0  # blocks that failed their CRC (quarantined)
    repaired: int = 0  # blocks the tier gave a valid copy of (found now or missing before)
    earlier: int = 0  # blocks quarantined before this pass and not stored again since
    sequences: int = 0  # sequence records checked
    seconds: float = 0.0
    unrepaired: list[tuple[str, int]] = field(default_factory=list)  # (model, hash)
    # Sequences whose record failed its CRC (quarantined, now or earlier): (model, name).
    lost: list[tuple[str, str]] = field(default_factory=list)
    # Sound sequences some of whose pinned blocks are not stored: (model, name, missing).
    incomplete: list[tuple[str, str, int]] = field(default_factory=list)


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


def _scan(
    handle: Handle, sub: str, after: bytes | None, visit: Callable[[Any, bytes, Any], None]
) -> tuple[int, int, bytes | None]:
    """Visit the entries of the model's sub-database ``sub`` (``blocks``, ``seqs``) after key
    ``after`` (None: from the first), one batch in one read transaction (``BATCH_BLOCKS``
    entries or ``BATCH_BYTES``): ``visit(txn, key, value)`` each; the entries and bytes
    visited, and the last key (None: none left)."""
    n = size = 0
    last = None
    more = False
    txn = handle.begin_read(True)
    try:
        cursor = txn.cursor(db=getattr(handle.dbs, sub))
        found = cursor.set_range(after + b"\0") if after is not None else cursor.first()
        while found:
            last = bytes(cursor.key())
            value = cursor.value()
            visit(txn, last, value)
            n += 1
            size += len(value)
            if n >= BATCH_BLOCKS or size >= BATCH_BYTES:
                more = cursor.next()
                break
            found = cursor.next()
    finally:
        handle.end_read(txn)
    return n, size, (last if more else None)


def _batch(handle: Handle, after: bytes | None) -> tuple[list[int], int, int, bytes | None]:
    """Check a batch of blocks after key ``after``: the corrupt hashes, the blocks and bytes
    checked, and the last key seen (None: none left)."""
    bad: list[int] = []

    def visit(txn: Any, key: bytes, value: Any) -> None:
        if not crc_matches(value):
            bad.append(BLOCK_KEY.unpack(key)[0])

    return (bad, *_scan(handle, "blocks", after, visit))


def _sequence_batch(
    handle: Handle, after: bytes | None
) -> tuple[list[bytes], dict[bytes, list[int]], int, int, bytes | None]:
    """Check a batch of sequence records after key ``after``: the keys of records that
    fail, the sound ones' pinned blocks that are not stored, the records and bytes checked,
    and the last key seen (None: none left)."""
    bad: list[bytes] = []
    missing: dict[bytes, list[int]] = {}

    def visit(txn: Any, key: bytes, raw: Any) -> None:
        seq = parse_sequence(raw, handle.geometry_in(txn))
        if seq is None:
            bad.append(key)
            return
        blocks = handle.dbs.blocks
        gone = [h for h in seq.referenced() if txn.get(BLOCK_KEY.pack(h), None, blocks) is None]
        if gone:
            missing[key] = list(dict.fromkeys(gone))

    return (bad, missing, *_scan(handle, "seqs", after, visit))


def _from_tier(handle: Handle, hashes: list[int]) -> list[int]:
    """Read ``hashes`` through from the tier (validated, committed); those it gave."""
    if handle.tier is None or not hashes:
        return []
    fetched = handle.tier.fetch(hashes, wait=True)
    repaired = [h for h in hashes if h in fetched]
    quarantine.forget(handle, repaired)
    return repaired


def _repair(handle: Handle, bad: list[int]) -> list[int]:
    """Quarantine ``bad`` as a read would, then read them back from the tier; the hashes
    repaired."""
    handle.quarantine(bad)
    return _from_tier(handle, bad)


def _scrub_model(
    model: str,
    handle: Handle,
    report: ScrubReport,
    pace: _Pace,
    stop: threading.Event,
    on_batch: OnBatch | None,
) -> None:
    """Steps 1-3 of the module docstring for one model."""
    earlier, records = quarantine.settle(handle, *quarantine.listed(handle))
    repaired = _from_tier(handle, earlier)
    report.earlier += len(earlier)
    report.repaired += len(repaired)
    report.unrepaired += [(model, h) for h in earlier if h not in repaired]
    if on_batch is not None and repaired:
        on_batch(0, 0, 0, len(repaired))
    report.lost += [(model, name) for name in records]
    after: bytes | None = None
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
        if last is None:
            break
        after = last
    key: bytes | None = None
    while not stop.is_set():
        bad_records, missing, n, size, next_key = _sequence_batch(handle, key)
        for record in bad_records:
            quarantine_sequence(handle, record)
            report.lost.append((model, record.decode("ascii", "replace")))
        for record, gone in missing.items():
            fetched = _from_tier(handle, gone)
            report.repaired += len(fetched)
            if len(fetched) < len(gone):
                name = record.decode("ascii", "replace")
                report.incomplete.append((model, name, len(gone) - len(fetched)))
        report.sequences += n
        report.bytes += size
        if on_batch is not None:
            on_batch(0, size, 0, 0)
        pace.add(size)
        if next_key is None:
            break
        key = next_key


def scrub_pass(
    store: Store,
    *,
    rate: float = 0,
    stop: threading.Event | None = None,
    on_batch: OnBatch | None = None,
    forget_unrepaired: bool = False,
) -> ScrubReport:
    """Check every block and sequence of every model once (see the module docstring).

    Args:
        store: an open store (its tier, if any, repairs what is found).
        rate: bytes per second at most (0: as fast as the disk allows).
        stop: set to end the pass early (the report covers what was checked).
        on_batch: told what each batch added, as it ends (progress, metrics).
        forget_unrepaired: drop the quarantine records of what stays unrepaired (still
            listed in the report), so that later passes no longer report it.
    """
    stop = stop or threading.Event()
    report = ScrubReport()
    pace = _Pace(rate, stop)
    for model in store.models():
        handle = store.model(model)._h  # the model's state (``state.Handle``)
        _scrub_model(model, handle, report, pace, stop, on_batch)
        if forget_unrepaired:
            hashes = [h for m, h in report.unrepaired if m == model]
            names = [name for m, name in report.lost if m == model]
            quarantine.forget(handle, hashes, names)
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
            if report.found or report.unrepaired or report.lost or report.incomplete:
                log.warning(
                    "%s: scrub found %d corrupt block(s), repaired %d from the tier; %d "
                    "block(s) and %d sequence(s) stay damaged",
                    self.store.path,
                    report.found,
                    report.repaired,
                    len(report.unrepaired),
                    len(report.lost) + len(report.incomplete),
                )
            if self.on_pass is not None:
                self.on_pass(report, time.time())
            self._stop.wait(max(0.0, started + self.period - time.monotonic()))
