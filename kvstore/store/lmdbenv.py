"""LMDB plumbing of the block store: the environment, its map size, its transactions.

Owns ``lmdb.open`` and the sub-database handles, read and write transactions guarded
against remaps (``MapGuard``), growing the map on ``MapFullError`` (and ahead of large
writes), adopting another process's map size on ``MapResizedError``, and telling a full
disk (``StoreFullError``) from other LMDB failures (``StoreError``). A user of the store
never sees an ``lmdb`` exception.

Read transactions that outlive their call (a closed reader's escaped arrays, zero-copy
bodies held by a transport) are kept by ``snapshots.Snapshots``; they do not hold the map
guard, so a remap first waits (bounded) for the held ones to end, refusing new holds
meanwhile, and never remaps under them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import lmdb

from ..errors import StoreBusyError, StoreError
from ..protocol import MAX_MODELS_LIMIT
from .diskformat import (
    DB_ATIME,
    DB_BLOCKS,
    DB_EMPTY,
    DB_EMPTY_INDEX,
    DB_EVENTS,
    DB_INDEX,
    DB_KEYLOG,
    DB_LRU,
    DB_META,
    DB_MODELS,
    DB_PENDING,
    DB_REFS,
    DB_SEQS,
    DB_TOKENS,
    DB_WAITING,
    MODEL_DBS,
    Dbs,
    max_dbs,
    model_db_name,
)
from .diskfull import failed_write
from .mapguard import MapGuard
from .prealloc import Preallocation
from .snapshots import Snapshots
from .writebehind import WriteBehind

log = logging.getLogger("tlkv.store")

T = TypeVar("T")

MAP_ALIGN = 2 << 20
_MAX_READERS = 512
_SPARE_TXNS = 8
# How long opening a store retries while other processes' commits keep outgrowing the map
# it has just sized (each retry adopts the new size): a writer growing it without pause
# leaves a window now and then, a store whose map never settles is an error.
_RESIZE_RETRY_SECONDS = 10.0


# How long a remap waits for zero-copy bodies held by transports to be released: longer
# than the service's watch (which aborts a body whose client read nothing for 30 s), so a
# put needing a remap outlasts a client that stopped reading.
HOLD_DRAIN_SECONDS = 35.0


class _HoldRefused(Exception):
    """A hold started between a remap's drain and its exclusive lock: drain again."""


# Environments whose close was skipped because zero-copy arrays still point into their
# map: kept (mapped) until the process exits.
_KEPT_OPEN: list[LmdbEnv] = []


def check_data_file(path: str) -> None:
    """Refuse a store directory whose LMDB data file is missing, empty or shorter than its
    own meta page says (a truncated copy) before anything opens it: LMDB would make an
    empty file a new, empty store, and a process reading a page past the end of a
    truncated one dies of SIGBUS. Only the file's size and its meta pages are read.

    Raises:
        StoreError: naming what is wrong (nothing is created or changed).
    """
    data = os.path.join(path, "data.mdb")
    try:
        size = os.path.getsize(data)
    except OSError as exc:
        raise StoreError(f"no store in {path}: {exc.strerror or exc} ({data})") from None
    if size == 0:
        raise StoreError(f"{data} is empty (0 bytes): not a store, and not re-created")
    try:
        env = lmdb.open(path, readonly=True, lock=False, subdir=True, max_dbs=0)
    except lmdb.Error as exc:
        raise StoreError(f"{data} ({size} bytes) is not a readable LMDB file: {exc}") from None
    try:
        need = (int(env.info()["last_pgno"]) + 1) * int(env.stat()["psize"])
    finally:
        env.close()
    if size < need:
        raise StoreError(
            f"{data} is truncated: {size} bytes, and its meta page says it holds pages up to "
            f"byte {need}; restore it from a copy or an archive"
        )


class LmdbEnv:
    """One LMDB environment in a directory, with guarded transactions and a managed map.

    Args:
        path: the directory (created if missing).
        map_size: the initial map size; it grows on demand.
        sync: fsync every commit (data and meta) before it returns.
        grow_floor: the least a growth adds beyond what is used and needed.
        preallocate: bytes of data file kept allocated and page-cached past the pages in
            use (``prealloc.Preallocation``; 0: none). ``open`` makes the first room.
        The environment has sub-database slots for the most models any store admits
        (``protocol.MAX_MODELS_LIMIT``), or for every sub-database the store holds already
        if that is more: a process can open every model another process may create,
        whatever limit the store is given later (LMDB fixes ``max_dbs`` at open; the slots
        cost no measurable time per transaction).

    Raises:
        StoreError: the directory does not hold an LMDB environment.
    """

    def __init__(
        self,
        path: str,
        *,
        map_size: int,
        sync: bool,
        grow_floor: int,
        preallocate: int = 0,
    ) -> None:
        self.path = path
        self.nothing: Dbs | None = None  # set by open()
        self.guard = MapGuard()
        self._grow_floor = grow_floor
        self.snapshots = Snapshots()
        # The thread that must never wait for held transactions (the one whose event loop
        # releases them): a remap it needs while some are held fails instead.
        self.loop_thread: int | None = None
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:  # a file in the way, no permission
            raise StoreError(f"cannot create the store directory {path}: {exc}") from exc
        try:
            slots = max_dbs(MAX_MODELS_LIMIT)
            self.env = self._open_env(map_size, sync, slots)
            # The main database holds one key per sub-database: a store holding more than
            # this limit admits is reopened with room for all of them (and one more model).
            existing = int(self.env.stat()["entries"])
            if existing + len(MODEL_DBS) > slots:
                self.env.close()
                self.env = self._open_env(map_size, sync, existing + len(MODEL_DBS))
            self.psize = int(self.env.stat()["psize"])
        except lmdb.Error as exc:
            raise StoreError(f"cannot open an LMDB environment in {path}: {exc}") from exc
        # LMDB: one sub-database open at a time in a process (mdb_dbi_open's rule).
        self._dbi_lock = threading.Lock()
        # Only durable commits wait for the disk; without sync the kernel writes later.
        self._write_behind = WriteBehind(os.path.join(path, "data.mdb"), enabled=sync)
        # A durable store's room is written (its commits then flush no new extents); the
        # room of one without sync is only read into the page cache.
        hold = weakref.WeakMethod(self._hold_writer) if sync else None
        self.prealloc = Preallocation(os.path.join(path, "data.mdb"), preallocate, self.psize, hold)

    def _open_env(self, map_size: int, sync: bool, slots: int) -> Any:
        """``lmdb.open``, again while another process's commits outgrow the map between
        LMDB's open (which sizes the map to the pages in use) and the first transaction
        py-lmdb begins in it (``MapResizedError``)."""
        deadline = time.monotonic() + _RESIZE_RETRY_SECONDS
        while True:
            try:
                return lmdb.open(
                    self.path,
                    map_size=map_size,
                    subdir=True,
                    max_dbs=slots,
                    sync=sync,
                    metasync=sync,
                    readahead=False,
                    max_readers=_MAX_READERS,
                    max_spare_txns=_SPARE_TXNS,
                    mode=0o644,
                )
            except lmdb.MapResizedError:
                if time.monotonic() > deadline:
                    raise

    def open(self, check: Callable[[Any, Dbs], None]) -> Dbs:
        """Open (creating) every shared sub-database and the default model's in one write
        transaction, run ``check``; returns the default model's handles (``nothing``
        becomes the handles a model not created yet reads: ``DB_EMPTY``)."""
        env = self.env
        deadline = time.monotonic() + _RESIZE_RETRY_SECONDS
        while time.monotonic() < deadline:
            try:
                with env.begin(write=True) as txn:
                    dbs = Dbs(
                        meta=env.open_db(DB_META, txn=txn),
                        blocks=env.open_db(DB_BLOCKS, txn=txn),
                        index=env.open_db(
                            DB_INDEX, txn=txn, dupsort=True, dupfixed=True, integerdup=True
                        ),
                        refs=env.open_db(DB_REFS, txn=txn),
                        atime=env.open_db(DB_ATIME, txn=txn),
                        lru=env.open_db(DB_LRU, txn=txn),
                        seqs=env.open_db(DB_SEQS, txn=txn),
                        pending=env.open_db(DB_PENDING, txn=txn),
                        models=env.open_db(DB_MODELS, txn=txn),
                        tokens=env.open_db(DB_TOKENS, txn=txn),
                        waiting=env.open_db(DB_WAITING, txn=txn, dupsort=True, dupfixed=True),
                        events=env.open_db(DB_EVENTS, txn=txn),
                        keylog=env.open_db(DB_KEYLOG, txn=txn),
                    )
                    empty = env.open_db(DB_EMPTY, txn=txn)
                    empty_index = env.open_db(
                        DB_EMPTY_INDEX, txn=txn, dupsort=True, dupfixed=True, integerdup=True
                    )
                    nothing = dbs._replace(
                        blocks=empty,
                        index=empty_index,
                        refs=empty,
                        atime=empty,
                        seqs=empty,
                        pending=empty,
                        tokens=empty,
                        waiting=empty_index,
                        number=-1,
                    )
                    check(txn, dbs)
                self.nothing = nothing
                if self.prealloc.nbytes:
                    self._first_room()
                return dbs
            except lmdb.MapResizedError:
                env.set_mapsize(0)
            except lmdb.MapFullError:
                env.set_mapsize(2 * env.info()["map_size"])
        raise StoreError(f"cannot open the store in {self.path}: the map keeps changing size")

    def open_model(self, shared: Dbs, number: int) -> Dbs:
        """The sub-databases of model ``number`` > 0 (created if missing), opened in a write
        transaction of their own (LMDB closes handles opened by an aborted one)."""
        env = self.env

        def body(txn: Any) -> Dbs:
            def db(name: bytes, **flags: bool) -> Any:
                return env.open_db(model_db_name(name, number), txn=txn, **flags)

            return shared._replace(
                blocks=db(DB_BLOCKS),
                index=db(DB_INDEX, dupsort=True, dupfixed=True, integerdup=True),
                refs=db(DB_REFS),
                atime=db(DB_ATIME),
                seqs=db(DB_SEQS),
                pending=db(DB_PENDING),
                tokens=db(DB_TOKENS),
                waiting=db(DB_WAITING, dupsort=True, dupfixed=True),
                number=number,
            )

        with self._dbi_lock:
            return self.write(body)

    def close(self, sync: bool) -> None:
        """Wait for this process's transactions to end, then close (after an fsync).

        If zero-copy arrays of a closed reader are still referenced, the environment is
        left open (and its map in place) for the rest of the process instead: closing
        would unmap memory they point into.
        """
        self.prealloc.stop()  # first: its helper may wait for the guard
        with self.guard.exclusive():
            self._write_behind.close()
            self.prealloc.close()
            if sync:
                self.env.sync(True)
            if self.snapshots.pinned():
                log.warning(
                    "%s: zero-copy arrays from a closed reader are still referenced; the "
                    "LMDB environment stays mapped until the process exits",
                    self.path,
                )
                _KEPT_OPEN.append(self)
                return
            self.env.close()

    def begin_read(self, buffers: bool) -> Any:
        """A read transaction holding the map guard; end it with ``end_read``."""
        while True:
            self.guard.acquire()
            try:
                return self.env.begin(buffers=True) if buffers else self.env.begin()
            except lmdb.MapResizedError:
                self.guard.release()
            except BaseException:
                self.guard.release()
                raise
            self.resize(grow=False, need=0)

    def end_read(self, txn: Any) -> None:
        try:
            txn.abort()
        finally:
            self.guard.release()

    def linger(self, txn: Any, refs: list[weakref.ref[Any]]) -> None:
        """End a read like ``end_read``, but keep ``txn`` open while any of ``refs`` lives.

        Zero-copy arrays that escaped a reader point into LMDB's map: the open snapshot
        keeps their pages from being reused, and the map is not moved while they live
        (``resize`` refuses). The transaction ends at the first reap after they die.
        """
        self.snapshots.linger(txn, refs)
        self.guard.release()

    def hold(self, txn: Any, values: list[Any]) -> list[memoryview]:
        """End a read like ``end_read``, but keep ``txn`` open while its data is referenced
        (``Snapshots.hold``: one read-only memoryview per value, no copy, unless a remap
        is pending). Call it in the thread that began ``txn``."""
        views = self.snapshots.hold(txn, values)
        if views is None:
            try:
                return [memoryview(bytes(value)) for value in values]
            finally:
                self.end_read(txn)
        self.guard.release()
        return views

    def write(self, body: Callable[[Any], T], need: int = 0) -> T:
        """Run ``body(txn)`` in one write transaction (``buffers=True``) and commit it.

        ``body`` may run more than once: after MapFullError the map grows and it is
        retried, after MapResizedError the new size is adopted and it is retried. ``need``
        is the bytes it writes (to grow ahead, to diagnose a full disk, and to start the
        disk writing during a large durable commit: ``WriteBehind``).

        Raises:
            StoreFullError: the disk is full (nothing was written).
            StoreError: any other LMDB failure.
        """
        if self.snapshots.any_lingering:
            self.snapshots.reap()
        if need and self.map_room() < need + need // 4:
            self.resize(grow=True, need=need)
        while True:
            self.guard.acquire()
            try:
                txn = self.env.begin(write=True, buffers=True)
                try:
                    result = body(txn)
                except BaseException:
                    txn.abort()
                    raise
                span = None
                if self.prealloc.nbytes:
                    span = self.prealloc.extend(int(self.env.info()["last_pgno"]), need)
                try:
                    with self._write_behind.during(need):
                        txn.commit()
                finally:
                    if span is not None:  # the file is extended whatever the commit did
                        self.prealloc.warm(span)
                return result
            except lmdb.MapFullError:
                grow = True
            except lmdb.MapResizedError:
                grow = False
            except lmdb.Error as exc:
                raise failed_write(exc, self.path, need, self.psize) from exc
            finally:
                self.guard.release()
            self.resize(grow=grow, need=need)

    def _first_room(self) -> None:
        """Make the preallocated room at open (in a write transaction of its own, aborted:
        it writes nothing to LMDB), then fill it before returning (``Preallocation.fill``),
        the transaction over so other writers do not wait for the filling."""
        span = None
        self.guard.acquire()
        try:
            txn = self.env.begin(write=True)
            try:
                span = self.prealloc.extend(int(self.env.info()["last_pgno"]), 0)
            finally:
                txn.abort()
        except lmdb.MapResizedError:  # another process grew the map: the first put makes it
            pass
        finally:
            self.guard.release()
        if span is not None:
            self.prealloc.fill(span)

    @contextlib.contextmanager
    def _hold_writer(self) -> Iterator[int | None]:
        """LMDB's writer lock held (a write transaction, aborted: it writes nothing), giving
        the bytes of the data file up to LMDB's last page in use; None when the map changed
        size in another process (the caller skips)."""
        self.guard.acquire()
        try:
            try:
                txn = self.env.begin(write=True)
            except lmdb.Error:  # MapResizedError: the next put adopts the new size
                yield None
                return
            try:
                yield (int(self.env.info()["last_pgno"]) + 1) * self.psize
            finally:
                txn.abort()
        finally:
            self.guard.release()

    def map_room(self) -> int:
        """Bytes of map above the highest page in use (free pages inside are extra)."""
        info = self.env.info()
        return int(info["map_size"]) - (int(info["last_pgno"]) + 1) * self.psize

    def resize(self, *, grow: bool, need: int) -> None:
        """Grow the map (at least doubling), or adopt the size another process set.

        First waits, up to ``HOLD_DRAIN_SECONDS``, for read transactions held for
        zero-copy bodies to end (no new one is held meanwhile).

        Raises:
            StoreBusyError: some are still held then (at once in ``loop_thread``): retry.
        """
        deadline = time.monotonic() + HOLD_DRAIN_SECONDS
        if threading.get_ident() == self.loop_thread:
            deadline = 0.0  # waiting here would keep the holds from ever ending
        with self.snapshots.refusing():
            while True:
                self.snapshots.drain(deadline)
                try:
                    self._resize(grow, need)
                    return
                except _HoldRefused:
                    if time.monotonic() >= deadline:
                        raise StoreBusyError(
                            f"{self.path}: cannot remap LMDB's map now: zero-copy response "
                            "bodies are still held by their transports; retry"
                        ) from None

    def _resize(self, grow: bool, need: int) -> None:
        with self.guard.exclusive():
            if self.snapshots.any_held:  # still held (or held again before the exclusive lock)
                raise _HoldRefused(self.path)
            pinned = self.snapshots.pinned()
            if pinned:
                raise StoreError(
                    f"{self.path}: cannot remap LMDB's map while zero-copy arrays from "
                    f"{pinned} closed reader(s) are still referenced (they point into it): "
                    "views are valid only inside `with store.reader()`; copy what you keep "
                    "(bytes(), .copy())"
                )
            if not grow:
                self.env.set_mapsize(0)
                return
            info = self.env.info()
            used = (int(info["last_pgno"]) + 1) * self.psize
            new = max(2 * int(info["map_size"]), used + 2 * need + self._grow_floor)
            new = -(-new // MAP_ALIGN) * MAP_ALIGN
            log.debug("%s: growing the LMDB map to %d bytes", self.path, new)
            self.env.set_mapsize(new)
