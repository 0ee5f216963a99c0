"""tl.kv.v1 gRPC benchmarks: PushKv and FetchKv against bare grpc.aio servicers, FetchKv
against our HTTP ``/v1/prefix``, and HasBlocks latency.

Servers are subprocesses on loopback; the client is this process. Blocks are 2 MiB v1
envelopes (geometry 16, 32, 8, 128), 64 per push, a 128-block prefix per fetch.

- PushKv: our servicer (``api.grpc_service.start_server``, uvloop, one process) on a
  ``Store(sync=False)`` (the issue's setting, to measure the transport) whose capacity is
  six pushes, measured while the store grows and once it evicts, against a bare
  grpc.aio servicer (same message limits) that reads every chunk of the stream and
  discards it, and against one that does the store's page-cache work and nothing else
  (keeps the stream, then writes it into a file without fsync, growing it as the store
  grows: on a VM whose fresh pages are slow to fault in, that is most of a growing
  store's commit). The same pre-built chunk messages go to all, through the generated
  stub, so the client's cost is the same on every side; rounds alternate between the
  servers and every round pushes new blocks.
- FetchKv: ``tlkv serve --grpc-port`` (one worker, its store holding the 128 blocks)
  answers both FetchKv and ``/v1/prefix``; the bare servicer streams one cached envelope
  (and its CRC) per requested hash. Read by the generated stub (transport), and by our
  clients: ``TransferClient.fetch`` (checks every chunk, joins one envelope) and
  ``TransferClient.fetch_blocks`` (checks every chunk, hands each over as it arrives and
  drops it, as an engine copying blocks into its own preallocated cache consumes them: no
  256 MiB of fresh memory) against ``Client.prefix`` (the HTTP body, one envelope,
  CRC-checked).
- HasBlocks: 8,192 hashes (the 128 stored first) through the generated stub, p50.

Ratios are the median of the per-round ratios (each round measures both sides back to
back, which cancels most of the drift of a shared machine); values are medians.

Usage: python tools/bench.py grpc [--quick]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_common import REPO, Row, server_env, stop_process
from ports import free_port

GEOMETRY = (16, 32, 8, 128)  # a 2 MiB v1 payload per block
PUSH_BLOCKS = 64
PUSH_CAPACITY_ROUNDS = 6  # the PushKv store holds this many rounds of 64 blocks
FETCH_BLOCKS = 128
HAS_HASHES = 8192


# --- the servers (this file run with --serve) ---------------------------------------------


def _options() -> list[tuple[str, int]]:
    from kvstore.transfer import MAX_MESSAGE_BYTES

    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ]


async def _serve_bare(port: int, blob: Path) -> None:
    import grpc

    from kvstore import crc32c, decode
    from kvstore.transfer._tlkv_v1 import kv_pb2, kv_pb2_grpc

    cached = blob.read_bytes()
    crc = crc32c(cached)
    n_tokens = decode(cached)[0].n_tokens

    class Bare(kv_pb2_grpc.KvTransferServicer):
        async def PushKv(self, request_iterator: Any, context: Any) -> Any:  # the RPC's name
            n = 0
            async for _chunk in request_iterator:
                n += 1
            return kv_pb2.PushKvResponse(blocks=n)

        async def FetchKv(self, request: Any, context: Any) -> Any:  # the RPC's name
            for h in request.block_hashes:
                yield kv_pb2.KvChunk(
                    block_hash=h, n_tokens=n_tokens, kv_format=1, payload=cached, crc32c=crc
                )

    server = grpc.aio.server(options=_options())
    kv_pb2_grpc.add_KvTransferServicer_to_server(Bare(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def _serve_bare_file(port: int, spool: Path) -> None:
    """A bare servicer whose PushKv does the store's page-cache work and nothing else: it
    keeps the stream's messages as gRPC hands them over (raw bytes, not parsed) until its
    end (all or nothing, as PushKv must), then writes them into a file without fsync (as
    the sync=False store writes LMDB's file). The file holds PUSH_CAPACITY_ROUNDS pushes
    and wraps around, so it grows through fresh page-cache pages for as many rounds as the
    store does, then rewrites its own."""
    import grpc

    from kvstore.transfer._tlkv_v1 import kv_pb2

    fd = os.open(spool, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    pushes = 0

    async def push_kv(request_iterator: Any, context: Any) -> Any:
        nonlocal pushes
        messages = [message async for message in request_iterator]
        size = sum(map(len, messages))
        offset = (pushes % PUSH_CAPACITY_ROUNDS) * size
        pushes += 1
        if os.pwritev(fd, messages, offset) != size:
            raise OSError("short write")
        return kv_pb2.PushKvResponse(blocks=len(messages), stored=len(messages))

    handler = grpc.method_handlers_generic_handler(
        "tl.kv.v1.KvTransfer",
        {
            "PushKv": grpc.stream_unary_rpc_method_handler(
                push_kv, response_serializer=kv_pb2.PushKvResponse.SerializeToString
            )
        },
    )
    server = grpc.aio.server(options=_options())
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def _serve_ours(port: int, data: Path) -> None:
    from api.grpc_service import start_server
    from kvstore import Geometry, Store

    # A capacity of PUSH_CAPACITY_ROUNDS pushes; it also sizes LMDB's map up front (2x,
    # sparse), so no round pays for a remap.
    capacity = PUSH_CAPACITY_ROUNDS * PUSH_BLOCKS * Geometry(*GEOMETRY).envelope_bytes(1, 1)
    store = Store(data, geometry=Geometry(*GEOMETRY), sync=False, capacity_bytes=capacity)
    server = await start_server(store, f"127.0.0.1:{port}")
    try:
        await server.wait_for_termination()
    finally:
        store.close()


def _serve(argv: list[str]) -> int:
    import uvloop

    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=["ours", "bare", "bare-file"])
    parser.add_argument("port", type=int)
    parser.add_argument("path", type=Path)
    args = parser.parse_args(argv)
    main = {"ours": _serve_ours, "bare": _serve_bare, "bare-file": _serve_bare_file}[args.kind]
    uvloop.run(main(args.port, args.path))
    return 0


# --- processes ----------------------------------------------------------------------------


class _Proc:
    """A server subprocess, ready once its gRPC port accepts a channel."""

    def __init__(self, cmd: list[str], grpc_port: int, log: Path) -> None:
        import grpc

        self.grpc_port = grpc_port
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=server_env(), stdout=self._log, stderr=self._log
        )
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {log.read_text(errors='replace')[-2000:]}")
            with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                try:
                    grpc.channel_ready_future(channel).result(timeout=1)
                    return
                except grpc.FutureTimeoutError:
                    if time.monotonic() > deadline:
                        raise RuntimeError("server did not start") from None

    def stop(self) -> None:
        stop_process(self.proc, self._log)


def _start_script(kind: str, path: Path, log: Path) -> _Proc:
    port = free_port()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", kind, str(port), str(path)]
    return _Proc(cmd, port, log)


def _start_tlkv(data: Path, log: Path) -> tuple[_Proc, int]:
    http_port, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "kvstore", "serve", "--data", str(data)]
    cmd += ["--port", str(http_port), "--grpc-port", str(grpc_port), "--workers", "1"]
    cmd += ["--geometry", ",".join(map(str, GEOMETRY)), "--log-level", "warning"]
    return _Proc(cmd, grpc_port, log), http_port


# --- measurements -------------------------------------------------------------------------


def _chunks(hashes: list[int], kv_seed: int = 0) -> list[Any]:
    """KvChunk messages of single-block v1 envelopes: one random payload, many hashes."""
    import numpy as np

    from kvstore import Block, Geometry, crc32c, encode
    from kvstore.transfer._tlkv_v1 import kv_pb2

    g = Geometry(*GEOMETRY)
    kv = np.random.default_rng(kv_seed).standard_normal(g.kv_shape).astype(np.float16)
    out = []
    for h in hashes:
        payload = encode(g, [Block(h, g.block_tokens, kv)], 1)
        out.append(
            kv_pb2.KvChunk(
                block_hash=h,
                n_tokens=g.block_tokens,
                kv_format=1,
                payload=payload,
                crc32c=crc32c(payload),
            )
        )
    return out


def _commit_alone(path: Path, growing: int, steady: int) -> tuple[list[float], list[float]]:
    """``Store.import_batch`` of the PushKv rounds' blocks in this process, in the same two
    regimes (the part of a push that happens after its stream ends)."""
    from kvstore import Geometry, Store

    g = Geometry(*GEOMETRY)
    capacity = PUSH_CAPACITY_ROUNDS * PUSH_BLOCKS * g.envelope_bytes(1, 1)
    times: list[float] = []
    with Store(path, geometry=g, sync=False, capacity_bytes=capacity) as store:
        total = PUSH_CAPACITY_ROUNDS + 2 + steady
        for r in range(total):
            hashes = [((r + 1) << 32) + i + 1 for i in range(PUSH_BLOCKS)]
            payloads = [memoryview(c.payload) for c in _chunks(hashes, kv_seed=r)]
            times.append(_timed(lambda p=payloads: store.import_batch(blocks=p)))
    return times[1 : 1 + growing], times[PUSH_CAPACITY_ROUNDS + 2 :]


def _stub(port: int) -> Any:
    import grpc

    from kvstore.transfer._tlkv_v1 import kv_pb2_grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=_options())
    return kv_pb2_grpc.KvTransferStub(channel)


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}x"


def run(args: argparse.Namespace) -> list[Row]:
    """Every tl.kv.v1 measurement; rows for tools/bench.py's table."""
    from kvstore.client import Client
    from kvstore.codec.layout import HEADER_SIZE, TRAILER_SIZE
    from kvstore.transfer import TransferClient
    from kvstore.transfer._tlkv_v1 import kv_pb2

    quick = bool(args.quick)
    rounds = 3 if quick else 7
    base = Path(os.environ.get("TLKV_BENCH_DIR", tempfile.gettempdir()))
    root = Path(tempfile.mkdtemp(prefix="tlkv-bench-grpc-", dir=base))
    rows: list[Row] = []
    procs: list[_Proc] = []
    try:
        blob = root / "blob.tlkv"
        blob.write_bytes(_chunks([1])[0].payload)
        bare = _start_script("bare", blob, root / "bare.log")
        procs.append(bare)
        ours = _start_script("ours", root / "push-store", root / "ours.log")
        procs.append(ours)
        bare_file = _start_script("bare-file", root / "bare-spool", root / "bare-file.log")
        procs.append(bare_file)
        bare_stub, ours_stub = _stub(bare.grpc_port), _stub(ours.grpc_port)
        file_stub = _stub(bare_file.grpc_port)

        # PushKv: rounds alternate between the servers, each pushes 64 new blocks. The
        # store's capacity is 6 rounds: the first round warms up, the next 5 grow the store
        # (LMDB writes fresh pages), later rounds evict the oldest blocks as a full cache
        # does (LMDB reuses their pages). Both regimes are reported.
        def push_round(r: int) -> tuple[float, float, float, int]:
            chunks = _chunks([((r + 1) << 32) + i + 1 for i in range(PUSH_BLOCKS)], kv_seed=r)
            tb = _timed(lambda: bare_stub.PushKv(iter(chunks)))
            tf = _timed(lambda: file_stub.PushKv(iter(chunks)))
            t0 = time.perf_counter()
            reply = ours_stub.PushKv(iter(chunks))
            to = time.perf_counter() - t0
            if reply.stored != PUSH_BLOCKS:
                raise RuntimeError(f"PushKv stored {reply.stored} of {PUSH_BLOCKS}")
            return to, tb, tf, sum(len(c.payload) for c in chunks)

        push_round(0)
        growing = [push_round(r) for r in range(1, PUSH_CAPACITY_ROUNDS)]
        for r in range(PUSH_CAPACITY_ROUNDS, PUSH_CAPACITY_ROUNDS + 2):
            push_round(r)  # the first evictions
        steady = [
            push_round(r)
            for r in range(PUSH_CAPACITY_ROUNDS + 2, PUSH_CAPACITY_ROUNDS + 2 + rounds)
        ]
        ours.stop()
        procs.remove(ours)
        commits = _commit_alone(root / "commit-store", len(growing), rounds)
        regimes = (
            ("store growing", growing, commits[0]),
            ("store at capacity", steady, commits[1]),
        )
        for label, runs, commit in regimes:
            t_ours = [o for o, _, _, _ in runs]
            t_bare = [b for _, b, _, _ in runs]
            t_file = [f for _, _, f, _ in runs]
            push_bytes = runs[0][3]
            ratio = statistics.median([b / o for o, b in zip(t_ours, t_bare)])
            rows.append(
                Row(
                    f"PushKv {PUSH_BLOCKS} x 2 MiB, sync=False, {label} (median of {len(runs)})",
                    f"{push_bytes / statistics.median(t_ours) / 1e9:.2f} GB/s",
                    "bare grpc.aio, discards "
                    f"{push_bytes / statistics.median(t_bare) / 1e9:.2f} GB/s",
                    ratio,
                    ">= 0.7x",
                    ratio >= 0.7,
                )
            )
            rows.append(
                Row("  per-round ratio spread", _spread([b / o for o, b in zip(t_ours, t_bare)]))
            )
            fair = statistics.median([f / o for o, f in zip(t_ours, t_file)])
            rows.append(
                Row(
                    "  same vs a bare servicer doing the store's page-cache work (writes the "
                    "stream to a file at its end, no fsync)",
                    f"{push_bytes / statistics.median(t_ours) / 1e9:.2f} GB/s",
                    f"bare grpc.aio, file {push_bytes / statistics.median(t_file) / 1e9:.2f} GB/s",
                    fair,
                    ">= 0.7x",
                    fair >= 0.7,
                )
            )
            rows.append(
                Row("  per-round ratio spread", _spread([f / o for o, f in zip(t_ours, t_file)]))
            )
            rows.append(
                Row(
                    "  the store's commit alone (import_batch, same blocks, same regime)",
                    f"{statistics.median(commit) * 1e3:.0f} ms",
                    f"bare stream {statistics.median(t_bare) * 1e3:.0f} ms, ours "
                    f"{statistics.median(t_ours) * 1e3:.0f} ms",
                )
            )

        # FetchKv and /v1/prefix from one tlkv serve holding a 128-block prefix.
        tlkv, http_port = _start_tlkv(root / "store", root / "tlkv.log")
        procs.append(tlkv)
        hashes = [(9 << 56) + i + 1 for i in range(FETCH_BLOCKS)]
        tlkv_stub = _stub(tlkv.grpc_port)
        for part in range(0, FETCH_BLOCKS, PUSH_BLOCKS):
            tlkv_stub.PushKv(iter(_chunks(hashes[part : part + PUSH_BLOCKS])))
        request = kv_pb2.FetchKvRequest(block_hashes=hashes)

        def read(stub: Any) -> int:
            return sum(len(c.payload) for c in stub.FetchKv(request))

        fetch_bytes = read(tlkv_stub)
        if fetch_bytes != FETCH_BLOCKS * len(blob.read_bytes()):
            raise RuntimeError(f"FetchKv returned {fetch_bytes} bytes")
        read(bare_stub)
        grpc_client = TransferClient(f"127.0.0.1:{tlkv.grpc_port}")
        http_client = Client(f"http://127.0.0.1:{http_port}", timeout=120)
        envelope = grpc_client.fetch(hashes=hashes)
        if http_client.prefix(hashes=hashes) != envelope:
            raise RuntimeError("FetchKv and /v1/prefix disagree")
        if (
            b"".join(bytes(e[0].raw_record) for e in grpc_client.fetch_blocks(hashes=hashes))
            != (envelope[HEADER_SIZE:-TRAILER_SIZE])
        ):
            raise RuntimeError("fetch_blocks and fetch disagree")
        f_ours, f_bare, c_grpc, c_http, c_blocks = [], [], [], [], []
        for _ in range(rounds + 2):
            f_bare.append(_timed(lambda: read(bare_stub)))
            f_ours.append(_timed(lambda: read(tlkv_stub)))
            c_http.append(_timed(lambda: http_client.prefix(hashes=hashes)))
            c_grpc.append(_timed(lambda: grpc_client.fetch(hashes=hashes)))
            # each block handed over as it arrives and dropped (constant memory), as an
            # engine copying blocks into its own preallocated cache consumes them
            c_blocks.append(
                _timed(lambda: collections.deque(grpc_client.fetch_blocks(hashes=hashes), 0))
            )
        mo, mb = statistics.median(f_ours), statistics.median(f_bare)
        ratio = statistics.median([b / o for o, b in zip(f_ours, f_bare)])
        rows.append(
            Row(
                f"FetchKv {FETCH_BLOCKS}-block prefix, generated stub (median of {len(f_ours)})",
                f"{fetch_bytes / mo / 1e9:.2f} GB/s",
                f"bare grpc.aio, cached bytes {fetch_bytes / mb / 1e9:.2f} GB/s",
                ratio,
                ">= 0.7x",
                ratio >= 0.7,
            )
        )
        rows.append(
            Row(
                "  FetchKv per-round ratio spread", _spread([b / o for o, b in zip(f_ours, f_bare)])
            )
        )
        mg, mh = statistics.median(c_grpc), statistics.median(c_http)
        ratio = statistics.median([h / g for g, h in zip(c_grpc, c_http)])
        rows.append(
            Row(
                f"TransferClient.fetch vs Client.prefix, {FETCH_BLOCKS} blocks (median of "
                f"{len(c_grpc)})",
                f"{len(envelope) / mg / 1e9:.2f} GB/s",
                f"HTTP /v1/prefix {len(envelope) / mh / 1e9:.2f} GB/s",
                ratio,
                ">= 0.8x",
                ratio >= 0.8,
            )
        )
        rows.append(Row("  client ratio spread", _spread([h / g for g, h in zip(c_grpc, c_http)])))
        mk = statistics.median(c_blocks)
        ratio = statistics.median([h / k for k, h in zip(c_blocks, c_http)])
        rows.append(
            Row(
                "TransferClient.fetch_blocks (each checked block used as it arrives) vs "
                f"Client.prefix (median of {len(c_blocks)})",
                f"{len(envelope) / mk / 1e9:.2f} GB/s",
                f"HTTP /v1/prefix {len(envelope) / mh / 1e9:.2f} GB/s",
                ratio,
                ">= 0.8x",
                ratio >= 0.8,
            )
        )
        rows.append(
            Row("  streamed ratio spread", _spread([h / k for k, h in zip(c_blocks, c_http)]))
        )
        http_client.close()

        # HasBlocks, 8,192 hashes: the stored ones first, then absent ones.
        probe = hashes + [(7 << 56) + i for i in range(HAS_HASHES - len(hashes))]
        has_request = kv_pb2.HasBlocksRequest(block_hashes=probe)
        if tlkv_stub.HasBlocks(has_request).prefix_blocks != FETCH_BLOCKS:
            raise RuntimeError("HasBlocks disagrees with the pushed prefix")
        repeat = 100 if quick else 400
        lat = [_timed(lambda: tlkv_stub.HasBlocks(has_request)) for _ in range(repeat)]
        client_lat = [_timed(lambda: grpc_client.has_blocks(probe)) for _ in range(repeat)]
        p50 = statistics.median(lat)
        rows.append(
            Row(
                f"HasBlocks, {HAS_HASHES:,} hashes, generated stub, p50",
                f"{p50 * 1e3:.2f} ms",
                target="<= 3 ms",
                ok=p50 <= 0.003,
            )
        )
        rows.append(
            Row(
                "  same through TransferClient.has_blocks (list of ints), p50",
                f"{statistics.median(client_lat) * 1e3:.2f} ms",
            )
        )
        grpc_client.close()
    finally:
        for p in procs:
            with contextlib.suppress(Exception):
                p.stop()
        shutil.rmtree(root, ignore_errors=True)
    return rows


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        sys.path.insert(0, str(REPO))
        raise SystemExit(_serve(sys.argv[2:]))
    raise SystemExit("run through tools/bench.py grpc")
