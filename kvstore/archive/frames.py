"""The frame layer of an archive: the tar stream cut into independent zstd frames, and the
seek index in a zstd skippable frame at the end (ARCHIVE.md 3-4).

Reading is strict: a frame must declare its size and checksum, and nothing is decompressed
before its declared size has been checked against the index; frames are decompressed
ahead (reading) and compressed behind (writing) on a thread pool.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np
import zstandard

from ..codec.checksum import crc32c
from ..errors import ArchiveError, TruncatedArchiveError, UnsafeArchiveError
from ..pipeline import OrderedPipeline
from .sources import FileSource, Source, open_source, read_exact
from .tar import TAR_BLOCK, member_prefix, member_size, padding

# --- zstd frames (RFC 8878) ---------------------------------------------------------------

ZSTD_FRAME_MAGIC = b"\x28\xb5\x2f\xfd"  # 0xFD2FB528 little-endian (RFC 8878 3.1.1)
# Skippable frame: u32 magic 0x184D2A5?, u32 frame size (RFC 8878 3.1.2).
SKIPPABLE_HEADER = struct.Struct("<II")
INDEX_SKIPPABLE_MAGIC = 0x184D2A5B
# A frame's window may not exceed this (the decompressor refuses larger ones).
MAX_WINDOW_SIZE = 1 << 27

# --- the seek index (ARCHIVE.md 4) ----------------------------------------------------------

# skippable magic, frame size S, u16 index version, u16 reserved (0), u32 n_frames, u32 n_blocks
INDEX_HEADER = struct.Struct("<IIHHII")
INDEX_VERSION = 1
# per data frame: u32 compressed size, u32 decompressed size
INDEX_FRAME = struct.Struct("<II")
# per block member (per model in member order, ascending hash): u64 hash, u32 frame,
# u32 offset of its tar header in the frame
INDEX_BLOCK = struct.Struct("<QII")
INDEX_BLOCK_DTYPE = np.dtype([("hash", "<u8"), ("frame", "<u4"), ("offset", "<u4")])
assert INDEX_BLOCK_DTYPE.itemsize == INDEX_BLOCK.size
# u32 crc32c of the index frame before the footer, u32 S again, 8-byte magic
INDEX_FOOTER = struct.Struct("<II8s")
INDEX_MAGIC = b"TLKVSEEK"
U32_MAX = 0xFFFFFFFF


# --- the seek index -------------------------------------------------------------------------


@dataclass
class Index:
    """The seek index: every data frame's sizes and every block member's position."""

    comp_sizes: np.ndarray  # u4 per frame
    decomp_sizes: np.ndarray  # u4 per frame
    blocks: np.ndarray  # INDEX_BLOCK_DTYPE: per model, in member order, ascending hash
    # where each model's entries start, plus the end (one model: the whole table)
    runs: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def set_runs(self, counts: Sequence[int]) -> None:
        """Cut the block table into the models' runs of ``counts`` entries (ARCHIVE.md 4),
        each strictly ascending by hash.

        Raises:
            ArchiveError: the counts do not add up, or a run is not strictly ascending.
        """
        if sum(counts) != len(self.blocks):
            raise ArchiveError(f"index lists {len(self.blocks)} blocks, the manifest {sum(counts)}")
        runs = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(np.asarray(counts, dtype=np.int64), out=runs[1:])
        hashes = self.blocks["hash"]
        rising = hashes[1:] > hashes[:-1]
        rising[runs[1:-1][(runs[1:-1] > 0) & (runs[1:-1] < len(hashes))] - 1] = True
        if not bool(np.all(rising)):
            raise ArchiveError("index: block hashes are not strictly ascending")
        self.runs = runs

    def run(self, model: int = 0) -> slice:
        """The entries of the ``model``-th model (all of them before ``set_runs``)."""
        if not len(self.runs):
            return slice(0, len(self.blocks))
        return slice(int(self.runs[model]), int(self.runs[model + 1]))

    @property
    def n_frames(self) -> int:
        """Number of data frames."""
        return len(self.comp_sizes)

    @property
    def offsets(self) -> np.ndarray:
        """File offset of every data frame, plus the index frame's offset at the end."""
        out = np.zeros(self.n_frames + 1, dtype=np.uint64)
        np.cumsum(self.comp_sizes, dtype=np.uint64, out=out[1:])
        return out

    @property
    def data_bytes(self) -> int:
        """Decompressed bytes of every data frame together (the tar stream's length)."""
        return int(self.decomp_sizes.sum(dtype=np.uint64))

    def find(self, block_hash: int, model: int = 0) -> tuple[int, int] | None:
        """``(frame, offset)`` of a block member of the ``model``-th model, or None."""
        entries = self.blocks[self.run(model)]
        hashes = entries["hash"]
        i = int(np.searchsorted(hashes, np.uint64(block_hash)))
        if i < len(hashes) and int(hashes[i]) == block_hash:
            return int(entries["frame"][i]), int(entries["offset"][i])
        return None


def encode_index(
    frames: Sequence[tuple[int, int]], blocks: Sequence[tuple[int, int, int]]
) -> bytes:
    """The index skippable frame for data frames ``(comp, decomp)`` and blocks
    ``(hash, frame, offset)`` (ascending hash)."""
    size = (
        INDEX_HEADER.size
        - SKIPPABLE_HEADER.size
        + len(frames) * INDEX_FRAME.size
        + len(blocks) * INDEX_BLOCK.size
        + INDEX_FOOTER.size
    )
    header = INDEX_HEADER.pack(
        INDEX_SKIPPABLE_MAGIC, size, INDEX_VERSION, 0, len(frames), len(blocks)
    )
    frame_table = np.array(list(frames), dtype="<u4").reshape(-1, 2)
    block_table = np.array(list(blocks), dtype=INDEX_BLOCK_DTYPE)
    parts = [header, frame_table.tobytes(), block_table.tobytes()]
    body = b"".join(parts)
    return body + INDEX_FOOTER.pack(crc32c(body), size, INDEX_MAGIC)


def read_index(source: Source | int, file_size: int) -> Index:
    """Locate, check and parse the index frame at the end of the file (ARCHIVE.md 4);
    ``source`` is a :class:`~kvstore.archive.sources.Source` or a file descriptor."""
    if isinstance(source, int):
        source = FileSource(fd=source)
    min_size = INDEX_HEADER.size + INDEX_FOOTER.size
    if file_size < min_size:
        raise TruncatedArchiveError(
            f"archive is {file_size} bytes, shorter than an empty index ({min_size}): truncated"
        )
    crc, size, magic = INDEX_FOOTER.unpack(
        read_exact(source, INDEX_FOOTER.size, file_size - INDEX_FOOTER.size, "index footer")
    )
    if magic != INDEX_MAGIC:
        raise TruncatedArchiveError(
            f"rule 'the file ends with the index magic {INDEX_MAGIC!r}' failed at offset "
            f"{file_size - 8}: found {magic!r} (truncated, or not a tlkv archive)"
        )
    start = file_size - SKIPPABLE_HEADER.size - size
    if start < 0 or size < min_size - SKIPPABLE_HEADER.size:
        raise ArchiveError(f"index footer: frame size {size} does not fit a {file_size}-byte file")
    raw = bytes(read_exact(source, size + SKIPPABLE_HEADER.size, start, "index frame"))
    body = memoryview(raw)[: -INDEX_FOOTER.size]
    if crc32c(body) != crc:
        raise ArchiveError(
            f"index frame at offset {start}: CRC-32C expected {crc32c(body):#010x}, "
            f"found {crc:#010x}"
        )
    smagic, size2, version, reserved, n_frames, n_blocks = INDEX_HEADER.unpack_from(raw, 0)
    if smagic != INDEX_SKIPPABLE_MAGIC or size2 != size or reserved != 0:
        raise ArchiveError(f"index frame at offset {start}: malformed skippable header")
    if version != INDEX_VERSION:
        raise ArchiveError(f"index frame: expected index version {INDEX_VERSION}, found {version}")
    expected = (
        INDEX_HEADER.size
        + n_frames * INDEX_FRAME.size
        + n_blocks * INDEX_BLOCK.size
        + INDEX_FOOTER.size
    )
    if expected != len(raw):
        raise ArchiveError(
            f"index frame: {n_frames} frames and {n_blocks} blocks need {expected} bytes, "
            f"found {len(raw)}"
        )
    pos = INDEX_HEADER.size
    frames = np.frombuffer(raw, dtype="<u4", count=2 * n_frames, offset=pos).reshape(-1, 2)
    pos += n_frames * INDEX_FRAME.size
    blocks = np.frombuffer(raw, dtype=INDEX_BLOCK_DTYPE, count=n_blocks, offset=pos)
    index = Index(frames[:, 0], frames[:, 1], blocks)
    if int(index.comp_sizes.sum(dtype=np.uint64)) != start:
        raise ArchiveError(
            f"index: the data frames' sizes add up to {int(index.comp_sizes.sum())} bytes, "
            f"but the index frame starts at offset {start}"
        )
    if n_blocks and int(blocks["frame"].max()) >= n_frames:
        raise ArchiveError("index: a block entry names a frame that does not exist")
    return index


# --- reading frames -----------------------------------------------------------------------

_local = threading.local()


def _dctx() -> zstandard.ZstdDecompressor:
    ctx = getattr(_local, "dctx", None)
    if ctx is None:
        ctx = _local.dctx = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW_SIZE)
    return ctx


class FrameReader:
    """Reads and decompresses the data frames of an archive file, checked against its index.

    Every frame must be a zstd frame that declares its content size (equal to the index's,
    at most ``max_frame_bytes``) and a content checksum, with a bounded window; it is
    decompressed in one call into a buffer of exactly that size.
    """

    def __init__(self, path: str | os.PathLike[str], max_frame_bytes: int) -> None:
        self.source = open_source(path)
        try:
            self.file_size = self.source.size
            self.index = read_index(self.source, self.file_size)
        except BaseException:
            self.source.close()
            raise
        self.offsets = self.index.offsets
        self.max_frame_bytes = max_frame_bytes

    def close(self) -> None:
        """Close the file."""
        self.source.close()

    def __enter__(self) -> FrameReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check_sizes(self, i: int) -> None:
        """The index's sizes of frame ``i`` are within limits (before reading anything)."""
        decomp = int(self.index.decomp_sizes[i])
        if decomp > self.max_frame_bytes:
            raise UnsafeArchiveError(
                f"frame {i}: declares {decomp} decompressed bytes, more than the "
                f"{self.max_frame_bytes} this archive's geometry allows"
            )
        if decomp == 0 or decomp % TAR_BLOCK:
            raise ArchiveError(f"frame {i}: {decomp} bytes is not a positive multiple of 512")

    def read_frame(self, i: int) -> bytes:
        """Decompress data frame ``i`` after checking its header against the index."""
        self.check_sizes(i)
        offset = int(self.offsets[i])
        comp = int(self.index.comp_sizes[i])
        decomp = int(self.index.decomp_sizes[i])
        where = f"frame {i} at offset {offset}"
        raw = read_exact(self.source, comp, offset, where)
        if bytes(raw[:4]) != ZSTD_FRAME_MAGIC:
            raise ArchiveError(f"{where}: not a zstd frame (magic {bytes(raw[:4]).hex()})")
        try:
            params = zstandard.get_frame_parameters(raw)
        except zstandard.ZstdError as exc:
            raise ArchiveError(f"{where}: bad zstd frame header: {exc}") from None
        if params.content_size != decomp:
            raise ArchiveError(
                f"{where}: frame header declares {params.content_size} bytes, the index {decomp}"
            )
        if not params.has_checksum:
            raise ArchiveError(f"{where}: the zstd frame has no content checksum")
        if params.window_size > MAX_WINDOW_SIZE:
            raise UnsafeArchiveError(
                f"{where}: zstd window of {params.window_size} bytes exceeds {MAX_WINDOW_SIZE}"
            )
        try:
            data = _dctx().decompress(raw, max_output_size=decomp, allow_extra_data=False)
        except zstandard.ZstdError as exc:
            raise ArchiveError(f"{where}: zstd: {exc}") from None
        if len(data) != decomp:
            raise ArchiveError(f"{where}: decompressed to {len(data)} bytes, expected {decomp}")
        return data

    def iter_frames(
        self, frames: Sequence[int], threads: int = 0, budget: int = 64 << 20
    ) -> Iterator[tuple[int, bytes | ArchiveError]]:
        """``(i, data or the error)`` for the given frames, in order, decompressed ahead on a
        thread pool with at most ``budget`` decompressed bytes in flight."""
        if threads <= 0:
            threads = min(4, os.cpu_count() or 1)
        if threads == 1 or len(frames) <= 1:
            for i in frames:
                yield i, self._read_or_error(i)
            return
        todo = iter(frames)
        with (
            ThreadPoolExecutor(threads, thread_name_prefix="tlkv-unzstd") as pool,
            OrderedPipeline[bytes | ArchiveError](
                pool, max_pending=2 * threads, max_weight=budget
            ) as pipeline,
        ):
            nxt = next(todo, None)
            while nxt is not None or len(pipeline):
                while nxt is not None and pipeline.has_room(size := self._frame_size(nxt)):
                    pipeline.submit(nxt, self._read_or_error, nxt, weight=size)
                    nxt = next(todo, None)
                yield pipeline.take()

    def _frame_size(self, i: int) -> int:
        return max(1, int(self.index.decomp_sizes[i]))

    def _read_or_error(self, i: int) -> bytes | ArchiveError:
        try:
            return self.read_frame(i)
        except ArchiveError as exc:
            return exc


# --- writing frames -------------------------------------------------------------------------


class FrameWriter:
    """Packs tar members into frames of about ``target`` bytes (never splitting a member),
    compresses the frames on a thread pool, and writes them in order, then the index.

    ``add`` keeps a reference to the member's data (any buffer) until its frame has been
    compressed, so the buffer must stay valid until ``finish`` returns (the store's
    snapshot guarantees that for the whole write); ``release`` is then called with the
    frame's buffers.
    """

    def __init__(
        self,
        out: BinaryIO,
        *,
        level: int = 3,
        threads: int = 0,
        target: int = 4 << 20,
        on_frame: Callable[[int, int], None] | None = None,
        release: Callable[[list[Any]], None] | None = None,
    ) -> None:
        self.out = out
        self.level = level
        self.threads = threads if threads > 0 else (os.cpu_count() or 1)
        self.target = target
        self.on_frame = on_frame
        self.release = release
        self._parts: list[Any] = []
        self._size = 0
        self._blocks_here: list[tuple[int, int]] = []
        self.frames: list[tuple[int, int]] = []
        self.blocks: list[tuple[int, int, int]] = []
        self.bytes_written = 0
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="tlkv-zstd")
        self._pending = OrderedPipeline[list[bytes]](self._pool, max_pending=2 * self.threads)
        self._local = threading.local()

    def _cctx(self) -> zstandard.ZstdCompressor:
        ctx = getattr(self._local, "cctx", None)
        if ctx is None:
            ctx = self._local.cctx = zstandard.ZstdCompressor(
                level=self.level, write_checksum=True, write_content_size=True
            )
        return ctx

    def _compress(self, parts: list[Any]) -> list[bytes]:
        # Streamed part by part into one frame: no joined copy of the frame (a fresh 4 MiB
        # buffer per frame, page-faulted in), the same frame header (content size first).
        size = sum(memoryview(p).nbytes for p in parts)
        cobj = self._cctx().compressobj(size=size)
        out = [cobj.compress(p) for p in parts]
        out.append(cobj.flush())
        return [c for c in out if c]

    def add(self, name: str, data: Any, block_hash: int | None = None) -> None:
        """Append one member; ``block_hash`` records it in the index."""
        size = memoryview(data).nbytes
        total = member_size(name, size)
        if self._size and self._size + total > self.target:
            self.seal()
        if block_hash is not None:
            self._blocks_here.append((block_hash, self._size))
        self._parts += [member_prefix(name, size), data, padding(size)]
        self._size += total

    def seal(self) -> None:
        """End the current frame (the next member starts a new one)."""
        if not self._size:
            return
        index = len(self.frames) + len(self._pending)
        blocks = [(h, index, off) for h, off in self._blocks_here]
        while not self._pending.has_room():
            self._drain_one()
        self._pending.submit((self._size, blocks, self._parts), self._compress, self._parts)
        self._parts, self._size, self._blocks_here = [], 0, []

    def add_raw_frame(self, data: bytes) -> None:
        """Append a frame holding exactly ``data`` (e.g. the end-of-archive marker)."""
        self.seal()
        self._parts, self._size = [data], len(data)
        self.seal()

    def _drain_one(self) -> None:
        (size, blocks, parts), chunks = self._pending.take()
        if self.release is not None:
            self.release(parts)
        n = 0
        for chunk in chunks:
            self.out.write(chunk)
            n += len(chunk)
        self.bytes_written += n
        self.frames.append((n, size))
        self.blocks.extend(blocks)
        if self.on_frame is not None:
            self.on_frame(size, len(blocks))

    def finish(self) -> int:
        """Seal, write every pending frame and the index; returns the archive's size."""
        self.seal()
        while len(self._pending):
            self._drain_one()
        self._pool.shutdown()
        index = encode_index(self.frames, self.blocks)
        self.out.write(index)
        self.bytes_written += len(index)
        return self.bytes_written

    def abort(self) -> None:
        """Drop pending work (after an error)."""
        self._pending.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)
