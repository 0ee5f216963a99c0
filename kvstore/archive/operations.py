"""Archives of a store's KV state: create, restore, verify, list and extract.

The format (ARCHIVE.md beside this package) keeps the store's single-block envelopes
verbatim in a tar stream cut into independent zstd frames, with a seek index in a zstd
skippable frame at the end: ``zstd -dc FILE | tar -x`` yields the envelopes as files.

Layers: ``tar`` (member headers), ``frames`` (zstd frames + seek index), ``manifest``
(names, manifest, sequence records, member rules), ``writer`` and ``reader`` (streaming
writer and validator, no store), ``importer`` (restore's batched import), and this module,
which ties them to the store:

- ``create`` reads one consistent snapshot (one LMDB read transaction) and writes a
  sibling temp file that is fsynced and renamed into place.
- ``restore`` validates and imports in one pass: each block is checked by every reader
  rule and committed in durable batches of bounded size as the archive streams by (one
  batch committing while the next is decompressed and checked); sequences, which replace
  and pin, are imported only once the whole archive has passed every rule. If anything
  fails -- a member, a count, the disk -- the blocks and sequences it added are removed
  before the error propagates; if the process dies, the store's restore journal has the
  next process to open the store remove them. When committing could evict (a store with
  a capacity the archive might exceed), a refused archive could not give evicted blocks
  back: restore then validates the whole archive first, writing nothing, and imports in a
  second pass.
  Memory stays bounded whatever the archive's size.
- ``verify``, ``iter_blocks``, ``list_archive``, ``extract``, ``extract_all`` read only.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..codec.envelope import decode
from ..codec.geometry import Geometry
from ..errors import (
    ArchiveError,
    ChecksumError,
    ShapeError,
    UnsafeArchiveError,
)
from ..fileio import atomic_file, current_umask, drop_mapped_pages, populate_mapped_pages
from ..protocol import DEFAULT_MODEL, check_sequence_name, hash_hex
from .importer import (
    Importer,
    RestoreReport,
)
from .manifest import (
    DEFAULT_LEVEL,
    MANIFEST_NAME,
    Manifest,
    SequenceRecord,
    block_member,
    find_positions,
    sequence_member,
    tail_member,
)
from .reader import ArchiveBlock, ArchiveReader, ArchiveSequence
from .sources import open_output
from .writer import WriteSummary, write_archive


class CorruptBlock(Exception):
    """A block of the snapshot failed its CRC while ``create`` read it."""

    def __init__(self, block_hash: int) -> None:
        super().__init__(f"block {block_hash:016x} fails its CRC")
        self.hash = block_hash


# create quarantines a block that fails its CRC and starts over, at most this many times.
MAX_CORRUPT_RETRIES = 16


class Progress(Protocol):
    """What long operations report to (the CLI's progress bar)."""

    def start(self, total_blocks: int, phase: str = "") -> None:
        """A (new) phase over ``total_blocks`` blocks begins: counts restart from 0."""

    def update(self, blocks: int, nbytes: int) -> None:
        """Blocks done in this phase (the bar's fraction and ETA) and bytes processed in it
        (its MB/s)."""


# --- create -------------------------------------------------------------------------------


@dataclass
class CreateSummary(WriteSummary):
    """What ``create`` wrote, and what it left out (with the reason)."""

    skipped: list[str] = field(default_factory=list)


def create(
    store: Any,
    path: str | os.PathLike[str],
    *,
    level: int = DEFAULT_LEVEL,
    sequences: Sequence[str] | None = None,
    threads: int = 0,
    progress: Progress | None = None,
) -> CreateSummary:
    """Archive a consistent snapshot of ``store`` (one read transaction) into ``path``.

    Written to a sibling temp file, fsynced, then renamed: a crash never leaves a half
    archive under ``path``. A block that fails its CRC is quarantined by the store and
    left out (listed in ``skipped``), with every sequence that references it.

    Args:
        sequences: archive only these sequences and the blocks they reference.
        level: zstd level; threads: compression threads (0: one per CPU).

    Raises:
        KeyError: a requested sequence does not exist.
    """
    if sequences is not None:
        for name in sequences:
            check_sequence_name(name)
    quarantined: list[int] = []
    for _attempt in range(MAX_CORRUPT_RETRIES):
        try:
            summary = _create_once(store, path, level, sequences, threads, progress)
        except CorruptBlock as exc:
            store.get(exc.hash)  # the store verifies the CRC and quarantines the block
            quarantined.append(exc.hash)
            continue
        summary.skipped[:0] = [f"block {h:016x}: fails its CRC; quarantined" for h in quarantined]
        return summary
    raise ArchiveError(f"{len(quarantined)} corrupt blocks found while archiving; giving up")


def _create_once(
    store: Any,
    path: str | os.PathLike[str],
    level: int,
    names: Sequence[str] | None,
    threads: int,
    progress: Progress | None,
) -> CreateSummary:
    skipped: list[str] = []
    skipped_names: set[str] = set()
    wanted = None if names is None else set(names)
    with open_output(path) as out, store.reader() as r:
        geometry = store.geometry
        keys = array("Q")
        for h, value in r.iter_blocks():  # the snapshot's hashes (pages dropped as we go)
            keys.append(h)
            drop_mapped_pages([value])
        present = np.array(keys, dtype=np.uint64)
        kept: dict[str, list[int]] = {}  # name -> hashes of each sequence archived
        for name, hashes, tail in r.iter_sequence_records():
            if wanted is not None and name not in wanted:
                continue
            if hashes is None:
                reason = tail
            else:
                missing = find_positions(present, hashes)[1]
                if missing is None:
                    kept[name] = list(hashes)
                    continue
                reason = f"block {missing:016x} is missing (quarantined as corrupt?)"
            skipped.append(f"sequence {name!r}: {reason}; not archived")
            skipped_names.add(name)
        if wanted is not None:
            unknown = wanted - kept.keys() - skipped_names
            if unknown:
                raise KeyError(f"no sequence named {sorted(unknown)[0]!r} in the store")
            block_hashes = sorted({h for hashes in kept.values() for h in hashes})
        n_blocks = len(block_hashes) if wanted is not None else len(keys)
        if progress is not None:
            progress.start(n_blocks)

        def blocks() -> Iterator[tuple[int, Any]]:
            source: Iterable[tuple[int, Any]]
            if wanted is None:
                source = r.iter_blocks()
            else:
                source = ((h, r.envelope(h)) for h in block_hashes)
            for h, env in source:
                populate_mapped_pages([env])  # one call, not a fault per 4 KiB page
                try:
                    decode(env, geometry)
                except ChecksumError:
                    raise CorruptBlock(h) from None
                yield h, env

        def records() -> Iterator[SequenceRecord]:
            for name, hashes, tail in r.iter_sequence_records():
                if name in kept and hashes is not None:
                    yield SequenceRecord(name, list(hashes), tail)

        summary = write_archive(
            out,
            geometry,
            blocks(),
            records(),
            n_blocks=n_blocks,
            n_sequences=len(kept),
            level=level,
            threads=threads,
            progress=None if progress is None else progress.update,
            release=drop_mapped_pages,
            model=getattr(store, "model_id", DEFAULT_MODEL),
        )
    return CreateSummary(**vars(summary), skipped=skipped)


# --- verify, iterate, list ------------------------------------------------------------------


@dataclass
class VerifyReport:
    """What ``verify`` checked."""

    manifest: Manifest
    blocks: int
    sequences: int
    data_bytes: int
    frames: int
    archive_bytes: int


def _check_geometry(archive: Geometry | None, wanted: Geometry | None, what: str) -> None:
    if archive is not None and wanted is not None and archive != wanted:
        raise ShapeError(
            f"rule 'block_tokens, n_layers, n_kv_heads, head_dim equal the receiving pool's' "
            f"failed: {what} has geometry {wanted.as_tuple()}, the archive "
            f"{archive.as_tuple()}"
        )


def verify(
    path: str | os.PathLike[str],
    *,
    geometry: Geometry | None = None,
    allow_nonfinite: bool = False,
    threads: int = 0,
    progress: Progress | None = None,
) -> VerifyReport:
    """Check every byte of an archive by every rule of ARCHIVE.md (and, when given, that
    its geometry is ``geometry``), and the finite-values rule a store applies on restore
    (NaN/Inf values, out-of-range v2 scales) unless ``allow_nonfinite``.

    Raises:
        ArchiveError: the container, a name, a record or a count is wrong (unsafe
            archives raise ``UnsafeArchiveError``).
        EnvelopeError: an envelope fails a reader rule (``ShapeError`` for geometry), or
            the finite-values rule (``FormatError``, naming the member).
    """
    with ArchiveReader(path, threads=threads) as ar:
        _check_geometry(ar.geometry, geometry, "the reader")
        blocks = sequences = 0
        done = 0
        if progress is not None:
            progress.start(ar.manifest.blocks)
        for item in ar.scan(finite=not allow_nonfinite):
            if isinstance(item, ArchiveBlock):
                blocks += 1
                done += len(item.envelope)
                if progress is not None:
                    progress.update(blocks, done)
            else:
                sequences += 1
        return VerifyReport(
            ar.manifest,
            blocks,
            sequences,
            ar.index.data_bytes,
            ar.index.n_frames,
            ar.archive_bytes,
        )


def iter_blocks(
    path: str | os.PathLike[str], *, threads: int = 0
) -> Iterator[tuple[int, memoryview]]:
    """``(hash, verbatim envelope)`` of every block, validated as it streams (an error
    raises when reached: blocks before it have been yielded already)."""
    with ArchiveReader(path, threads=threads) as ar:
        for item in ar.scan():
            if isinstance(item, ArchiveBlock):
                yield item.hash, item.envelope


@dataclass
class SequenceInfo:
    """A sequence as listed: its name, its hashes and whether it has a tail."""

    name: str
    hashes: list[int]
    tail: bool


@dataclass
class Listing:
    """What ``list_archive`` found: manifest, block hashes (from the index), sequences."""

    manifest: Manifest
    hashes: np.ndarray
    sequences: list[SequenceInfo]
    archive_bytes: int
    data_bytes: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (hashes as 16 hex digits)."""
        return {
            "manifest": self.manifest.to_dict(),
            "archive_bytes": self.archive_bytes,
            "data_bytes": self.data_bytes,
            "blocks": [hash_hex(h) for h in self.hashes.tolist()],
            "sequences": [
                {"name": s.name, "hashes": [hash_hex(h) for h in s.hashes], "tail": s.tail}
                for s in self.sequences
            ],
        }


def list_archive(path: str | os.PathLike[str]) -> Listing:
    """List an archive from its index and its sequence frames only (blocks are not read;
    run ``verify`` to check them)."""
    with ArchiveReader(path) as ar:
        sequences = [SequenceInfo(*record) for record in ar.sequence_records()]
        return Listing(
            ar.manifest, ar.hashes().copy(), sequences, ar.archive_bytes, ar.index.data_bytes
        )


# --- extract --------------------------------------------------------------------------------


def extract(path: str | os.PathLike[str], block_hash: int, out: str | os.PathLike[str]) -> int:
    """Write one block's verbatim envelope to ``out`` (a file path, an existing directory,
    or ``-`` for stdout), reading only the frame that holds it. Returns the bytes written.

    Raises:
        KeyError: the archive holds no such block.
    """
    return extract_checked(path, block_hash, out).size


@dataclass(frozen=True)
class Extracted:
    """What :func:`extract_checked` wrote, and what it found inconsistent where it looked."""

    size: int
    findings: list[str]


def extract_checked(
    path: str | os.PathLike[str], block_hash: int, out: str | os.PathLike[str]
) -> Extracted:
    """:func:`extract`, also when the block is valid but the archive's index or manifest
    disagrees with it or with the frame it sits in (``findings``, empty when consistent);
    only a block that is itself invalid, or cannot be found, raises."""
    with ArchiveReader(path, threads=1, strict=False) as ar:
        data, findings = ar.read_block_checked(block_hash)
    target = os.fspath(out)
    if target == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        return Extracted(len(data), findings)
    if os.path.isdir(target):
        target = os.path.join(target, f"{block_hash:016x}.tlkv")
    with atomic_file(target) as f:
        f.write(data)
    return Extracted(len(data), findings)


def _inside(root: str, name: str) -> str:
    """``root/name``, refusing any name that would resolve outside ``root``."""
    target = os.path.realpath(os.path.join(root, name))
    if os.path.commonpath([root, target]) != root or os.path.isabs(name):
        raise UnsafeArchiveError(f"member name {name!r} would escape {root!r}")
    return target


def extract_all(path: str | os.PathLike[str], directory: str | os.PathLike[str]) -> int:
    """Extract every member, validated, into the new directory ``directory``; returns the
    number of files. Written into a sibling temp directory renamed at the end: on any
    error nothing is left behind, and no file is ever written outside ``directory``."""
    final = os.path.abspath(os.fspath(directory))
    if os.path.lexists(final):
        raise FileExistsError(f"{final} exists; extract --all writes a new directory")
    parent = os.path.dirname(final)
    tmp = os.path.realpath(tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.", dir=parent))
    os.chmod(tmp, 0o777 & ~current_umask())  # what mkdir would give, not mkdtemp's 0700
    count = 0
    try:
        with ArchiveReader(path) as ar:

            def put(name: str, data: Any) -> None:
                nonlocal count
                target = _inside(tmp, name)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "xb") as f:
                    f.write(data)
                count += 1

            put(MANIFEST_NAME, ar.manifest.to_json())
            for item in ar.scan():
                if isinstance(item, ArchiveBlock):
                    put(block_member(item.hash), item.envelope)
                elif isinstance(item, ArchiveSequence):
                    record = SequenceRecord(item.name, item.hashes, item.tail)
                    put(sequence_member(item.name), record.to_json())
                    if item.tail is not None:
                        put(tail_member(item.name), item.tail)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return count


# --- restore --------------------------------------------------------------------------------


def _fits_without_eviction(store: Any, ar: ArchiveReader) -> bool:
    """Whether importing all of ``ar`` cannot make ``store`` evict (its tar stream's size
    bounds the envelope bytes it adds)."""
    capacity = store.capacity_bytes
    if capacity is None:
        return True
    return int(store.total_bytes()) + int(ar.index.data_bytes) <= capacity


def restore(
    path: str | os.PathLike[str],
    store: Any,
    *,
    partial: bool = False,
    threads: int = 0,
    progress: Progress | None = None,
    model: str | None = None,
) -> RestoreReport:
    """Import an archive into ``store``: blocks (deduplicated) and sequences (pinned).

    All or nothing by default: every envelope is checked by every reader rule against
    the store's geometry, and blocks are committed in bounded durable batches as they
    pass (the archive is read and decompressed once); sequences are imported only after
    the whole archive has passed. If anything fails, the blocks and sequences this
    restore added are removed again (and the sequences it replaced put back) before the
    error propagates, so the store ends as it was. (Blocks of an archive later refused
    are visible to concurrent readers until then.) If the process is killed, the next
    process to open the store does the same (``Store.begin_restore``). If the archive
    might not fit the store's capacity without evicting,
    the whole archive is validated first, writing nothing, then imported in a second
    pass. A sequence that already exists under the same name is replaced. With
    ``partial=True`` the valid members are imported in one pass and the refused ones are
    listed in ``RestoreReport.problems``.

    The archive's blocks and sequences go to the model its manifest names (``default``
    for a version-1 archive) of ``store``'s environment, or to ``model`` when given (a
    rename); a ``Store`` handle of another model than the archive's is not used as is.

    Raises:
        ShapeError: the archive's geometry differs from the store's.
        ArchiveError, EnvelopeError: (``partial=False``) the first invalid member.
    """
    report = RestoreReport()
    with ArchiveReader(path, threads=threads) as ar:
        store = store.model(model or ar.manifest.model)
        _check_geometry(ar.geometry, store.geometry, "the store")
        done = [0, 0]  # blocks and envelope bytes in this pass

        def tick(item: Any) -> None:
            if progress is not None and isinstance(item, ArchiveBlock):
                done[0] += 1
                done[1] += len(item.envelope)
                progress.update(done[0], done[1])

        def phase(name: str) -> None:
            done[:] = [0, 0]
            if progress is not None:
                progress.start(ar.manifest.blocks, name)

        one_pass = not partial and _fits_without_eviction(store, ar)
        if not partial and not one_pass:
            phase("validating")
            for item in ar.scan():  # pass 1: validate everything, write nothing
                tick(item)
        phase("validating and importing" if one_pass else "importing")
        importer = Importer(store, ar, report, defer_sequences=one_pass)
        try:
            # The store checks every CRC again while it writes: a second pass need not.
            for item in ar.scan(partial=partial, verify_crc=partial or one_pass):
                tick(item)
                if isinstance(item, ArchiveBlock):
                    importer.add_block(item)
                elif isinstance(item, ArchiveSequence):
                    importer.add_sequence(item)
                else:
                    report.problems.append(item)
            importer.finish()
        except BaseException:
            if partial:
                importer.abort()
            else:
                importer.undo()
            raise
    return report
