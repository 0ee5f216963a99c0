"""A crash drill anyone can run: no acknowledged put is lost when the server is killed.

    python tools/drill.py [--seconds 30] [--clients 4] [--workers 2] [--port N]
                          [--case kill|stalled-reader|model-cap|slow-upload|foreign-models ...]
                          [--json]

Starts ``tlkv serve`` with ``--workers`` workers on a temporary store, on ``--port`` (by
default a free loopback port; nothing else is touched), and runs the cases asked for
(default: all, in this order). The ``kill`` case drives mixed load from ``--clients``
processes: puts of 1-4 block envelopes, block reads, has-blocks and prefix reads of what
each client put before, every answer checked byte for byte. A third of the way in (once
puts are being acknowledged), one worker is SIGKILLed (uvicorn starts another); at two
thirds (once more puts were acknowledged since) the whole server (supervisor and workers,
its process group) is SIGKILLed and started again on the same store and port. The
clients keep going through both (a refused or cut connection is counted, never
acknowledged). When time is up every acknowledged put is read back from the restarted
server and compared byte for byte. Prints the table (operations, acknowledged, intact,
5xx) and exits 1 on any lost or wrong block or any 5xx, else 0.

Every envelope is a pure function of its seed, so the clients remember seeds, not bytes.
The ``stalled-reader``, ``model-cap`` and ``slow-upload`` cases (``tools/drill_cases.py``)
then run on the same server: two clients that never read a 16 MiB prefix answer are cut
off within 33 s while puts that grow the map wait (or answer 503) and never fail; 205 new
models leave exactly 200 (the default ``--max-models``) created and 5 refused with 507;
eight connections that announce 64 MiB bodies and trickle a byte every 2 s are refused
with 408 while every ordinary put answers 200 within 3 s. ``foreign-models`` starts a
second server, ``--max-models 5`` on a store of its own, and has other processes add 64
models to that store (a library ``Store`` and ``tlkv archive restore``): its listings
keep answering 200 and name them all.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import drill_cases
import numpy as np
from bench_common import REPO, server_env
from ports import free_port

from kvstore import Block, Geometry, chain_hashes, encode, split
from kvstore.protocol import ENVELOPE_MEDIA_TYPE, JSON_MEDIA_TYPE

GEOMETRY = Geometry(block_tokens=16, n_layers=2, n_kv_heads=2, head_dim=64)  # 16 KiB blocks
ENVELOPE = {"content-type": ENVELOPE_MEDIA_TYPE}
START_TIMEOUT = 60.0
OPS = ("put", "get", "has-blocks", "prefix")
MIX = (0.4, 0.3, 0.15, 0.15)  # of OPS; the first operation of a client is a put


def envelope_for(seed: int) -> bytes:
    """The envelope put under ``seed``: 1-4 full blocks of random tokens and values."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 5))
    b = GEOMETRY.block_tokens
    hashes = chain_hashes(rng.integers(0, 2**32, n * b, dtype=np.uint64), b)
    return encode(
        GEOMETRY,
        [
            Block(int(h), b, rng.standard_normal(GEOMETRY.kv_shape).astype(np.float16))
            for h in hashes
        ],
    )


def block_hashes(env: bytes) -> list[str]:
    """The hex hashes of the full blocks of ``env``."""
    return [f"{int.from_bytes(s[28:36], 'little'):016x}" for s in split(env)]


# --- the server ------------------------------------------------------------------------


class Server:
    """``tlkv serve`` in its own process group, so one signal reaches all its processes."""

    def __init__(
        self, data: Path, port: int, workers: int, log: Path, extra: tuple[str, ...] = ()
    ) -> None:
        self.data, self.port, self.workers, self.log = data, port, workers, log
        self.extra = extra  # more `tlkv serve` options
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        """Start and wait until every worker answers; returns the seconds it took."""
        t0 = time.monotonic()
        geometry = ",".join(map(str, GEOMETRY.as_tuple()))
        cmd = [sys.executable, "-m", "kvstore", "serve", "--data", str(self.data)]
        cmd += ["--port", str(self.port), "--workers", str(self.workers)]
        cmd += ["--geometry", geometry, "--log-level", "warning", *self.extra]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO, env=server_env(), stdout=log, stderr=log, start_new_session=True
            )
        while time.monotonic() - t0 < START_TIMEOUT:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tlkv serve exited:\n{self.log.read_text()[-3000:]}")
            if len(self.worker_pids()) == self.workers and _get(self.port, "/healthz") == 200:
                return time.monotonic() - t0
            time.sleep(0.05)
        self.kill()  # nothing is left running
        raise RuntimeError(f"tlkv serve did not start:\n{self.log.read_text()[-3000:]}")

    def worker_pids(self) -> list[int]:
        """The uvicorn workers: the supervisor's spawned children (not its resource
        tracker)."""
        assert self.proc is not None
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                    cmdline = (entry / "cmdline").read_bytes()
                except OSError:
                    continue
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                if ppid == self.proc.pid and b"spawn_main" in cmdline:
                    pids.append(int(entry.name))
        return pids

    def kill_worker(self) -> tuple[int, float]:
        """SIGKILL one worker; (its pid, seconds until a replacement runs)."""
        before = self.worker_pids()
        victim = before[0]
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        while time.monotonic() - t0 < START_TIMEOUT:
            now = self.worker_pids()
            if victim not in now and len(now) == self.workers:
                return victim, time.monotonic() - t0
            time.sleep(0.05)
        raise RuntimeError("uvicorn did not replace the killed worker")

    def kill(self) -> None:
        """SIGKILL the supervisor and every worker at once."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        """SIGTERM the process group (SIGKILL after 30 s)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.kill()


def _get(port: int, path: str) -> int:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", path)
        status = conn.getresponse().status
        conn.close()
        return status
    except (OSError, http.client.HTTPException):
        return 0


# --- the clients -----------------------------------------------------------------------


@dataclass
class ClientResult:
    """What one client did: operations and statuses, acknowledged seeds, wrong answers."""

    ops: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)  # "op status" or "op error"
    acked: list[int] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # the first cut connections, for the log


def _request(
    conn: http.client.HTTPConnection, method: str, path: str, **kw: Any
) -> tuple[int, bytes]:
    conn.request(method, path, **kw)
    r = conn.getresponse()
    return r.status, r.read()


def _one(conn: http.client.HTTPConnection, op: str, rng: Any, seed: int, r: ClientResult) -> int:
    """One operation; returns its status (raises on a broken connection)."""
    if op == "put":
        status, _ = _request(conn, "PUT", "/v1/blocks", body=envelope_for(seed), headers=ENVELOPE)
        if status == 200:
            r.acked.append(seed)
        return status
    mine = int(r.acked[int(rng.integers(len(r.acked)))])
    env = envelope_for(mine)
    hashes = block_hashes(env)
    if op == "get":
        i = int(rng.integers(len(hashes)))
        status, body = _request(conn, "GET", f"/v1/blocks/{hashes[i]}")
        if status != 200 or body != split(env)[i]:
            r.wrong.append(f"GET {hashes[i]} (seed {mine}): {status}, {len(body)} bytes")
        return status
    payload = json.dumps({"hashes": hashes})
    headers = {"content-type": JSON_MEDIA_TYPE}
    if op == "has-blocks":
        status, body = _request(conn, "POST", "/v1/has-blocks", body=payload, headers=headers)
        if status != 200 or json.loads(body)["present"] != [True] * len(hashes):
            r.wrong.append(f"has-blocks (seed {mine}): {status} {body[:200]!r}")
        return status
    status, body = _request(conn, "POST", "/v1/prefix", body=payload, headers=headers)
    if status != 200 or body != env:
        r.wrong.append(f"prefix (seed {mine}): {status}, {len(body)} of {len(env)} bytes")
    return status


def client(index: int, port: int, seconds: float, go: Any, acks: Any, out: Any) -> None:
    """Once every client is ready (``go``, a barrier), run mixed operations for ``seconds``,
    counting acknowledged puts in ``acks`` (a shared value); put a ClientResult."""
    rng = np.random.default_rng(index)
    r = ClientResult()
    seed = (index + 1) << 40
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    go.wait()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        op = "put" if not r.acked else OPS[int(rng.choice(len(OPS), p=MIX))]
        r.ops[op] += 1
        acked = len(r.acked)
        try:
            status = _one(conn, op, rng, seed, r)
            r.statuses[f"{op} {status}"] += 1
        except (OSError, http.client.HTTPException) as exc:
            r.statuses[f"{op} error"] += 1  # killed under it: not acknowledged, try again
            if len(r.errors) < 5:
                r.errors.append(f"{op}: {exc!r}")
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            time.sleep(0.05)
        if len(r.acked) > acked:
            with acks.get_lock():
                acks.value += 1
        if op == "put":
            seed += 1
    conn.close()
    out.put(r)


# --- the drill -------------------------------------------------------------------------


def check_acked(port: int, seeds: list[int]) -> tuple[int, int, list[str]]:
    """Read every block of every acknowledged put back: (blocks, intact, problems)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    blocks = intact = 0
    problems: list[str] = []
    for seed in seeds:
        env = envelope_for(seed)
        for h, single in zip(block_hashes(env), split(env)):
            blocks += 1
            status, body = _request(conn, "GET", f"/v1/blocks/{h}")
            if status == 200 and body == single:
                intact += 1
            else:
                problems.append(f"block {h} of seed {seed}: {status}, {len(body)} bytes")
    conn.close()
    return blocks, intact, problems


def _wait(until: float, acks: Any, more_than: int, deadline: float) -> int:
    """Sleep until ``until`` and until more than ``more_than`` puts are acknowledged (so a
    kill lands under load), but not past ``deadline``; the acknowledged puts so far."""
    while time.monotonic() < deadline and (time.monotonic() < until or acks.value <= more_than):
        time.sleep(0.01)
    return int(acks.value)


CASES = ("kill", "stalled-reader", "model-cap", "slow-upload", "foreign-models")
PARTS = ("stalled_reader", "model_cap", "slow_upload", "foreign_models")  # their summaries


def drill(
    seconds: float,
    clients: int,
    workers: int,
    data: Path,
    port: int = 0,
    cases: tuple[str, ...] = CASES,
) -> dict[str, Any]:
    """Run the drill's ``cases`` on ``data`` (a fresh directory) with a server on ``port``
    (0: a free one); the summary as a dict."""
    server = Server(data / "store", port or free_port(), workers, data / "server.log")
    server.start()  # stops what it started if it fails
    try:
        summary = _kill_loop(server, seconds, clients) if "kill" in cases else {"ok": True}
        summary["workers"], summary["cases"] = workers, list(cases)
        if "stalled-reader" in cases:
            summary["stalled_reader"] = drill_cases.stalled_readers(server.port, GEOMETRY)
        if "model-cap" in cases:
            summary["model_cap"] = drill_cases.model_cap(server.port, GEOMETRY)
        if "slow-upload" in cases:
            summary["slow_upload"] = drill_cases.slow_upload(server.port, GEOMETRY)
    finally:
        server.stop()
    if "foreign-models" in cases:
        other = Server(
            data / "foreign", free_port(), workers, data / "foreign.log", ("--max-models", "5")
        )
        other.start()
        try:
            summary["foreign_models"] = drill_cases.foreign_models(
                other.port, GEOMETRY, data / "foreign"
            )
        finally:
            other.stop()
    summary["ok"] = all(
        part["ok"] for part in (summary, *(summary.get(p) for p in PARTS)) if part is not None
    )
    return summary


def _kill_loop(server: Server, seconds: float, clients: int) -> dict[str, Any]:
    """The kill case on a started ``server`` (left running)."""
    port = server.port
    events: list[str] = []
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    go = ctx.Barrier(clients + 1)
    acks = ctx.Value("q", 0)
    args = (port, seconds, go, acks, queue)
    procs = [ctx.Process(target=client, args=(i, *args)) for i in range(clients)]
    try:
        for p in procs:
            p.start()
        go.wait(timeout=START_TIMEOUT)  # every client started: the clock starts
        start = time.monotonic()
        seen = _wait(start + seconds / 3, acks, 0, start + seconds)
        at = time.monotonic() - start
        pid, took = server.kill_worker()
        events.append(
            f"worker {pid} SIGKILLed at {at:.1f} s ({seen} puts acknowledged), replaced in "
            f"{took:.1f} s"
        )
        seen = _wait(start + 2 * seconds / 3, acks, seen, start + seconds)
        at = time.monotonic() - start
        server.kill()
        took = server.start()
        events.append(
            f"server SIGKILLed at {at:.1f} s ({seen} puts acknowledged), restarted in {took:.1f} s"
        )
        results: list[ClientResult] = [queue.get(timeout=seconds + 120) for _ in procs]
        for p in procs:
            p.join(timeout=30)
        seeds = [s for r in results for s in r.acked]
        blocks, intact, problems = check_acked(port, seeds)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    ops: Counter[str] = Counter()
    statuses: Counter[str] = Counter()
    wrong: list[str] = []
    errors: list[str] = []
    for r in results:
        ops.update(r.ops)
        statuses.update(r.statuses)
        wrong += r.wrong
        errors += r.errors
    server_errors = sum(n for k, n in statuses.items() if k.split()[1].startswith("5"))
    return {
        "seconds": seconds,
        "clients": clients,
        "events": events,
        "operations": dict(ops),
        "statuses": dict(statuses),
        "acknowledged_puts": len(seeds),
        "acknowledged_blocks": blocks,
        "intact_blocks": intact,
        "lost": problems[:20],
        "wrong_answers": wrong[:20],
        "cut_sample": errors[:10],
        "5xx": server_errors,
        "ok": intact == blocks and not wrong and not server_errors and len(seeds) > 0,
    }


def print_report(s: dict[str, Any]) -> None:
    """The drill's tables."""
    if "kill" in s["cases"]:
        _print_kill_loop(s)
    for case in PARTS:
        if case in s:
            part = dict(s[case])
            ok = part.pop("ok")
            print(f"{case.replace('_', '-')}: {'PASS' if ok else 'FAIL'} {json.dumps(part)}")
    print("PASS" if s["ok"] else "FAIL")


def _print_kill_loop(s: dict[str, Any]) -> None:
    print(f"tlkv drill: {s['workers']} workers, {s['clients']} clients, {s['seconds']:g} s")
    for event in s["events"]:
        print(f"  {event}")
    print(f"{'operation':<12}{'count':>8}{'2xx':>8}{'4xx':>6}{'5xx':>6}{'cut':>6}")
    for op in OPS:
        by = Counter[str]()
        for key, n in s["statuses"].items():
            name, status = key.rsplit(" ", 1)
            if name == op:
                by["cut" if status == "error" else status[0] + "xx"] += n
        print(
            f"{op:<12}{s['operations'].get(op, 0):>8}{by['2xx']:>8}{by['4xx']:>6}"
            f"{by['5xx']:>6}{by['cut']:>6}"
        )
    print(
        f"acknowledged: {s['acknowledged_puts']} puts, {s['acknowledged_blocks']} blocks; "
        f"intact after the kills: {s['intact_blocks']}; wrong answers during load: "
        f"{len(s['wrong_answers'])}; 5xx: {s['5xx']}"
    )
    for line in s["lost"] + s["wrong_answers"]:
        print(f"  LOST/WRONG {line}")
    if s["lost"] or s["wrong_answers"] or s["5xx"]:
        for line in s["cut_sample"]:
            print(f"  cut: {line}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="load duration (30)")
    parser.add_argument("--clients", type=int, default=4, help="client processes (4)")
    parser.add_argument("--workers", type=int, default=2, help="server workers (2)")
    parser.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    parser.add_argument(
        "--case", action="append", choices=CASES, help="a case to run (repeatable; all)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the store and server log")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.clients < 1 or args.workers < 1 or args.port < 0:
        parser.error("--seconds, --clients and --workers must be positive, --port >= 0")
    cases = tuple(c for c in CASES if c in (args.case or CASES))
    data = Path(tempfile.mkdtemp(prefix="tlkv-drill-"))
    try:
        summary = drill(args.seconds, args.clients, args.workers, data, args.port, cases)
    finally:
        if args.keep:
            print(f"store and server log kept in {data}", file=sys.stderr)
        else:
            shutil.rmtree(data, ignore_errors=True)
    if args.json:
        print(json.dumps(summary))
    else:
        print_report(summary)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
