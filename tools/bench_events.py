"""KV events benchmarks: puts with the publisher on vs off, events delivered to a
subscriber, and a router's lookup of an 8,192-token prompt.

- put throughput: ``Store.put`` of prompts of 32 blocks of 128 KiB (geometry 16, 8, 4, 64;
  v1), each with its token ids, into a store (``sync=False``: no fsync, so the puts' own
  CPU is what is compared), with the event log on and the real publisher process
  (``api.kvevents``) following it and sending every batch to a connected subscriber, vs
  the log off and no publisher. Rounds alternate on/off (5 of each; 2 with --quick); the
  ratio is the median of the per-pair ratios, its spread printed. Target: >= 0.95x.
- the same with the puts over HTTP (``Client.put`` with tokens, one client) to ``tlkv
  serve`` with ``--kv-events-endpoint`` vs without: what a deployment sees.
- events delivered: 2,000 one-block puts (each one batch, one ``BlockStored``) as fast as
  one writer goes; events per second from the first put to the subscriber's last event,
  beside the writer's own put rate (the baseline: the publisher keeps up when equal).
- lookup: ``POST /v1/lookup`` of an 8,192-token prompt (512 blocks of 16) over two models
  holding it, p50 of 200, vs ``POST /v1/has-blocks`` of the same tokens for one model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from bench_common import REPO, Row, free_port, server_env, stop_process

from kvstore import Block, Geometry, Store, chain_hashes, encode
from kvstore.client import Client
from kvstore.events.subscriber import Subscriber

GEOMETRY = Geometry(16, 8, 4, 64)  # 128 KiB blocks
PROMPT_BLOCKS = 32
TARGET = 0.95


def _prompts(n: int, seed: int, geometry: Geometry = GEOMETRY) -> list[tuple[list[int], bytes]]:
    rng = np.random.default_rng(seed)
    kv = [rng.standard_normal(geometry.kv_shape).astype(np.float16) for _ in range(8)]
    out = []
    for i in range(n):
        ids = rng.integers(0, 100_000, PROMPT_BLOCKS * geometry.block_tokens).tolist()
        hashes = chain_hashes(ids, geometry.block_tokens)
        blocks = [Block(h, geometry.block_tokens, kv[(i + j) % 8]) for j, h in enumerate(hashes)]
        out.append((ids, encode(geometry, blocks)))
    return out


class _Publisher:
    """The real publisher process on a store, and a subscriber process (as a router is)
    that counts what it sends: ``wait_for`` returns when it has the batches and gives the
    wall-clock time the last one arrived."""

    def __init__(self, data: Path, expect: int) -> None:
        self.port, self.replay = free_port(), free_port()
        cmd = [sys.executable, "-m", "api.kvevents", "--data", str(data)]
        cmd += ["--endpoint", f"tcp://*:{self.port}", "--replay-endpoint", f"tcp://*:{self.replay}"]
        cmd += ["--node", "bench", "--topic", "kv@{node}@{model}", "--parent", str(os.getpid())]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=server_env())
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"
        sub = [sys.executable, __file__, "subscribe", f"tcp://127.0.0.1:{self.port}", str(expect)]
        self.sub = subprocess.Popen(sub, stdout=subprocess.PIPE, text=True, env=server_env())
        assert self.sub.stdout is not None and self.sub.stdout.readline().strip() == "ready"

    def wait_for(self) -> tuple[int, float]:
        """(batches received, time.time() of the last)."""
        out, _ = self.sub.communicate(timeout=120)
        count, last = out.split()
        return int(count), float(last)

    def close(self) -> None:
        if self.sub.poll() is None:
            self.sub.kill()
        self.sub.wait()
        self.proc.terminate()
        self.proc.wait(10)


def _subscribe(endpoint: str, expect: int) -> None:
    """The subscriber process: count ``expect`` batches (or stop 10 s after the last)."""
    with Subscriber(endpoint) as sub:
        time.sleep(0.3)
        print("ready", flush=True)
        count, last = 0, 0.0
        while count < expect and sub.recv(10.0) is not None:
            count += 1
            last = time.time()
    print(count, last, flush=True)


def _put_round(root: Path, prompts: list[tuple[list[int], bytes]], on: bool) -> float:
    """Seconds of the puts of ``prompts`` into a fresh store (publisher on or off)."""
    data = Path(tempfile.mkdtemp(dir=root))
    Store(data, geometry=GEOMETRY, events=100_000 if on else 0).close()
    publisher = _Publisher(data, len(prompts)) if on else None
    try:
        with Store(data, sync=False) as s:
            t0 = time.perf_counter()
            for ids, env in prompts:
                s.put(env, tokens=ids)
            seconds = time.perf_counter() - t0
        if publisher is not None:
            assert publisher.wait_for()[0] == len(prompts), "the subscriber lost batches"
        return seconds
    finally:
        if publisher is not None:
            publisher.close()
        shutil.rmtree(data, ignore_errors=True)


def _serve(data: Path, events: bool, log: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    cmd = [sys.executable, "-m", "kvstore", "serve", "--data", str(data), "--port", str(port)]
    cmd += ["--log-level", "warning", "--scrub-rate", "0"]
    if events:
        cmd += ["--kv-events-endpoint", f"tcp://*:{free_port()}"]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=server_env(), stdout=out, stderr=out)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc, port
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"tlkv serve did not start: {log.read_text()[-2000:]}")


def _http_round(root: Path, prompts: list[tuple[list[int], bytes]], on: bool) -> float:
    data = Path(tempfile.mkdtemp(dir=root))
    log = root / "serve.log"
    proc, port = _serve(data, on, log)
    try:
        with Client(f"http://127.0.0.1:{port}") as c:
            c.put(prompts[0][1], tokens=prompts[0][0])  # warm: the model's geometry adopted
            t0 = time.perf_counter()
            for ids, env in prompts[1:]:
                c.put(env, tokens=ids)
            return time.perf_counter() - t0
    finally:
        stop_process(proc, open(os.devnull, "wb"))  # noqa: SIM115 - closed by stop_process
        shutil.rmtree(data, ignore_errors=True)


def _pairs(fn, root: Path, prompts: list, rounds: int) -> tuple[float, list[float], float, float]:  # type: ignore[no-untyped-def]
    ratios, on_s, off_s = [], [], []
    for _ in range(rounds):
        off = fn(root, prompts, False)
        on = fn(root, prompts, True)
        ratios.append(off / on)  # throughput on / throughput off
        on_s.append(on)
        off_s.append(off)
    return statistics.median(ratios), ratios, statistics.median(on_s), statistics.median(off_s)


def _delivery(root: Path, n: int) -> tuple[float, float]:
    """(events delivered per second, puts per second) for ``n`` one-block puts."""
    g = Geometry(16, 2, 2, 64)
    data = Path(tempfile.mkdtemp(dir=root))
    Store(data, geometry=g, events=100_000).close()
    publisher = _Publisher(data, n)
    rng = np.random.default_rng(1)
    kv = rng.standard_normal(g.kv_shape).astype(np.float16)
    items = []
    for _ in range(n):
        ids = rng.integers(0, 100_000, 16).tolist()
        items.append((ids, encode(g, [Block(chain_hashes(ids, 16)[0], 16, kv)])))
    try:
        with Store(data, sync=False) as s:
            started = time.time()
            t0 = time.perf_counter()
            for ids, env in items:
                s.put(env, tokens=ids)
            put_seconds = time.perf_counter() - t0
        delivered, last = publisher.wait_for()
        return delivered / (last - started), n / put_seconds
    finally:
        publisher.close()
        shutil.rmtree(data, ignore_errors=True)


def _lookup(root: Path, repeat: int) -> tuple[float, float]:
    """p50 seconds of POST /v1/lookup (two models) and of POST /v1/has-blocks (one)."""
    g = Geometry(16, 2, 2, 64)
    data = Path(tempfile.mkdtemp(dir=root))
    proc, port = _serve(data, False, root / "serve.log")
    url = f"http://127.0.0.1:{port}"
    rng = np.random.default_rng(2)
    ids = rng.integers(0, 100_000, 8192).tolist()
    hashes = chain_hashes(ids, 16)
    kv = rng.standard_normal(g.kv_shape).astype(np.float16)
    env = encode(g, [Block(h, 16, kv) for h in hashes])
    try:
        for model in ("a", "b"):
            with Client(url, model=model) as c:
                c.put(env, tokens=ids)
        lookup = json.dumps({"tokens": ids, "models": ["a", "b"]}).encode()
        has = json.dumps({"tokens": ids}).encode()
        headers = {"content-type": "application/json"}
        with httpx.Client(base_url=url, headers=headers) as http:
            assert (
                http.post("/v1/lookup", content=lookup).json()["models"][0]["local_blocks"] == 512
            )

            def p50(path: str, body: bytes) -> float:
                times = []
                for _ in range(repeat):
                    t0 = time.perf_counter()
                    http.post(path, content=body).raise_for_status()
                    times.append(time.perf_counter() - t0)
                return statistics.median(times)

            return p50("/v1/lookup", lookup), p50("/v1/models/a/has-blocks", has)
    finally:
        stop_process(proc, open(os.devnull, "wb"))  # noqa: SIM115
        shutil.rmtree(data, ignore_errors=True)


def run(args: argparse.Namespace) -> list[Row]:
    rounds = 2 if args.quick else 5
    root = Path(tempfile.mkdtemp(prefix="tlkv-bench-events-"))
    rows: list[Row] = []
    try:
        prompts = _prompts(8 if args.quick else 24, seed=0)
        mib = sum(len(e) for _, e in prompts) / 2**20
        ratio, ratios, on, off = _pairs(_put_round, root, prompts, rounds)
        spread = f"{min(ratios):.3f}-{max(ratios):.3f}"
        rows.append(
            Row(
                f"Store.put, 128 KiB blocks, publisher on (pairs: {spread})",
                f"{mib / on:.0f} MiB/s",
                f"{mib / off:.0f} MiB/s off",
                ratio,
                f">= {TARGET}x",
                ratio >= TARGET,
            )
        )
        ratio, ratios, on, off = _pairs(_http_round, root, prompts, rounds)
        spread = f"{min(ratios):.3f}-{max(ratios):.3f}"
        mib_http = sum(len(e) for _, e in prompts[1:]) / 2**20
        rows.append(
            Row(
                f"HTTP put, tlkv serve --kv-events-endpoint (pairs: {spread})",
                f"{mib_http / on:.0f} MiB/s",
                f"{mib_http / off:.0f} MiB/s without",
                ratio,
                f">= {TARGET}x",
                ratio >= TARGET,
            )
        )
        delivered, puts = _delivery(root, 500 if args.quick else 2000)
        rows.append(
            Row(
                "events delivered to a subscriber (one-block puts)",
                f"{delivered:,.0f} batches/s",
                f"{puts:,.0f} puts/s",
                delivered / puts,
            )
        )
        lookup, has = _lookup(root, 50 if args.quick else 200)
        rows.append(
            Row(
                "POST /v1/lookup, 8,192 tokens, 2 models, p50",
                f"{lookup * 1e3:.2f} ms",
                f"{has * 1e3:.2f} ms has-blocks (1 model)",
                lookup / has,
            )
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


if __name__ == "__main__":
    if sys.argv[1:2] == ["subscribe"]:
        _subscribe(sys.argv[2], int(sys.argv[3]))
