"""The streaming archive reader and validator (ARCHIVE.md 5.2): every member checked by every
reader rule against the manifest, holding one frame (a few MiB) plus eight bytes per block
at a time whatever the archive's size; single blocks read through the seek index.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..codec.envelope import Envelope, check_finite
from ..codec.geometry import Geometry
from ..codec.layout import NO_HASH
from ..errors import (
    ArchiveError,
    EnvelopeError,
    FormatError,
    UnsafeArchiveError,
)
from .frames import FrameReader
from .manifest import (
    BLOCK_NAME,
    FRAME_TARGET,
    MANIFEST_NAME,
    MAX_BLOCK_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_SEQUENCE_BYTES,
    SEQUENCE_JSON_NAME,
    SEQUENCE_TAIL_NAME,
    Manifest,
    block_member,
    check_member_envelope,
    escapes,
    find_positions,
    parse_sequence_json,
    sequence_member,
    sequence_version,
    tail_member,
)
from .tar import END_OF_ARCHIVE, TAR_BLOCK, Member, iter_members, member_size, padded

# --- reading ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArchiveBlock:
    """A validated block member: its hash and its verbatim single-block envelope."""

    hash: int
    envelope: memoryview


@dataclass(frozen=True)
class ArchiveSequence:
    """A validated sequence: name, ordered hashes (all archived), the tail envelope, and
    the format version its blocks and tail share."""

    name: str
    hashes: list[int]
    tail: memoryview | None
    version: int


@dataclass(frozen=True)
class Problem:
    """A member or frame refused while reading with ``partial=True``."""

    where: str
    error: Exception

    def __str__(self) -> str:
        return f"{self.where}: {type(self.error).__name__}: {self.error}"


Item = ArchiveBlock | ArchiveSequence | Problem


class ArchiveReader:
    """Random and streaming access to a tlkv archive file, validating as it reads.

    Opening reads the seek index and the manifest only. ``scan()`` streams every member
    through every check; ``read_block()`` reads just the frame holding one block.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, threads: int = 0, strict: bool = True
    ) -> None:
        """``strict=False`` records the index/manifest disagreements that do not stop a
        single block from being read (the block counts) in ``findings`` instead of raising."""
        self.path = os.fspath(path)
        self.threads = threads
        self.strict = strict
        self.findings: list[str] = []
        # Frame 0 holds only the manifest; the real frame limit needs its geometry.
        self._frames = FrameReader(path, TAR_BLOCK + padded(MAX_MANIFEST_BYTES))
        try:
            self.index = self._frames.index
            self.manifest = self._read_manifest()
        except BaseException:
            self._frames.close()
            raise

    def _read_manifest(self) -> Manifest:
        index = self.index
        if index.n_frames < 2:
            raise ArchiveError(f"archive has {index.n_frames} data frames; at least 2 needed")
        frame = memoryview(self._frames.read_frame(0))
        members = list(iter_members(frame, 0, self._manifest_limit))
        if len(members) != 1 or members[0].name != MANIFEST_NAME:
            raise ArchiveError(f"frame 0 must hold exactly {MANIFEST_NAME}")
        manifest = Manifest.from_json(members[0].data)
        env_max = manifest.max_envelope()
        if env_max > MAX_BLOCK_BYTES:
            raise UnsafeArchiveError(
                f"manifest: geometry {manifest.geometry} means {env_max}-byte blocks, "
                f"more than the {MAX_BLOCK_BYTES} an archive may hold"
            )
        self.env_max = env_max
        biggest = max(padded(env_max), padded(MAX_SEQUENCE_BYTES), FRAME_TARGET)
        self._frames.max_frame_bytes = biggest + 4 * TAR_BLOCK
        if len(index.blocks) != manifest.blocks:
            found = f"index lists {len(index.blocks)} blocks, the manifest {manifest.blocks}"
            if self.strict:
                raise ArchiveError(found)
            self.findings.append(found)
        bound = (
            member_size(MANIFEST_NAME, MAX_MANIFEST_BYTES)
            + manifest.blocks * member_size(block_member(1), env_max)
            + manifest.sequences
            * (
                member_size(sequence_member("x" * 128), MAX_SEQUENCE_BYTES)
                + member_size(tail_member("x" * 128), env_max)
            )
            + len(END_OF_ARCHIVE)
        )
        if index.data_bytes > bound:
            raise UnsafeArchiveError(
                f"index declares {index.data_bytes} decompressed bytes, more than the "
                f"{bound} the manifest's counts allow (decompression bomb?)"
            )
        if int(index.decomp_sizes[-1]) != len(END_OF_ARCHIVE):
            raise ArchiveError("the last data frame must hold only the end-of-archive marker")
        return manifest

    @staticmethod
    def _manifest_limit(name: str) -> int:
        if name != MANIFEST_NAME:
            raise ArchiveError(f"frame 0: expected {MANIFEST_NAME}, found {name!r}")
        return MAX_MANIFEST_BYTES

    def _limit(self, name: str) -> int:
        """Largest data size of a member name; refuses names outside ARCHIVE.md 1.1."""
        if BLOCK_NAME.fullmatch(name) or SEQUENCE_TAIL_NAME.fullmatch(name):
            return self.env_max
        if SEQUENCE_JSON_NAME.fullmatch(name):
            return MAX_SEQUENCE_BYTES
        if name == MANIFEST_NAME:
            raise ArchiveError(f"duplicate member {name!r}")
        if escapes(name):
            raise UnsafeArchiveError(f"member name {name!r} would escape the destination")
        raise UnsafeArchiveError(f"unexpected member name {name!r}")

    @property
    def geometry(self) -> Geometry | None:
        """The archive's geometry (None for an empty archive)."""
        return self.manifest.geometry

    def close(self) -> None:
        """Close the file."""
        self._frames.close()

    def __enter__(self) -> ArchiveReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def hashes(self) -> np.ndarray:
        """Every block hash the index lists, ascending (``<u8``)."""
        return self.index.blocks["hash"]

    @property
    def archive_bytes(self) -> int:
        """Size of the archive file."""
        return self._frames.file_size

    def sequence_records(self) -> Iterator[tuple[str, list[int], bool]]:
        """``(name, hashes, has_tail)`` of every sequence record, reading only the frames
        after the last block's (the blocks themselves are not checked: see ``scan``)."""
        index = self.index
        first = int(index.blocks["frame"].max()) if len(index.blocks) else 1
        for i in range(max(first, 1), index.n_frames - 1):
            frame = memoryview(self._frames.read_frame(i))
            for m in iter_members(frame, i, self._limit):
                found = SEQUENCE_JSON_NAME.fullmatch(m.name)
                if found:
                    hashes, tail = parse_sequence_json(m.data, found.group(1))
                    yield found.group(1), hashes, tail

    def sequence_tails(self) -> Iterator[tuple[str, memoryview]]:
        """``(name, tail envelope)`` of every sequence tail member, in archive (name) order,
        each checked by every reader rule, the CRC included; reads only the frames after
        the last block's (the order and reference rules are ``scan``'s)."""
        index = self.index
        assert self.geometry is not None
        first = int(index.blocks["frame"].max()) if len(index.blocks) else 1
        for i in range(max(first, 1), index.n_frames - 1):
            frame = memoryview(self._frames.read_frame(i))
            for m in iter_members(frame, i, self._limit):
                found = SEQUENCE_TAIL_NAME.fullmatch(m.name)
                if found:
                    check_member_envelope(m.data, self.geometry, m.name, None)
                    yield found.group(1), m.data

    def read_block(self, block_hash: int) -> bytes:
        """The verbatim envelope of one block, validated; reads only its frame.

        Raises:
            KeyError: the archive holds no such block.
        """
        return self.read_block_checked(block_hash)[0]

    def read_block_checked(self, block_hash: int) -> tuple[bytes, list[str]]:
        """:meth:`read_block`, and what is inconsistent where it looked: the archive's
        findings so far (``strict=False``) and every disagreement between the index and the
        members of the frame it read (a block the index places elsewhere or not at all, an
        index entry with no member, a member that does not parse). The block itself is
        valid by every rule, or this raises as :meth:`read_block` does.
        """
        where = self.index.find(block_hash)
        if where is None:
            raise KeyError(f"block {block_hash:016x} is not in the archive")
        frame_no, offset = where
        if frame_no == 0 or frame_no == self.index.n_frames - 1:
            raise ArchiveError(f"index: block {block_hash:016x} points at frame {frame_no}")
        frame = memoryview(self._frames.read_frame(frame_no))
        member = next(iter_members(frame[offset:], frame_no, self._limit), None)
        if member is None or member.name != block_member(block_hash):
            raise ArchiveError(
                f"index: frame {frame_no} offset {offset} does not hold block {block_hash:016x}"
            )
        assert self.geometry is not None
        check_member_envelope(member.data, self.geometry, member.name, block_hash)
        return bytes(member.data), [*self.findings, *self._frame_findings(frame_no, frame)]

    def _frame_findings(self, frame_no: int, frame: memoryview) -> list[str]:
        """Where the index and frame ``frame_no``'s block members disagree."""
        blocks = self.index.blocks
        mine = blocks[blocks["frame"] == frame_no]
        listed = dict(zip(mine["hash"].tolist(), mine["offset"].tolist()))
        held: dict[int, int] = {}
        findings = []
        try:
            for m in iter_members(frame, frame_no, self._limit):
                name = BLOCK_NAME.fullmatch(m.name)
                if name is not None:
                    held[int(name.group(1), 16)] = m.offset
        except (ArchiveError, EnvelopeError) as exc:
            findings.append(f"frame {frame_no}: {exc}")
        for h, off in listed.items():
            if h not in held:
                findings.append(
                    f"index: block {h:016x} at frame {frame_no} offset {off}: no such member"
                )
            elif held[h] != off:
                findings.append(
                    f"index: block {h:016x} at frame {frame_no} offset {off}, "
                    f"but the member is at offset {held[h]}"
                )
        for h, off in held.items():
            if h not in listed:
                other = self.index.find(h)
                said = "does not list it" if other is None else f"says frame {other[0]}"
                findings.append(
                    f"frame {frame_no} offset {off} holds block {h:016x}: the index {said}"
                )
        return findings

    def scan(
        self, *, partial: bool = False, verify_crc: bool = True, finite: bool = False
    ) -> Iterator[Item]:
        """Every block and sequence, validated, in archive order.

        With ``partial=False`` the first problem raises. With ``partial=True`` a refused
        member, or a frame that does not decompress, is yielded as a ``Problem`` and the
        scan goes on with the next member or frame; a sequence whose blocks were refused
        is refused too. Problems with the index or manifest raise in both modes (they
        are found when the reader opens). ``verify_crc=False`` skips the envelopes' CRCs
        (only for a second pass whose consumer checks them again, as the store does).
        ``finite=True`` applies the finite-values rule too (``envelope.check_finite``, a
        store's rule unless it allows non-finite data) to every block and tail.
        """
        state = _ScanState(self, verify_crc, finite)
        last = self.index.n_frames - 1
        frames = range(1, last)
        for i, data in self._frames.iter_frames(frames, self.threads):
            try:
                if isinstance(data, Exception):
                    raise data
                for member in iter_members(memoryview(data), i, self._limit):
                    try:
                        item = state.member(member)
                    except (ArchiveError, EnvelopeError) as exc:
                        if not partial:
                            raise
                        yield Problem(member.name, exc)
                        continue
                    if item is not None:
                        yield item
            except (ArchiveError, EnvelopeError) as exc:
                if not partial:
                    raise
                state.lost_frame()
                yield Problem(f"frame {i}", exc)
        try:
            state.finish(self._frames.read_frame(last))
        except (ArchiveError, EnvelopeError) as exc:
            if not partial:
                raise
            yield Problem("end of archive", exc)


class _ScanState:
    """The order, reference and count rules across members (ARCHIVE.md 1.1, 5)."""

    def __init__(
        self, reader: ArchiveReader, verify_crc: bool = True, finite: bool = False
    ) -> None:
        self.verify_crc = verify_crc
        self.finite = finite
        self.reader = reader
        self.geometry = reader.geometry
        self.index = reader.index
        self.last_hash = NO_HASH
        self.valid = array("Q")
        self.valid_versions = array("B")
        self.blocks_seen = 0
        self.present: np.ndarray | None = None
        self.present_versions = np.zeros(0, dtype=np.uint8)
        self.last_name = ""
        # (name, hashes, positions, refused) of a record whose tail member comes next
        self.pending: tuple[str, list[int], np.ndarray, bool] | None = None
        self.sequences_seen = 0

    def member(self, m: Member) -> Item | None:
        name = m.name
        if self.pending is not None:
            return self._tail(m)
        found = BLOCK_NAME.fullmatch(name)
        if found:
            return self._block(m, int(found.group(1), 16))
        found = SEQUENCE_JSON_NAME.fullmatch(name)
        if found:
            return self._sequence(m, found.group(1))
        raise ArchiveError(f"member {name!r} out of place (a tail follows its record)")

    def _block(self, m: Member, block_hash: int) -> Item:
        if self.present is not None:
            raise ArchiveError(f"block member {m.name!r} after the sequence records")
        if block_hash <= self.last_hash:
            kind = "duplicate" if block_hash == self.last_hash else "out-of-order"
            raise ArchiveError(f"{kind} block member {m.name!r}")
        self.last_hash = block_hash
        self.blocks_seen += 1
        listed = self.index.find(block_hash)
        if listed != (m.frame, m.offset):
            said = "no entry" if listed is None else f"frame {listed[0]} offset {listed[1]}"
            raise ArchiveError(
                f"{m.name}: found at frame {m.frame} offset {m.offset}, the index has {said}"
            )
        assert self.geometry is not None
        env = check_member_envelope(m.data, self.geometry, m.name, block_hash, self.verify_crc)
        self._check_finite(env, m.name)
        self.valid.append(block_hash)
        self.valid_versions.append(env.version)
        return ArchiveBlock(block_hash, m.data)

    def _check_finite(self, env: Envelope, what: str) -> None:
        if not self.finite:
            return
        try:
            check_finite(env)
        except FormatError as exc:
            raise FormatError(f"{what}: {exc}") from None

    def _sequence(self, m: Member, name: str) -> Item | None:
        if self.present is None:
            self.present = np.array(self.valid, dtype=np.uint64)
            self.present_versions = np.array(self.valid_versions, dtype=np.uint8)
        if name <= self.last_name:
            kind = "duplicate" if name == self.last_name else "out-of-order"
            raise ArchiveError(f"{kind} sequence member {m.name!r}")
        self.last_name = name
        self.sequences_seen += 1
        hashes, tail = parse_sequence_json(m.data, name)
        positions, missing = find_positions(self.present, hashes)
        if tail:
            # The tail member is consumed even when the record is refused.
            self.pending = (name, hashes, positions, missing is not None)
        if missing is not None:
            raise ArchiveError(f"{m.name}: block {missing:016x} is not in the archive")
        if tail:
            return None
        version = sequence_version(m.name, self.present_versions, positions, None)
        return ArchiveSequence(name, hashes, None, version)

    def _tail(self, m: Member) -> Item | None:
        assert self.pending is not None
        name, hashes, positions, refused = self.pending
        self.pending = None
        if m.name != tail_member(name):
            raise ArchiveError(f"expected {tail_member(name)!r}, found {m.name!r}")
        assert self.geometry is not None
        env = check_member_envelope(m.data, self.geometry, m.name, None, self.verify_crc)
        self._check_finite(env, m.name)
        if refused:
            return None
        version = sequence_version(m.name, self.present_versions, positions, env.version)
        return ArchiveSequence(name, hashes, m.data, version)

    def lost_frame(self) -> None:
        """A frame could not be read (partial mode)."""
        self.pending = None

    def finish(self, eoa: bytes) -> None:
        """The end-of-archive frame and the count rules."""
        if eoa != END_OF_ARCHIVE:
            raise ArchiveError("the last data frame is not the end-of-archive marker")
        if self.pending is not None:
            raise ArchiveError(f"sequence {self.pending[0]!r}: its tail member is missing")
        m = self.reader.manifest
        if self.blocks_seen != m.blocks or self.sequences_seen != m.sequences:
            raise ArchiveError(
                f"manifest counts {m.blocks} blocks and {m.sequences} sequences; the archive "
                f"holds {self.blocks_seen} and {self.sequences_seen}"
            )
