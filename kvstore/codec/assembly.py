"""The one builder of envelope bytes: header, records, running CRC-32C, trailer.

Every layer that puts an envelope together -- ``encode``/``join``, the store's sequences,
the archive's restore and the HTTP service's streamed prefix -- goes through here, so the
wire format (FORMAT.md, section 2) is assembled in one place:

- :func:`pack_header` and :func:`assemble` (parts in, one copy out, CRC appended), and
  :func:`from_records` over them (``split``, ``join``, ``Envelope.single``);
- :class:`EnvelopeStream`, the streaming form: the header, then records as they come,
  then the trailer, with the CRC carried along (nothing is buffered);
- :class:`SingleBlock`, the sizes and CRC constants of one-block envelopes (the store's
  unit), with which a record's CRC follows from its single-block envelope's stored CRC
  without reading the record again (``crcmath``);
- small readers of fields of envelopes already validated once: :func:`stored_crc`,
  :func:`envelope_version`, :func:`record_of`, :func:`crc_matches`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np

from .checksum import crc32c, join_crc
from .crcmath import CrcShift, crc_shift
from .geometry import Geometry
from .layout import (
    DTYPE_FOR_VERSION,
    HEADER,
    HEADER_SIZE,
    HEADER_VERSION,
    HEADER_VERSION_OFFSET,
    MAGIC,
    MIN_ENVELOPE_SIZE,
    TRAILER,
    TRAILER_SIZE,
)


def pack_header(version: int, geometry: Geometry, n_blocks: int) -> bytes:
    """The 28-byte header of an envelope of ``n_blocks`` blocks."""
    return HEADER.pack(MAGIC, version, DTYPE_FOR_VERSION[version], n_blocks, *geometry.as_tuple())


def assemble(parts: Iterable[Any]) -> bytes:
    """Header and record parts concatenated with their CRC-32C appended, in one pass that
    copies and checksums each part (``checksum.join_crc``)."""
    return join_crc(list(parts))


def from_records(version: int, geometry: Geometry, records: Sequence[Any]) -> bytes:
    """One envelope of these block records (already checked): header, records, CRC."""
    return assemble([pack_header(version, geometry, len(records)), *records])


def stored_crc(data: Any) -> int:
    """The CRC-32C an envelope's trailer holds."""
    return int(TRAILER.unpack_from(data, len(data) - TRAILER_SIZE)[0])


def envelope_version(data: Any) -> int:
    """The format version in an envelope's header."""
    return int(HEADER_VERSION.unpack_from(data, HEADER_VERSION_OFFSET)[0])


def record_of(single: Any) -> memoryview:
    """The block record (hash, fill, payload) of a one-block envelope, as a view."""
    return memoryview(single)[HEADER_SIZE : len(single) - TRAILER_SIZE]


def crc_matches(data: Any) -> bool:
    """The trailing CRC-32C of an envelope matches its bytes (False when too short to be
    one). A quick integrity check of bytes already validated once, e.g. stored ones."""
    n = len(data)
    if n < MIN_ENVELOPE_SIZE:
        return False
    return bool(crc32c(memoryview(data)[: n - TRAILER_SIZE]) == stored_crc(data))


def same_bytes(a: Any, b: Any) -> bool:
    """Byte equality of two buffers (vectorized, no copies)."""
    x = np.frombuffer(a, dtype=np.uint8)
    y = np.frombuffer(b, dtype=np.uint8)
    return x.shape == y.shape and bool(np.array_equal(x, y))


def holds_record(single: Any, version: int, record: Any) -> bool:
    """Whether the one-block envelope ``single`` is ``record`` in format ``version``."""
    return (
        len(single) == HEADER_SIZE + len(record) + TRAILER_SIZE
        and envelope_version(single) == version
        and same_bytes(record_of(single), record)
    )


class SingleBlock(NamedTuple):
    """Sizes and CRC constants of one-block envelopes for a geometry and version."""

    record_bytes: int
    single_len: int
    header1: bytes  # the header of a one-block envelope
    crc_header1: int
    k: int  # crc_header1 shifted over one record: crc(record) = crc(header1 + record) ^ k
    shift: CrcShift  # a CRC shifted over one record

    def envelope(self, record: Any) -> bytes:
        """The one-block envelope of ``record``."""
        return b"".join((self.header1, record, TRAILER.pack(crc32c(record, self.crc_header1))))

    def record_crc(self, single: Any) -> int:
        """The CRC-32C of a one-block envelope's record, from its stored CRC (no read)."""
        return stored_crc(single) ^ self.k


@lru_cache(maxsize=32)
def single_block(geometry: Geometry, version: int) -> SingleBlock:
    """The (cached) :class:`SingleBlock` constants of ``geometry`` and ``version``."""
    record = geometry.record_bytes(version)
    header1 = pack_header(version, geometry, 1)
    crc1 = crc32c(header1)
    shift = crc_shift(record)
    return SingleBlock(
        record, geometry.envelope_bytes(1, version), header1, crc1, shift(crc1), shift
    )


class EnvelopeStream:
    """An envelope written piece by piece: ``header``, each record, then ``trailer()``.

    The caller sends the pieces on (a socket, a list to join); the stream only carries
    the CRC. Records of one-block envelopes that were CRC-checked already can be added
    by :meth:`add_checked_single` without reading them again.
    """

    __slots__ = ("_crc", "_single", "header")

    def __init__(self, version: int, geometry: Geometry, n_blocks: int) -> None:
        self.header = pack_header(version, geometry, n_blocks)
        self._crc = crc32c(self.header)
        self._single = single_block(geometry, version)

    def add(self, record: Any) -> Any:
        """Account for ``record`` (read once for its CRC); returns it."""
        self._crc = crc32c(record, self._crc)
        return record

    def add_checked_single(self, single: Any) -> memoryview:
        """The record of a one-block envelope whose CRC was verified, accounted for by CRC
        combination (the record is not read); returns it as a view."""
        c = self._single
        self._crc = c.shift(self._crc) ^ c.record_crc(single)
        return record_of(single)

    def trailer(self) -> bytes:
        """The 4-byte trailer: the CRC-32C of every piece before it."""
        return TRAILER.pack(self._crc)
