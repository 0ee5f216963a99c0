"""A 1 GiB archive of 2 MiB blocks: restored and re-created by ``tlkv`` subprocesses whose
peak RSS stays under 256 MiB, and re-creating it gives back the same bytes."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from archive_helpers import run_tlkv

from kvstore import Block, Geometry, crc32c, encode
from kvstore.archive.writer import write_archive
from kvstore.codec.layout import HEADER_SIZE, RECORD, TRAILER, TRAILER_SIZE
from kvstore.store.store import Store

GEOMETRY = Geometry(16, 32, 8, 128)  # a 2 MiB v1 payload per block
N_BLOCKS = 512  # 1 GiB of envelopes
RSS_LIMIT_MIB = 256
VARIANTS = 8


def _blocks() -> tuple[list[int], list[bytes]]:
    rng = np.random.default_rng(0)
    templates = [
        encode(GEOMETRY, [Block(1, 16, rng.standard_normal(GEOMETRY.kv_shape).astype(np.float16))])
        for _ in range(VARIANTS)
    ]
    rnd = random.Random(0)
    hashes = sorted({rnd.getrandbits(64) | 1 for _ in range(N_BLOCKS)})
    return hashes, templates


def _envelope(template: bytes, block_hash: int) -> bytes:
    buf = bytearray(template)
    RECORD.pack_into(buf, HEADER_SIZE, block_hash, GEOMETRY.block_tokens)
    TRAILER.pack_into(buf, len(buf) - TRAILER_SIZE, crc32c(memoryview(buf)[:-TRAILER_SIZE]))
    return bytes(buf)


@pytest.mark.slow
def test_one_gib_restore_and_create_in_bounded_memory(tmp_path: Path) -> None:
    hashes, templates = _blocks()
    source = tmp_path / "big.tlkv.tar.zst"
    with open(source, "wb") as out:
        summary = write_archive(
            out,
            GEOMETRY,
            ((h, _envelope(templates[i % VARIANTS], h)) for i, h in enumerate(hashes)),
            [],
            n_blocks=len(hashes),
            n_sequences=0,
        )
    assert summary.data_bytes > 1 << 30

    ran = run_tlkv("archive", "restore", str(source), "--data", str(tmp_path / "store"))
    assert ran.code == 0, ran.err
    assert ran.peak_mib <= RSS_LIMIT_MIB, f"restore peak RSS {ran.peak_mib:.0f} MiB"

    with Store(tmp_path / "store") as store:
        assert store.stats()["blocks"] == N_BLOCKS
        for i in (0, 1, N_BLOCKS // 2, N_BLOCKS - 1):
            assert store.get(hashes[i]) == _envelope(templates[i % VARIANTS], hashes[i])

    again = tmp_path / "again.tlkv.tar.zst"
    ran = run_tlkv("archive", "create", "--data", str(tmp_path / "store"), "-o", str(again))
    assert ran.code == 0, ran.err
    assert ran.peak_mib <= RSS_LIMIT_MIB, f"create peak RSS {ran.peak_mib:.0f} MiB"
    assert again.stat().st_size == source.stat().st_size
    with open(source, "rb") as a, open(again, "rb") as b:
        while True:
            x, y = a.read(1 << 24), b.read(1 << 24)
            assert x == y
            if not x:
                break
