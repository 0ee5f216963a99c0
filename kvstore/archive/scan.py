"""The streaming checks of an archive's members (ARCHIVE.md 5): the items a scan yields,
and the order, reference and count rules across one model's members (``ArchiveReader.scan``
feeds each member to them; ``ArchiveReader.sequence_parts`` reads a record's members
again through ``SequenceParts``).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..codec.envelope import Envelope, check_finite
from ..codec.geometry import Geometry
from ..codec.layout import NO_HASH
from ..codec.tokens import record_bytes, unpack_records, verify_tokens
from ..errors import ArchiveError, EnvelopeError, FormatError, TokenMismatchError
from .manifest import (
    BLOCK_NAME,
    SEQUENCE_JSON_NAME,
    TOKENS_NAME,
    check_member_envelope,
    sequence_block_member,
    split_member,
    tail_member,
)
from .sequences import find_positions, parse_sequence_json, referenced, sequence_version
from .tar import END_OF_ARCHIVE, Member

if TYPE_CHECKING:
    from .reader import ArchiveReader


@dataclass
class SequenceParts:
    """A sequence record read again with its tail and own block members (``sequence_parts``)."""

    name: str
    hashes: list[int]
    tail: memoryview | None
    own: list[tuple[int, memoryview]]
    positions: list[int]  # the record's own positions

    def envelopes(self) -> list[memoryview]:
        """Its own block and tail envelopes."""
        return [e for _, e in self.own] + ([] if self.tail is None else [self.tail])

    def add(self, m: Member, geometry: Geometry, prefix: str) -> None:
        """Check and keep the member ``m``, which must be this sequence's next one."""
        done = len(self.own)
        if done < len(self.positions):
            p = self.positions[done]
            want = sequence_block_member(self.name, p, prefix)
            if m.name == want:
                check_member_envelope(m.data, geometry, m.name, self.hashes[p])
                self.own.append((p, m.data))
                return
        else:
            want = tail_member(self.name, prefix)
            if m.name == want and self.tail is None:
                check_member_envelope(m.data, geometry, m.name, None)
                self.tail = m.data
                return
        raise ArchiveError(f"expected {want!r}, found {m.name!r}")


@dataclass(frozen=True)
class ArchiveBlock:
    """A validated block member: its hash, its verbatim single-block envelope, and the
    number of its model in the manifest (``ArchiveReader.sections``); ``decoded`` is the
    envelope as the scan decoded it (the restore hands it to the store, which then does
    not decode it again)."""

    hash: int
    envelope: memoryview
    section: int = 0
    decoded: Envelope | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class ArchiveTokens:
    """A validated token member (version 5): the block just before it, its parent's hash
    and token ids (checked: they hash to the block's name)."""

    hash: int
    parent: int
    ids: np.ndarray = field(compare=False, repr=False)
    section: int = 0


@dataclass(frozen=True)
class ArchiveSequence:
    """A validated sequence: name, ordered hashes (all archived), the tail envelope, and
    the format version its blocks and tail share, the number of its model, and the
    blocks it keeps of its own (version 4)."""

    name: str
    hashes: list[int]
    tail: memoryview | None
    version: int
    section: int = 0
    own: tuple[tuple[int, memoryview], ...] = ()  # (position, envelope) of its own blocks


@dataclass(frozen=True)
class Problem:
    """A member or frame refused while reading with ``partial=True``."""

    where: str
    error: Exception

    def __str__(self) -> str:
        return f"{self.where}: {type(self.error).__name__}: {self.error}"


Item = ArchiveBlock | ArchiveTokens | ArchiveSequence | Problem


class Scan:
    """Hands each member to its model's rules: the models' members come in manifest order,
    each model's complete (its counts checked) before the next one's begin."""

    def __init__(
        self, reader: ArchiveReader, verify_crc: bool, finite: bool, partial: bool
    ) -> None:
        self.sections = reader.sections
        self.states = [_ScanState(reader, n, verify_crc, finite) for n in range(len(self.sections))]
        self.current = 0
        self.partial = partial
        self.problems: list[Problem] = []

    def member(self, m: Member) -> Item | None:
        n, rest = split_member(m.name, self.sections)
        if n < self.current:
            raise ArchiveError(
                f"member {m.name!r} out of place (after the members of model {self.current})"
            )
        while self.current < n:
            self._close(self.current)
            self.current += 1
        return self.states[n].member(m, rest)

    def _close(self, n: int) -> None:
        try:
            self.states[n].close()
        except (ArchiveError, EnvelopeError) as exc:
            if not self.partial:
                raise
            self.problems.append(Problem(f"model {self.sections[n].model!r}", exc))

    def take_problems(self) -> list[Problem]:
        """The problems found closing a model (``partial``), once."""
        out, self.problems = self.problems, []
        return out

    def lost_frame(self) -> None:
        """A frame could not be read (partial mode)."""
        self.states[self.current].lost_frame()

    def finish(self, eoa: bytes) -> None:
        """The end-of-archive frame, and the rules of every model not closed yet."""
        if eoa != END_OF_ARCHIVE:
            raise ArchiveError("the last data frame is not the end-of-archive marker")
        for n in range(self.current, len(self.states)):
            self.states[n].close()


class _ScanState:
    """The order, reference and count rules across the members of one model (ARCHIVE.md
    1.1, 5)."""

    def __init__(
        self, reader: ArchiveReader, section: int, verify_crc: bool = True, finite: bool = False
    ) -> None:
        self.verify_crc = verify_crc
        self.finite = finite
        self.reader = reader
        self.section = section
        self.info = reader.sections[section]
        self.geometry = self.info.geometry
        self.index = reader.index
        self.last_hash = NO_HASH
        self.valid = array("Q")
        self.valid_versions = array("B")
        self.blocks_seen = 0
        self.present: np.ndarray | None = None
        self.present_versions = np.zeros(0, dtype=np.uint8)
        self.last_name = ""
        self.own_ok = reader.own_ok
        self.tokens_ok = reader.tokens_ok
        self.last_block: int | None = None  # the block member just before, if valid
        # A record whose own block or tail members come next.
        self.pending: _Pending | None = None
        self.sequences_seen = 0
        self.own_seen = 0

    def member(self, m: Member, rest: str) -> Item | None:
        """Check the member ``m`` (``rest``: its name inside its model's directory)."""
        last, self.last_block = self.last_block, None
        if self.pending is not None:
            return self._part(m)
        found = BLOCK_NAME.fullmatch(rest)
        if found:
            return self._block(m, int(found.group(1), 16))
        found = TOKENS_NAME.fullmatch(rest) if self.tokens_ok else None
        if found:
            return self._tokens(m, int(found.group(1), 16), last)
        found = SEQUENCE_JSON_NAME.fullmatch(rest)
        if found:
            return self._sequence(m, found.group(1))
        raise ArchiveError(
            f"member {m.name!r} out of place (own blocks and a tail follow their record)"
        )

    def _block(self, m: Member, block_hash: int) -> Item:
        if self.present is not None:
            raise ArchiveError(f"block member {m.name!r} after the sequence records")
        if block_hash <= self.last_hash:
            kind = "duplicate" if block_hash == self.last_hash else "out-of-order"
            raise ArchiveError(f"{kind} block member {m.name!r}")
        self.last_hash = block_hash
        self.blocks_seen += 1
        listed = self.index.find(block_hash, self.section)
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
        self.last_block = block_hash
        return ArchiveBlock(block_hash, m.data, self.section, env)

    def _tokens(self, m: Member, block_hash: int, last: int | None) -> Item:
        """A block's token member: right after the block, one record that hashes to it."""
        if block_hash != last:
            raise ArchiveError(f"token member {m.name!r} does not follow its block member")
        assert self.geometry is not None
        if len(m.data) != record_bytes(self.geometry.block_tokens):
            raise ArchiveError(
                f"{m.name}: a token member is one record of "
                f"{record_bytes(self.geometry.block_tokens)} bytes, found {len(m.data)}"
            )
        tokens = unpack_records(m.data, self.geometry.block_tokens)
        try:
            verify_tokens([block_hash], tokens)
        except TokenMismatchError as exc:
            raise TokenMismatchError(f"{m.name}: {exc}", block_hash=block_hash) from None
        return ArchiveTokens(block_hash, int(tokens.parents[0]), tokens.ids[0], self.section)

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
        hashes, tail, own = parse_sequence_json(m.data, name, self.own_ok)
        positions, missing = find_positions(self.present, referenced(hashes, own))
        if own or tail:
            # Its members are consumed even when the record is refused.
            self.pending = _Pending(name, hashes, positions, missing is not None, own, tail)
        if missing is not None:
            raise ArchiveError(f"{m.name}: block {missing:016x} is not in the archive")
        if own or tail:
            return None
        version = sequence_version(m.name, self.present_versions, positions, None)
        return ArchiveSequence(name, hashes, None, version, self.section)

    def _part(self, m: Member) -> Item | None:
        """The next own block or tail member of the pending record."""
        p = self.pending
        assert p is not None and self.geometry is not None
        k = p.next
        p.next += 1
        position = p.positions[k] if k < len(p.positions) else None
        if p.next == len(p.positions) + p.tail:
            self.pending = None
        if position is None:
            want, block_hash = tail_member(p.name, self.info.prefix), None
        else:
            want = sequence_block_member(p.name, position, self.info.prefix)
            block_hash = p.hashes[position]
            self.own_seen += 1
        if m.name != want:
            self.pending = None
            raise ArchiveError(f"expected {want!r}, found {m.name!r}")
        try:
            env = check_member_envelope(m.data, self.geometry, m.name, block_hash, self.verify_crc)
            self._check_finite(env, m.name)
        except (ArchiveError, EnvelopeError):
            p.refused = True
            raise
        if position is not None:
            p.own.append((position, m.data))
            p.versions.append(env.version)
        if self.pending is not None or p.refused:
            return None
        tail = None if position is not None else m.data
        tail_version = None if tail is None else env.version
        version = sequence_version(m.name, self.present_versions, p.found, tail_version, p.versions)
        return ArchiveSequence(p.name, p.hashes, tail, version, self.section, tuple(p.own))

    def lost_frame(self) -> None:
        """A frame could not be read (partial mode)."""
        self.pending = None

    def close(self) -> None:
        """The model's members are over: a pending tail and the count rules."""
        if self.pending is not None:
            raise ArchiveError(f"sequence {self.pending.name!r}: its members are missing")
        m = self.info
        if (
            self.blocks_seen != m.blocks
            or self.sequences_seen != m.sequences
            or self.own_seen != m.own_blocks
        ):
            where = f" for model {m.model!r}" if m.prefix else ""
            raise ArchiveError(
                f"manifest counts {m.blocks} blocks, {m.sequences} sequences and "
                f"{m.own_blocks} own blocks{where}; the archive holds {self.blocks_seen}, "
                f"{self.sequences_seen} and {self.own_seen}"
            )


@dataclass
class _Pending:
    """A sequence record whose own block members (``positions``, ascending) and tail
    member come next: what it references, and the own members checked so far."""

    name: str
    hashes: list[int]
    found: np.ndarray  # where its referenced hashes are among the archive's blocks
    refused: bool
    positions: list[int]
    tail: bool
    next: int = 0  # how many of its members were checked
    own: list[tuple[int, memoryview]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
