"""Archives to and from s3:// URLs on moto's S3 API: create (multipart), restore, verify,
ls, extract (ranged GETs of the seek index and one frame)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SMALL, make_envelope
from s3_server import S3Server

from kvstore import Store, decode
from kvstore.archive.operations import create, extract, list_archive, restore, verify
from kvstore.archive.sources import ObjectSource
from kvstore.errors import TruncatedArchiveError


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    return s3_server


def _filled(path: Path) -> tuple[Store, list[bytes]]:
    store = Store(path)
    envelopes = [make_envelope(SMALL, 4 * 30 + 2, seed=s) for s in (21, 22)]
    for e in envelopes:
        store.put(e)
    store.put_sequence("chat-1", envelopes[0])
    return store, envelopes


def test_archive_round_trip_through_s3(tmp_path: Path, s3_env: S3Server) -> None:
    bucket = s3_env.new_bucket()
    url = f"s3://{bucket}/backups/node-a.tlkv"
    local = tmp_path / "local.tlkv"
    src, envelopes = _filled(tmp_path / "src")
    with src:
        summary = create(src, url)
        create(src, local)
        hashes = [int(h) for h in decode(envelopes[1]).hashes if h]
        want = src.get(hashes[7])
    # the object is the same archive a local create writes, byte for byte
    body = s3_env.client().get_object(Bucket=bucket, Key="backups/node-a.tlkv")["Body"].read()  # type: ignore[attr-defined]
    assert body == local.read_bytes() and summary.archive_bytes == len(body)
    report = verify(url)
    assert report.archive_bytes == len(body) and report.blocks == summary.manifest.blocks
    listing = list_archive(url)
    assert listing.to_dict() == list_archive(local).to_dict()
    out = tmp_path / "one.tlkv"
    assert extract(url, hashes[7], out) == len(want)  # type: ignore[arg-type]
    assert out.read_bytes() == want
    with Store(tmp_path / "dst") as dst:
        restore(url, dst)
        assert dst.get_sequence("chat-1") == envelopes[0]
        assert dst.get(hashes[7]) == want


def test_extract_reads_the_index_and_one_frame(tmp_path: Path, s3_env: S3Server) -> None:
    bucket = s3_env.new_bucket()
    url = f"s3://{bucket}/a.tlkv"
    src, envelopes = _filled(tmp_path / "src")
    with src:
        create(src, url)
    reads: list[tuple[int, int]] = []
    real = ObjectSource.pread

    def counting(self: ObjectSource, size: int, offset: int) -> memoryview:
        reads.append((offset, size))
        return real(self, size, offset)

    ObjectSource.pread = counting  # type: ignore[method-assign]
    try:
        h = int(decode(envelopes[1]).hashes[3])
        extract(url, h, tmp_path / "x.tlkv")
    finally:
        ObjectSource.pread = real  # type: ignore[method-assign]
    size = ObjectSource(url).size
    assert sum(n for _, n in reads) < size  # never the whole archive
    # footer, index, manifest frame, the block's frame
    assert len(reads) <= 4, reads


def test_archive_errors_on_s3(tmp_path: Path, s3_env: S3Server) -> None:
    bucket = s3_env.new_bucket()
    with pytest.raises(FileNotFoundError):
        verify(f"s3://{bucket}/absent.tlkv")
    s3_env.client().put_object(Bucket=bucket, Key="short.tlkv", Body=b"TLKV" * 3)  # type: ignore[attr-defined]
    with pytest.raises(TruncatedArchiveError):
        list_archive(f"s3://{bucket}/short.tlkv")


@pytest.mark.slow  # two CLI processes
def test_cli_create_and_restore_s3(tmp_path: Path, s3_env: S3Server) -> None:
    bucket = s3_env.new_bucket()
    url = f"s3://{bucket}/cli.tlkv"
    src, envelopes = _filled(tmp_path / "src")
    src.close()
    env = {**os.environ, "AWS_ENDPOINT_URL": s3_env.endpoint}

    def tlkv(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "kvstore", *args]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)

    r = tlkv("archive", "create", "--data", str(tmp_path / "src"), "-o", url)
    assert r.returncode == 0, r.stderr
    r = tlkv("archive", "restore", url, "--data", str(tmp_path / "dst"))
    assert r.returncode == 0, r.stderr
    with Store(tmp_path / "dst") as dst:
        assert dst.get_sequence("chat-1") == envelopes[0]
