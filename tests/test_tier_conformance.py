"""The tier's backend contract (``kvstore.testing.TierBackendTests``) run against both
backends: ``s3://`` (moto's S3 API on loopback, objects read out of band with boto3) and
``file://`` (a directory).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from s3_server import S3Server

from kvstore.testing import TierBackend, TierBackendTests


def _file_backend(parent: Path, name: str) -> TierBackend:
    root = parent / name

    def read_raw(key: str) -> bytes | None:
        try:
            return (root / key).read_bytes()
        except FileNotFoundError:
            return None

    def write_raw(key: str, data: bytes) -> None:
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)

    return TierBackend(
        "file", f"file://{root}", None, read_raw, write_raw, lambda n: _file_backend(parent, n)
    )


def _s3_backend(server: S3Server, bucket: str, name: str) -> TierBackend:
    s3 = server.client()
    prefix = f"fleet/{name}"

    def read_raw(key: str) -> bytes | None:
        try:
            body = s3.get_object(Bucket=bucket, Key=f"{prefix}/{key}")["Body"]  # type: ignore[attr-defined]
        except s3.exceptions.NoSuchKey:  # type: ignore[attr-defined]
            return None
        return bytes(body.read())

    def write_raw(key: str, data: bytes) -> None:
        s3.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=data)  # type: ignore[attr-defined]

    return TierBackend(
        "s3",
        f"s3://{bucket}/{prefix}",
        server.endpoint,
        read_raw,
        write_raw,
        lambda n: _s3_backend(server, bucket, n),
    )


class TestTierBackends(TierBackendTests):
    """Every case of the contract on ``s3`` and ``file``."""

    @pytest.fixture(params=["s3", "file"])
    def backend(self, request: pytest.FixtureRequest, tmp_path: Path) -> TierBackend:
        """A fresh, empty tier root on each backend: ``s3://<new bucket>/fleet/a`` or
        ``file://<tmp>/fleet/a``."""
        if request.param == "file":
            return _file_backend(tmp_path / "fleet", "a")
        server: S3Server = request.getfixturevalue("s3_server")
        return _s3_backend(server, server.new_bucket(), "a")
