"""Test helpers: run ``python -m kvstore serve`` in a subprocess, or an app under uvicorn
in a thread, on a free loopback port.

``ServerProcess`` starts the real server (uvicorn, real LMDB directory), waits for
``/healthz`` and, with ``--workers N``, until ``/metrics`` lists all N workers, and stops
it with SIGTERM (SIGKILL as a last resort). Its log goes to a file next to the data,
printed when start-up fails. ``ThreadServer`` runs an app in this process (its store at
hand), on uvloop with the HTTP protocol asked for.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, TypeVar

import httpx
import uvicorn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

from ports import free_port  # noqa: E402  (tools/ is not a package)

__all__ = ["ServerProcess", "ThreadServer", "free_port"]
_Server = TypeVar("_Server", bound="ServerProcess")
START_TIMEOUT = 30.0


class ThreadServer:
    """``app`` under uvicorn in a thread: uvloop, and ``http`` (uvicorn's ``"httptools"``
    or a protocol class such as ``tlkv serve``'s); a context manager."""

    def __init__(self, app: Any, http: Any = "httptools", log_level: str = "warning") -> None:
        self.app = app
        self.http = http
        self.port = free_port()
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            loop="uvloop",
            http=http,
            log_level=log_level,
            lifespan="on",
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Any:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(20)

    @property
    def store(self) -> Any:
        """The app's open store."""
        return self.app.state.store


class ServerProcess:
    """One ``tlkv serve`` process (and its workers) on ``data``; a context manager."""

    def __init__(
        self,
        data: Path,
        *args: str,
        token: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.data = Path(data)
        self.args = list(args)
        self.token = token
        self.extra_env = env or {}
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.data.parent / f"{self.data.name}.server.log"

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:40123``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        """The Authorization header when a token is configured."""
        return {"authorization": f"Bearer {self.token}"} if self.token else {}

    def log(self) -> str:
        """What the server wrote to stdout/stderr so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def start(self) -> ServerProcess:
        """Start the server and wait until ``/healthz`` answers 200."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("TLKV_")}
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        if self.token is not None:
            env["TLKV_TOKEN"] = self.token
        env.update(self.extra_env)
        for _attempt in range(3):  # the free port may be taken between probe and bind
            self.port = free_port()
            cmd = [sys.executable, "-m", "kvstore", "serve", "--data", str(self.data)]
            cmd += ["--port", str(self.port), "--log-level", "warning", *self.args]
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
                )
            if self._wait_healthy():
                return self
            self.stop()
            if "address already in use" not in self.log().lower():
                break
        raise RuntimeError(f"tlkv serve did not start:\n{self.log()}")

    def _workers(self) -> int:
        if "--workers" in self.args:
            return int(self.args[self.args.index("--workers") + 1])
        return 1

    def _wait_healthy(self) -> bool:
        """Wait for ``/healthz``, then until ``/metrics`` lists every worker as started."""
        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT
        healthy = False
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                if not healthy:
                    healthy = httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200
                if healthy and self._workers() == 1:
                    return True
                if healthy:
                    r = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=1.0)
                    started = r.text.count("\ntlkv_worker_start_time_seconds{")
                    if started == self._workers():
                        return True
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        return False

    def alive(self) -> bool:
        """True while the server process runs."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> int | None:
        """SIGTERM, wait, SIGKILL if needed; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        code = self.proc.returncode
        self.proc = None
        return code

    def client(self, **kwargs: Any) -> httpx.Client:
        """An httpx client on the server, with the token when one is configured."""
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=30.0, **kwargs)

    def __enter__(self: _Server) -> _Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Status, headers (lower-case names) and body of one response read from ``sock``
    (framed by its Content-Length); status 0 when the server closed or reset the connection
    before the head. A socket timeout goes to the caller."""
    data = b""
    while b"\r\n\r\n" not in data:
        try:
            chunk = sock.recv(65536)
        except ConnectionError:
            chunk = b""
        if not chunk:
            return 0, {}, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    while len(body) < int(headers.get("content-length", "0")):
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1]), headers, body


def assert_error(response: httpx.Response, status: int, kind: str) -> str:
    """Assert the one error shape ``{"error": {"kind", "message"}}``; returns the message."""
    assert response.status_code == status, (response.status_code, response.text[:300])
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"kind", "message"}, body
    assert body["error"]["kind"] == kind, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return str(body["error"]["message"])
