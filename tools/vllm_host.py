"""One process that imports vLLM once and forks a fresh child for each engine run.

Importing vLLM (torch, transformers, its config and model registries) costs several
times what a small engine's own start-up does, so a test suite that runs each engine in a
process of its own (``vllm_demo.run_engine``) spends most of its time importing.
``EngineHost`` starts ``python tools/vllm_host.py`` once: it imports vLLM and
then, for each run, forks a child that sets the run's environment, sends its output to
the run's files and calls ``vllm_demo._engine`` exactly as ``vllm_demo.py engine`` does.
Each engine still runs in a process of its own, with its own vLLM state and a cache it
allocates itself; nothing but the imported modules is shared.

The environment of a run is its own: the child sets each variable in which the run's
differs from the host's, and keeps what vLLM's import set in the host, as that import
would in a fresh process. A variable a library reads while it is imported (vLLM's logging
level, Hugging Face's and torch's settings, the module path) is fixed in the host, so a
run whose environment differs from the host's in such a variable (``IMPORT_TIME``, except
the ``PER_RUN`` ones vLLM reads when an engine starts) starts a fresh interpreter instead:
``EngineHost.accepts``. A run that needs a fresh interpreter anyway (the README's
commands, tensor-parallel workers that vLLM spawns) does not come here.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import IO, Any

# Prefixes of variables read while vLLM and what it imports are imported.
IMPORT_TIME = (
    "VLLM_", "HF_", "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS", "TORCH", "PYTORCH",
    "TRITON", "CUDA", "OMP_", "KMP_", "MKL_", "LD_", "PYTHON", "TMPDIR",
)  # fmt: skip
# Variables vLLM reads when an engine starts, never at import (``vllm.envs`` reads the
# environment on access): a run may set them to its own values.
PER_RUN = frozenset({"VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_LOG_STATS_INTERVAL"})


def _differ(a: dict[str, str], b: dict[str, str]) -> set[str]:
    return {k for k in set(a) | set(b) if a.get(k) != b.get(k)}


def hostable(run_env: dict[str, str], host_env: dict[str, str]) -> bool:
    """Whether a run with the full environment ``run_env`` may be forked from a host
    started with ``host_env``: they differ in no variable read at import time."""
    return not any(k.startswith(IMPORT_TIME) for k in _differ(run_env, host_env) - PER_RUN)


class EngineHost:
    """A running host process; ``run`` is ``vllm_demo.run_engine`` through a fork of it."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = dict(env)
        self._lock = threading.Lock()  # one run at a time: the host forks, then waits
        self._proc = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=self.env,
            text=True,
        )
        self._answer()  # {"ready": true} once vLLM is imported

    def accepts(self, env: dict[str, str]) -> bool:
        """Whether a run with the full environment ``env`` may be forked from this host."""
        return hostable(env, self.env)

    def run(self, spec_path: str, env: dict[str, str], timeout: float) -> tuple[int, str, str]:
        """Run the engine of ``spec_path`` in a fork; its exit code, stdout and stderr. A
        run past ``timeout`` seconds is killed and raises ``subprocess.TimeoutExpired``."""
        with self._lock, tempfile.TemporaryDirectory() as tmp:
            out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
            self._ask({"spec": spec_path, "env": env, "out": out, "err": err})
            pid = int(self._answer()["pid"])
            timed_out = threading.Event()

            def kill() -> None:
                timed_out.set()
                _kill(pid)

            timer = threading.Timer(timeout, kill)
            timer.start()
            try:
                rc = int(self._answer()["rc"])
            finally:
                timer.cancel()
            if timed_out.is_set():
                raise subprocess.TimeoutExpired(["vllm_host", spec_path], timeout)
            return rc, Path(out).read_text(), Path(err).read_text()

    def close(self) -> None:
        """Stop the host (its stdin closes; it exits)."""
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def _ask(self, message: dict[str, Any]) -> None:
        stdin = self._proc.stdin
        assert stdin is not None
        stdin.write(json.dumps(message) + "\n")
        stdin.flush()

    def _answer(self) -> dict[str, Any]:
        stdout = self._proc.stdout
        assert stdout is not None
        line = stdout.readline()
        if not line:
            raise RuntimeError(f"the vLLM engine host exited ({self._proc.wait()})")
        return dict(json.loads(line))


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it ended as the timer fired
        os.kill(pid, 9)


def _child(request: dict[str, Any], started: dict[str, str], answers: IO[str]) -> None:
    """In the fork: the run's environment (where it differs from ``started``, the host's
    before its imports) and files, then the engine; never returns."""
    code = 1
    try:
        answers.close()
        env: dict[str, str] = request["env"]
        for key in _differ(env, started):
            if key in env:
                os.environ[key] = env[key]
            else:
                os.environ.pop(key, None)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["out"]), (2, request["err"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
        from vllm_demo import _engine

        result = _engine(json.loads(Path(request["spec"]).read_text()))
        print("RESULT " + json.dumps(result), flush=True)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> int:
    """The host: import vLLM, say ready, then fork one child per request line."""
    started = dict(os.environ)
    # What every run imports, done once here: vLLM, its LLM class and its config.
    import vllm.config  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import vllm_demo  # noqa: F401

    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM's messages in the host go to stderr, never into the answers
    answers.write('{"ready": true}\n')
    answers.flush()
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request, started, answers)
        answers.write(json.dumps({"pid": pid}) + "\n")
        answers.flush()
        _, status = os.waitpid(pid, 0)
        answers.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        answers.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
