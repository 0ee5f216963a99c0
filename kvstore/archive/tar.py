"""The tar layer of an archive, sans-IO: ustar/pax member headers written and parsed strictly
(ARCHIVE.md 2). It knows nothing of zstd, envelopes or files: headers must be byte-identical
to the ones the writer produces, names and sizes are checked against the caller's limits.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..errors import ArchiveError, UnsafeArchiveError

# --- tar (POSIX.1-1988 ustar, POSIX.1-2001 pax) -------------------------------------------

TAR_BLOCK = 512
# name, mode, uid, gid, size, mtime, chksum, typeflag, linkname, magic, version, uname, gname,
# devmajor, devminor, prefix, pad: the 512-byte ustar header (ARCHIVE.md 2.1).
USTAR_HEADER = struct.Struct("100s8s8s8s12s12s8s1s100s6s2s32s32s8s8s155s12s")
assert USTAR_HEADER.size == TAR_BLOCK
USTAR_CHKSUM_OFFSET = 148
USTAR_CHKSUM_SIZE = 8
USTAR_NAME_MAX = 100
USTAR_SIZE_DIGITS = 11  # 12-byte size field: 11 octal digits and a NUL
TYPE_FILE = b"0"
TYPE_PAX = b"x"
FILE_MODE = b"0000644\0"
ZERO_ID = b"0000000\0"  # uid, gid, devmajor, devminor
ZERO_MTIME = b"00000000000\0"
USTAR_MAGIC = b"ustar\0"
USTAR_VERSION = b"00"
PAX_HEADER_NAME = "././@PaxHeader"
PAX_PATH_KEY = "path"
PAX_MAX_BYTES = TAR_BLOCK  # one pax record "NNN path=<= 148 chars>\n" always fits
# The end-of-archive marker: two zero blocks, alone in the last data frame.
END_OF_ARCHIVE = bytes(2 * TAR_BLOCK)


# --- tar headers --------------------------------------------------------------------------


def _octal(value: int, digits: int) -> bytes:
    return b"%0*o\0" % (digits, value)


def ustar_header(name: str, size: int, typeflag: bytes = TYPE_FILE) -> bytes:
    """The canonical 512-byte ustar header of a regular file (or pax header) member."""
    raw = name.encode("ascii")[:USTAR_NAME_MAX]
    if not 0 <= size < 8**USTAR_SIZE_DIGITS:
        raise ValueError(f"tar member {name!r}: size {size} does not fit the ustar size field")
    fields = [
        raw,
        FILE_MODE,
        ZERO_ID,
        ZERO_ID,
        _octal(size, USTAR_SIZE_DIGITS),
        ZERO_MTIME,
        b" " * USTAR_CHKSUM_SIZE,
        typeflag,
        b"",
        USTAR_MAGIC,
        USTAR_VERSION,
        b"",
        b"",
        ZERO_ID,
        ZERO_ID,
        b"",
        b"",
    ]
    header = bytearray(USTAR_HEADER.pack(*fields))
    chksum = sum(header)
    header[USTAR_CHKSUM_OFFSET : USTAR_CHKSUM_OFFSET + USTAR_CHKSUM_SIZE] = b"%06o\0 " % chksum
    return bytes(header)


def _pax_record(key: str, value: str) -> bytes:
    """One pax record ``"<len> key=value\\n"``, its length counting its own digits."""
    body = f" {key}={value}\n".encode("ascii")
    length = len(body) + 1
    while len(str(length)) + len(body) != length:
        length += 1
    return str(length).encode("ascii") + body


def padding(size: int) -> bytes:
    """Zero bytes after ``size`` bytes of member data up to the next 512-byte boundary."""
    return bytes(-size % TAR_BLOCK)


def padded(size: int) -> int:
    """``size`` rounded up to a multiple of 512."""
    return size + (-size % TAR_BLOCK)


def member_prefix(name: str, size: int) -> bytes:
    """The headers before a member's data: a pax ``path`` member when the name is longer
    than 100 bytes, then the ustar header."""
    if len(name) <= USTAR_NAME_MAX:
        return ustar_header(name, size)
    record = _pax_record(PAX_PATH_KEY, name)
    pax = ustar_header(PAX_HEADER_NAME, len(record), TYPE_PAX) + record + padding(len(record))
    return pax + ustar_header(name, size)


def member_size(name: str, size: int) -> int:
    """Bytes a member occupies in the tar stream: headers, data and padding."""
    return len(member_prefix(name, 0)) + padded(size)


@dataclass(frozen=True)
class Member:
    """One tar member of a frame: its name, where its headers start, and its data (a view)."""

    name: str
    frame: int
    offset: int
    data: memoryview


def _parse_octal(field: bytes, where: str) -> int:
    text = field.rstrip(b"\0")
    if not text or not all(48 <= c <= 55 for c in text):
        raise ArchiveError(f"{where}: expected an octal number, found {field!r}")
    return int(text, 8)


def _parse_header(frame: memoryview, offset: int, where: str) -> tuple[str, int, bytes]:
    """(name, size, typeflag) of the header at ``offset``; the header must be canonical."""
    if offset + TAR_BLOCK > len(frame):
        raise ArchiveError(f"{where}: tar header runs past the end of its frame")
    raw = bytes(frame[offset : offset + TAR_BLOCK])
    if not any(raw):
        raise ArchiveError(f"{where}: end-of-archive zero block before the last frame")
    fields = USTAR_HEADER.unpack(raw)
    name_field, size_field, typeflag = fields[0], fields[4], fields[7]
    name_bytes = name_field.split(b"\0", 1)[0]
    try:
        name = name_bytes.decode("ascii")
    except UnicodeDecodeError:
        raise UnsafeArchiveError(f"{where}: member name is not ASCII: {name_bytes!r}") from None
    if typeflag not in (TYPE_FILE, TYPE_PAX):
        raise UnsafeArchiveError(
            f"{where}: member {name!r} has tar type {typeflag!r}; only regular files ('0') "
            f"are allowed (no links, devices or directories)"
        )
    size = _parse_octal(size_field, f"{where}: size field of {name!r}")
    if raw != ustar_header(name, size, typeflag):
        raise ArchiveError(
            f"{where}: tar header of {name!r} is not canonical (mode, owner, mtime, magic, "
            f"checksum or padding differ from ARCHIVE.md 2.1)"
        )
    return name, size, typeflag


def _parse_pax(data: memoryview, where: str) -> str:
    """The path of a pax header holding exactly one canonical ``path`` record."""
    raw = bytes(data)
    try:
        text = raw.decode("ascii")
        length_text, rest = text.split(" ", 1)
        key, value = rest[:-1].split("=", 1)
    except (UnicodeDecodeError, ValueError):
        raise ArchiveError(f"{where}: malformed pax header {raw[:64]!r}") from None
    if key != PAX_PATH_KEY or _pax_record(key, value) != raw or length_text != str(len(raw)):
        raise ArchiveError(f"{where}: pax header must hold exactly one path record")
    if len(value) <= USTAR_NAME_MAX:
        raise ArchiveError(f"{where}: pax header for a name that fits the ustar header")
    return value


def iter_members(
    frame: memoryview, index: int, limit: Callable[[str], int] | None = None
) -> Iterator[Member]:
    """Every member of one decompressed frame, strictly parsed (ARCHIVE.md 2).

    ``limit(name)`` gives the largest data size allowed for a name (and raises for a name
    that is not allowed); it is called before the data is sliced.
    """
    offset = 0
    end = len(frame)
    while offset < end:
        where = f"frame {index}, offset {offset}"
        start = offset
        name, size, typeflag = _parse_header(frame, offset, where)
        offset += TAR_BLOCK
        if typeflag == TYPE_PAX:
            if name != PAX_HEADER_NAME or size > PAX_MAX_BYTES or offset + size > end:
                raise ArchiveError(f"{where}: malformed pax header member {name!r}")
            long_name = _parse_pax(frame[offset : offset + size], where)
            offset += padded(size)
            name, size, typeflag = _parse_header(frame, offset, where)
            if typeflag != TYPE_FILE or name != long_name[:USTAR_NAME_MAX]:
                raise ArchiveError(f"{where}: pax header not followed by its member")
            name = long_name
            offset += TAR_BLOCK
        elif len(name) >= USTAR_NAME_MAX and name.startswith(PAX_HEADER_NAME):
            raise ArchiveError(f"{where}: stray pax header name {name!r}")
        if limit is not None:
            allowed = limit(name)
            if size > allowed:
                raise UnsafeArchiveError(
                    f"{where}: member {name!r} is {size} bytes, larger than the "
                    f"{allowed} bytes the format allows"
                )
        if offset + padded(size) > end:
            raise ArchiveError(f"{where}: member {name!r} ({size} bytes) runs past its frame")
        pad = frame[offset + size : offset + padded(size)]
        if any(pad):
            raise ArchiveError(f"{where}: padding after {name!r} is not zero")
        yield Member(name, index, start, frame[offset : offset + size])
        offset += padded(size)
