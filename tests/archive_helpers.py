"""Builders shared by the archive tests: populated stores, store snapshots, and hand-made
(hostile) archives assembled member by member and frame by frame."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zstandard
from conftest import SMALL, make_envelope

from kvstore import Geometry, decode, split
from kvstore.archive.frames import encode_index
from kvstore.archive.manifest import BLOCK_NAME, Manifest, canonical_json
from kvstore.archive.sequences import SequenceRecord
from kvstore.archive.tar import END_OF_ARCHIVE, member_prefix, padding

LONG_NAME = "agent-" + "x" * 110  # > 100 bytes as a member name: needs a pax header


def populate(store: Any, seed: int = 0) -> None:
    """Blocks of both format versions and four sequences (tail, no tail, v2, long name)."""
    for i in range(4):
        store.put(make_envelope(SMALL, 4 * 6, seed=seed * 100 + i))
    store.put(make_envelope(SMALL, 4 * 3, version=2, seed=seed * 100 + 50))
    store.put_sequence("chat-1", make_envelope(SMALL, 4 * 5 + 3, seed=seed * 100 + 60))
    store.put_sequence("chat-2", make_envelope(SMALL, 4 * 4, seed=seed * 100 + 61))
    store.put_sequence("v2-seq", make_envelope(SMALL, 4 * 2 + 1, version=2, seed=seed * 100 + 62))
    store.put_sequence(LONG_NAME, make_envelope(SMALL, 4 * 2 + 2, seed=seed * 100 + 63))


def snapshot(store: Any) -> dict[str, Any]:
    """Everything observable about a store's content, to compare before and after."""
    with store.reader() as r:
        blocks = {h: hashlib.sha256(bytes(v)).hexdigest() for h, v in r.iter_blocks()}
    seqs = {n: store.get_sequence(n) for n in store.sequences()}
    stats = store.stats()
    keep = ("blocks", "bytes", "pinned_blocks", "sequences", "corrupt")
    return {"blocks": blocks, "sequences": seqs, "stats": {k: stats[k] for k in keep}}


# --- a writer running beside create --------------------------------------------------------

LIVE_FULL = 3  # full blocks of each live sequence (plus a one-token tail)


def live_sequence(k: int) -> bytes:
    """The envelope the live writer puts as sequence ``live-<k>``: unique blocks per k."""
    return make_envelope(SMALL, 4 * LIVE_FULL + 1, seed=10_000 + k)


def live_hashes(k: int) -> list[int]:
    """The full blocks' hashes of ``live_sequence(k)``."""
    return [int(h) for h in decode(live_sequence(k)).hashes[:LIVE_FULL]]


# --- hand-made archives -----------------------------------------------------------------


@dataclass
class Raw:
    """One member to craft: name and data, with an optional replacement header."""

    name: str
    data: bytes
    header: bytes | None = None  # raw bytes replacing the canonical headers
    index_hash: int | None = None  # list it in the index under this hash (a consistent liar)

    def encode(self) -> bytes:
        head = self.header if self.header is not None else member_prefix(self.name, len(self.data))
        return head + self.data + padding(len(self.data))


def valid_members(
    geometry: Geometry = SMALL, n_tokens: int = 4 * 5 + 2, seed: int = 7
) -> tuple[list[Raw], list[Raw], list[Raw]]:
    """(manifest, blocks, sequences) members of a small valid archive."""
    parts = split(make_envelope(geometry, n_tokens, seed=seed))
    tail = parts[-1] if decode(parts[-1]).hashes[0] == 0 else None
    full = [p for p in parts if decode(p).hashes[0] != 0]
    hashes = [int(decode(p).hashes[0]) for p in full]
    blocks = [Raw(f"blocks/{h:016x}.tlkv", p) for h, p in sorted(zip(hashes, full))]
    record = SequenceRecord("s", hashes, tail)
    seqs = [Raw("sequences/s.json", record.to_json())]
    if tail is not None:
        seqs.append(Raw("sequences/s.tail.tlkv", tail))
    manifest = [Raw("manifest.json", Manifest(geometry, len(blocks), 1).to_json())]
    return manifest, blocks, seqs


def valid_own_members(
    geometry: Geometry = SMALL, seed: int = 7
) -> tuple[list[Raw], list[Raw], list[Raw]]:
    """(manifest, blocks, sequences) members of a small valid version-4 archive: the v2
    sequence ``s`` keeps its first block of its own (``sequences/s.0.tlkv``), because the
    archive's block of that hash is its v1 copy; its other two blocks are referenced."""
    v1 = split(make_envelope(geometry, 4 * 3 + 2, version=1, seed=seed))
    v2 = split(make_envelope(geometry, 4 * 3 + 2, version=2, seed=seed))
    hashes = [int(decode(p).hashes[0]) for p in v2[:3]]
    stored = [v1[0], *v2[1:3]]
    blocks = [Raw(f"blocks/{h:016x}.tlkv", p) for h, p in sorted(zip(hashes, stored))]
    record = SequenceRecord("s", hashes, v2[3], [(0, v2[0])])
    seqs = [
        Raw("sequences/s.json", record.to_json()),
        Raw("sequences/s.0.tlkv", v2[0]),
        Raw("sequences/s.tail.tlkv", v2[3]),
    ]
    manifest = Manifest(geometry, len(blocks), 1, archive_version=4, own_blocks=1)
    return [Raw("manifest.json", manifest.to_json())], blocks, seqs


def manifest_member(
    geometry: Geometry | None, blocks: int, sequences: int, **extra: Any
) -> list[Raw]:
    """A frame holding a manifest with these counts (and extra or replaced keys)."""
    obj = Manifest(geometry, blocks, sequences).to_dict()
    obj.update(extra)
    return [Raw("manifest.json", canonical_json(obj))]


def compress(data: bytes, **kw: Any) -> bytes:
    kw.setdefault("write_checksum", True)
    kw.setdefault("write_content_size", True)
    return zstandard.ZstdCompressor(level=3, **kw).compress(data)


def craft(
    path: Path,
    frames: Sequence[Sequence[Raw] | bytes],
    *,
    end: bool = True,
    index_blocks: list[tuple[int, int, int]] | None = None,
    raw_frames: dict[int, tuple[bytes, int]] | None = None,
) -> Path:
    """Write an archive from frames of members (or raw decompressed bytes), adding the
    end-of-archive frame and a matching index. ``raw_frames[i] = (compressed bytes,
    decompressed size for the index)`` replaces frame i's compressed form."""
    contents: list[bytes] = []
    blocks: list[tuple[int, int, int]] = []
    for i, frame in enumerate(frames):
        if isinstance(frame, bytes):
            contents.append(frame)
            continue
        offset = 0
        chunks = []
        for m in frame:
            found = BLOCK_NAME.fullmatch(m.name)
            if m.index_hash is not None:
                blocks.append((m.index_hash, i, offset))
            elif found:
                blocks.append((int(found.group(1), 16), i, offset))
            enc = m.encode()
            chunks.append(enc)
            offset += len(enc)
        contents.append(b"".join(chunks))
    if end:
        contents.append(END_OF_ARCHIVE)
    table = []
    with open(path, "wb") as f:
        for i, content in enumerate(contents):
            if raw_frames and i in raw_frames:
                comp, size = raw_frames[i]
            else:
                comp, size = compress(content), len(content)
            f.write(comp)
            table.append((len(comp), size))
        blocks.sort()
        f.write(encode_index(table, index_blocks if index_blocks is not None else blocks))
    return path


def frame_bounds(path: Path) -> list[tuple[int, int]]:
    """``(offset, size)`` of every frame of an archive, the index frame last."""
    from kvstore.archive.frames import read_index

    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        index = read_index(fd, size)
    finally:
        os.close(fd)
    offsets = index.offsets.tolist()
    bounds = [(offsets[i], int(index.comp_sizes[i])) for i in range(index.n_frames)]
    bounds.append((offsets[-1], size - offsets[-1]))
    return bounds


# --- running tlkv in a subprocess ---------------------------------------------------------

REPO = Path(__file__).resolve().parent.parent

# Runs the tlkv CLI and reports the peak RSS of its own address space (VmHWM). getrusage
# in the parent would also count the pages the child inherits from the test process.
_TLKV = (
    "import sys\n"
    "from kvstore.cli import main\n"
    "rc = main(sys.argv[1:])\n"
    "hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM'))\n"
    "sys.stderr.write('VmHWM ' + hwm.split()[1] + '\\n')\n"
    "sys.exit(rc)\n"
)


@dataclass
class Ran:
    """A finished ``tlkv`` run: exit code, output, and peak RSS in MiB."""

    code: int
    out: str
    err: str
    peak_mib: float


def run_tlkv(*args: str, timeout: float = 120) -> Ran:
    """``python -m kvstore ARGS`` (through a wrapper that reports its VmHWM)."""
    import subprocess
    import sys

    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", _TLKV, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    err, _, hwm = proc.stderr.rpartition("VmHWM ")
    return Ran(proc.returncode, proc.stdout, err, int(hwm.split()[0]) / 1024 if hwm else 0.0)
