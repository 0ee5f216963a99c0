"""Read-only looks at an archive, no store: ``verify`` (every rule, every byte),
``iter_blocks`` (validated, streaming) and ``list_archive`` (index and sequences only),
and the geometry check a restore shares with ``verify``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..codec.geometry import Geometry
from ..errors import ShapeError
from ..protocol import DEFAULT_MODEL, hash_hex
from .manifest import Manifest
from .progress import Progress
from .reader import ArchiveReader
from .scan import ArchiveBlock, ArchiveSequence


@dataclass
class VerifyReport:
    """What ``verify`` checked."""

    manifest: Manifest
    blocks: int
    sequences: int
    data_bytes: int
    frames: int
    archive_bytes: int


def check_geometry(archive: Geometry | None, wanted: Geometry | None, what: str) -> None:
    """The store's rule: an archive's geometry equals the one ``what`` has (when both
    are known).

    Raises:
        ShapeError: they differ.
    """
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
            check_geometry(section.geometry, geometry, "the reader")
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
            elif isinstance(item, ArchiveSequence):
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
    """A sequence as listed: its name, its hashes, whether it has a tail, its model, and
    the positions of the blocks it keeps of its own (version 4)."""

    name: str
    hashes: list[int]
    tail: bool
    model: str = DEFAULT_MODEL
    own: list[int] = field(default_factory=list)


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
                | ({"own": s.own} if s.own else {})
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
            SequenceInfo(name, hashes, tail, ids[n], own)
            for name, hashes, tail, n, own in ar.model_sequence_records()
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
