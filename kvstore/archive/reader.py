"""The streaming archive reader and validator (ARCHIVE.md 5.2): every member checked by every
reader rule against the manifest, holding one frame (a few MiB) plus eight bytes per block
at a time whatever the archive's size; single blocks read through the seek index.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np

from ..codec.geometry import Geometry
from ..codec.tokens import record_bytes
from ..errors import (
    ArchiveError,
    EnvelopeError,
    TokenMismatchError,
    UnsafeArchiveError,
)
from .frames import FrameReader
from .manifest import (
    ARCHIVE_VERSION_OWN,
    ARCHIVE_VERSION_TOKENS,
    BLOCK_NAME,
    FRAME_TARGET,
    MANIFEST_NAME,
    MAX_BLOCK_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_SEQUENCE_BYTES,
    SEQUENCE_BLOCK_NAME,
    SEQUENCE_JSON_NAME,
    SEQUENCE_TAIL_NAME,
    TOKENS_NAME,
    Manifest,
    Section,
    block_member,
    check_member_envelope,
    escapes,
    sequence_block_member,
    sequence_member,
    split_member,
    tail_member,
    tokens_member,
)
from .scan import Item, Problem, Scan, SequenceParts
from .sequences import parse_sequence_json
from .tar import END_OF_ARCHIVE, TAR_BLOCK, iter_members, member_size, padded

# --- reading ------------------------------------------------------------------------------


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
        self.own_ok = manifest.archive_version >= ARCHIVE_VERSION_OWN
        self.tokens_ok = manifest.archive_version >= ARCHIVE_VERSION_TOKENS
        self.sections: tuple[Section, ...] = manifest.sections()
        self._env_max = [x.max_envelope() for x in self.sections]
        env_max = manifest.max_envelope()
        if env_max > MAX_BLOCK_BYTES:
            big = self.sections[self._env_max.index(env_max)]
            raise UnsafeArchiveError(
                f"manifest: geometry {big.geometry} (model {big.model!r}) means "
                f"{env_max}-byte blocks, more than the {MAX_BLOCK_BYTES} an archive may hold"
            )
        self.env_max = env_max
        biggest = max(padded(env_max), padded(MAX_SEQUENCE_BYTES), FRAME_TARGET)
        self._frames.max_frame_bytes = biggest + 4 * TAR_BLOCK
        if len(self.sections) > 1:
            index.set_runs([x.blocks for x in self.sections])  # a model's entries are a run
        else:
            index.set_runs([len(index.blocks)])
        if len(index.blocks) != manifest.blocks:
            found = f"index lists {len(index.blocks)} blocks, the manifest {manifest.blocks}"
            if self.strict:
                raise ArchiveError(found)
            self.findings.append(found)
        bound = member_size(MANIFEST_NAME, MAX_MANIFEST_BYTES) + len(END_OF_ARCHIVE)
        for x, env in zip(self.sections, self._env_max):
            bound += x.blocks * member_size(block_member(1, x.prefix), env) + x.sequences * (
                member_size(sequence_member("x" * 128, x.prefix), MAX_SEQUENCE_BYTES)
                + member_size(tail_member("x" * 128, x.prefix), env)
            )
            longest = sequence_block_member("x" * 128, 10**10 - 1, x.prefix)
            bound += x.own_blocks * member_size(longest, env)
            if self.tokens_ok and x.geometry is not None:
                size = record_bytes(x.geometry.block_tokens)
                bound += x.blocks * member_size(tokens_member(1, x.prefix), size)
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
        if name == MANIFEST_NAME:
            raise ArchiveError(f"duplicate member {name!r}")
        n, rest = split_member(name, self.sections)
        if BLOCK_NAME.fullmatch(rest) or SEQUENCE_TAIL_NAME.fullmatch(rest):
            return self._env_max[n]
        if self.own_ok and SEQUENCE_BLOCK_NAME.fullmatch(rest):
            return self._env_max[n]
        geometry = self.sections[n].geometry
        if self.tokens_ok and geometry is not None and TOKENS_NAME.fullmatch(rest):
            return record_bytes(geometry.block_tokens)
        if SEQUENCE_JSON_NAME.fullmatch(rest):
            return MAX_SEQUENCE_BYTES
        if escapes(name):
            raise UnsafeArchiveError(f"member name {name!r} would escape the destination")
        raise UnsafeArchiveError(f"unexpected member name {name!r}")

    @property
    def geometry(self) -> Geometry | None:
        """The archive's geometry (None for an empty archive, or one of several models)."""
        return self.manifest.geometry

    def section_of(self, model: str) -> int:
        """The number of the model ``model`` in this archive.

        Raises:
            KeyError: the archive holds no such model.
        """
        for n, x in enumerate(self.sections):
            if x.model == model:
                return n
        raise KeyError(f"the archive holds no model {model!r}")

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

    def _record_frames(self) -> list[int]:
        """The data frames that may hold sequence members: all but those strictly inside
        one model's run of block frames (and, for one model, those before its last)."""
        index = self.index
        keep = np.ones(index.n_frames, dtype=bool)
        keep[0] = keep[-1] = False
        frames = index.blocks["frame"]
        for n in range(len(self.sections)):
            run = frames[index.run(n)]
            if len(run):
                low = 0 if len(self.sections) == 1 else int(run.min()) + 1
                keep[low : int(run.max())] = False
        return np.flatnonzero(keep).tolist()

    def sequence_records(self) -> Iterator[tuple[str, list[int], bool]]:
        """``(name, hashes, has_tail)`` of every sequence record (of every model), reading
        only the frames after the blocks' (the blocks are not checked: see ``scan``)."""
        for name, hashes, tail, _, _ in self.model_sequence_records():
            yield name, hashes, tail

    def model_sequence_records(self) -> Iterator[tuple[str, list[int], bool, int, list[int]]]:
        """``(name, hashes, has_tail, model number, own positions)`` of every sequence
        record, reading only the frames that may hold records (the blocks are not checked:
        see ``scan``)."""
        for i in self._record_frames():
            frame = memoryview(self._frames.read_frame(i))
            for m in iter_members(frame, i, self._limit):
                n, rest = split_member(m.name, self.sections)
                found = SEQUENCE_JSON_NAME.fullmatch(rest)
                if found:
                    hashes, tail, own = parse_sequence_json(m.data, found.group(1), self.own_ok)
                    yield found.group(1), hashes, tail, n, own

    def sequence_parts(self, section: int = 0) -> Iterator[SequenceParts]:
        """Every sequence record of the ``section``-th model with its tail and own block
        members, in archive (name) order; each of those members is checked by every
        reader rule, the CRC included, an own block's hash against its record. Reads only
        the frames from its model's last block's on (the order, reference and count rules
        are ``scan``'s)."""
        index = self.index
        geometry = self.sections[section].geometry
        assert geometry is not None
        before = index.blocks["frame"][: index.run(section).stop]
        first = int(before.max()) if len(before) else 1
        parts: SequenceParts | None = None
        for i in range(max(first, 1), index.n_frames - 1):
            frame = memoryview(self._frames.read_frame(i))
            for m in iter_members(frame, i, self._limit):
                n, rest = split_member(m.name, self.sections)
                if n > section:
                    break
                if n < section or BLOCK_NAME.fullmatch(rest):
                    continue
                found = SEQUENCE_JSON_NAME.fullmatch(rest)
                if found:
                    if parts is not None:
                        yield parts
                    name = found.group(1)
                    hashes, _, own = parse_sequence_json(m.data, name, self.own_ok)
                    parts = SequenceParts(name, hashes, None, [], own)
                    continue
                if parts is None:
                    raise ArchiveError(f"{m.name!r} before its sequence record")
                parts.add(m, geometry, self.sections[section].prefix)
            else:
                continue
            break
        if parts is not None:
            yield parts

    def read_block(self, block_hash: int, section: int = 0) -> bytes:
        """The verbatim envelope of one block of the ``section``-th model, validated; reads
        only its frame.

        Raises:
            KeyError: the archive holds no such block.
        """
        return self.read_block_checked(block_hash, section)[0]

    def read_block_checked(self, block_hash: int, section: int = 0) -> tuple[bytes, list[str]]:
        """:meth:`read_block`, and what is inconsistent where it looked: the archive's
        findings so far (``strict=False``) and every disagreement between the index and the
        members of the frame it read (a block the index places elsewhere or not at all, an
        index entry with no member, a member that does not parse). The block itself is
        valid by every rule, or this raises as :meth:`read_block` does.
        """
        where = self.index.find(block_hash, section)
        if where is None:
            raise KeyError(f"block {block_hash:016x} is not in the archive")
        prefix = self.sections[section].prefix
        frame_no, offset = where
        if frame_no == 0 or frame_no == self.index.n_frames - 1:
            raise ArchiveError(f"index: block {block_hash:016x} points at frame {frame_no}")
        frame = memoryview(self._frames.read_frame(frame_no))
        member = next(iter_members(frame[offset:], frame_no, self._limit), None)
        if member is None or member.name != block_member(block_hash, prefix):
            raise ArchiveError(
                f"index: frame {frame_no} offset {offset} does not hold block {block_hash:016x}"
            )
        geometry = self.sections[section].geometry
        assert geometry is not None
        check_member_envelope(member.data, geometry, member.name, block_hash)
        return bytes(member.data), [*self.findings, *self._frame_findings(frame_no, frame)]

    def _frame_findings(self, frame_no: int, frame: memoryview) -> list[str]:
        """Where the index and frame ``frame_no``'s block members disagree."""
        blocks = self.index.blocks
        here = np.flatnonzero(blocks["frame"] == frame_no)
        runs = self.index.runs
        models = np.searchsorted(runs[1:], here, side="right").tolist() if len(runs) else []
        listed = dict(
            zip(zip(models, blocks["hash"][here].tolist()), blocks["offset"][here].tolist())
        )
        held: dict[tuple[int, int], int] = {}
        findings = []
        try:
            for m in iter_members(frame, frame_no, self._limit):
                n, rest = split_member(m.name, self.sections)
                name = BLOCK_NAME.fullmatch(rest)
                if name is not None:
                    held[n, int(name.group(1), 16)] = m.offset
        except (ArchiveError, EnvelopeError) as exc:
            findings.append(f"frame {frame_no}: {exc}")
        for key, off in listed.items():
            h = key[1]
            if key not in held:
                findings.append(
                    f"index: block {h:016x} at frame {frame_no} offset {off}: no such member"
                )
            elif held[key] != off:
                findings.append(
                    f"index: block {h:016x} at frame {frame_no} offset {off}, "
                    f"but the member is at offset {held[key]}"
                )
        for key, off in held.items():
            if key not in listed:
                h = key[1]
                other = self.index.find(h, key[0])
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
        state = Scan(self, verify_crc, finite, partial)
        last = self.index.n_frames - 1
        frames = range(1, last)
        for i, data in self._frames.iter_frames(frames, self.threads):
            try:
                if isinstance(data, Exception):
                    raise data
                for member in iter_members(memoryview(data), i, self._limit):
                    try:
                        item = state.member(member)
                    except (ArchiveError, EnvelopeError, TokenMismatchError) as exc:
                        if not partial:
                            raise
                        yield from state.take_problems()
                        yield Problem(member.name, exc)
                        continue
                    yield from state.take_problems()
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
