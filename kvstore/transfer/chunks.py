"""The rules one ``KvChunk`` carrying a payload obeys, and the joins of checked chunks.

Sans-IO (bytes in, an ``Envelope`` or a typed error out): used by the server's PushKv
(through :class:`~kvstore.transfer.pushstream.PushStream`) and by the client's FetchKv
checks (:class:`~kvstore.transfer.fetch.FetchChecks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..codec.assembly import EnvelopeStream
from ..codec.checksum import crc32c
from ..codec.envelope import Envelope, decode
from ..codec.geometry import Geometry
from ..codec.layout import SUPPORTED_VERSIONS, TRAILER, TRAILER_SIZE
from ..errors import FormatError, InvalidRequestError, TooLargeError, UnsupportedVersionError
from .limits import MAX_CHUNK_PAYLOAD

__all__ = ["check_chunk", "envelope_crc_to_chunk_crc", "join_checked"]


def envelope_crc_to_chunk_crc(payload: Any) -> int:
    """``crc32c(payload)`` of an envelope whose trailer is known to be right, in O(1).

    The CRC of a message followed by its own CRC is the CRC of those four bytes continued
    from that CRC, so the store's CRC-checked bytes need no second pass. (That value is a
    constant of CRC-32C, ``0x48674BC7``, for every valid envelope: which is also why one
    pass checks both a chunk's ``crc32c`` and its envelope's trailer.)
    """
    mv = memoryview(payload)
    tail = mv[len(mv) - TRAILER_SIZE :]
    (trailer,) = TRAILER.unpack_from(tail)
    return crc32c(tail, trailer)


def check_chunk(
    block_hash: int,
    n_tokens: int,
    kv_format: int,
    payload: Any,
    crc: int,
    *,
    geometry: Geometry | None,
    versions: Sequence[int] = SUPPORTED_VERSIONS,
    crc_verified: bool = False,
) -> Envelope:
    """Validate a chunk carrying a payload; returns the decoded single-block envelope.

    Order: the ``kv_format`` is one the reader reads, the payload size, the chunk's CRC,
    every reader rule of the envelope (one CRC pass covers both CRCs), ``n_blocks == 1``,
    then the chunk's fields against the payload's own. ``crc_verified=True`` skips the CRC
    pass, for a caller that has checked both CRCs of this payload already (``FetchChecks``
    does, in the same pass that copies it).

    Raises:
        UnsupportedVersionError: ``kv_format`` or the payload's version is not read here.
        TooLargeError: the payload is over 4 MiB.
        FormatError, ShapeError: the CRC, a reader rule, or a field disagreeing.
        InvalidRequestError: the payload holds more or fewer than one block.
    """
    if kv_format and kv_format not in versions:
        raise UnsupportedVersionError(
            f"kv_format {kv_format} is not a format this server reads (it reads "
            f"{', '.join(map(str, versions))})"
        )
    size = len(payload)
    if size > MAX_CHUNK_PAYLOAD:
        raise TooLargeError(
            f"chunk payload of {size} bytes exceeds the spec's {MAX_CHUNK_PAYLOAD} bytes "
            "(4 MiB); a block this large must travel as format v2"
        )
    actual = crc if crc_verified else crc32c(payload)
    if actual != crc:
        raise FormatError(
            f"chunk crc32c {crc:#010x} does not match its payload's CRC-32C {actual:#010x}"
        )
    # The chunk's CRC is the envelope's own CRC re-based: when they agree, the envelope's
    # CRC holds without a second pass over the payload; when not, decode checks it (and
    # names the first rule that fails).
    same_crc = size >= TRAILER_SIZE and actual == envelope_crc_to_chunk_crc(payload)
    env = decode(payload, geometry, versions, verify_crc=not same_crc)
    if len(env) != 1:
        raise InvalidRequestError(f"a chunk payload holds one block, found n_blocks={len(env)}")
    block = env[0]
    if (block.hash, block.n_tokens, env.version) != (block_hash, n_tokens, kv_format):
        raise FormatError(
            f"chunk fields block_hash={block_hash:016x} n_tokens={n_tokens} kv_format="
            f"{kv_format} disagree with its payload's block_hash={block.hash:016x} "
            f"n_tokens={block.n_tokens} version={env.version}"
        )
    return env


def join_checked(parts: Sequence[Any]) -> bytes:
    """One envelope of single-block envelopes whose CRCs were verified, in order, with one
    copy and no CRC pass (``EnvelopeStream.add_checked_single`` combines their CRCs).

    The parts must share one geometry and version (as the chunks of one stream checked
    by :func:`check_chunk` against the first one's geometry do).
    """
    first = decode(parts[0], verify_crc=False)
    stream = EnvelopeStream(first.version, first.geometry, len(parts))
    records = [stream.add_checked_single(p) for p in parts]
    return b"".join([stream.header, *records, stream.trailer()])
