"""Archives of a store's KV state: create, restore, verify, list and extract.

The format (ARCHIVE.md beside this package) keeps the store's single-block envelopes
verbatim in a tar stream cut into independent zstd frames, with a seek index in a zstd
skippable frame at the end: ``zstd -dc FILE | tar -x`` yields the envelopes as files.

Layers: ``tar`` (member headers), ``frames`` (zstd frames + seek index), ``manifest``
(names, manifest, sequence records, member rules), ``writer`` and ``reader`` (streaming
writer and validator, no store), ``importer`` (restore's batched import), and this module,
which ties them to the store:

- ``create`` reads one consistent snapshot of each model it archives (one LMDB read
  transaction each, all open together) and writes a sibling temp file that is fsynced and
  renamed into place: format version 2 for one model, 3 for several.
- ``restore`` validates and imports in one pass: each block is checked by every reader
  rule and committed in durable batches of bounded size as the archive streams by (one
  batch committing while the next is decompressed and checked); sequences, which replace
  and pin, are imported only once the whole archive has passed every rule. If anything
  fails -- a member, a count, the disk -- the blocks and sequences it added are removed
  before the error propagates; if the process dies, the store's restore journal has the
  next process to open the store remove them. When committing could evict (a store with
  a capacity the archive might exceed), a refused archive could not give evicted blocks
  back: restore then validates the whole archive first, writing nothing, and imports in a
  second pass. Each of an archive's models goes to its own model of the store (one
  importer and journal each), and one commit keeps them all.
  Memory stays bounded whatever the archive's size.
- ``verify``, ``iter_blocks``, ``list_archive``, ``extract``, ``extract_all`` read only.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
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
from ..protocol import DEFAULT_MODEL, check_model_id, check_sequence_name, hash_hex
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
from .writer import ModelContent, WriteSummary, write_models


class CorruptBlock(Exception):
    """A block of the snapshot failed its CRC while ``create`` read it."""

    def __init__(self, block_hash: int, store: Any) -> None:
        super().__init__(f"block {block_hash:016x} fails its CRC")
        self.hash = block_hash
        self.store = store  # the handle of the block's model


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
    models: Sequence[str] | None = None,
    level: int = DEFAULT_LEVEL,
    sequences: Sequence[str] | None = None,
    threads: int = 0,
    progress: Progress | None = None,
) -> CreateSummary:
    """Archive a snapshot of models of ``store`` (one read transaction per model) into
    ``path``: version 2 for one model, version 3 for several (ARCHIVE.md 1).

    Written to a sibling temp file, fsynced, then renamed: a crash never leaves a half
    archive under ``path``. A block that fails its CRC is quarantined by the store and
    left out (listed in ``skipped``), with every sequence that references it.

    Args:
        models: the model ids to archive; None: the model of ``store`` when it is a
            handle on a model other than ``default``, else every model of the store
            (``Store.models()``).
        sequences: archive only these sequences (of whichever model has them) and the
            blocks they reference.
        level: zstd level; threads: compression threads (0: one per CPU).

    Raises:
        KeyError: a requested model or sequence does not exist.
    """
    if sequences is not None:
        for name in sequences:
            check_sequence_name(name)
    handles = [store.model(m) for m in _models_to_archive(store, models)]
    quarantined: list[int] = []
    for _attempt in range(MAX_CORRUPT_RETRIES):
        try:
            summary = _create_once(handles, path, level, sequences, threads, progress)
        except CorruptBlock as exc:
            exc.store.get(exc.hash)  # the store verifies the CRC and quarantines the block
            quarantined.append(exc.hash)
            continue
        summary.skipped[:0] = [f"block {h:016x}: fails its CRC; quarantined" for h in quarantined]
        return summary
    raise ArchiveError(f"{len(quarantined)} corrupt blocks found while archiving; giving up")


def _models_to_archive(store: Any, models: Sequence[str] | None) -> list[str]:
    """The ids ``create`` archives, ascending (see its ``models``)."""
    if models is None:
        own = getattr(store, "model_id", DEFAULT_MODEL)
        return [own] if own != DEFAULT_MODEL else list(store.models())
    wanted = sorted({check_model_id(m) for m in models})
    if not wanted:
        raise ValueError("models: name at least one model")
    for m in wanted:
        if not store.has_model(m):
            raise KeyError(f"no model {m!r} in the store")
    return wanted


@dataclass
class _Snapshot:
    """What ``create`` archives of one model: its handle, open reader, block hashes and
    the sequences it keeps."""

    store: Any
    reader: Any
    keys: array[int]
    kept: dict[str, list[int]]
    block_hashes: list[int] | None  # the blocks the kept sequences use (with --sequence)
    named: set[str]  # the sequences asked for that the model has (kept or not)

    def content(self) -> ModelContent:
        """The model's blocks (each checked as it is written) and kept records."""
        store, r, geometry = self.store, self.reader, self.store.geometry

        def blocks() -> Iterator[tuple[int, Any]]:
            source: Iterable[tuple[int, Any]]
            if self.block_hashes is None:
                source = r.iter_blocks()
            else:
                source = ((h, r.envelope(h)) for h in self.block_hashes)
            for h, env in source:
                populate_mapped_pages([env])  # one call, not a fault per 4 KiB page
                try:
                    decode(env, geometry)
                except ChecksumError:
                    raise CorruptBlock(h, store) from None
                yield h, env

        def records() -> Iterator[SequenceRecord]:
            for name, hashes, tail in r.iter_sequence_records():
                if name in self.kept and hashes is not None:
                    yield SequenceRecord(name, list(hashes), tail)

        n_blocks = len(self.keys) if self.block_hashes is None else len(self.block_hashes)
        return ModelContent(store.model_id, geometry, blocks(), records(), n_blocks, len(self.kept))


def _snapshot(store: Any, r: Any, wanted: set[str] | None, skipped: list[str]) -> _Snapshot:
    """Read one model's block hashes and choose its sequences (reporting those left out)."""
    keys = array("Q")
    for h, value in r.iter_blocks():  # the snapshot's hashes (pages dropped as we go)
        keys.append(h)
        drop_mapped_pages([value])
    present = np.array(keys, dtype=np.uint64)
    kept: dict[str, list[int]] = {}  # name -> hashes of each sequence archived
    named: set[str] = set()
    where = "" if store.model_id == DEFAULT_MODEL else f" of model {store.model_id!r}"
    for name, hashes, tail in r.iter_sequence_records():
        if wanted is not None and name not in wanted:
            continue
        named.add(name)
        if hashes is None:
            reason = tail
        else:
            missing = find_positions(present, hashes)[1]
            if missing is None:
                kept[name] = list(hashes)
                continue
            reason = f"block {missing:016x} is missing (quarantined as corrupt?)"
        skipped.append(f"sequence {name!r}{where}: {reason}; not archived")
    block_hashes = None
    if wanted is not None:
        block_hashes = sorted({h for hashes in kept.values() for h in hashes})
    return _Snapshot(store, r, keys, kept, block_hashes, named)


def _create_once(
    handles: Sequence[Any],
    path: str | os.PathLike[str],
    level: int,
    names: Sequence[str] | None,
    threads: int,
    progress: Progress | None,
) -> CreateSummary:
    skipped: list[str] = []
    wanted = None if names is None else set(names)
    with open_output(path) as out, contextlib.ExitStack() as stack:
        snaps = []
        for store in handles:
            r = stack.enter_context(store.reader())
            snaps.append(_snapshot(store, r, wanted, skipped))
        if wanted is not None:
            unknown = wanted.difference(*(snap.named for snap in snaps))
            if unknown:
                raise KeyError(f"no sequence named {sorted(unknown)[0]!r} in the store")
        parts = [snap.content() for snap in snaps]
        if progress is not None:
            progress.start(sum(p.n_blocks for p in parts))
        summary = write_models(
            out,
            parts,
            level=level,
            threads=threads,
            progress=None if progress is None else progress.update,
            release=drop_mapped_pages,
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
        for section in ar.sections:
            _check_geometry(section.geometry, geometry, "the reader")
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
    """``(hash, verbatim envelope)`` of every block (of every model, in member order),
    validated as it streams (an error raises when reached: blocks before it have been
    yielded already)."""
    with ArchiveReader(path, threads=threads) as ar:
        for item in ar.scan():
            if isinstance(item, ArchiveBlock):
                yield item.hash, item.envelope


@dataclass
class SequenceInfo:
    """A sequence as listed: its name, its hashes, whether it has a tail, its model."""

    name: str
    hashes: list[int]
    tail: bool
    model: str = DEFAULT_MODEL


@dataclass
class Listing:
    """What ``list_archive`` found: manifest, block hashes (from the index; in member
    order, ``models[i]`` the model of each), sequences."""

    manifest: Manifest
    hashes: np.ndarray
    sequences: list[SequenceInfo]
    archive_bytes: int
    data_bytes: int
    models: list[str] = field(default_factory=list)

    def model_of(self) -> list[str]:
        """The model id of each entry of ``hashes``."""
        if not self.models:
            return [self.manifest.model] * len(self.hashes)
        return self.models

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (hashes as 16 hex digits)."""
        out: dict[str, Any] = {
            "manifest": self.manifest.to_dict(),
            "archive_bytes": self.archive_bytes,
            "data_bytes": self.data_bytes,
            "blocks": [hash_hex(h) for h in self.hashes.tolist()],
            "sequences": [
                {"name": s.name, "hashes": [hash_hex(h) for h in s.hashes], "tail": s.tail}
                for s in self.sequences
            ],
        }
        if len(self.manifest.sections()) > 1:  # version 3: which model each belongs to
            out["block_models"] = self.model_of()
            for entry, s in zip(out["sequences"], self.sequences):
                entry["model"] = s.model
        return out


def list_archive(path: str | os.PathLike[str]) -> Listing:
    """List an archive from its index and its sequence frames only (blocks are not read;
    run ``verify`` to check them)."""
    with ArchiveReader(path) as ar:
        ids = [x.model for x in ar.sections]
        sequences = [
            SequenceInfo(name, hashes, tail, ids[n])
            for name, hashes, tail, n in ar.model_sequence_records()
        ]
        models: list[str] = []
        if len(ids) > 1:
            for n, model_id in enumerate(ids):
                run = ar.index.run(n)
                models.extend([model_id] * (run.stop - run.start))
        return Listing(
            ar.manifest,
            ar.hashes().copy(),
            sequences,
            ar.archive_bytes,
            ar.index.data_bytes,
            models,
        )


# --- extract --------------------------------------------------------------------------------


def extract(
    path: str | os.PathLike[str],
    block_hash: int,
    out: str | os.PathLike[str],
    *,
    model: str | None = None,
) -> int:
    """Write one block's verbatim envelope to ``out`` (a file path, an existing directory,
    or ``-`` for stdout), reading only the frame that holds it. Returns the bytes written.
    ``model``: the model the block belongs to (needed when the archive holds several).

    Raises:
        KeyError: the archive holds no such block (or no such model).
        ValueError: no ``model`` for an archive of several models.
    """
    return extract_checked(path, block_hash, out, model=model).size


@dataclass(frozen=True)
class Extracted:
    """What :func:`extract_checked` wrote, and what it found inconsistent where it looked."""

    size: int
    findings: list[str]


def extract_checked(
    path: str | os.PathLike[str],
    block_hash: int,
    out: str | os.PathLike[str],
    *,
    model: str | None = None,
) -> Extracted:
    """:func:`extract`, also when the block is valid but the archive's index or manifest
    disagrees with it or with the frame it sits in (``findings``, empty when consistent);
    only a block that is itself invalid, or cannot be found, raises."""
    with ArchiveReader(path, threads=1, strict=False) as ar:
        if model is not None:
            section = ar.section_of(model)
        elif len(ar.sections) == 1:
            section = 0
        else:
            ids = [x.model for x in ar.sections]
            raise ValueError(f"the archive holds {len(ids)} models {ids}; name one (--model)")
        data, findings = ar.read_block_checked(block_hash, section)
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

            def prefix(item: ArchiveBlock | ArchiveSequence) -> str:
                return ar.sections[item.section].prefix

            put(MANIFEST_NAME, ar.manifest.to_json())
            for item in ar.scan():
                if isinstance(item, ArchiveBlock):
                    put(block_member(item.hash, prefix(item)), item.envelope)
                elif isinstance(item, ArchiveSequence):
                    record = SequenceRecord(item.name, item.hashes, item.tail)
                    put(sequence_member(item.name, prefix(item)), record.to_json())
                    if item.tail is not None:
                        put(tail_member(item.name, prefix(item)), item.tail)
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


def _targets(
    ar: ArchiveReader, store: Any, model: str | None, renames: Mapping[str, str] | None
) -> list[Any]:
    """The store handle each of the archive's models goes to: its own id, or the new id
    ``renames`` gives it (``model``: the new id of an archive's only model)."""
    ids = [x.model for x in ar.sections]
    names = dict(renames or {})
    if model is not None:
        if len(ids) != 1:
            raise ValueError(f"the archive holds {len(ids)} models {ids}; rename one with OLD=NEW")
        names[ids[0]] = model
    for old, new in names.items():
        if old not in ids:
            raise KeyError(f"the archive holds no model {old!r} (it holds {ids})")
        check_model_id(new)
    chosen = [names.get(m, m) for m in ids]
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"two of the archive's models would restore into one: {chosen}")
    return [store.model(m) for m in chosen]


def restore(
    path: str | os.PathLike[str],
    store: Any,
    *,
    partial: bool = False,
    threads: int = 0,
    progress: Progress | None = None,
    model: str | None = None,
    renames: Mapping[str, str] | None = None,
) -> RestoreReport:
    """Import an archive into ``store``: blocks (deduplicated) and sequences (pinned).

    All or nothing by default: every envelope is checked by every reader rule against
    the geometry of the model it goes to, and blocks are committed in bounded durable
    batches as they pass (the archive is read and decompressed once); sequences are
    imported only after the whole archive has passed. If anything fails, the blocks and
    sequences this restore added, in every model, are removed again (and the sequences it
    replaced put back) before the error propagates, so the store ends as it was. (Blocks
    of an archive later refused are visible to concurrent readers until then.) The
    restore becomes whole in one commit for all its models; if the process is killed
    before it, the next process to open the store undoes it (``Store.begin_restore``). If
    the archive might not fit the store's capacity without evicting, the whole archive
    is validated first, writing nothing, then imported in a second pass. A sequence that
    already exists under the same name is replaced. With ``partial=True`` the valid
    members are imported in one pass and the refused ones are listed in
    ``RestoreReport.problems``.

    Each of the archive's models goes to the model of the same id in ``store``'s
    environment (a version-1 archive is ``default``), or to ``renames[id]``; ``model``
    renames the model of a one-model archive (a ``Store`` handle of another model than
    the archive's is not used as is).

    Raises:
        ShapeError: one of the archive's geometries differs from its model's in the store.
        KeyError: ``renames`` names a model the archive does not hold.
        ValueError: ``model`` for an archive of several models, or two models renamed
            into one.
        ArchiveError, EnvelopeError: (``partial=False``) the first invalid member.
    """
    report = RestoreReport()
    with ArchiveReader(path, threads=threads) as ar:
        targets = _targets(ar, store, model, renames)
        for section, target in zip(ar.sections, targets):
            _check_geometry(section.geometry, target.geometry, f"the model {target.model_id!r}")
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
        importers: list[Importer] = []
        try:
            for n, target in enumerate(targets):
                importers.append(Importer(target, ar, report, defer_sequences=one_pass, section=n))
            current = 0
            # The store checks every CRC again while it writes: a second pass need not.
            for item in ar.scan(partial=partial, verify_crc=partial or one_pass):
                tick(item)
                if isinstance(item, ArchiveBlock | ArchiveSequence):
                    if item.section != current:  # one model's commits at a time
                        importers[current].flush_blocks()
                        current = item.section
                    if isinstance(item, ArchiveBlock):
                        importers[current].add_block(item)
                    else:
                        importers[current].add_sequence(item)
                else:
                    report.problems.append(item)
            for importer in importers:
                importer.complete()
            store.keep_restores([importer.journal for importer in importers])
        except BaseException:
            for importer in importers:
                if partial:
                    importer.abort()
                else:
                    importer.undo()
            raise
    return report
