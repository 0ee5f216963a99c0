"""The rules of one PushKv stream, as a sans-IO state machine both sides run.

The receiver (``api.grpc_push``) feeds it every chunk as it arrives; the sender
(``TransferClient.push``, through :func:`plan_push`) runs the same rules over the chunks it
is about to send, so a stream the server would refuse for its shape is refused before
anything travels. The rules, in the order they are applied:

1. ``note`` (in stream order, as each chunk arrives): the sequence name is given on the
   first chunk only (a later chunk may repeat it) and is a valid name; the stream's
   payload bytes stay within the receiver's limit.
2. ``check`` (any thread, each chunk alone): token ids (tlkv's extension) are absent, or
   exactly ``n_tokens`` of them on a full block (hash not 0; the store checks that they
   hash to it); an empty payload is a reference to a full block: it names a format the
   receiver reads, its ``crc32c`` is 0 and its hash is not 0 (the partial tail always
   carries its payload); a payload obeys every rule of
   :func:`~kvstore.transfer.chunks.check_chunk` against the receiver's geometry.
3. ``take`` (once the stream has ended, the checked chunks in stream order): one geometry
   per stream, a referenced block is full (``n_tokens`` is the geometry's
   ``block_tokens``), and a named sequence is one envelope: every payload in one format.

What is left for the receiver is the rule only its store can answer: a referenced block
is held (sent earlier in the stream, or stored).
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Any, NamedTuple

from ..codec.envelope import Envelope
from ..codec.geometry import Geometry
from ..codec.layout import NO_HASH, SUPPORTED_VERSIONS
from ..codec.tokens import BlockTokens
from ..errors import (
    FormatError,
    InvalidRequestError,
    ShapeError,
    TlkvError,
    TooLargeError,
    UnsupportedVersionError,
)
from ..protocol import SEQUENCE_NAME_MAX, is_sequence_name
from .chunks import check_chunk
from .wirechunk import WireChunk

__all__ = ["Checked", "PushStream", "plan_push"]


class Checked(NamedTuple):
    """A chunk past its own rules: its hash, the envelope that carries its block (None for
    a reference), and its format.

    On the receiver the envelope is the one :func:`~kvstore.transfer.chunks.check_chunk`
    decoded from the chunk's payload (the store takes it without decoding it again); in
    :func:`plan_push` it is the sender's envelope the block travels from."""

    block_hash: int
    envelope: Envelope | None
    kv_format: int

    @property
    def geometry(self) -> Geometry | None:
        """The carrying envelope's geometry (None for a reference)."""
        return None if self.envelope is None else self.envelope.geometry


class PushStream:
    """One PushKv stream's rules (see the module docstring), and what it amounts to.

    Args:
        formats: envelope versions the receiver reads.
        geometry: the receiver's geometry (None: the first payload's sets the stream's).
        max_bytes: payload bytes the receiver takes in one stream (None: no limit).

    Once ``take`` has run: ``name`` is the sequence the stream names (or None),
    ``entries`` its ``(hash, envelope or None, kv_format)`` in stream order (the
    envelope as ``Checked`` holds it), ``referenced``
    its empty-payload chunks, ``payload_bytes`` the bytes that travelled, and ``version``
    the format of a named sequence (None without a name).
    """

    def __init__(
        self,
        formats: Sequence[int] = SUPPORTED_VERSIONS,
        *,
        geometry: Geometry | None = None,
        max_bytes: int | None = None,
    ) -> None:
        self.formats = tuple(formats)
        self.receiver_geometry = geometry
        self.max_bytes = max_bytes
        self.name: str | None = None
        self.count = 0
        self.payload_bytes = 0
        self.entries: list[tuple[int, Envelope | None, int]] = []
        self.referenced = 0
        self.version: int | None = None

    def note(self, chunk: Any) -> int:
        """The order-dependent rules of the next chunk; returns its index.

        Raises:
            InvalidRequestError: a bad sequence name, or one given after the first chunk.
            TooLargeError: the stream's payloads exceed ``max_bytes``.
        """
        index = self.count
        self.count += 1
        if chunk.sequence:
            if index == 0:
                if not is_sequence_name(chunk.sequence):
                    raise InvalidRequestError(
                        f"a sequence name is 1-{SEQUENCE_NAME_MAX} characters of "
                        f"[A-Za-z0-9._-], found {chunk.sequence[:140]!r}"
                    )
                self.name = chunk.sequence
            elif chunk.sequence != self.name:
                raise InvalidRequestError(
                    f"chunk {index}: the sequence name is given on the first chunk only"
                )
        self.payload_bytes += len(chunk.payload)
        if self.max_bytes is not None and self.payload_bytes > self.max_bytes:
            raise TooLargeError(
                f"the stream's payloads exceed this server's limit of {self.max_bytes} bytes "
                "per PushKv; push in smaller parts"
            )
        return index

    def check(self, index: int, chunk: Any) -> Checked:
        """Every rule of one chunk alone (safe to run in a thread pool).

        Raises:
            InvalidRequestError: a reference without a format, or to the partial tail.
            UnsupportedVersionError: a format the receiver does not read.
            FormatError: a reference with a non-zero ``crc32c``.
            TlkvError: a payload failed ``check_chunk`` (its message names the chunk).
        """
        h, fmt, payload = chunk.block_hash, chunk.kv_format, chunk.payload
        if len(chunk.token_ids) and (h == NO_HASH or len(chunk.token_ids) != chunk.n_tokens):
            raise InvalidRequestError(
                f"chunk {index}: rule 'token_ids are those of a full block, n_tokens of them' "
                f"failed: block_hash {h:016x}, n_tokens {chunk.n_tokens}, found "
                f"{len(chunk.token_ids)} token ids"
            )
        if not len(payload):
            if not fmt:  # proto3's unset value: a reference names its format too
                raise InvalidRequestError(
                    f"chunk {index}: rule 'kv_format is one of "
                    f"{', '.join(map(str, SUPPORTED_VERSIONS))}' failed: found 0"
                )
            if fmt not in self.formats:
                raise UnsupportedVersionError(
                    f"chunk {index}: kv_format {fmt} is not a format this server reads "
                    f"(it reads {', '.join(map(str, self.formats))})"
                )
            if chunk.crc32c:
                raise FormatError(
                    f"chunk {index}: crc32c {chunk.crc32c:#010x} of an empty payload must be 0"
                )
            if h == NO_HASH:
                raise InvalidRequestError(
                    f"chunk {index}: an empty payload references a full block by its hash; "
                    "block_hash 0 (the partial tail) must carry its payload"
                )
            return Checked(h, None, fmt)
        try:
            env = check_chunk(
                h,
                chunk.n_tokens,
                fmt,
                payload,
                chunk.crc32c,
                geometry=self.receiver_geometry,
                versions=self.formats,
            )
        except TlkvError as exc:
            raise type(exc)(f"chunk {index} (block {h:016x}): {exc}") from None
        return Checked(h, env, env.version)

    def take(self, checked: Sequence[Checked], chunks: Sequence[Any]) -> None:
        """The rules across the stream's checked chunks, in stream order; fills ``entries``.

        Raises:
            ShapeError: a payload's geometry differs from the stream's.
            InvalidRequestError: a referenced block is not full, or a named sequence mixes
                formats.
        """
        geometry = self.receiver_geometry
        for index, (c, chunk) in enumerate(zip(checked, chunks)):
            h, env, fmt = c
            g = c.geometry
            if g is not None and geometry is None:
                geometry = g
            elif g is not None and g != geometry:
                assert geometry is not None
                raise ShapeError(
                    f"chunk {index} (block {h:016x}): geometry {g.as_tuple()} differs from "
                    f"the stream's {geometry.as_tuple()}"
                )
            if env is None:
                if geometry is not None and chunk.n_tokens != geometry.block_tokens:
                    raise InvalidRequestError(
                        f"chunk {index}: a referenced block is full: n_tokens must be "
                        f"{geometry.block_tokens}, found {chunk.n_tokens}"
                    )
                self.referenced += 1
            self.entries.append((h, env, fmt))
        if self.name is not None and self.entries:
            self.version = self._sequence_format()

    def _sequence_format(self) -> int:
        """The one format of a named sequence: its payloads', else its references'."""
        sent = [v for _, e, v in self.entries if e is not None]
        version = sent[0] if sent else self.entries[0][2]
        for i, (_, env, v) in enumerate(self.entries):
            if env is not None and v != version:
                raise InvalidRequestError(
                    f"chunk {i}: a sequence is one envelope of one format: kv_format {v} "
                    f"after {version}"
                )
        return version


def plan_push(
    env: Envelope,
    held: Container[int],
    sequence: str | None,
    tokens: BlockTokens | None = None,
) -> list[tuple[WireChunk, bool]]:
    """The chunks that send ``env``, without their payloads, checked by :class:`PushStream`;
    each with whether it is a reference.

    A full block in ``held`` travels as a reference (an empty payload, ``crc32c`` 0);
    every other block, the partial tail included, carries its single-block envelope (the
    sender fills ``payload`` and ``crc32c`` in as it sends: the decoded envelope's blocks
    are checked already). ``sequence`` goes on the first chunk only. ``tokens`` (one row
    per full block, checked already) go on every full block's chunk, with its parent.

    Raises:
        InvalidRequestError: ``sequence`` is not a valid sequence name.
    """
    stream = PushStream((env.version,), geometry=env.geometry)
    chunks: list[WireChunk] = []
    checked: list[Checked] = []
    row = 0
    for i, block in enumerate(env):
        h = block.hash
        name = sequence if i == 0 and sequence else ""
        chunk = WireChunk(h, block.n_tokens, env.version, sequence=name)
        if tokens is not None and h != NO_HASH:
            chunk.parent_hash = int(tokens.parents[row])
            chunk.token_ids = tokens.ids[row].tolist()
            row += 1
        index = stream.note(chunk)
        if h != NO_HASH and h in held:
            checked.append(stream.check(index, chunk))
        else:
            checked.append(Checked(h, env, env.version))
        chunks.append(chunk)
    stream.take(checked, chunks)
    return [(chunk, e is None) for chunk, (_, e, _) in zip(chunks, stream.entries)]
