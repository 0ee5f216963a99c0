"""Where an archive's bytes live: a local file, or an object of an object store.

Readers take a :class:`Source` (positioned reads of a known size): ``FileSource`` over a
file descriptor (``os.pread``), ``ObjectSource`` over one object (a ranged GET per read:
opening an archive reads its seek index, extracting a block reads one frame). Writers get
``open_output``: ``fileio.atomic_file`` for a path, a streamed multipart upload for an
object URL (``s3://bucket/key``; the object appears only when the upload completes, so a
failure never leaves a partial archive under the name).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, BinaryIO, Protocol

from ..errors import TruncatedArchiveError
from ..fileio import atomic_file
from ..tier import ObjectClient, is_object_url, parse_url


class Source(Protocol):
    """Positioned reads from an archive of ``size`` bytes, named ``name``."""

    name: str
    size: int

    def pread(self, size: int, offset: int) -> Any:
        """Up to ``size`` bytes at ``offset`` (fewer only at the end)."""
        ...

    def close(self) -> None:
        """Release what the source holds."""
        ...


class FileSource:
    """A local file (or an open descriptor, which stays the caller's)."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *, fd: int = -1) -> None:
        self._own = fd < 0
        self.fd = os.open(path, os.O_RDONLY) if self._own else fd  # type: ignore[arg-type]
        self.name = os.fspath(path) if path is not None else f"fd {fd}"
        try:
            self.size = os.fstat(self.fd).st_size
        except BaseException:
            self.close()
            raise

    def pread(self, size: int, offset: int) -> bytes:
        return os.pread(self.fd, size, offset)

    def close(self) -> None:
        if self._own and self.fd >= 0:
            os.close(self.fd)
        self.fd = -1


def split_object_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b.tlkv`` as the bucket's URL and the key ``a/b.tlkv``.

    Raises:
        ValueError: not an s3 URL naming an object.
    """
    parsed = parse_url(url)
    if parsed.scheme != "s3" or not parsed.path:
        raise ValueError(f"an archive object URL is s3://bucket/key, found {url!r}")
    return f"s3://{parsed.bucket}", parsed.path


class ObjectSource:
    """One object: each read is a ranged GET (endpoint and credentials: AWS_* variables)."""

    def __init__(self, url: str) -> None:
        root, self.key = split_object_url(url)
        self.client = ObjectClient(root)
        self.name = url
        self.size = self.client.size(self.key)

    def pread(self, size: int, offset: int) -> memoryview:
        if size <= 0 or offset >= self.size:
            return memoryview(b"")
        return memoryview(self.client.get_range(self.key, offset, min(size, self.size - offset)))

    def close(self) -> None:
        pass


def local_path(target: str | os.PathLike[str]) -> str | None:
    """The local path ``target`` names (a ``file://`` URL too); None for an s3 URL."""
    text = os.fspath(target)
    if not is_object_url(text):
        return text
    parsed = parse_url(text)
    return parsed.path if parsed.scheme == "file" else None


def open_source(target: str | os.PathLike[str]) -> Source:
    """The archive at ``target``: a path, ``file:///path`` or ``s3://bucket/key``.

    Raises:
        FileNotFoundError: no such file or object.  TierError: the object store failed.
    """
    path = local_path(target)
    if path is not None:
        return FileSource(path)
    return ObjectSource(os.fspath(target))


def read_exact(source: Source, size: int, offset: int, what: str) -> Any:
    """Exactly ``size`` bytes at ``offset``, or ``TruncatedArchiveError``."""
    data = source.pread(size, offset)
    if len(data) != size:
        raise TruncatedArchiveError(
            f"{what}: expected {size} bytes at offset {offset}, found {len(data)} (truncated)"
        )
    return data


@contextlib.contextmanager
def open_output(target: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """A file to write an archive to: temp file + rename for a path, a streamed multipart
    upload (bounded memory) for an ``s3://`` URL, completed only when the body succeeds."""
    path = local_path(target)
    if path is not None:
        with atomic_file(path) as out:
            yield out
        return
    root, key = split_object_url(os.fspath(target))
    writer = ObjectClient(root).open_writer(key)
    yield writer
    writer.close()  # completes the upload; on an exception it is left incomplete (no object)
