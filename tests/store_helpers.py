"""Builders and invariant checks shared by the store's test files (test_store*.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
from conftest import SMALL, make_blocks

import kvstore.store.diskformat as L
from kvstore import Block, Geometry, Store, decode, encode
from kvstore.store.debug import raw_snapshot

REPO = Path(__file__).resolve().parent.parent
SINGLE = SMALL.envelope_bytes(1)  # bytes of one stored SMALL v1 block


def elsewhere(code: str, *args: str) -> str:
    """Run ``code`` in another Python process (``sys.argv[1:]`` = ``args``, the repository
    the working directory); its stdout."""
    ran = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr
    return ran.stdout


def full_blocks(geometry: Geometry, n: int, seed: int) -> list[Block]:
    """``n`` full blocks of one chain (random tokens and KV)."""
    return make_blocks(geometry, n * geometry.block_tokens, seed)


def one_block_envelopes(n: int, seed: int = 0, geometry: Geometry = SMALL) -> list[bytes]:
    """``n`` single-block envelopes of distinct blocks."""
    return [encode(geometry, [b]) for b in full_blocks(geometry, n, seed)]


def hashes_of(envelope: bytes) -> list[int]:
    return list(decode(envelope).hashes.tolist())


def check_consistency(s: Store) -> None:
    """Every on-disk invariant: block index, byte count, pins, LRU order."""
    with raw_snapshot(s) as (txn, dbs):
        blocks = {bytes(k): len(v) for k, v in txn.cursor(db=dbs.blocks)}
        seqs = {bytes(k): bytes(v) for k, v in txn.cursor(db=dbs.seqs)}
        refs = {bytes(k): L.REFCOUNT.unpack(v)[0] for k, v in txn.cursor(db=dbs.refs)}
        atime = {bytes(k): bytes(v) for k, v in txn.cursor(db=dbs.atime)}
        lru = [bytes(k) for k in txn.cursor(db=dbs.lru).iternext(values=False)]
        meta_bytes = L.counter(txn.get(L.META_BYTES, None, dbs.meta))
        cur = txn.cursor(db=dbs.index)
        dups = list(cur.iternext_dup(keys=False)) if cur.set_key(L.INDEX_KEY) else []
        index = sorted(L.INDEX_VALUE.unpack(v)[0] for v in dups)
    assert index == sorted(L.BLOCK_KEY.unpack(k)[0] for k in blocks)
    assert meta_bytes == sum(blocks.values()) + sum(len(v) for v in seqs.values())
    want: dict[bytes, int] = {}
    for raw in seqs.values():
        parsed = L.parse_sequence(raw, s.geometry)
        assert parsed is not None
        for h in parsed.referenced():
            want[L.BLOCK_KEY.pack(h)] = want.get(L.BLOCK_KEY.pack(h), 0) + 1
    assert refs == want
    unpinned = {k for k in blocks if k not in refs}
    assert set(atime) == unpinned
    lru_pairs = [L.LRU_KEY.unpack(k) for k in lru]
    assert sorted(lru_pairs) == sorted(
        (L.COUNTER.unpack(v)[0], L.BLOCK_KEY.unpack(k)[0]) for k, v in atime.items()
    )


def flip_byte(envelope: bytes, offset: int) -> bytes:
    """``envelope`` with one bit of its byte at ``offset`` flipped."""
    data = bytearray(envelope)
    data[offset] ^= 0x40
    return bytes(data)


def flip_on_disk(path: Path, pattern: bytes, offset_in_pattern: int = 0, once: bool = True) -> None:
    """Flip one bit of ``pattern`` inside ``data.mdb`` (every copy, with ``once=False``:
    LMDB's copy-on-write leaves stale copies of small values in free pages)."""
    data_file = path / "data.mdb"
    data = bytearray(data_file.read_bytes())
    at = data.find(pattern)
    assert at >= 0
    while at >= 0:
        data[at + offset_in_pattern] ^= 0x01
        at = data.find(pattern, at + 1)
        assert not once or at < 0, "pattern must occur exactly once"
    data_file.write_bytes(bytes(data))


def marked_block(marker: float, h: int, n_tokens: int = SMALL.block_tokens) -> Block:
    """A block whose first KV row is ``marker + 0..7``: a byte pattern found once on disk."""
    kv = np.zeros(SMALL.kv_shape, dtype=np.float32)
    kv[0, 0, 0, 0, :] = marker + np.arange(SMALL.head_dim)
    return Block(h, n_tokens, kv)


def marker_bytes(marker: float) -> bytes:
    return (marker + np.arange(SMALL.head_dim)).astype(np.float16).tobytes()
