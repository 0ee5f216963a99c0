"""The servers the HTTP benchmarks start: ``tlkv serve`` and the bare ASGI app
(``bench_bare_app``), each a subprocess with ``WORKERS`` uvicorn workers on a free
loopback port, ready once ``/healthz`` answers and every worker runs.
"""

from __future__ import annotations

import contextlib
import http.client
import subprocess
import sys
import time
from pathlib import Path

from bench_common import REPO, server_env, stop_process
from ports import free_port

GEOMETRY = (16, 32, 8, 128)  # Llama-3-8B: a 2 MiB v1 payload per block
WORKERS = 2
BLOB_ENV = "TLKV_BENCH_BLOB"  # a file: the bare app answers every GET with its bytes
BARE_CRC_ENV = "TLKV_BENCH_BARE_CRC"  # "1": the bare app checks the body's CRC per request
BARE_STORE_ENV = "TLKV_BENCH_BARE_STORE"  # a store directory: the bare app puts into it


class Server:
    """A server subprocess on a free loopback port; ``pids`` are its worker processes."""

    def __init__(self, cmd: list[str], port: int, env: dict[str, str], log: Path) -> None:
        self.port = port
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log, stderr=self._log)
        try:
            self._wait_ready(port, log)
        except BaseException:
            self.stop()  # not left running (its supervisor would restart its workers)
            raise

    def _wait_ready(self, port: int, log: Path) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {log.read_text(errors='replace')[-2000:]}")
            with contextlib.suppress(OSError):
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                c.request("GET", "/healthz")
                if c.getresponse().status == 200 and len(self.worker_pids()) >= WORKERS:
                    c.close()
                    return
                c.close()
            time.sleep(0.1)
        raise RuntimeError("server did not start")

    def worker_pids(self) -> list[int]:
        """Child processes of the supervisor (the uvicorn workers)."""
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == self.proc.pid:
                pids.append(int(entry.name))
        return pids

    def rss_anon_mib(self) -> float:
        """Anonymous RSS of every worker (LMDB's file-backed map pages excluded), MiB."""
        total = 0
        for pid in self.worker_pids():
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("RssAnon:"):
                        total += int(line.split()[1])
        return total / 1024

    def stop(self) -> None:
        stop_process(self.proc, self._log)


def start_tlkv(
    data: Path,
    log: Path,
    max_body: str = "64MiB",
    geometry: tuple[int, ...] = GEOMETRY,
    grpc_port: int | None = None,
) -> Server:
    """``tlkv serve`` with WORKERS workers on a free port (and gRPC on ``grpc_port``)."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvstore", "serve", "--data", str(data), "--port", str(port)]
    cmd += ["--workers", str(WORKERS), "--geometry", ",".join(map(str, geometry))]
    cmd += ["--log-level", "warning", "--max-body", max_body]
    if grpc_port is not None:
        cmd += ["--grpc-port", str(grpc_port)]
    return Server(cmd, port, server_env(), log)


def start_bare(
    blob: Path | None, log: Path, check_crc: bool = False, store: Path | None = None
) -> Server:
    port = free_port()
    code = (
        "import uvicorn; uvicorn.run('bench_bare_app:bare_app', host='127.0.0.1', "
        f"port={port}, workers={WORKERS}, loop='uvloop', http='httptools', "
        "log_level='warning', access_log=False)"
    )
    env = server_env()
    env[BLOB_ENV] = "" if blob is None else str(blob)
    env[BARE_CRC_ENV] = "1" if check_crc else "0"
    env[BARE_STORE_ENV] = "" if store is None else str(store)
    return Server([sys.executable, "-c", code], port, env, log)
