"""Mooncake Store for the benches that compare against it (``bench_peers``, ``bench_fleet``,
``bench_vllm_mooncake``): its master, its Python client and its return codes.

``mooncake_master`` runs with its HTTP metadata server on (otherwise its defaults, but for
flags a bench names: ``bench_peers``' persisting master adds ``--root_fs_dir``,
``bench_fleet``'s master a longer object lease); a
client is ``MooncakeDistributedStore().setup(...)`` over TCP, mounting ``segment`` bytes
of DRAM (0: it holds no values) and a ``local`` buffer, as Mooncake's docs configure it.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ports import free_port

OBJECT_NOT_FOUND = -704  # Mooncake's ErrorCode (OBJECT_HAS_LEASE is -706)


def check_rc(rc: Any) -> None:
    """Raise on a Mooncake return code (an int, or a list of them) below zero."""
    for code in rc if isinstance(rc, list) else [rc]:
        if isinstance(code, int) and code < 0:
            raise RuntimeError(f"Mooncake call failed: {code}")


def start_master(
    root: Path,
    port: int | None = None,
    meta: int | None = None,
    flags: Sequence[str] = (),
    name: str = "mooncake_master",
) -> tuple[subprocess.Popen[bytes], int, int, Any]:
    """``mooncake_master`` with its HTTP metadata server (on free ports unless given; its
    metrics server on a free one) and ``flags`` besides, logging to ``root/<name>.log``;
    the process, its port, the metadata port and its open log (the caller closes it)."""
    port, meta = port or free_port(), meta or free_port()
    exe = Path(sys.executable).with_name("mooncake_master")
    if not exe.exists():
        found = shutil.which("mooncake_master")
        if found is None:
            raise RuntimeError("mooncake_master not found (pip install the Mooncake wheel)")
        exe = Path(found)
    log = open(root / f"{name}.log", "ab")  # noqa: SIM115 - the caller closes it
    cmd = [str(exe), f"--port={port}", "--enable_http_metadata_server=true", *flags]
    cmd.append(f"--metrics_port={free_port()}")  # its default, 9003, is one for all masters
    proc = subprocess.Popen([*cmd, f"--http_metadata_server_port={meta}"], stdout=log, stderr=log)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return proc, port, meta, log
        time.sleep(0.1)
    proc.kill()
    log.close()
    raise RuntimeError("mooncake_master did not start")


def stop_master(master: subprocess.Popen[bytes] | None) -> None:
    """Terminate a master and wait for it (30 s at most)."""
    if master is not None:
        master.terminate()
        with contextlib.suppress(Exception):
            master.wait(30)


def mooncake_client(
    master_port: int, meta_port: int, segment: int, local: int, port: int | None = None
) -> Any:
    """A ``MooncakeDistributedStore`` set up on ``port`` (a free one unless given; another
    free one if that fails, twice at most)."""
    from mooncake.store import MooncakeDistributedStore

    rc = None
    for attempt in range(3):
        store = MooncakeDistributedStore()
        rc = store.setup(
            f"127.0.0.1:{port if port is not None and attempt == 0 else free_port()}",
            f"http://127.0.0.1:{meta_port}/metadata",
            segment,
            local,
            "tcp",
            "",
            f"127.0.0.1:{master_port}",
        )
        if rc == 0:
            return store
    raise RuntimeError(f"Mooncake setup failed: {rc}")
