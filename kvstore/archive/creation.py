"""``create``: archive a consistent snapshot of models of a store.

Each model is read in one LMDB read transaction (all open together); every block is
checked by every reader rule as it is written (``writer``), and a block failing its CRC
is quarantined by the store, left out with the sequences using it, and the archive
started over. The file is a sibling temp file, fsynced and renamed into place
(``sources.open_output``): version 2 for one model, 3 for several, 4 when a sequence
keeps blocks of its own (written with them, ``Reader.iter_sequence_parts`` of the store).
"""

from __future__ import annotations

import contextlib
import os
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..codec.envelope import decode
from ..errors import ArchiveError, ChecksumError, IncompleteArchiveError
from ..fileio import drop_mapped_pages, populate_mapped_pages
from ..protocol import DEFAULT_MODEL, check_model_id, check_sequence_name
from ..store.protocols import ArchiveSource
from .manifest import DEFAULT_LEVEL
from .progress import Progress
from .sequences import SequenceRecord, find_positions, referenced
from .sources import open_output
from .writer import ModelContent, WriteSummary, write_models


class CorruptBlock(Exception):
    """A block of the snapshot failed its CRC while ``create`` read it."""

    def __init__(self, block_hash: int, store: ArchiveSource) -> None:
        super().__init__(f"block {block_hash:016x} fails its CRC")
        self.hash = block_hash
        self.store = store  # the handle of the block's model


# create quarantines a block that fails its CRC and starts over, at most this many times.
MAX_CORRUPT_RETRIES = 16


@dataclass
class CreateSummary(WriteSummary):
    """What ``create`` wrote, and what it left out (with the reason)."""

    skipped: list[str] = field(default_factory=list)


def create(
    store: ArchiveSource,
    path: str | os.PathLike[str],
    *,
    models: Sequence[str] | None = None,
    level: int = DEFAULT_LEVEL,
    sequences: Sequence[str] | None = None,
    threads: int = 0,
    progress: Progress | None = None,
    allow_skipped: bool = True,
) -> CreateSummary:
    """Archive a snapshot of models of ``store`` (one read transaction per model) into
    ``path``: version 2 for one model, version 3 for several, version 4 (either shape)
    when a sequence keeps blocks of its own, version 5 when blocks carry their token ids
    (a token member after each such block; ARCHIVE.md 1, 1.6, 1.7).

    Written to a sibling temp file, fsynced, then renamed: a crash never leaves a half
    archive under ``path``. A block that fails its CRC is quarantined by the store and
    left out (listed in ``skipped``), with every sequence that references it; so is a
    sequence record that fails its CRC.

    Args:
        models: the model ids to archive; None: the model of ``store`` when it is a
            handle on a model other than ``default``, else every model of the store
            (``Store.models()``).
        sequences: archive only these sequences (of whichever model has them) and the
            blocks they reference.
        level: zstd level; threads: compression threads (0: one per CPU).
        allow_skipped: False: anything that would be left out (a sequence that uses a
            missing block, or whose record fails its CRC; a block failing its CRC) fails
            the create before an archive is written (``tlkv archive create`` without
            ``--allow-skipped``).

    Raises:
        KeyError: a requested model or sequence does not exist.
        IncompleteArchiveError: something would be left out and ``allow_skipped`` is False.
    """
    if sequences is not None:
        for name in sequences:
            check_sequence_name(name)
    handles = [store.model(m) for m in _models_to_archive(store, models)]
    quarantined: list[int] = []
    for _attempt in range(MAX_CORRUPT_RETRIES):
        try:
            summary = _create_once(
                handles, path, level, sequences, threads, progress, allow_skipped
            )
        except CorruptBlock as exc:
            exc.store.get(exc.hash)  # the store verifies the CRC and quarantines the block
            quarantined.append(exc.hash)
            if not allow_skipped:
                raise _incomplete([f"block {exc.hash:016x}: fails its CRC; quarantined"]) from None
            continue
        summary.skipped[:0] = [f"block {h:016x}: fails its CRC; quarantined" for h in quarantined]
        return summary
    raise ArchiveError(f"{len(quarantined)} corrupt blocks found while archiving; giving up")


def _incomplete(skipped: list[str]) -> IncompleteArchiveError:
    return IncompleteArchiveError(
        f"the archive would leave out {len(skipped)} item(s): {'; '.join(skipped[:3])}"
        f"{'; ...' if len(skipped) > 3 else ''} (nothing written; allow it with "
        "--allow-skipped)"
    )


def _models_to_archive(store: ArchiveSource, models: Sequence[str] | None) -> list[str]:
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

    store: ArchiveSource
    reader: Any
    keys: array[int]
    kept: dict[str, int]  # name -> how many blocks it keeps of its own
    block_hashes: list[int] | None  # the blocks the kept sequences use (with --sequence)
    named: set[str]  # the sequences asked for that the model has (kept or not)
    tokens: bool  # whether some block has its token ids (archived with it, version 5)

    def content(self) -> ModelContent:
        """The model's blocks (each checked as it is written) and kept records."""
        store, r, geometry = self.store, self.reader, self.store.geometry

        def blocks() -> Iterator[tuple[int, Any, Any]]:
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
                yield h, env, r.token_record(h) if self.tokens else None

        def records() -> Iterator[SequenceRecord]:
            for seq in r.iter_sequence_parts():
                if seq.name in self.kept and seq.hashes is not None:
                    yield SequenceRecord(seq.name, seq.hashes, seq.tail, seq.own)

        n_blocks = len(self.keys) if self.block_hashes is None else len(self.block_hashes)
        n_own = sum(self.kept.values())
        return ModelContent(
            store.model_id,
            geometry,
            blocks(),
            records(),
            n_blocks,
            len(self.kept),
            n_own,
            self.tokens,
        )


def _snapshot(
    store: ArchiveSource, r: Any, wanted: set[str] | None, skipped: list[str]
) -> _Snapshot:
    """Read one model's block hashes and choose its sequences (reporting those left out)."""
    keys = array("Q")
    for h, value in r.iter_blocks():  # the snapshot's hashes (pages dropped as we go)
        keys.append(h)
        drop_mapped_pages([value])
    present = np.array(keys, dtype=np.uint64)
    kept: dict[str, int] = {}  # name -> its own blocks, of each sequence archived
    used: set[int] = set()  # the blocks they reference (with --sequence)
    named: set[str] = set()
    where = "" if store.model_id == DEFAULT_MODEL else f" of model {store.model_id!r}"
    for name, hashes, _, own in r.iter_sequence_parts():
        if wanted is not None and name not in wanted:
            continue
        named.add(name)
        if hashes is None:
            reason = "its record fails its CRC"
        else:
            refs = referenced(hashes, [p for p, _ in own])
            missing = find_positions(present, refs)[1]
            if missing is None:
                kept[name] = len(own)
                if wanted is not None:
                    used.update(np.asarray(refs, dtype=np.uint64).tolist())
                continue
            reason = f"block {missing:016x} is missing (quarantined as corrupt?)"
        skipped.append(f"sequence {name!r}{where}: {reason}; not archived")
    block_hashes = None
    if wanted is not None:
        block_hashes = sorted(used)
    return _Snapshot(store, r, keys, kept, block_hashes, named, r.has_tokens())


def _create_once(
    handles: Sequence[Any],
    path: str | os.PathLike[str],
    level: int,
    names: Sequence[str] | None,
    threads: int,
    progress: Progress | None,
    allow_skipped: bool,
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
        if skipped and not allow_skipped:
            raise _incomplete(skipped)
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
