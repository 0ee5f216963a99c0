"""vLLM's own Mooncake store connector (``MooncakeStoreConnector``) for ``tools/bench.py
vllm``: the KV store a vLLM user would pick instead of tlkv, on the same engines.

It runs on vLLM 0.32.0's CPU build with Mooncake's non-CUDA wheel
(``mooncake-transfer-engine-non-cuda``) in Mooncake's ``standalone-store`` mode: one
``mooncake_master`` (HTTP metadata server on) and one ``mooncake_client`` process that owns
the 2 GiB DRAM segment the values live in, so a fresh engine finds what an earlier one
saved (in the ``embedded`` mode the segment is the engine's own and goes with it). The
engines mount no segment (``global_segment_size`` 0), TCP transport, a 512 MiB local
buffer; the config file is what ``MOONCAKE_CONFIG_PATH`` names
(``vllm/distributed/mooncake_store.py``).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench_mooncake import start_master
from ports import free_port

CONNECTOR: dict[str, Any] = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
SEGMENT = "2GB"
LOCAL_BUFFER = "512MB"


def available() -> str | None:
    """None when Mooncake's wheel is installed, else why the rows are not run."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return f"Mooncake not installed ({exc})"
    return None


def _exe(name: str) -> str:
    exe = Path(sys.executable).with_name(name)
    found = str(exe) if exe.exists() else shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} not found (pip install the Mooncake wheel)")
    return found


@contextlib.contextmanager
def store(root: Path) -> Iterator[dict[str, str]]:
    """A running Mooncake store; yields the environment an engine needs to use it."""
    master, mport, meta, master_log = start_master(root)
    port = free_port()
    log = open(root / "mooncake_client.log", "ab")  # noqa: SIM115 - closed below
    cmd = [
        _exe("mooncake_client"),
        f"--master_server_address=127.0.0.1:{mport}",
        f"--metadata_server=http://127.0.0.1:{meta}/metadata",
        f"--global_segment_size={SEGMENT}",
        f"--local_buffer_size={LOCAL_BUFFER}",
        "--protocol=tcp",
        "--host=127.0.0.1",
        f"--port={port}",
    ]
    client = subprocess.Popen(cmd, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if client.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("mooncake_client did not start")
            time.sleep(0.1)
        config = root / "mooncake.json"
        config.write_text(
            json.dumps(
                {
                    "metadata_server": f"http://127.0.0.1:{meta}/metadata",
                    "master_server_address": f"127.0.0.1:{mport}",
                    "protocol": "tcp",
                    "device_name": "",
                    "mode": "standalone-store",
                    "global_segment_size": 0,
                    "local_buffer_size": LOCAL_BUFFER,
                }
            )
        )
        yield {"MOONCAKE_CONFIG_PATH": str(config), "GLOG_minloglevel": "2"}
    finally:
        for proc in (client, master):
            proc.terminate()
            with contextlib.suppress(Exception):
                proc.wait(30)
        log.close()
        master_log.close()
