"""The checks of one FetchKv stream, as the client receives it (sans-IO).

Each chunk is checked by :func:`~kvstore.transfer.chunks.check_chunk` against the first
chunk's geometry, and every chunk must be in the first chunk's format (the one asked for,
when one was). :meth:`FetchChecks.append` checks a chunk and copies its record into the
envelope being built in one pass over the payload.
"""

from __future__ import annotations

from typing import Any

from ..codec.assembly import SingleBlock, record_of, single_block, stored_crc
from ..codec.builder import BytesBuilder
from ..codec.checksum import crc32c
from ..codec.envelope import Envelope
from ..codec.geometry import Geometry
from ..codec.layout import HEADER_SIZE, TRAILER_SIZE
from ..errors import FormatError
from . import limits
from .chunks import check_chunk

__all__ = ["FetchChecks", "fetch_capacity"]


class FetchChecks:
    """The checks of one FetchKv stream's chunks: each by :func:`check_chunk` against the
    first chunk's geometry, all in the first chunk's format (``kv_format``'s when one was
    asked for). ``append`` checks a chunk and copies its record into the envelope being
    built in one pass over the payload."""

    def __init__(self, kv_format: int = 0) -> None:
        self.kv_format = kv_format
        self.geometry: Geometry | None = None
        self.version = 0
        self.single: SingleBlock | None = None
        self.count = 0  # chunks checked so far

    def check(self, chunk: Any, *, crc_verified: bool = False) -> Envelope:
        """The chunk's checked single-block envelope (views into its payload).

        Raises:
            FormatError: a check of ``check_chunk`` failed, or the chunk's format is not
                the stream's (or the one asked for). UnsupportedVersionError, ShapeError,
                InvalidRequestError, TooLargeError: as ``check_chunk`` raises them.
        """
        env = check_chunk(
            chunk.block_hash,
            chunk.n_tokens,
            chunk.kv_format,
            chunk.payload,
            chunk.crc32c,
            geometry=self.geometry,
            crc_verified=crc_verified,
        )
        if self.geometry is None:
            self.geometry, self.version = env.geometry, env.version
            self.single = single_block(env.geometry, env.version)
        elif env.version != self.version:
            raise FormatError(
                f"FetchKv chunk {self.count} is format v{env.version}, the stream's first "
                f"was v{self.version}"
            )
        if self.kv_format and env.version != self.kv_format:
            raise FormatError(
                f"FetchKv asked for format v{self.kv_format}, chunk {self.count} is v{env.version}"
            )
        self.count += 1
        return env

    def append(self, chunk: Any, out: BytesBuilder) -> int:
        """Check a chunk and append its block record to ``out``; returns the record's CRC.

        A payload with the stream's one-block header is copied and checksummed in one pass
        (``BytesBuilder.write_crc``), and its two CRCs are checked from that one; the rest
        of ``check_chunk`` then runs without a CRC pass. Any other payload, and any CRC
        that does not match, goes through ``check_chunk`` whole (which raises the rule that
        failed): what ``out`` holds then is never returned.
        """
        single, p = self.single, chunk.payload
        if (
            single is not None
            and len(p) == single.single_len
            and chunk.kv_format == self.version
            and p[:HEADER_SIZE] == single.header1
        ):
            record = out.write_crc(record_of(p))
            envelope_crc = record ^ single.k
            tail = p[single.single_len - TRAILER_SIZE :]
            if stored_crc(p) == envelope_crc and crc32c(tail, envelope_crc) == chunk.crc32c:
                self.check(chunk, crc_verified=True)
                return int(record)
            self.check(chunk)  # raises the failed CRC rule
            raise FormatError("rule 'the CRC matches' failed")  # not reached
        self.check(chunk)
        assert self.single is not None
        out.write(record_of(p))
        return self.single.record_crc(p)


def fetch_capacity(
    asked_hashes: int, asked_tokens: int, geometry: Geometry, single: SingleBlock
) -> int:
    """Bytes of the envelope of every block a FetchKv request asks for (by ``asked_hashes``
    hashes, else by ``asked_tokens`` tokens): the most its stream can carry, at most
    ``limits.FETCH_RESERVE_BYTES`` (the builder grows past that)."""
    asked = asked_hashes or asked_tokens // geometry.block_tokens + 1
    need = HEADER_SIZE + asked * single.record_bytes + TRAILER_SIZE
    return min(need, limits.FETCH_RESERVE_BYTES)
