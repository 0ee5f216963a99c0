"""Archive benchmarks: create, restore, extract and peak memory, against tar and zstd.

A store of 2 MiB v1 blocks (geometry 16, 32, 8, 128): 1,024 blocks (2 GiB), or 128
(256 MiB) with --quick. ``tlkv archive create``/``restore`` run as subprocesses (their
peak RSS is read with ``os.wait4``); the baselines run in the same session over the same
envelopes: ``tar -I 'zstd -3 -T0' -cf`` over the envelopes as files, and
``zstd -dc FILE | tar -x`` into a directory followed by a ``sync`` of every extracted file
and directory (a durable baseline, as restore's commit is), alternating with ours, best
of two rounds each (one with --quick). Restore includes full validation and a durable
(fsynced) commit; the durable-write speed of the disk (``dd conv=fdatasync``) is
reported beside it.
Set TLKV_BENCH_DIR to choose the scratch directory (default: the system temp dir).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_common import Row

from kvstore import Block, Geometry, crc32c, encode
from kvstore.archive.operations import extract
from kvstore.codec.layout import HEADER_SIZE, RECORD, TRAILER, TRAILER_SIZE
from kvstore.store.store import Store

GEOMETRY = Geometry(16, 32, 8, 128)
REPO = Path(__file__).resolve().parent.parent
RSS_LIMIT_MIB = 256
VARIANTS = 16  # distinct payloads, rotated: no two neighbours share bytes
EXTRACT_SAMPLES = 25
ROUNDS = 2


def _envelopes(n: int) -> list[bytes]:
    """``VARIANTS`` distinct single-block envelopes, re-hashed per block by ``_rehash``."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(VARIANTS):
        kv = rng.standard_normal(GEOMETRY.kv_shape).astype(np.float16)
        out.append(encode(GEOMETRY, [Block(i + 1, GEOMETRY.block_tokens, kv)]))
    return out


def _rehash(template: bytes, block_hash: int) -> bytes:
    buf = bytearray(template)
    RECORD.pack_into(buf, HEADER_SIZE, block_hash, GEOMETRY.block_tokens)
    TRAILER.pack_into(buf, len(buf) - TRAILER_SIZE, crc32c(memoryview(buf)[:-TRAILER_SIZE]))
    return bytes(buf)


def _hashes(n: int) -> list[int]:
    rnd = random.Random(1)
    return sorted({rnd.getrandbits(64) | 1 for _ in range(n)})[:n]


def _build(root: Path, n: int) -> tuple[Path, Path, list[int]]:
    """The store and the same envelopes as files (``files/blocks/<hash>.tlkv``)."""
    store_dir, files = root / "store", root / "files"
    (files / "blocks").mkdir(parents=True)
    templates = _envelopes(n)
    hashes = _hashes(n)
    with Store(store_dir, geometry=GEOMETRY) as store:
        batch: list[bytes] = []
        for i, h in enumerate(hashes):
            env = _rehash(templates[i % VARIANTS], h)
            (files / "blocks" / f"{h:016x}.tlkv").write_bytes(env)
            batch.append(env)
            if len(batch) == 32:
                store.import_batch(blocks=batch)
                batch = []
        if batch:
            store.import_batch(blocks=batch)
    subprocess.run(["sync"], check=True)
    return store_dir, files, hashes


# Runs ``tlkv`` and reports its own peak RSS (VmHWM of its address space: getrusage would
# also count the pages of this big parent process, which the child inherits at spawn).
_TLKV = (
    "import sys\n"
    "from kvstore.cli import main\n"
    "rc = main(sys.argv[1:])\n"
    "hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM'))\n"
    "sys.stderr.write('VmHWM ' + hwm.split()[1] + '\\n')\n"
    "sys.exit(rc)\n"
)


def _run(cmd: list[str] | str) -> tuple[float, float]:
    """Wall seconds of one command (a shell pipeline when a str; ``tlkv ...`` when it
    starts with "tlkv"), after a ``sync`` so earlier writes do not slow it down; and the
    peak RSS in MiB of a tlkv command."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    tlkv = isinstance(cmd, list) and cmd[0] == "tlkv"
    if tlkv:
        cmd = [sys.executable, "-c", _TLKV, *cmd[1:]]
    subprocess.run(["sync"], check=True)
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd, shell=isinstance(cmd, str), env=env, stderr=subprocess.PIPE, text=True
    )
    seconds = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{cmd} exited {proc.returncode}: {proc.stderr[-2000:]}")
    rss = 0.0
    if tlkv:
        rss = int(proc.stderr.rsplit("VmHWM ", 1)[1].split()[0]) / 1024
    return seconds, rss


def _mbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e6:.0f} MB/s"


def run(args: argparse.Namespace) -> list[Row]:
    n = 128 if args.quick else 1024
    base = Path(os.environ.get("TLKV_BENCH_DIR", tempfile.gettempdir()))
    root = Path(tempfile.mkdtemp(prefix="tlkv-bench-archive-", dir=base))
    rows: list[Row] = []
    try:
        store_dir, files, hashes = _build(root, n)
        total = sum(f.stat().st_size for f in (files / "blocks").iterdir())
        archive = root / "a.tlkv.tar.zst"
        tar_out = root / "b.tar.zst"

        # Ours and the baseline alternate ROUNDS times; each keeps its best time (the
        # machine may be shared), and peak RSS is the worst seen.
        rounds = 1 if args.quick else ROUNDS
        t_tar = t_create = t_untar = t_restore = float("inf")
        rss_create = rss_restore = 0.0
        untar, target = root / "untar", root / "restored"
        for _ in range(rounds):
            t, _ = _run(
                ["tar", "-I", "zstd -3 -T0", "-cf", str(tar_out), "-C", str(files), "blocks"]
            )
            t_tar = min(t_tar, t)
            create = ["tlkv", "archive", "create", "--data", str(store_dir), "-o", str(archive)]
            t, rss = _run([*create, "--quiet"])
            t_create, rss_create = min(t_create, t), max(rss_create, rss)
        for _ in range(rounds):
            untar.mkdir()
            t, _ = _run(
                f"zstd -q -dc {archive} | tar -x -C {untar} && find {untar} -exec sync -- {{}} +"
            )
            t_untar = min(t_untar, t)
            shutil.rmtree(untar)
            t, rss = _run(
                ["tlkv", "archive", "restore", str(archive), "--data", str(target), "--quiet"]
            )
            t_restore, rss_restore = min(t_restore, t), max(rss_restore, rss)
            shutil.rmtree(target)
        ratio = t_tar / t_create
        rows.append(
            Row(
                f"create, {n} x 2 MiB blocks",
                _mbps(total, t_create),
                f"tar -I 'zstd -3 -T0' {_mbps(total, t_tar)}",
                ratio,
                ">= 0.9x",
                ratio >= 0.9,
            )
        )
        size = archive.stat().st_size
        rows.append(
            Row(
                "archive size",
                f"{size / 2**20:.0f} MiB",
                f"tar.zst {tar_out.stat().st_size / 2**20:.0f} MiB",
                total / size,
                "(compression ratio)",
            )
        )
        ratio = t_untar / t_restore
        rows.append(
            Row(
                "restore (validate + durable commit)",
                _mbps(total, t_restore),
                f"zstd -dc, tar -x, sync {_mbps(total, t_untar)}",
                ratio,
                ">= 0.8x",
                ratio >= 0.8,
            )
        )
        t_verify, rss_verify = _run(["tlkv", "archive", "verify", str(archive), "--quiet"])
        t_unzstd, _ = _run(f"zstd -q -dc {archive} > /dev/null")
        rows.append(
            Row(
                "verify",
                _mbps(total, t_verify),
                f"zstd -dc > /dev/null {_mbps(total, t_unzstd)}",
                t_unzstd / t_verify,
            )
        )
        sync_file = root / "dd.out"
        t_dd, _ = _run(f"dd if={archive} of={sync_file} bs=4M conv=fdatasync status=none")
        sync_file.unlink()
        rows.append(
            Row(
                "disk: durable write (dd conv=fdatasync)",
                _mbps(size, t_dd),
                "(ceiling of a durable restore)",
            )
        )

        out = root / "one.tlkv"
        rnd = random.Random(2)
        samples = []
        for h in rnd.sample(hashes, min(EXTRACT_SAMPLES, len(hashes))):
            t0 = time.perf_counter()
            extract(archive, h, out)
            samples.append(time.perf_counter() - t0)
        ms = statistics.median(samples) * 1e3
        rows.append(
            Row(
                "extract one block (library)",
                f"{ms:.1f} ms",
                f"max {max(samples) * 1e3:.1f} ms",
                None,
                "<= 50 ms",
                ms <= 50,
            )
        )
        for name, rss in (("create", rss_create), ("restore", rss_restore), ("verify", rss_verify)):
            rows.append(
                Row(
                    f"peak RSS, {name} ({total / 2**30:.2f} GiB)",
                    f"{rss:.0f} MiB",
                    "",
                    None,
                    f"<= {RSS_LIMIT_MIB} MiB",
                    rss <= RSS_LIMIT_MIB,
                )
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows
