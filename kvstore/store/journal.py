"""The restore journal: what an unfinished archive restore added, so a killed one is undone.

A restore commits in many transactions (LMDB holds a transaction's dirty pages in memory),
so a SIGKILL between two of them would leave part of an archive behind. Instead, each of
its transactions also notes, in the same commit, what it changed (``note_blocks``,
``note_sequence``: keys ``JOURNAL_PREFIX + token ...`` in ``meta``, see ``diskformat``);
``commit`` deletes the notes in one transaction, the moment the restore becomes whole.

Whether a journal's restore still runs is told by a lock file ``restore-<token>.lock`` in
the store directory, held (``flock``) by the restoring process from before its first note
until after its last: the kernel drops the lock when the process dies, however it dies. A
store that opens and finds notes whose lock it can take rolls them back (``rollback``, one
transaction): the sequences the restore wrote are dropped (a replaced one is put back
when every block it references is still stored), then the blocks it added are removed
unless another sequence pins them. Blocks the restore made the store evict stay evicted.
A lock file without notes (a restore killed before its first commit) is removed by the
next open that can take it (``remove_orphan_locks``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
from collections import Counter
from typing import Any

import numpy as np

from ..codec.geometry import Geometry
from ..protocol import DEFAULT_MODEL
from .diskformat import (
    BLOCK_KEY,
    JOURNAL_BATCH,
    JOURNAL_BLOCKS,
    JOURNAL_CREATED,
    JOURNAL_HASH_DTYPE,
    JOURNAL_MODEL,
    JOURNAL_PREFIX,
    JOURNAL_REPLACED,
    JOURNAL_SEQUENCE,
    JOURNAL_TOKEN_BYTES,
    parse_sequence,
)
from .seqtxn import drop_sequence
from .writetxn import WriteTxn

try:
    import fcntl
except ImportError:  # pragma: no cover - not on Windows: a killed restore stays until undone
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("tlkv.store")


_LOCK_NAME = re.compile(rf"restore-[0-9a-f]{{{2 * JOURNAL_TOKEN_BYTES}}}\.lock")


def lock_path(store_path: str, token: bytes) -> str:
    """The lock file a running restore holds for ``token``."""
    return os.path.join(store_path, f"restore-{token.hex()}.lock")


class RestoreJournal:
    """One restore's journal: a fresh token and its lock file, held until ``release``."""

    def __init__(
        self, store_path: str, token: bytes | None = None, model: str = DEFAULT_MODEL
    ) -> None:
        self.token = secrets.token_bytes(JOURNAL_TOKEN_BYTES) if token is None else token
        self.model = model  # the model whose sub-databases the restore writes
        self._model_noted = False
        self.path = lock_path(store_path, self.token)
        self._batches = 0
        self._noted: set[bytes] = set()
        self._fd: int | None = None
        if token is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            if fcntl is not None:
                fcntl.flock(self._fd, fcntl.LOCK_EX)

    @classmethod
    def claim(cls, store_path: str, token: bytes) -> RestoreJournal | None:
        """The journal ``token`` if its restore is gone (its lock taken, to keep until it is
        rolled back), or None while the restore still runs (its process holds the lock;
        without ``flock``, always None)."""
        if fcntl is None:
            return None
        journal = cls(store_path, token)
        try:
            journal._fd = os.open(journal.path, os.O_RDWR)
        except FileNotFoundError:
            return journal  # no lock file: its restore is gone too
        try:
            fcntl.flock(journal._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            journal.release(unlink=False)
            return None
        return journal

    def note_blocks(self, txn: Any, meta: Any, hashes: list[int]) -> None:
        """Note (in the transaction that adds them) the blocks this restore added."""
        if not hashes:
            return
        self._note_model(txn, meta)
        key = _key(self.token, JOURNAL_BLOCKS, JOURNAL_BATCH.pack(self._batches))
        txn.put(key, np.asarray(hashes, dtype=JOURNAL_HASH_DTYPE).tobytes(), db=meta)
        self._batches += 1

    def note_sequence(self, txn: Any, dbs: Any, key: bytes) -> None:
        """Note, before the sequence ``key`` is written, the record it replaces (once)."""
        if key in self._noted:
            return
        self._noted.add(key)
        self._note_model(txn, dbs.meta)
        old = txn.get(key, None, dbs.seqs)
        value = JOURNAL_CREATED if old is None else JOURNAL_REPLACED + bytes(old)
        txn.put(_key(self.token, JOURNAL_SEQUENCE, key), value, db=dbs.meta)

    def _note_model(self, txn: Any, meta: Any) -> None:
        # With the first note: a killed restore is undone in the model it wrote.
        if not self._model_noted:
            txn.put(_key(self.token, JOURNAL_MODEL), self.model.encode(), db=meta)
            self._model_noted = True

    def release(self, *, unlink: bool = True) -> None:
        """Drop the lock and its file (after ``commit`` or ``rollback``, or on giving up)."""
        if self._fd is None:
            return
        if unlink:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        os.close(self._fd)
        self._fd = None


def remove_orphan_locks(store_path: str, journals: set[bytes]) -> int:
    """Remove the lock files of restores that died before their first commit (no journal
    among ``journals``, lock free); returns how many. A lock still held is left alone."""
    if fcntl is None:
        return 0
    removed = 0
    with os.scandir(store_path) as entries:
        names = [e.name for e in entries if _LOCK_NAME.fullmatch(e.name)]
    for name in names:
        if bytes.fromhex(name[len("restore-") : -len(".lock")]) in journals:
            continue  # rolled back (or left to its running restore) by the caller
        try:
            fd = os.open(os.path.join(store_path, name), os.O_RDWR)
        except FileNotFoundError:
            continue  # its restore just finished
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # its restore still runs
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(store_path, name))
            removed += 1
        os.close(fd)
    return removed


def _key(token: bytes, kind: bytes, suffix: bytes = b"") -> bytes:
    return JOURNAL_PREFIX + token + kind + suffix


def pending(txn: Any, meta: Any) -> list[bytes]:
    """The tokens of every journal in the store (restores running or killed)."""
    tokens: dict[bytes, None] = {}
    cursor = txn.cursor(meta)
    if cursor.set_range(JOURNAL_PREFIX):
        for key in cursor.iternext(keys=True, values=False):
            if not key.startswith(JOURNAL_PREFIX):
                break
            at = len(JOURNAL_PREFIX)
            tokens[bytes(key[at : at + JOURNAL_TOKEN_BYTES])] = None
    return list(tokens)


def _entries(txn: Any, meta: Any, token: bytes) -> list[tuple[bytes, bytes]]:
    prefix = JOURNAL_PREFIX + token
    out: list[tuple[bytes, bytes]] = []
    cursor = txn.cursor(meta)
    if cursor.set_range(prefix):
        for key, value in cursor:
            key = bytes(key)
            if not key.startswith(prefix):
                break
            out.append((key, bytes(value)))
    return out


def journal_model(txn: Any, meta: Any, token: bytes) -> str:
    """The model the restore ``token`` wrote into (``default`` for a journal without one)."""
    raw = txn.get(_key(token, JOURNAL_MODEL), None, meta)
    return DEFAULT_MODEL if raw is None else bytes(raw).decode()


def commit(txn: Any, meta: Any, token: bytes) -> None:
    """The restore is whole: delete its notes (in its last transaction)."""
    for key, _ in _entries(txn, meta, token):
        txn.delete(key, db=meta)


def rollback(w: WriteTxn, token: bytes, geometry: Geometry | None) -> tuple[int, int]:
    """Undo what the restore ``token`` noted, and delete its notes: ``(blocks removed,
    sequences dropped or put back)``."""
    txn, dbs = w.txn, w.dbs
    entries = _entries(txn, dbs.meta, token)
    at = len(JOURNAL_PREFIX) + JOURNAL_TOKEN_BYTES
    blocks: list[int] = []
    sequences = 0
    for key, value in entries:
        kind, rest = key[at : at + 1], key[at + 1 :]
        if kind == JOURNAL_SEQUENCE:
            drop_sequence(w, rest, geometry)
            if value.startswith(JOURNAL_REPLACED):
                _put_back(w, rest, value[len(JOURNAL_REPLACED) :], geometry)
            sequences += 1
        elif kind == JOURNAL_BLOCKS:
            blocks.extend(np.frombuffer(value, JOURNAL_HASH_DTYPE).tolist())
        txn.delete(key, db=dbs.meta)
    removed = 0
    for h in blocks:  # after the sequences: their pins are released
        hk = BLOCK_KEY.pack(h)
        value = txn.get(hk, None, dbs.blocks)
        if value is None or txn.get(hk, None, dbs.refs) is not None:
            continue  # evicted since, or pinned by a sequence of someone else
        w.remove_block(hk, h, len(value))
        removed += 1
    return removed, sequences


def _put_back(w: WriteTxn, key: bytes, raw: bytes, geometry: Geometry | None) -> None:
    """Reinstate a replaced sequence record when every block it references is stored."""
    seq = parse_sequence(raw, geometry)
    if seq is None:
        return
    pins = Counter(seq.referenced())
    if any(w.txn.get(BLOCK_KEY.pack(h), None, w.dbs.blocks) is None for h in pins):
        log.warning("restore rollback: sequence %r lost blocks it references; dropped", key)
        return
    w.txn.put(key, raw, db=w.dbs.seqs)
    w.bytes += len(raw)
    for h, count in pins.items():
        w.pin(h, count)
