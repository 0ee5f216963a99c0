"""A real S3 API on loopback for the tier's tests: moto's server mode on a free port.

``S3Server`` owns one ``ThreadedMotoServer`` (in this process). ``S3Process`` runs moto
in a subprocess whose ``kill`` drops every connection at once (a stopped in-process
server keeps serving its open keep-alive connections): an unreachable tier; ``start``
brings it back on the same port, empty.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import boto3
from http_server import free_port
from moto.server import ThreadedMotoServer

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "tlkv-test",
    "AWS_SECRET_ACCESS_KEY": "tlkv-test-secret",
    "AWS_REGION": "us-east-1",
}


class S3Server:
    """moto's S3 server on ``127.0.0.1:port``."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server: ThreadedMotoServer | None = None

    def start(self) -> None:
        for _ in range(50):  # the port may linger a moment after stop()
            try:
                server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
                server.start()
                break
            except OSError:
                time.sleep(0.1)
        else:
            raise RuntimeError(f"cannot restart moto on port {self.port}")
        self._server = server
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("moto did not start")

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def client(self) -> object:
        """A boto3 S3 client of this server (bucket management)."""
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name=CREDENTIALS["AWS_REGION"],
        )

    def new_bucket(self) -> str:
        """A fresh, empty bucket's name."""
        name = f"tlkv-{uuid.uuid4().hex[:16]}"
        self.client().create_bucket(Bucket=name)  # type: ignore[attr-defined]
        return name


class S3Process(S3Server):
    """moto's S3 server in a subprocess on ``127.0.0.1:port``."""

    def __init__(self) -> None:
        super().__init__()
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                self.client().list_buckets()  # type: ignore[attr-defined]
                return
            except Exception:
                time.sleep(0.05)
        raise RuntimeError("moto did not start")

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait(10)
            self._proc = None


def set_credentials() -> None:
    """The standard AWS variables the tier reads (moto accepts any credentials)."""
    os.environ.update(CREDENTIALS)
