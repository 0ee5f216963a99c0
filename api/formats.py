"""The envelope versions a server reads (``tlkv serve --formats``), enforced on HTTP and gRPC.

A v1-only server (drill ops.04, ``--formats 1``) refuses a v2 envelope with 415 ``version``
on ``PUT /v1/blocks`` and ``PUT /v1/sequences/{name}``, as its gRPC side answers
FAILED_PRECONDITION; it refuses a read asking for v2 (``?format=2``, ``kv_format=2``) the
same way, and answers a read without a format in its own format (a v2 block or sequence
another writer stored is sent transcoded): it never sends an envelope version it does not
read.
The codec's reader order holds: a damaged v2 envelope is still a
``format`` error (its CRC is checked before its version is refused).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstore.codec.assembly import envelope_version
from kvstore.codec.envelope import decode, transcode
from kvstore.codec.layout import SUPPORTED_VERSIONS
from kvstore.errors import (
    ChecksumError,
    EnvelopeError,
    UnconvertibleError,
    UnsupportedVersionError,
)


def require_formats(body: Any, formats: Sequence[int]) -> Any:
    """Refuse an envelope whose version is not in ``formats`` (other rules: the store's).

    Returns:
        What to hand the store: the ``Envelope`` decoded here (on a server that does not
        read every version; the store takes it without decoding it again, and checks the
        CRC as it copies it), else ``body`` itself.

    Raises:
        UnsupportedVersionError: the version is not read here (HTTP 415).
        FormatError: the envelope is damaged before its version could be refused.
    """
    if tuple(formats) == SUPPORTED_VERSIONS:
        return body
    try:
        return decode(body, versions=formats, verify_crc=False)
    except (UnsupportedVersionError, ChecksumError):
        raise  # the version refused, or the CRC the codec checks before refusing it
    except EnvelopeError:
        return body  # any other rule: the store's validation reports it


def read_version(asked: int | None, formats: Sequence[int]) -> int | None:
    """The version a block read answers in: ``asked`` when given, else as stored (None) on
    a server reading every version, else the newest version the server reads.

    Raises:
        UnsupportedVersionError: ``asked`` is not a version this server reads (HTTP 415,
            gRPC FAILED_PRECONDITION).
    """
    formats = tuple(formats)
    if asked is not None and asked not in formats:
        raise UnsupportedVersionError(
            f"format {asked} is not a format this server reads "
            f"(it reads {', '.join(map(str, formats))})"
        )
    if asked is not None or formats == SUPPORTED_VERSIONS:
        return asked
    return formats[-1]


def served(data: bytes, formats: Sequence[int], what: str) -> bytes:
    """A stored envelope as this server sends it: as stored, or transcoded to its newest
    version when it does not read the stored one (``--formats``).

    Raises:
        UnconvertibleError: the stored data cannot be converted (HTTP 409).
    """
    version = read_version(None, formats)
    if version is None or envelope_version(data) == version:
        return data
    try:
        return transcode(data, version)
    except ValueError as exc:
        raise UnconvertibleError(f"{what} cannot be converted to format {version}: {exc}") from None
