"""The streaming archive writer (ARCHIVE.md 5.1): blocks and sequence records in, an archive
out, each member checked by every reader rule before it is written. It takes a geometry and
iterables of envelopes and never touches the store.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, BinaryIO

import numpy as np

from ..codec.geometry import Geometry
from ..codec.layout import NO_HASH, U64_MAX
from ..codec.tokens import unpack_records, verify_tokens
from ..protocol import DEFAULT_MODEL, check_model_id, check_sequence_name
from .frames import FrameWriter
from .manifest import (
    DEFAULT_LEVEL,
    FRAME_TARGET,
    MANIFEST_NAME,
    Manifest,
    Section,
    block_member,
    check_member_envelope,
    sequence_block_member,
    sequence_member,
    tail_member,
    tokens_member,
)
from .sequences import SequenceRecord, find_positions, referenced, sequence_version
from .tar import END_OF_ARCHIVE

# --- writing ------------------------------------------------------------------------------


@dataclass
class WriteSummary:
    """What ``write_archive`` wrote."""

    manifest: Manifest
    archive_bytes: int
    data_bytes: int
    frames: int


@dataclass
class ModelContent:
    """One model's part of an archive to write: its id and geometry (None only when it
    has no blocks or sequences), ``(hash, envelope)`` in strictly ascending hash order,
    sequence records in strictly ascending name order, and their counts."""

    model: str
    geometry: Geometry | None
    blocks: Iterable[tuple[int, Any] | tuple[int, Any, Any]]
    sequences: Iterable[SequenceRecord | tuple[str, Sequence[int], Any]]
    n_blocks: int
    n_sequences: int
    n_own_blocks: int = 0  # the blocks the sequences keep of their own (ARCHIVE.md 1.6)
    # Whether some block comes as ``(hash, envelope, token record or None)``: its token
    # record is written after it (ARCHIVE.md 1.7, version 5).
    tokens: bool = False


def write_archive(
    out: BinaryIO,
    geometry: Geometry | None,
    blocks: Iterable[tuple[int, Any]],
    sequences: Iterable[SequenceRecord | tuple[str, Sequence[int], Any]],
    *,
    n_blocks: int,
    n_sequences: int,
    level: int = DEFAULT_LEVEL,
    threads: int = 0,
    progress: Callable[[int, int], None] | None = None,
    release: Callable[[list[Any]], None] | None = None,
    model: str = DEFAULT_MODEL,
) -> WriteSummary:
    """Write an archive of one model's ``blocks`` and ``sequences`` to the binary file
    ``out`` (archive version 2).

    Args:
        out: a file opened for writing (sequential writes only).
        geometry: the blocks' geometry (None only for an empty archive).
        blocks: ``(hash, single-block envelope)`` in strictly ascending hash order.
        sequences: records in strictly ascending name order; every hash must be a block.
        n_blocks, n_sequences: the counts, written first in the manifest.
        level: zstd level; threads: compression threads (0: one per CPU).
        progress: called with ``(blocks written, tar bytes written)`` after each frame.
        release: called with a frame's buffers once it is compressed (the store drops
            the memory-mapped pages it read).
        model: the model the blocks and sequences belong to (recorded in the manifest).

    Raises:
        ValueError: the inputs break an ordering, count or reference rule.
        EnvelopeError: an envelope fails a reader rule (the archive would be refused).
    """
    part = ModelContent(model, geometry, blocks, sequences, n_blocks, n_sequences)
    return write_models(
        out, [part], level=level, threads=threads, progress=progress, release=release
    )


def write_models(
    out: BinaryIO,
    parts: Sequence[ModelContent],
    *,
    level: int = DEFAULT_LEVEL,
    threads: int = 0,
    progress: Callable[[int, int], None] | None = None,
    release: Callable[[list[Any]], None] | None = None,
) -> WriteSummary:
    """Write an archive of the models ``parts`` (strictly ascending ids) to ``out``:
    version 2 for one model, version 3 (each model's members under ``models/<n>/``) for
    several. Arguments and errors as :func:`write_archive`'s."""
    if not parts:
        raise ValueError("an archive holds at least one model")
    for prev, part in pairwise(parts):
        if part.model <= prev.model:
            raise ValueError(f"models must be in ascending order: {part.model!r}")
    for part in parts:
        check_model_id(part.model)
        if part.geometry is None and (part.n_blocks or part.n_sequences):
            raise ValueError("an archive with blocks or sequences needs a geometry")
    manifest = Manifest.of_models(
        [
            Section(p.model, p.geometry, p.n_blocks, p.n_sequences, "", p.n_own_blocks)
            for p in parts
        ],
        tokens=any(p.tokens for p in parts),
    )
    done = [0, 0]

    def on_frame(size: int, n: int) -> None:
        done[0] += n
        done[1] += size
        if progress is not None:
            progress(done[0], done[1])

    writer = FrameWriter(
        out, level=level, threads=threads, target=FRAME_TARGET, on_frame=on_frame, release=release
    )
    try:
        writer.add(MANIFEST_NAME, manifest.to_json())
        writer.seal()
        for part, section in zip(parts, manifest.sections()):
            _write_model(writer, part, section.prefix)
        writer.add_raw_frame(END_OF_ARCHIVE)
        size = writer.finish()
    except BaseException:
        writer.abort()
        raise
    data_bytes = sum(d for _, d in writer.frames)
    return WriteSummary(manifest, size, data_bytes, len(writer.frames))


def _write_model(writer: FrameWriter, part: ModelContent, prefix: str) -> None:
    """One model's members, each checked by every reader rule, names under ``prefix``."""
    geometry = part.geometry
    written = array("Q")
    versions = array("B")
    previous = NO_HASH
    for entry in part.blocks:
        block_hash, envelope = entry[0], entry[1]
        record = entry[2] if len(entry) > 2 else None
        if not NO_HASH < block_hash <= U64_MAX or block_hash <= previous:
            raise ValueError(f"block hashes must be ascending and non-zero: {block_hash:#x}")
        assert geometry is not None
        name = block_member(block_hash, prefix)
        env = check_member_envelope(envelope, geometry, name, block_hash)
        writer.add(name, envelope, block_hash)
        if record is not None:
            if not part.tokens:
                raise ValueError("a token record given for a model without tokens=True")
            verify_tokens([block_hash], unpack_records(record, geometry.block_tokens))
            writer.add(tokens_member(block_hash, prefix), record)
        written.append(block_hash)
        versions.append(env.version)
        previous = block_hash
    if len(written) != part.n_blocks:
        raise ValueError(f"n_blocks is {part.n_blocks} but {len(written)} blocks were given")
    present = np.array(written, dtype=np.uint64)
    present_versions = np.array(versions, dtype=np.uint8)
    count = own_count = 0
    last_name = ""
    for item in part.sequences:
        record = item if isinstance(item, SequenceRecord) else SequenceRecord(*item)
        check_sequence_name(record.name)
        if record.name <= last_name:
            raise ValueError(f"sequence names must be ascending: {record.name!r}")
        own = [p for p, _ in record.own]
        if own != sorted(set(own)) or (own and not 0 <= own[0] <= own[-1] < len(record.hashes)):
            raise ValueError(f"sequence {record.name!r}: own positions {own} out of order")
        own_versions = []
        for p, envelope in record.own:
            assert geometry is not None
            name = sequence_block_member(record.name, p, prefix)
            own_versions.append(
                check_member_envelope(envelope, geometry, name, record.hashes[p]).version
            )
        positions, missing = find_positions(present, referenced(record.hashes, own))
        if missing is not None:
            raise ValueError(f"sequence {record.name!r}: block {missing:016x} is not archived")
        if not len(record.hashes) and record.tail is None:
            raise ValueError(f"sequence {record.name!r} has neither blocks nor a tail")
        tail_version = None
        if record.tail is not None:
            assert geometry is not None
            tail_env = check_member_envelope(
                record.tail, geometry, tail_member(record.name, prefix), None
            )
            tail_version = tail_env.version
        sequence_version(
            sequence_member(record.name, prefix),
            present_versions,
            positions,
            tail_version,
            own_versions,
        )
        writer.add(sequence_member(record.name, prefix), record.to_json())
        for p, envelope in record.own:
            writer.add(sequence_block_member(record.name, p, prefix), envelope)
        if record.tail is not None:
            writer.add(tail_member(record.name, prefix), record.tail)
        last_name = record.name
        count += 1
        own_count += len(own)
    if count != part.n_sequences or own_count != part.n_own_blocks:
        raise ValueError(
            f"n_sequences, n_own_blocks are {part.n_sequences}, {part.n_own_blocks} but "
            f"{count}, {own_count} were given"
        )
