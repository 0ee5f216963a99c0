"""Which engine runs the vLLM tests' engine host forks (``tools/vllm_host.py``): a run
whose environment differs from the host's in a variable read while vLLM is imported
starts a fresh interpreter instead."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from vllm_host import hostable

HOST = {"PATH": "/usr/bin", "PYTHONPATH": "/repo", "VLLM_LOGGING_LEVEL": "INFO"}


def test_the_same_environment_is_hostable() -> None:
    assert hostable(dict(HOST), HOST)


def test_variables_read_when_an_engine_starts_or_never_by_vllm_are_hostable() -> None:
    assert hostable({**HOST, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, HOST)
    assert hostable({**HOST, "VLLM_LOG_STATS_INTERVAL": "0.001"}, HOST)
    assert hostable({**HOST, "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}, HOST)
    assert hostable({k: v for k, v in HOST.items() if k != "PATH"}, HOST)


def test_variables_read_at_import_are_not() -> None:
    assert not hostable({**HOST, "VLLM_LOGGING_LEVEL": "DEBUG"}, HOST)
    assert not hostable({**HOST, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}, HOST)
    assert not hostable({**HOST, "HF_HUB_OFFLINE": "1"}, HOST)
    assert not hostable({**HOST, "PYTHONPATH": "/elsewhere"}, HOST)
    assert not hostable({k: v for k, v in HOST.items() if k != "VLLM_LOGGING_LEVEL"}, HOST)
    assert not hostable({**HOST, "OMP_NUM_THREADS": "1"}, HOST)
