"""Object-store tier benchmarks, against obstore's raw concurrent calls in the same run.

moto's S3 server runs as a subprocess on a loopback port (a real S3 API; its Python
server is the bottleneck, which both sides share). Blocks are 2 MiB v1 envelopes
(geometry 16, 32, 8, 128); every figure is the median of three rounds (one with --quick),
ours and the baseline alternating, and the spread (min-max) is printed:

- read-through: ``Store.get_many`` of 128 blocks on a fresh store whose tier holds them
  (fetch, every reader rule + CRC, the blocks as ``bytes``; the durable local insert
  runs behind, on the filler thread) vs obstore's own ``get_async`` of the same 128
  objects, 16 in flight, left in obstore's buffers;
- upload drain: 1 GiB (512 blocks; 128 with --quick) put into a store whose tier bucket
  does not exist yet, then timed from the bucket's creation until the pending set is
  empty; and the same puts with the uploader running, timed from the first put until
  drained; both vs a raw concurrent put of as many objects (``put_new_many``); the latter
  also vs the same durable local puts on a store without a tier run beside a raw
  concurrent put of the same objects (the same work on the same two cores, without the
  tier's own code: moto's Python server shares the CPU with the local commits);
- archive create to ``s3://`` vs create to a local file + a raw multipart upload of it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import obstore
from bench_common import Row
from ports import free_port

from kvstore import Block, Geometry, Store, crc32c, encode
from kvstore.archive.operations import create
from kvstore.codec.layout import HEADER_SIZE, RECORD, TRAILER, TRAILER_SIZE
from kvstore.tier import ObjectClient, block_key

GEOMETRY = Geometry(16, 32, 8, 128)
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench-secret",
    "AWS_REGION": "us-east-1",
}
TARGET = 0.8


class _Moto:
    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import socket

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("moto did not start")

    def bucket(self, name: str) -> str:
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint).create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def _blocks(n: int, seed: int) -> list[bytes]:
    """``n`` distinct 2 MiB single-block envelopes (16 payloads, re-hashed per block)."""
    rng = np.random.default_rng(seed)
    templates = []
    for i in range(16):
        kv = rng.standard_normal(GEOMETRY.kv_shape).astype(np.float16)
        templates.append(encode(GEOMETRY, [Block(i + 1, GEOMETRY.block_tokens, kv)]))
    out = []
    for i in range(n):
        buf = bytearray(templates[i % 16])
        h = (seed << 40) + i + 1
        RECORD.pack_into(buf, HEADER_SIZE, h, GEOMETRY.block_tokens)
        TRAILER.pack_into(buf, len(buf) - TRAILER_SIZE, crc32c(memoryview(buf)[:-TRAILER_SIZE]))
        out.append(bytes(buf))
    return out


def _hash(block: bytes) -> int:
    return int(RECORD.unpack_from(block, HEADER_SIZE)[0])


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _row(name: str, nbytes: int, ours: list[float], base: list[float], what: str) -> Row:
    o, b = statistics.median(ours), statistics.median(base)
    ratio = b / o
    mib = nbytes / 2**20

    def spread(ts: list[float]) -> str:
        return f"{mib / max(ts):.0f}-{mib / min(ts):.0f}"

    return Row(
        name,
        f"{mib / o:.0f} MiB/s ({spread(ours)})",
        f"{what} {mib / b:.0f} MiB/s ({spread(base)})",
        ratio,
        f">= {TARGET}x",
        ratio >= TARGET,
    )


def run(args: argparse.Namespace) -> list[Row]:
    os.environ.update(CREDENTIALS)
    rounds = 1 if args.quick else 3
    scratch = Path(
        tempfile.mkdtemp(prefix="tlkv-bench-tier-", dir=os.environ.get("TLKV_BENCH_DIR"))
    )
    moto = _Moto()
    os.environ["AWS_ENDPOINT_URL"] = moto.endpoint
    rows = []
    try:
        rows.append(_read_through(moto, scratch, rounds))
        rows.extend(_drain(moto, scratch, rounds, 128 if args.quick else 512))
        rows.append(_archive(moto, scratch, rounds))
    finally:
        moto.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    return rows


def _read_through(moto: _Moto, scratch: Path, rounds: int) -> Row:
    url = f"s3://{moto.bucket('bench-read')}/t"
    blocks = _blocks(128, seed=1)
    hashes = [_hash(b) for b in blocks]
    client = ObjectClient(url)
    client.put_new_many([(block_key("default", h), b) for h, b in zip(hashes, blocks)])
    keys = [block_key("default", h) for h in hashes]

    loop = asyncio.new_event_loop()  # a long-lived loop on a thread, as the tier's own
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def raw_get() -> list[object]:  # obstore alone: 16 in flight, left in its buffers
        async def all_of() -> list[object]:
            sem = asyncio.Semaphore(16)

            async def one(key: str) -> object:
                async with sem:
                    result = await obstore.get_async(client.store, key)
                    return await result.bytes_async()

            return await asyncio.gather(*(one(k) for k in keys))

        return asyncio.run_coroutine_threadsafe(all_of(), loop).result()

    ours, base = [], []
    for r in range(rounds):
        path = scratch / f"read-{r}"

        def read_through() -> None:
            with Store(path, tier=url) as store:  # noqa: B023
                got: list[bytes | None] = []
                ours.append(_timed(lambda: got.extend(store.get_many(hashes))))
                assert got == blocks and store.wait_uploaded(60)
                assert store.stats()["blocks"] == 128
            shutil.rmtree(path)  # noqa: B023

        for step in (read_through, lambda: base.append(_timed(raw_get)))[:: 1 - 2 * (r % 2)]:
            step()  # alternating which goes first
    loop.call_soon_threadsafe(loop.stop)
    return _row("read-through 128 x 2 MiB", 128 * len(blocks[0]), ours, base, "raw get")


def _puts_beside_raw_put(
    path: Path, raw: ObjectClient, keys: list[str], blocks: list[bytes]
) -> float:
    """Seconds for the same durable local puts (a store without a tier) and a raw
    concurrent put of the same objects, run at the same time: the work of "puts with the
    uploader running" without the tier's own code (pending set, reads back from LMDB)."""
    failed: list[BaseException] = []

    def upload() -> None:
        try:
            raw.put_new_many(list(zip(keys, blocks)))
        except BaseException as exc:  # re-raised below
            failed.append(exc)

    with Store(path) as store:
        t0 = time.perf_counter()
        uploader = threading.Thread(target=upload)
        uploader.start()
        for b in blocks:
            store.put(b)
        uploader.join()
        elapsed = time.perf_counter() - t0
    shutil.rmtree(path)
    if failed:
        raise failed[0]
    return elapsed


def _drain(moto: _Moto, scratch: Path, rounds: int, n: int) -> list[Row]:
    ours, both, base, beside = [], [], [], []
    for r in range(rounds):
        blocks = _blocks(n, seed=10 + r)
        keys = [block_key("default", _hash(b)) for b in blocks]
        raw = ObjectClient(f"s3://{moto.bucket(f'bench-raw-{r}')}")
        base.append(_timed(lambda: raw.put_new_many(list(zip(keys, blocks)))))  # noqa: B023
        # the pending set alone: puts while the bucket does not exist yet, then the drain
        url = f"s3://bench-drain-{r}/t"
        path = scratch / f"drain-{r}"
        with Store(path, tier=url) as store:
            for b in blocks:
                store.put(b)
        moto.bucket(f"bench-drain-{r}")
        with Store(path, tier=url) as store:
            ours.append(_timed(lambda: store.wait_uploaded(600)))
            assert store.tier_info()["uploads"] == n  # type: ignore[index]
        shutil.rmtree(path)
        # puts with the uploader running, until the pending set is empty
        url = f"s3://{moto.bucket(f'bench-both-{r}')}/t"
        with Store(path, tier=url) as store:

            def puts_and_drain() -> None:
                for b in blocks:  # noqa: B023
                    store.put(b)
                assert store.wait_uploaded(600)

            both.append(_timed(puts_and_drain))
            assert store.tier_info()["uploads"] == n  # type: ignore[index]
        shutil.rmtree(path)
        # the fair baseline of the line above: the same local puts beside a raw put
        raw_beside = ObjectClient(f"s3://{moto.bucket(f'bench-beside-{r}')}")
        beside.append(_puts_beside_raw_put(scratch / f"beside-{r}", raw_beside, keys, blocks))
        for kind in ("raw", "drain", "both", "beside"):
            bucket = f"bench-{kind}-{r}"
            client = ObjectClient(f"s3://{bucket}")
            client.delete_many(keys if kind in ("raw", "beside") else [f"t/{k}" for k in keys])
    nbytes = n * len(blocks[0])
    return [
        _row(f"upload drain of {nbytes >> 20} MiB pending", nbytes, ours, base, "raw put"),
        _row(
            f"{nbytes >> 20} MiB of puts, uploader running, to drained",
            nbytes,
            both,
            base,
            "raw put",
        ),
        _row(
            "  same vs the same local puts (no tier) beside a raw put of the same objects",
            nbytes,
            both,
            beside,
            "puts + raw put",
        ),
    ]


def _archive(moto: _Moto, scratch: Path, rounds: int) -> Row:
    bucket = moto.bucket("bench-archive")
    blocks = _blocks(128, seed=30)
    ours, base = [], []
    with Store(scratch / "archive-src") as store:
        for b in blocks:
            store.put(b)
        client = ObjectClient(f"s3://{bucket}")
        for r in range(rounds):
            local = scratch / f"a{r}.tlkv"

            def local_then_upload() -> None:
                create(store, local)  # noqa: B023
                client.put_file(f"raw{r}.tlkv", str(local))  # noqa: B023

            base.append(_timed(local_then_upload))
            ours.append(_timed(lambda: create(store, f"s3://{bucket}/ours{r}.tlkv")))  # noqa: B023
            size = local.stat().st_size
            local.unlink()
    return _row("archive create to s3:// (256 MiB)", size, ours, base, "local create + upload")
