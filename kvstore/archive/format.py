"""The tlkv archive format over the container of ``_zstdtar``: manifest, member names, sequence
records, the streaming writer and the streaming validator (ARCHIVE.md, sections 1 and 5).

Pure: it takes a geometry and iterables of envelopes and never touches the store. The
validator holds one frame (a few MiB) plus eight bytes per block at a time, whatever the
archive's size, and checks every envelope by every reader rule against the manifest.
"""

from __future__ import annotations

import json
import os
import re
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np

from ..codec.envelope import decode
from ..codec.geometry import Geometry
from ..codec.layout import NO_HASH, SUPPORTED_VERSIONS, U32_MAX, U64_MAX
from ..errors import (
    ArchiveError,
    EnvelopeError,
    FormatError,
    UnsafeArchiveError,
    UnsupportedVersionError,
)
from ..protocol import HASH_HEX_REGEX, SEQUENCE_NAME_REGEX, check_sequence_name, is_hash_hex
from .zstdtar import (
    END_OF_ARCHIVE,
    TAR_BLOCK,
    FrameReader,
    FrameWriter,
    Member,
    iter_members,
    member_size,
    padded,
)

ARCHIVE_FORMAT = "tlkv-archive"
ARCHIVE_VERSION = 1
MANIFEST_NAME = "manifest.json"
BLOCK_NAME = re.compile(rf"blocks/({HASH_HEX_REGEX})\.tlkv")
SEQUENCE_JSON_NAME = re.compile(rf"sequences/({SEQUENCE_NAME_REGEX})\.json")
SEQUENCE_TAIL_NAME = re.compile(rf"sequences/({SEQUENCE_NAME_REGEX})\.tail\.tlkv")
MANIFEST_KEYS = ("archive_version", "blocks", "format", "geometry", "sequences", "tool")
GEOMETRY_KEYS = tuple(sorted(Geometry.FIELDS))
SEQUENCE_KEYS = ("hashes", "name", "tail")
TOOL_NAME = re.compile(r"[ -~]{1,64}")

MAX_MANIFEST_BYTES = 1 << 16
MAX_SEQUENCE_BYTES = 1 << 24  # about 880,000 hashes: far beyond any context length
MAX_BLOCK_BYTES = 1 << 26  # the largest single-block envelope an archive may hold
FRAME_TARGET = 4 << 20  # the writer starts a new frame rather than grow one past this
DEFAULT_LEVEL = 3


def tool_version() -> str:
    """The ``tool`` string of the manifest: ``tlkv <version>``."""
    from .._version import __version__

    return f"tlkv {__version__}"


def canonical_json(obj: Any) -> bytes:
    """The one serialization a manifest or sequence record may have (ARCHIVE.md 1.2)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return (text + "\n").encode("ascii")


def _strict_json(data: Any, what: str, limit: int) -> Any:
    raw = bytes(data)
    if len(raw) > limit:
        raise UnsafeArchiveError(f"{what}: {len(raw)} bytes exceeds the limit of {limit}")
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ArchiveError(f"{what}: not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ArchiveError(f"{what}: expected a JSON object")
    try:
        canonical = canonical_json(obj)
    except (TypeError, ValueError):
        canonical = b""
    if canonical != raw:
        raise ArchiveError(f"{what}: not in canonical form (sorted keys, no spaces, one \\n)")
    return obj


def _is_int(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def block_member(block_hash: int) -> str:
    """Member name of a block: ``blocks/<16 lowercase hex>.tlkv``."""
    return f"blocks/{block_hash:016x}.tlkv"


def sequence_member(name: str) -> str:
    """Member name of a sequence record."""
    return f"sequences/{name}.json"


def tail_member(name: str) -> str:
    """Member name of a sequence's tail envelope."""
    return f"sequences/{name}.tail.tlkv"


def _escapes(name: str) -> bool:
    parts = name.replace("\\", "/").split("/")
    return name.startswith(("/", "\\")) or ".." in parts or ":" in name


@dataclass(frozen=True)
class Manifest:
    """The first member: format version, geometry, member counts and the writing tool."""

    geometry: Geometry | None
    blocks: int
    sequences: int
    tool: str = field(default_factory=tool_version)
    archive_version: int = ARCHIVE_VERSION

    def to_dict(self) -> dict[str, Any]:
        """The manifest as a JSON-ready dict."""
        g = self.geometry
        return {
            "archive_version": self.archive_version,
            "blocks": self.blocks,
            "format": ARCHIVE_FORMAT,
            "geometry": None if g is None else g.as_dict(),
            "sequences": self.sequences,
            "tool": self.tool,
        }

    def to_json(self) -> bytes:
        """The canonical bytes of ``manifest.json``."""
        return canonical_json(self.to_dict())

    @classmethod
    def from_json(cls, data: Any) -> Manifest:
        """Parse and check ``manifest.json`` (ARCHIVE.md 1.2).

        Raises:
            UnsupportedVersionError: another archive_version.
            ArchiveError: anything else malformed.
        """
        obj = _strict_json(data, MANIFEST_NAME, MAX_MANIFEST_BYTES)
        if obj.get("format") != ARCHIVE_FORMAT:
            raise ArchiveError(f"manifest: format must be {ARCHIVE_FORMAT!r}")
        version = obj.get("archive_version")
        if version != ARCHIVE_VERSION:
            raise UnsupportedVersionError(
                f"manifest: archive_version {version!r}; this reader reads {ARCHIVE_VERSION}"
            )
        if tuple(sorted(obj)) != MANIFEST_KEYS:
            raise ArchiveError(f"manifest: keys must be {MANIFEST_KEYS}, found {sorted(obj)}")
        for key in ("blocks", "sequences"):
            if not _is_int(obj[key], 0, U32_MAX):
                raise ArchiveError(f"manifest: {key} must be an integer in 0..{U32_MAX}")
        if not isinstance(obj["tool"], str) or not TOOL_NAME.fullmatch(obj["tool"]):
            raise ArchiveError("manifest: tool must be 1-64 printable ASCII characters")
        g = obj["geometry"]
        geometry = None
        if g is None:
            if obj["blocks"] or obj["sequences"]:
                raise ArchiveError("manifest: geometry is null but the archive is not empty")
        else:
            if not isinstance(g, dict) or tuple(sorted(g)) != GEOMETRY_KEYS:
                raise ArchiveError(f"manifest: geometry must have the keys {GEOMETRY_KEYS}")
            if not all(_is_int(g[k], 1, U32_MAX) for k in GEOMETRY_KEYS):
                raise ArchiveError(f"manifest: geometry values must be in 1..{U32_MAX}")
            geometry = Geometry.from_dict(g)
        return cls(geometry, obj["blocks"], obj["sequences"], obj["tool"], version)

    def max_envelope(self) -> int:
        """The largest single-block envelope the geometry allows (either version)."""
        if self.geometry is None:
            return 0
        return max(self.geometry.envelope_bytes(1, v) for v in SUPPORTED_VERSIONS)


@dataclass(frozen=True)
class SequenceRecord:
    """A named KV state: its full blocks' hashes in order and its tail envelope (or None)."""

    name: str
    hashes: Sequence[int]
    tail: Any = None

    def to_json(self) -> bytes:
        """The canonical bytes of ``sequences/<name>.json``."""
        return canonical_json(
            {
                "hashes": [f"{h:016x}" for h in self.hashes],
                "name": self.name,
                "tail": self.tail is not None,
            }
        )


def parse_sequence_json(data: Any, name: str) -> tuple[list[int], bool]:
    """``(hashes, has_tail)`` of a sequence record named ``name`` (ARCHIVE.md 1.4)."""
    what = sequence_member(name)
    obj = _strict_json(data, what, MAX_SEQUENCE_BYTES)
    if tuple(sorted(obj)) != SEQUENCE_KEYS:
        raise ArchiveError(f"{what}: keys must be {SEQUENCE_KEYS}, found {sorted(obj)}")
    if obj["name"] != name:
        raise ArchiveError(f"{what}: records the name {obj['name']!r}")
    hashes, tail = obj["hashes"], obj["tail"]
    if not isinstance(tail, bool) or not isinstance(hashes, list):
        raise ArchiveError(f"{what}: hashes must be a list and tail a boolean")
    if not all(map(is_hash_hex, hashes)):
        raise ArchiveError(f"{what}: every hash must be 16 lowercase hex digits")
    values = [int(h, 16) for h in hashes]
    if NO_HASH in values:
        raise ArchiveError(f"{what}: hash 0 (no hash) cannot name a full block")
    if not values and not tail:
        raise ArchiveError(f"{what}: a sequence has at least one block or a tail")
    return values, tail


def _check_single(
    env_bytes: Any, geometry: Geometry, what: str, want_hash: int | None, verify_crc: bool = True
) -> Any:
    """Decode a single-block envelope by every reader rule; its hash must be ``want_hash``
    (or 0 for a tail, ``want_hash=None``)."""
    try:
        env = decode(env_bytes, geometry, verify_crc=verify_crc)
    except EnvelopeError as exc:
        raise type(exc)(f"{what}: {exc}") from None
    if len(env) != 1:
        raise FormatError(f"{what}: holds {len(env)} blocks; a member holds exactly one")
    found = int(env.hashes[0])
    if want_hash is None:
        if found != NO_HASH:
            raise ArchiveError(f"{what}: a tail's block hash must be 0, found {found:016x}")
    elif found != want_hash:
        raise ArchiveError(f"{what}: the envelope's block hash is {found:016x}")
    return env


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

    Raises:
        ValueError: the inputs break an ordering, count or reference rule.
        EnvelopeError: an envelope fails a reader rule (the archive would be refused).
    """
    if geometry is None and (n_blocks or n_sequences):
        raise ValueError("an archive with blocks or sequences needs a geometry")
    manifest = Manifest(geometry, n_blocks, n_sequences)
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
            env = _check_single(envelope, geometry, block_member(block_hash), block_hash)
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
                tail_env = _check_single(record.tail, geometry, tail_member(record.name), None)
                tail_version = tail_env.version
            _sequence_version(
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


def find_positions(present: np.ndarray, hashes: Sequence[int]) -> tuple[np.ndarray, int | None]:
    """Positions of ``hashes`` in the sorted array ``present``, and the first hash that is
    not there (or None)."""
    wanted = np.asarray(hashes, dtype=np.uint64)
    if not len(wanted):
        return np.zeros(0, dtype=np.intp), None
    if not len(present):
        return np.zeros(0, dtype=np.intp), int(wanted[0])
    pos = np.searchsorted(present, wanted)
    pos[pos >= len(present)] = 0
    ok = present[pos] == wanted
    if bool(ok.all()):
        return pos, None
    return pos, int(wanted[int(np.argmin(ok))])


def _sequence_version(
    what: str, versions: np.ndarray, positions: np.ndarray, tail_version: int | None
) -> int:
    """The one format version of a sequence's blocks and tail (ARCHIVE.md rule R12)."""
    found = set(np.unique(versions[positions]).tolist()) if len(positions) else set()
    if tail_version is not None:
        found.add(tail_version)
    if len(found) != 1:
        raise ArchiveError(f"{what}: blocks and tail mix format versions {sorted(found)}")
    return int(found.pop())


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

    def __init__(self, path: str | os.PathLike[str], *, threads: int = 0) -> None:
        self.path = os.fspath(path)
        self.threads = threads
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
            raise ArchiveError(
                f"index lists {len(index.blocks)} blocks, the manifest {manifest.blocks}"
            )
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
        if _escapes(name):
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

    def read_block(self, block_hash: int) -> bytes:
        """The verbatim envelope of one block, validated; reads only its frame.

        Raises:
            KeyError: the archive holds no such block.
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
        _check_single(member.data, self.geometry, member.name, block_hash)
        return bytes(member.data)

    def scan(self, *, partial: bool = False, verify_crc: bool = True) -> Iterator[Item]:
        """Every block and sequence, validated, in archive order.

        With ``partial=False`` the first problem raises. With ``partial=True`` a refused
        member, or a frame that does not decompress, is yielded as a ``Problem`` and the
        scan goes on with the next member or frame; a sequence whose blocks were refused
        is refused too. Problems with the index or manifest raise in both modes (they
        are found when the reader opens). ``verify_crc=False`` skips the envelopes' CRCs
        (only for a second pass whose consumer checks them again, as the store does).
        """
        state = _ScanState(self, verify_crc)
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

    def __init__(self, reader: ArchiveReader, verify_crc: bool = True) -> None:
        self.verify_crc = verify_crc
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
        env = _check_single(m.data, self.geometry, m.name, block_hash, self.verify_crc)
        self.valid.append(block_hash)
        self.valid_versions.append(env.version)
        return ArchiveBlock(block_hash, m.data)

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
        version = _sequence_version(m.name, self.present_versions, positions, None)
        return ArchiveSequence(name, hashes, None, version)

    def _tail(self, m: Member) -> Item | None:
        assert self.pending is not None
        name, hashes, positions, refused = self.pending
        self.pending = None
        if m.name != tail_member(name):
            raise ArchiveError(f"expected {tail_member(name)!r}, found {m.name!r}")
        assert self.geometry is not None
        env = _check_single(m.data, self.geometry, m.name, None, self.verify_crc)
        if refused:
            return None
        version = _sequence_version(m.name, self.present_versions, positions, env.version)
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


__all__ = [
    "ARCHIVE_FORMAT",
    "ARCHIVE_VERSION",
    "ArchiveBlock",
    "ArchiveReader",
    "ArchiveSequence",
    "Item",
    "Manifest",
    "Problem",
    "SequenceRecord",
    "WriteSummary",
    "write_archive",
]
