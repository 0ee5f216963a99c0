"""KV events benchmarks: puts with the publisher on vs off, events delivered to a
subscriber, and a router's lookup of an 8,192-token prompt.

- put throughput: 200 prompts of 32 blocks of 128 KiB (geometry 16, 8, 4, 64; v1), each
  put with its token ids into two stores side by side (``sync=False``: no fsync, so the
  puts' own work is what is compared; 64 MiB capacity each, so puts also evict and the
  log announces the removals): one with the event log on, the real publisher process
  (``api.kvevents``) following it and a subscriber process receiving every batch, the
  other with the log off. Each prompt goes to both, one right after the other (the side
  going first alternating), so the shared machine's load swings hit both alike; the
  ratio is median put time off / on, and the putting thread's median CPU time per put
  off / on beside it. Target: >= 0.95x.
- the same over HTTP (``Client.put`` with tokens) to two ``tlkv serve`` side by side, one
  with ``--kv-events-endpoint``: wall ratio, and the CPU per put of each server's process
  tree (the publisher included).
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
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
from bench_common import REPO, Row, server_env, stop_process
from ports import free_port

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


def _interleaved(
    put_on: Callable[[bytes, list[int]], object],
    put_off: Callable[[bytes, list[int]], object],
    prompts: list[tuple[list[int], bytes]],
    cpu_on: Callable[[], float] = time.thread_time,
    cpu_off: Callable[[], float] = time.thread_time,
) -> tuple[list[float], ...]:
    """Each prompt put on both sides, one right after the other (the side going first
    alternating): per put, wall seconds and the CPU seconds ``cpu_on``/``cpu_off`` count
    (default: the putting thread's)."""
    wall_on: list[float] = []
    wall_off: list[float] = []
    spent_on: list[float] = []
    spent_off: list[float] = []
    for i, (ids, env) in enumerate(prompts):
        first = i % 2 == 0
        for on in (first, not first):
            put, cpu = (put_on, cpu_on) if on else (put_off, cpu_off)
            c0, t0 = cpu(), time.perf_counter()
            put(env, ids)
            wall, spent = time.perf_counter() - t0, cpu() - c0
            (wall_on if on else wall_off).append(wall)
            (spent_on if on else spent_off).append(spent)
    return wall_on, wall_off, spent_on, spent_off


def _tree_cpu(pid: int) -> Callable[[], float]:
    """CPU seconds of process ``pid`` and its children (every thread), nanosecond-exact
    (``/proc/<pid>/task/*/schedstat``)."""

    def total() -> float:
        pids = [pid]
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    stat = Path(f"/proc/{entry.name}/stat").read_text()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    pids.append(int(entry.name))
        ns = 0
        for p in pids:
            try:
                for task in os.scandir(f"/proc/{p}/task"):
                    ns += int(Path(task.path, "schedstat").read_text().split()[0])
            except OSError:
                continue
        return ns / 1e9

    return total


def _store_puts(root: Path, prompts: list) -> tuple[list[float], ...]:
    """Puts into two stores side by side, the event log on with its publisher and a
    subscriber on one of them, off on the other; both bounded (64 MiB), so the puts also
    evict (and the log announces the removals)."""
    cap = 64 << 20
    data_on, data_off = Path(tempfile.mkdtemp(dir=root)), Path(tempfile.mkdtemp(dir=root))
    Store(data_on, geometry=GEOMETRY, events=100_000).close()
    publisher = _Publisher(data_on, len(prompts))
    try:
        with (
            Store(data_on, sync=False, capacity_bytes=cap) as on,
            Store(data_off, geometry=GEOMETRY, sync=False, capacity_bytes=cap, events=0) as off,
        ):
            times = _interleaved(
                lambda env, ids: on.put(env, tokens=ids),
                lambda env, ids: off.put(env, tokens=ids),
                prompts,
            )
        got = publisher.wait_for()[0]
        assert got == len(prompts), f"the subscriber got {got} of {len(prompts)} batches"
        return times
    finally:
        publisher.close()
        shutil.rmtree(data_on, ignore_errors=True)
        shutil.rmtree(data_off, ignore_errors=True)


def _serve(data: Path, events: bool, log: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    cmd = [sys.executable, "-m", "kvstore", "serve", "--data", str(data), "--port", str(port)]
    cmd += ["--log-level", "warning", "--scrub-rate", "0", "--capacity", "64MiB"]
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


def _http_puts(root: Path, prompts: list) -> tuple[list[float], ...]:
    """Client puts to two servers side by side, one publishing KV events."""
    procs = []
    try:
        ports = []
        for events in (True, False):
            proc, port = _serve(Path(tempfile.mkdtemp(dir=root)), events, root / "serve.log")
            procs.append(proc)
            ports.append(port)
        with (
            Client(f"http://127.0.0.1:{ports[0]}") as on,
            Client(f"http://127.0.0.1:{ports[1]}") as off,
        ):
            return _interleaved(
                lambda env, ids: on.put(env, tokens=ids),
                lambda env, ids: off.put(env, tokens=ids),
                prompts,
                _tree_cpu(procs[0].pid),
                _tree_cpu(procs[1].pid),
            )
    finally:
        for proc in procs:
            stop_process(proc, open(os.devnull, "wb"))  # noqa: SIM115 - closed by stop_process


def _ratio_rows(label: str, cpu: str, times: tuple[list[float], ...], mib: float) -> list[Row]:
    wall_on, wall_off, cpu_on, cpu_off = times
    won, woff = statistics.median(wall_on), statistics.median(wall_off)
    con, coff = statistics.median(cpu_on), statistics.median(cpu_off)
    return [
        Row(
            f"{label}: throughput, publisher on",
            f"{mib / won:.0f} MiB/s",
            f"{mib / woff:.0f} MiB/s off",
            woff / won,
            f">= {TARGET}x",
            woff / won >= TARGET,
        ),
        Row(
            f"{label}: {cpu} per put",
            f"{con * 1e3:.2f} ms",
            f"{coff * 1e3:.2f} ms off",
            coff / con,
            f">= {TARGET}x",
            coff / con >= TARGET,
        ),
    ]


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
    root = Path(tempfile.mkdtemp(prefix="tlkv-bench-events-"))
    rows: list[Row] = []
    try:
        prompts = _prompts(24 if args.quick else 200, seed=0)
        mib = len(prompts[0][1]) / 2**20  # one put
        times = _store_puts(root, prompts)
        rows += _ratio_rows("Store.put of 32 x 128 KiB", "the putting thread's CPU", times, mib)
        times = _http_puts(root, prompts)
        rows += _ratio_rows("HTTP put of 32 x 128 KiB", "server CPU (+ publisher)", times, mib)
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
