"""``BytesBuilder``: one new ``bytes`` object filled part by part, without a join.

A result assembled from parts that arrive one at a time (``TransferClient.fetch``'s
envelope, from a stream of chunks) would otherwise be written into a growing buffer and
copied once more, or joined at the end. The compiled builder
(``kvstore.codec._native.BytesBuilder``) writes straight into the ``bytes`` object it
returns: each part is copied once (``write_crc`` checksums it in the same pass), with the
GIL released (the next part keeps arriving meanwhile), onto pages populated with one
``madvise`` call per part (no 4 KiB page fault per page; no huge-page advice, which costs
more than it saves on a VM whose idle memory went back to the host: see
``_native/builder.c``), and
``finish()`` trims the object to its size in place. ``view(n)`` hands out the room after
what is written as a writable view, for a reader that fills it in place (a socket's
``recv_into``: the client's envelope reads), and ``advance(n)`` counts it. Without the
compiled module the same interface runs on a ``bytearray`` (one more copy at ``finish()``).
"""

from __future__ import annotations

from typing import Any

from .checksum import crc32c

__all__ = ["BytesBuilder", "PyBytesBuilder"]


class PyBytesBuilder:
    """The portable builder: the interface of ``_native.BytesBuilder`` over a bytearray
    (``_size`` of its bytes written; the rest is room handed out by ``view``)."""

    def __init__(self, capacity: int = 0) -> None:
        if capacity < 0:
            raise ValueError("BytesBuilder: capacity must be >= 0")
        self._buf: bytearray | None = bytearray()
        self._size = 0

    def _ready(self) -> bytearray:
        if self._buf is None:
            raise ValueError("BytesBuilder: already finished")
        return self._buf

    def __len__(self) -> int:
        return self._size if self._buf is not None else 0

    def write(self, data: Any) -> int:
        """Append a C-contiguous buffer; returns the size written so far."""
        buf = self._ready()
        part = memoryview(data).cast("B")
        end = self._size + len(part)
        if end > len(buf):
            buf.extend(bytes(end - len(buf)))  # BufferError while a view is held
        buf[self._size : end] = part
        self._size = end
        return end

    def write_crc(self, data: Any, crc: int = 0) -> int:
        """Append a C-contiguous buffer; returns its CRC-32C continuing ``crc``."""
        crc = crc32c(data, crc)
        self.write(data)
        return crc

    def write_at(self, offset: int, data: Any) -> None:
        """Overwrite bytes already written, from ``offset``."""
        buf = self._ready()
        part = memoryview(data).cast("B")
        if offset < 0 or len(part) > self._size - offset:
            raise ValueError(
                f"BytesBuilder.write_at: {len(part)} bytes at offset {offset} are not "
                f"within the {self._size} written"
            )
        buf[offset : offset + len(part)] = part

    def view(self, n: int) -> memoryview:
        """A writable view of the ``n`` bytes after those written, to fill in place and
        count with ``advance``."""
        if n < 0:
            raise ValueError("BytesBuilder.view: n must be >= 0")
        buf = self._ready()
        end = self._size + n
        if end > len(buf):
            buf.extend(bytes(end - len(buf)))
        return memoryview(buf)[self._size : end]

    def advance(self, n: int) -> int:
        """Count the ``n`` bytes after those written as written (filled through ``view``)."""
        buf = self._ready()
        if n < 0 or n > len(buf) - self._size:
            raise ValueError(
                f"BytesBuilder.advance: {n} bytes are not within the {len(buf) - self._size} "
                f"of room after the {self._size} written"
            )
        self._size += n
        return self._size

    def finish(self) -> bytes:
        """The bytes written; the builder is spent."""
        buf = self._ready()
        del buf[self._size :]  # BufferError while a view is held, as the compiled builder
        self._buf = None
        return bytes(buf)


try:
    from ._native import BytesBuilder
except ImportError:  # pragma: no cover - only where the build had no compiler
    BytesBuilder = PyBytesBuilder  # type: ignore[assignment,misc]
