"""Restore's commit side: validated archive items imported into the store in bounded batches.

Blocks commit in transactions of about ``COMMIT_BATCH_BYTES`` (LMDB holds a transaction's
dirty pages in memory until it commits), one batch committing on a thread of its own while
the next is validated and filled; sequences follow once every block is in, assembled from
the store's copies (or the archive's). Every commit notes what it adds or replaces in the
store's restore journal (``Store.begin_restore``): :meth:`Importer.finish` keeps the
restore in one last commit, :meth:`Importer.undo` removes what it added (on a failure),
and a process that opens the store after a restore was killed undoes it the same way.

With ``defer_sequences`` (restore's single pass, which validates and commits blocks as it
reads), sequences are only noted while the archive streams by; they are imported by
:meth:`Importer.finish`, after the scan has checked every rule of the whole archive, with
their tails read again from the frames after the last block's (a few MiB). Blocks are the
only thing such a restore commits before the archive is known to be valid.
"""

from __future__ import annotations

import contextlib
from array import array
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..codec.assembly import (
    assemble,
    crc_matches,
    envelope_version,
    pack_header,
    record_of,
)
from ..codec.envelope import decode
from ..codec.tokens import BlockTokens
from ..errors import ArchiveError, TlkvError
from ..pipeline import OrderedPipeline
from ..store.protocols import RestoreTarget
from .reader import ArchiveReader
from .scan import ArchiveBlock, ArchiveSequence, ArchiveTokens, Problem

# Restore commits blocks in transactions of about this many envelope bytes: LMDB holds a
# transaction's dirty pages in memory until it commits. One batch commits (on its own
# thread) while the next one is validated and filled.
COMMIT_BATCH_BYTES = 16 << 20


@dataclass
class RestoreReport:
    """What ``restore`` did: blocks and sequences imported, blocks newly stored (the rest
    were present already), and with ``partial=True`` the members it refused."""

    blocks: int = 0
    new_blocks: int = 0
    sequences: int = 0
    problems: list[Problem] = field(default_factory=list)


class Importer:
    """Imports validated items into the store in bounded batches; can undo its additions.

    Block batches are committed on a thread of their own while the caller validates the
    next batch (LMDB releases the GIL while it writes and syncs); sequences follow once
    every block is in.
    """

    def __init__(
        self,
        store: RestoreTarget,
        archive: ArchiveReader,
        report: RestoreReport,
        *,
        defer_sequences: bool = False,
        section: int = 0,
    ) -> None:
        """``store`` is the handle of the model that the archive's ``section``-th model
        goes to."""
        self.store = store
        self.section = section
        self.geometry = archive.sections[section].geometry
        self.defer_sequences = defer_sequences
        # (name, hashes, has a tail, version, own positions) of each sequence, in order
        self.deferred: list[tuple[str, array[int], bool, int, list[int]]] = []
        self.archive = archive
        self.report = report
        self.blocks: list[ArchiveBlock] = []
        self.block_bytes = 0
        self.tokens: dict[int, BlockTokens] = {}  # the batch's blocks' token ids
        self.sequences: list[tuple[str, bytes]] = []
        self.sequence_bytes = 0
        self.journal = store.begin_restore()
        # One batch commits while the next is validated and filled; a batch is sent only
        # after the one before it committed, so nothing is committed after a failure.
        self._pool: ThreadPoolExecutor | None = None
        self._commits: OrderedPipeline[None] | None = None

    def _commit_blocks(self, batch: list[ArchiveBlock], tokens: dict[int, BlockTokens]) -> None:
        present = self.store.has([b.hash for b in batch])
        new = [b for b, p in zip(batch, present) if not p]
        if new:
            envelopes = [b.envelope if b.decoded is None else b.decoded for b in new]
            kept = [tokens.get(b.hash) for b in new]
            self.store.import_batch(blocks=envelopes, journal=self.journal, tokens=kept)
        self.report.blocks += len(batch)
        self.report.new_blocks += len(new)

    def add_block(self, item: ArchiveBlock) -> None:
        # A full batch is sent before the next block joins it: the last block stays until
        # its token member (version 5), which comes right after it, has joined it too.
        if self.block_bytes >= COMMIT_BATCH_BYTES:
            self._send_blocks()
        self.blocks.append(item)
        self.block_bytes += len(item.envelope)

    def add_tokens(self, item: ArchiveTokens) -> None:
        """The token ids of the block added last (checked by the scan)."""
        if not self.blocks or self.blocks[-1].hash != item.hash:
            raise ArchiveError(f"token member of block {item.hash:016x} without its block")
        ids = item.ids.reshape(1, -1)
        self.tokens[item.hash] = BlockTokens(np.array([item.parent], "<u8"), ids)

    def _send_blocks(self) -> None:
        if not self.blocks:
            return
        if self._commits is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tlkv-restore")
            self._commits = OrderedPipeline[None](self._pool, max_pending=1)
        while not self._commits.has_room():
            self._commits.take()  # the previous batch's failure is raised here
        self._commits.submit(None, self._commit_blocks, self.blocks, self.tokens)
        self.blocks, self.block_bytes, self.tokens = [], 0, {}

    def _join(self) -> None:
        """Wait until every block batch is committed (raising the first failure)."""
        if self._commits is None:
            return
        try:
            while len(self._commits):
                self._commits.take()
        finally:
            self._commits.cancel()
            if self._pool is not None:
                self._pool.shutdown()
            self._commits = self._pool = None

    def flush_blocks(self) -> None:
        self._send_blocks()
        self._join()

    def add_sequence(self, item: ArchiveSequence) -> None:
        if self.defer_sequences:
            own = [p for p, _ in item.own]
            entry = (item.name, array("Q", item.hashes), item.tail is not None, item.version, own)
            self.deferred.append(entry)
            return
        self._import_sequence(item)

    def _import_deferred(self) -> None:
        """Import the noted sequences, their tails and own blocks read again (and checked
        again)."""
        again = self.archive.sequence_parts(self.section)
        for name, hashes, has_tail, version, own in self.deferred:
            tail: memoryview | None = None
            own_blocks: tuple[tuple[int, memoryview], ...] = ()
            if has_tail or own:
                found = next((x for x in again if x.name >= name), None)
                if (
                    found is None
                    or found.name != name
                    or found.hashes != hashes.tolist()
                    or found.positions != own
                    or (found.tail is not None) != has_tail
                    or {envelope_version(e) for e in found.envelopes()} != {version}
                ):
                    raise ArchiveError(f"sequence {name!r}: its members changed while restoring")
                tail, own_blocks = found.tail, tuple(found.own)
            item = ArchiveSequence(name, hashes.tolist(), tail, version, self.section, own_blocks)
            self._import_sequence(item)
        self.deferred = []

    def _import_sequence(self, item: ArchiveSequence) -> None:
        self.flush_blocks()
        envelope = self._assemble(item)
        self.sequences.append((item.name, envelope))
        self.sequence_bytes += len(envelope)
        if self.sequence_bytes >= COMMIT_BATCH_BYTES:
            self.flush_sequences()

    def _assemble(self, item: ArchiveSequence) -> bytes:
        """The sequence's whole envelope: its blocks from the store when the stored copy
        has the sequence's format version, else from the archive, then the tail."""
        g = self.geometry
        assert g is not None
        version = item.version
        n = len(item.hashes) + (item.tail is not None)
        parts: list[Any] = [pack_header(version, g, n)]
        fallback: list[int] = []
        own = dict(item.own)  # its own blocks: the archive's bytes, whatever the store holds
        with self.store.reader() as r:
            for i, h in enumerate(item.hashes):
                if i in own:
                    decode(own[i], g)  # the CRC, which the second pass does not check
                    parts.append(record_of(own[i]))
                    continue
                stored = r.envelope(h)
                if stored is None or envelope_version(stored) != version or not crc_matches(stored):
                    fallback.append(i)  # absent, another version, or damaged: the archive's
                    parts.append(b"")
                    continue
                parts.append(bytes(record_of(stored)))
        for i in fallback:  # read_block checks every rule, the CRC included
            parts[1 + i] = record_of(self.archive.read_block(item.hashes[i], self.section))
        if item.tail is not None:
            decode(item.tail, g)  # the CRC, which the second pass does not check
            parts.append(record_of(item.tail))
        return assemble(parts)

    def flush_sequences(self) -> None:
        if not self.sequences:
            return
        self.store.import_batch(sequences=self.sequences, journal=self.journal)
        self.report.sequences += len(self.sequences)
        self.sequences, self.sequence_bytes = [], 0

    def finish(self) -> None:
        """Import what is left, then keep the restore (the commit that makes it whole)."""
        self.complete()
        self.keep()

    def complete(self) -> None:
        """Import what is left (blocks, then sequences), journaled, not yet kept."""
        self.flush_blocks()
        if self.deferred:
            self._import_deferred()
        self.flush_sequences()

    def keep(self) -> None:
        """Keep the restore: the commit that deletes its journal."""
        self.store.end_restore(self.journal, keep=True)

    def abort(self) -> None:
        """Stop the commit thread (after a failure), keeping what it committed."""
        with contextlib.suppress(BaseException):
            self._join()
        with contextlib.suppress(TlkvError, OSError):
            self.store.end_restore(self.journal, keep=True)
        self.journal.release()

    def undo(self) -> None:
        """Stop the commit thread and remove what this restore added, putting back the
        sequences it replaced (after a failure), in one transaction. If that fails, the
        next process to open the store does it."""
        with contextlib.suppress(BaseException):
            self._join()
        with contextlib.suppress(TlkvError, OSError):
            self.store.end_restore(self.journal, keep=False)
        self.journal.release()
