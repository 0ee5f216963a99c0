"""The ``Store``'s write API: ``put``/``put_report``, ``put_sequence``, ``import_batch``
(the archive restore path) with its journal (``begin_restore``, ``end_restore``,
``keep_restores``), ``delete`` and ``delete_sequence``.

Each public write validates its envelopes by every reader rule but the CRC before the
transaction opens, then runs one write transaction (``core``) over ``writetxn``, which
checks the CRC while it copies; a mismatch there stores nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from ..codec.envelope import Envelope, check_finite, decode
from ..codec.geometry import Geometry
from ..codec.layout import NO_HASH
from ..errors import ChecksumError, EnvelopeError, PinnedError
from .checks import check_hash, check_sequence_blocks, seq_key
from .core import StoreCore
from .diskformat import BLOCK_KEY
from .journal import RestoreJournal, commit, rollback
from .results import PutReport, PutResult
from .writetxn import CrcMismatch, WriteTxn

T = TypeVar("T")


class StoreWrites(StoreCore):
    """The write API of a ``Store`` handle (a mixin of ``Store``)."""

    def _validate(self, data: Any, geometry: Geometry | None = None) -> Envelope:
        """Every reader rule but the CRC (checked while writing); errors in the codec's order."""
        if geometry is None and self._geometry is None and self._tier is not None:
            geometry = self._tier.learned_geometry()  # the namespace's in the tier, if any
        geometry = geometry or self._geometry
        try:
            env = decode(data, geometry, verify_crc=False)
            if not self._allow_nonfinite:
                check_finite(env)
            return env
        except EnvelopeError:
            decode(data, geometry)  # raises the codec's own error, the CRC checked first
            raise

    def _run_write(self, body: Callable[[WriteTxn], T], need: int) -> T:
        """Run a put-like transaction; a CRC mismatch found while writing raises the codec's
        ``ChecksumError``."""
        try:
            result = self._write(body, need)
        except CrcMismatch as exc:
            decode(exc.envelope.data)  # raises ChecksumError with the codec's message
            raise ChecksumError("rule 'the CRC matches' failed") from None
        if self._tier is not None:
            self._tier.uploader.wake()
        return result

    def put(self, envelope: Any) -> PutResult:
        """Store every full block of ``envelope`` under its hash, in one transaction.

        The envelope is validated by every reader rule against the store's geometry; the
        value stored per block is its verbatim single-block envelope, the bytes ``get``
        returns. Hashes already present are not rewritten (the first put wins); partial
        blocks (hash 0) are not stored.

        Raises:
            EnvelopeError: a reader rule failed (nothing stored).
            StoreFullError: the blocks do not fit even after eviction (nothing stored).
        """
        return self.put_report(envelope).counts()

    def put_report(self, envelope: Any) -> PutReport:
        """``put``, reporting the hashes stored and already present (the HTTP reply)."""
        env = self._validate(envelope)
        self._resolve(create=True)

        def body(w: WriteTxn) -> PutReport:
            self._adopt_geometry(w, env.geometry)
            return PutReport(*w.put_blocks(env))

        return self._run_write(body, len(env.data))

    def put_sequence(self, name: str, envelope: Any) -> PutResult:
        """Store a named KV state, replacing any sequence of that name.

        Its full blocks are stored content-addressed (deduplicated) and pinned; its partial
        tail, if any, is kept inside the sequence record. ``get_sequence`` returns the
        envelope byte-identical (a block already stored in another format version or with
        other bytes is kept inside the record too, unpinned).

        Raises:
            ValueError: ``name`` is not 1-128 characters of ``[A-Za-z0-9._-]``, or the
                envelope has no block.
            FormatError: a partial block (hash 0) is not the last block.
            EnvelopeError: a reader rule failed.  StoreFullError: it does not fit.
        """
        key = seq_key(name)
        env = self._validate(envelope)
        check_sequence_blocks(env)
        self._resolve(create=True)

        def body(w: WriteTxn) -> PutResult:
            self._adopt_geometry(w, env.geometry)
            return PutResult(*w.put_sequence(key, env))

        return self._run_write(body, len(env.data))

    def import_batch(
        self,
        blocks: Iterable[Any] = (),
        sequences: Iterable[tuple[str, Any]] = (),
        *,
        journal: RestoreJournal | None = None,
    ) -> PutResult:
        """Put many block envelopes, then sequences ``(name, envelope)``, in ONE write
        transaction: all or nothing (the archive restore path).

        Everything is validated before the transaction opens. LMDB holds the batch's dirty
        pages in memory until it commits: size batches accordingly. With a ``journal``
        (``begin_restore``), what the batch adds and replaces is noted in the same commit.
        """
        geometry = self._geometry
        envs: list[Envelope] = []
        for data in blocks:
            envs.append(self._validate(data, geometry))
            geometry = geometry or envs[-1].geometry
        seqs: list[tuple[bytes, Envelope]] = []
        for name, data in sequences:
            key = seq_key(name)
            env = self._validate(data, geometry)
            geometry = geometry or env.geometry
            check_sequence_blocks(env)
            seqs.append((key, env))
        if envs or seqs:
            self._resolve(create=True)

        def body(w: WriteTxn) -> PutResult:
            if geometry is not None:
                self._adopt_geometry(w, geometry)
            reports = [PutReport(*w.put_blocks(e)) for e in envs]
            results = [r.counts() for r in reports]
            added = [h for r in reports for h in r.stored]
            for k, e in seqs:
                if journal is not None:
                    journal.note_sequence(w.txn, w.dbs, k)
                    added += [h for h in e.hashes.tolist() if h != NO_HASH and not self._in(w, h)]
                results.append(PutResult(*w.put_sequence(k, e)))
            if journal is not None:
                journal.note_blocks(w.txn, w.dbs.meta, added)
            return PutResult(
                sum(r.stored for r in results),
                sum(r.duplicate for r in results),
                sum(r.partial for r in results),
            )

        need = sum(len(e.data) for e in envs) + sum(len(e.data) for _, e in seqs)
        return self._run_write(body, need)

    @staticmethod
    def _in(w: WriteTxn, h: int) -> bool:
        return w.txn.get(BLOCK_KEY.pack(h), None, w.dbs.blocks) is not None

    def begin_restore(self) -> RestoreJournal:
        """A journal for one restore's ``import_batch`` calls, to pass to ``end_restore``:
        until then, a process that opens the store after the restore's died undoes it."""
        self._check_usable()
        return RestoreJournal(self._path, model=self._model)

    def end_restore(self, journal: RestoreJournal, *, keep: bool) -> None:
        """Finish a restore: ``keep`` what it imported (one commit), or undo it.

        Raises:
            StoreError: the commit failed; the journal stays, and the next process to open
                the store undoes the restore.
        """
        try:
            if not self._created():
                return  # nothing was imported: the model's first write would have made it
            if keep:
                self._write(lambda w: commit(w.txn, w.dbs.meta, journal.token))
            else:
                self._write(lambda w: rollback(w, journal.token, self._geometry_in(w.txn)))
        finally:
            journal.release()

    def keep_restores(self, journals: Iterable[RestoreJournal]) -> None:
        """Keep several restores (one per model of an archive) in one commit: all of them
        become whole, or none does (then ``end_restore(keep=False)`` each, or let the next
        process to open the store undo them).

        Raises:
            StoreError: the commit failed; the journals stay (not released).
        """
        kept = list(journals)

        def keep_all(w: WriteTxn) -> None:
            for journal in kept:  # the journals live in ``meta``, which every model shares
                commit(w.txn, w.dbs.meta, journal.token)

        self._root._write(keep_all)
        for journal in kept:
            journal.release()

    def delete(self, block_hash: int) -> bool:
        """Remove a block; False when absent.

        Raises:
            PinnedError: a sequence references the block (HTTP 409).
        """
        h = check_hash(block_hash)
        hk = BLOCK_KEY.pack(h)
        if not self._created():
            return False

        def body(w: WriteTxn) -> bool:
            value = w.txn.get(hk, None, w.dbs.blocks)
            if value is None:
                return False
            refs = w.txn.get(hk, None, w.dbs.refs)
            if refs is not None:
                raise PinnedError(
                    f"block {h:016x} is pinned by a sequence; delete the sequences using it first"
                )
            w.remove_block(hk, h, len(value))
            return True

        removed = self._write(body)
        if removed:
            self._recency.discard(h)
        return removed

    def delete_sequence(self, name: str) -> bool:
        """Drop a sequence and its pins; False when absent."""
        key = seq_key(name)
        if not self._created():
            return False
        return self._write(lambda w: w.drop_sequence(key, self._geometry_in(w.txn)))
