"""The store side of archives: crash-safe output files, snapshot helpers, and the
batched importer that restore commits through (used by ``archive``; no public API).

Memory stays bounded whatever the archive's size: pages of LMDB's map that ``create``
has read are dropped from the resident set once compressed, output is handed to the
kernel's writeback as it is written, and restore commits in batches of bounded size
on a thread of its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..codec.assembly import (
    assemble,
    crc_matches,
    envelope_version,
    holds_record,
    pack_header,
    record_of,
)
from ..codec.envelope import decode
from ..codec.layout import (
    NO_HASH,
)
from ..errors import PinnedError, TlkvError
from ..pipeline import OrderedPipeline
from .format import (
    ArchiveBlock,
    ArchiveReader,
    ArchiveSequence,
    Problem,
)

# Restore commits blocks in transactions of about this many envelope bytes: LMDB holds a
# transaction's dirty pages in memory until it commits. One batch commits (on its own
# thread) while the next one is validated and filled.
COMMIT_BATCH_BYTES = 16 << 20


class CorruptBlock(Exception):
    def __init__(self, block_hash: int) -> None:
        super().__init__(f"block {block_hash:016x} fails its CRC")
        self.hash = block_hash


@dataclass
class SnapshotSequence:
    name: str
    hashes: list[int]
    has_tail: bool


def iter_sequence_records(reader: Any) -> Iterator[tuple[str, list[int] | None, Any]]:
    """``(name, hashes, tail envelope or None)`` of every sequence in the snapshot.

    Uses the store's ``iter_sequence_records`` when it has one; otherwise rebuilds them
    from ``iter_sequences`` (whole envelopes, one at a time). A sequence that keeps its
    own copy of a full block (stored in another format version than the block space's)
    cannot be written by reference and is reported as ``(name, None, reason)``.
    """
    fast = getattr(reader, "iter_sequence_records", None)
    if fast is not None:
        yield from fast()
        return
    for name, envelope in reader.iter_sequences():
        env = decode(envelope, verify_crc=False)  # assembled by the store from checked data
        hashes = env.hashes.tolist()
        tail = None
        if hashes and hashes[-1] == NO_HASH:
            tail = env.single(len(hashes) - 1)
            hashes.pop()
        reason = None
        for i, h in enumerate(hashes):
            stored = reader.envelope(h)
            if stored is None or not holds_record(stored, env.version, env.record(i)):
                reason = f"keeps its own copy of block {h:016x} (another format version)"
                break
        if reason is None:
            yield name, hashes, tail
        else:
            yield name, None, reason


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

    def __init__(self, store: Any, archive: ArchiveReader, report: RestoreReport) -> None:
        self.store = store
        self.archive = archive
        self.report = report
        self.blocks: list[ArchiveBlock] = []
        self.block_bytes = 0
        self.sequences: list[tuple[str, bytes]] = []
        self.sequence_bytes = 0
        self.added: list[int] = []
        self.existing_names = set(store.sequences())
        self.created: list[str] = []
        # One batch commits while the next is validated and filled; a batch is sent only
        # after the one before it committed, so nothing is committed after a failure.
        self._pool: ThreadPoolExecutor | None = None
        self._commits: OrderedPipeline[None] | None = None

    def _commit_blocks(self, batch: list[ArchiveBlock]) -> None:
        present = self.store.has([b.hash for b in batch])
        new = [b for b, p in zip(batch, present) if not p]
        if new:
            self.store.import_batch(blocks=[b.envelope for b in new])
            self.added.extend(b.hash for b in new)
        self.report.blocks += len(batch)
        self.report.new_blocks += len(new)

    def add_block(self, item: ArchiveBlock) -> None:
        self.blocks.append(item)
        self.block_bytes += len(item.envelope)
        if self.block_bytes >= COMMIT_BATCH_BYTES:
            self._send_blocks()

    def _send_blocks(self) -> None:
        if not self.blocks:
            return
        if self._commits is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tlkv-restore")
            self._commits = OrderedPipeline[None](self._pool, max_pending=1)
        while not self._commits.has_room():
            self._commits.take()  # the previous batch's failure is raised here
        self._commits.submit(None, self._commit_blocks, self.blocks)
        self.blocks, self.block_bytes = [], 0

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
        self.flush_blocks()
        envelope = self._assemble(item)
        self.sequences.append((item.name, envelope))
        self.sequence_bytes += len(envelope)
        if self.sequence_bytes >= COMMIT_BATCH_BYTES:
            self.flush_sequences()

    def _assemble(self, item: ArchiveSequence) -> bytes:
        """The sequence's whole envelope: its blocks from the store when the stored copy
        has the sequence's format version, else from the archive, then the tail."""
        g = self.archive.geometry
        assert g is not None
        version = item.version
        n = len(item.hashes) + (item.tail is not None)
        parts: list[Any] = [pack_header(version, g, n)]
        fallback: list[int] = []
        with self.store.reader() as r:
            for i, h in enumerate(item.hashes):
                stored = r.envelope(h)
                if stored is None or envelope_version(stored) != version or not crc_matches(stored):
                    fallback.append(i)  # absent, another version, or damaged: the archive's
                    parts.append(b"")
                    continue
                parts.append(bytes(record_of(stored)))
        for i in fallback:  # read_block checks every rule, the CRC included
            parts[1 + i] = record_of(self.archive.read_block(item.hashes[i]))
        if item.tail is not None:
            decode(item.tail, g)  # the CRC, which the second pass does not check
            parts.append(record_of(item.tail))
        return assemble(parts)

    def flush_sequences(self) -> None:
        if not self.sequences:
            return
        self.store.import_batch(sequences=self.sequences)
        for name, _ in self.sequences:
            if name not in self.existing_names:
                self.created.append(name)
        self.report.sequences += len(self.sequences)
        self.sequences, self.sequence_bytes = [], 0

    def finish(self) -> None:
        self.flush_blocks()
        self.flush_sequences()

    def abort(self) -> None:
        """Stop the commit thread (after a failure), keeping what it committed."""
        with contextlib.suppress(BaseException):
            self._join()

    def undo(self) -> None:
        """Remove the sequences created and the blocks added (after a failed commit)."""
        self.abort()
        for name in self.created:
            with contextlib.suppress(TlkvError, OSError):
                self.store.delete_sequence(name)
        for h in self.added:
            with contextlib.suppress(TlkvError, OSError, PinnedError):
                self.store.delete(h)
