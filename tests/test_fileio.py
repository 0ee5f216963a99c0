"""kvstore.fileio: atomic outputs, writeback hints, dropping mapped pages."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

from kvstore import fileio


def test_atomic_file_appears_whole_with_umask_permissions(tmp_path: Path) -> None:
    out = tmp_path / "out.bin"
    data = os.urandom(3 * fileio.WRITEBACK_BYTES // 2)  # crosses a writeback request
    with fileio.atomic_file(out) as f:
        f.write(data[:100])
        f.write(memoryview(data)[100:])
        assert not out.exists()
    assert out.read_bytes() == data
    assert out.stat().st_mode & 0o777 == 0o666 & ~fileio.current_umask()
    assert os.listdir(tmp_path) == ["out.bin"]


def test_atomic_file_leaves_nothing_on_error(tmp_path: Path) -> None:
    out = tmp_path / "out.bin"
    with pytest.raises(RuntimeError), fileio.atomic_file(out) as f:
        f.write(b"partial")
        raise RuntimeError("fail mid-write")
    assert os.listdir(tmp_path) == []


def test_start_writeback(tmp_path: Path) -> None:
    p = tmp_path / "f"
    p.write_bytes(b"x" * 65536)
    fd = os.open(p, os.O_RDWR)
    try:
        assert fileio.start_writeback(fd) is fileio.writeback_available()
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        if fileio.writeback_available():
            fileio.start_writeback(fd)  # closed descriptor
        else:
            raise OSError("no writeback here")


def test_drop_mapped_pages_keeps_the_data(tmp_path: Path) -> None:
    p = tmp_path / "m"
    data = os.urandom(8 * mmap.PAGESIZE)
    p.write_bytes(data)
    with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        view = memoryview(m)
        assert bytes(view) == data
        fileio.drop_mapped_pages([view[mmap.PAGESIZE :], b"not a view", view[:10]])
        assert bytes(view) == data  # a shared file mapping: pages come back from the file
        view.release()
