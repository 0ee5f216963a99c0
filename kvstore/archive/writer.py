"""The streaming archive writer (ARCHIVE.md 5.1): blocks and sequence records in, an archive
out, each member checked by every reader rule before it is written. It takes a geometry and
iterables of envelopes and never touches the store.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from ..codec.geometry import Geometry
from ..codec.layout import NO_HASH, U64_MAX
from ..protocol import DEFAULT_MODEL, check_sequence_name
from .frames import FrameWriter
from .manifest import (
    DEFAULT_LEVEL,
    FRAME_TARGET,
    MANIFEST_NAME,
    Manifest,
    SequenceRecord,
    block_member,
    check_member_envelope,
    find_positions,
    sequence_member,
    sequence_version,
    tail_member,
)
from .tar import END_OF_ARCHIVE

# --- writing ------------------------------------------------------------------------------


@dataclass
class WriteSummary:
    """What ``write_archive`` wrote."""

    manifest: Manifest
    archive_bytes: int
    data_bytes: int
    frames: int


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
    """Write an archive of ``blocks`` and ``sequences`` to the binary file ``out``.

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
    if geometry is None and (n_blocks or n_sequences):
        raise ValueError("an archive with blocks or sequences needs a geometry")
    manifest = Manifest(geometry, n_blocks, n_sequences, model=model)
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
        written = array("Q")
        versions = array("B")
        previous = NO_HASH
        for block_hash, envelope in blocks:
            if not NO_HASH < block_hash <= U64_MAX or block_hash <= previous:
                raise ValueError(f"block hashes must be ascending and non-zero: {block_hash:#x}")
            assert geometry is not None
            env = check_member_envelope(envelope, geometry, block_member(block_hash), block_hash)
            writer.add(block_member(block_hash), envelope, block_hash)
            written.append(block_hash)
            versions.append(env.version)
            previous = block_hash
        if len(written) != n_blocks:
            raise ValueError(f"n_blocks is {n_blocks} but {len(written)} blocks were given")
        present = np.array(written, dtype=np.uint64)
        present_versions = np.array(versions, dtype=np.uint8)
        count = 0
        last_name = ""
        for item in sequences:
            record = item if isinstance(item, SequenceRecord) else SequenceRecord(*item)
            check_sequence_name(record.name)
            if record.name <= last_name:
                raise ValueError(f"sequence names must be ascending: {record.name!r}")
            positions, missing = find_positions(present, record.hashes)
            if missing is not None:
                raise ValueError(f"sequence {record.name!r}: block {missing:016x} is not archived")
            if not len(record.hashes) and record.tail is None:
                raise ValueError(f"sequence {record.name!r} has neither blocks nor a tail")
            tail_version = None
            if record.tail is not None:
                assert geometry is not None
                tail_env = check_member_envelope(
                    record.tail, geometry, tail_member(record.name), None
                )
                tail_version = tail_env.version
            sequence_version(
                sequence_member(record.name), present_versions, positions, tail_version
            )
            writer.add(sequence_member(record.name), record.to_json())
            if record.tail is not None:
                writer.add(tail_member(record.name), record.tail)
            last_name = record.name
            count += 1
        if count != n_sequences:
            raise ValueError(f"n_sequences is {n_sequences} but {count} were given")
        writer.add_raw_frame(END_OF_ARCHIVE)
        size = writer.finish()
    except BaseException:
        writer.abort()
        raise
    data_bytes = sum(d for _, d in writer.frames)
    return WriteSummary(manifest, size, data_bytes, len(writer.frames))
