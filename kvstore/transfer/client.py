"""The tl.kv.v1 client: :class:`TransferClient`, the prefill side of ``KvTransfer``.

``push`` asks ``HasBlocks`` first and sends payloads only for the blocks the server lacks
(plus the partial tail), so the bytes moved are ``(missing full blocks + 1 tail) *
single-block envelope size``; its chunks are planned by the stream rules the server runs
(:func:`~kvstore.transfer.pushstream.plan_push`). ``fetch`` checks every chunk
(:class:`~kvstore.transfer.fetch.FetchChecks`) as it arrives.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator, Sequence
from typing import Any

import grpc
import numpy as np

from ..codec.assembly import SingleBlock, pack_header, record_of
from ..codec.builder import BytesBuilder
from ..codec.checksum import crc32c
from ..codec.crcmath import crc_combine
from ..codec.envelope import Envelope, decode
from ..codec.geometry import Geometry
from ..codec.hashing import TokenInput
from ..codec.layout import HEADER_SIZE, NO_HASH, TRAILER, U64_MAX
from ..codec.tokens import BlockTokens, tokens_for
from ..errors import NotFoundError, TlkvError
from ..protocol import MODEL_HEADER, check_model_id, parse_hash_hex
from ..results import HasResult, PushReport
from ._tlkv_models_v1 import models_pb2, models_pb2_grpc
from ._tlkv_v1 import kv_pb2, kv_pb2_grpc
from .chunks import envelope_crc_to_chunk_crc
from .fetch import FetchChecks, fetch_capacity
from .limits import GRPC_SCHEME, MAX_MESSAGE_BYTES, SERVICE_NAME
from .pushstream import plan_push
from .status import error_from_status
from .wirechunk import parse_chunk

__all__ = ["TransferClient"]

# A Lookup answer's fields per model (``ModelPrefix``, the JSON keys of ``/v1/lookup``).
LOOKUP_FIELDS = (
    "model",
    "block_tokens",
    "local_blocks",
    "local_tokens",
    "tier_blocks",
    "tier_tokens",
)


def _fetch_request(
    tokens: Sequence[int] | None, hashes: Iterable[Any] | None, kv_format: int
) -> kv_pb2.FetchKvRequest:
    if (tokens is None) == (hashes is None):
        raise ValueError("pass exactly one of tokens= or hashes=")
    request = kv_pb2.FetchKvRequest(kv_format=kv_format)
    if hashes is not None:
        request.block_hashes.extend(_u64_list(hashes))
    else:
        request.tokens.extend(int(t) for t in tokens or ())
    return request


def _fetch_capacity(request: Any, geometry: Geometry, single: SingleBlock) -> int:
    return fetch_capacity(len(request.block_hashes), len(request.tokens), geometry, single)


def _target(target: str) -> str:
    return target[len(GRPC_SCHEME) :] if target.startswith(GRPC_SCHEME) else target


def _u64_list(hashes: Iterable[Any]) -> list[int]:
    """Hashes (ints, numpy integers, 16-hex-digit strings) as u64 ints, vectorized for ints."""
    if isinstance(hashes, np.ndarray):
        if hashes.dtype.kind not in "iu" or (hashes.dtype.kind == "i" and (hashes < 0).any()):
            raise ValueError(f"hashes must be u64 values, found dtype {hashes.dtype}")
        return list(hashes.reshape(-1).astype(np.uint64).tolist())
    items = hashes if isinstance(hashes, list) else list(hashes)
    if not any(isinstance(h, str) for h in items):
        try:
            return list(np.asarray(items, dtype=np.uint64).tolist())
        except (OverflowError, TypeError, ValueError):
            pass  # the loop below names the offending value
    out = []
    for h in items:
        value = parse_hash_hex(h) if isinstance(h, str) else int(h)
        if not 0 <= value <= U64_MAX:
            raise ValueError(f"a block hash must fit u64, found {value}")
        out.append(value)
    return out


class TransferClient:
    """A gRPC channel to one tl.kv.v1 server (``tlkv serve --grpc-port``).

    Args:
        target: ``host:port`` or ``grpc://host:port``.
        token: the server's bearer token (sent as ``authorization: Bearer`` metadata).
        timeout: seconds per call (None: no deadline).
        model: the model (namespace) every call addresses (``x-tlkv-model`` metadata;
            None: the server's ``default``).

    Failed calls raise the typed tlkv exceptions (``FormatError`` for DATA_LOSS,
    ``UnsupportedVersionError`` for a format the server does not read, ...).
    """

    def __init__(
        self,
        target: str,
        token: str | None = None,
        *,
        timeout: float | None = 120.0,
        model: str | None = None,
    ) -> None:
        self._channel = grpc.insecure_channel(
            _target(target),
            options=[
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ],
        )
        self._stub = kv_pb2_grpc.KvTransferStub(self._channel)
        # FetchKv's chunks parsed without copying their payloads (wirechunk).
        self._fetch = self._channel.unary_stream(
            f"/{SERVICE_NAME}/FetchKv",
            request_serializer=kv_pb2.FetchKvRequest.SerializeToString,
            response_deserializer=parse_chunk,
        )
        metadata = [("authorization", f"Bearer {token}")] if token else []
        if model is not None:
            metadata.append((MODEL_HEADER, check_model_id(model)))
        self._metadata = tuple(metadata)
        self._timeout = timeout

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def connect(self) -> None:
        """Connect the channel now (gRPC connects at the first call otherwise): one
        HasBlocks of no hashes that waits for the connection; any answer of the server
        (an error status included) means connected. A call, not ``channel_ready_future``,
        whose polling thread outlives it and fails if the channel closes within 0.2 s.

        Raises:
            TlkvError: the server was not reached within the client's timeout (its status
                mapped as every call's: ``error_from_status``).
        """
        try:
            self._stub.HasBlocks(
                kv_pb2.HasBlocksRequest(),
                timeout=self._timeout,
                metadata=self._metadata,
                wait_for_ready=True,
            )
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise error_from_status(exc) from None

    def __enter__(self) -> TransferClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def delete_model(self, model: str) -> dict[str, int] | None:
        """Delete ``model`` with every block and sequence of it (tlkv's own ``Models``
        service; a token that may write it): what it held (``blocks``, ``bytes``,
        ``sequences``), or None when the server has no such model."""
        stub = models_pb2_grpc.ModelsStub(self._channel)
        request = models_pb2.DeleteModelRequest(model=model)
        try:
            reply = stub.DeleteModel(request, timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            err = error_from_status(exc)
            if isinstance(err, NotFoundError):
                return None
            raise err from None
        return {"blocks": reply.blocks, "bytes": reply.bytes, "sequences": reply.sequences}

    def has_blocks(self, hashes: Iterable[Any]) -> HasResult:
        """Which ``hashes`` (ints, numpy integers or 16-hex-digit strings) the server holds."""
        request = kv_pb2.HasBlocksRequest(block_hashes=_u64_list(hashes))
        try:
            reply = self._stub.HasBlocks(request, timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise error_from_status(exc) from None
        return HasResult(list(reply.present), int(reply.prefix_blocks))

    def lookup(
        self,
        tokens: Sequence[int] | None = None,
        hashes: Iterable[Any] | None = None,
        models: Sequence[str] | None = None,
    ) -> list[dict[str, Any]]:
        """tlkv's ``Lookup``: as ``Client.lookup`` (``block_tokens`` 0 for a model the
        server does not have, or the token may not read)."""
        if (tokens is None) == (hashes is None):
            raise ValueError("pass exactly one of tokens= or hashes=")
        request = kv_pb2.LookupRequest(models=list(models or ()))
        if hashes is not None:
            request.block_hashes.extend(_u64_list(hashes))
        else:
            request.tokens.extend(int(t) for t in tokens or ())
        try:
            reply = self._stub.Lookup(request, timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise error_from_status(exc) from None
        return [{f: getattr(m, f) for f in LOOKUP_FIELDS} for m in reply.models]

    def push(
        self,
        envelope: Any,
        sequence: str | None = None,
        *,
        tokens: TokenInput | BlockTokens | None = None,
        parent: int = 0,
    ) -> PushReport:
        """Send a KV state: HasBlocks, then one PushKv with payloads only where needed.

        Full blocks the server holds travel as empty-payload references; every other
        block, the partial tail included, as its single-block envelope. With ``sequence``
        the server pins the whole state under that name (as ``Store.put_sequence``). A
        HasBlocks answered NOT_FOUND (a model the push creates, a write-only token) sends
        every payload: a model the server does not have yet is created by the push (as by
        a first HTTP ``PUT``). When a referenced block was evicted meanwhile
        (FAILED_PRECONDITION naming it), the push is sent once more with every payload.
        ``tokens`` (and ``parent``), as ``Store.put`` takes them: checked here, then each
        full block's chunk carries its token ids and parent hash (tlkv's extension
        fields), which the server checks and keeps (for blocks it stores by the push).

        Raises:
            EnvelopeError: ``envelope`` breaks a reader rule (nothing is sent).
            TokenMismatchError: ``tokens`` do not hash to the blocks (nothing is sent).
            InvalidRequestError: ``sequence`` is not a sequence name (nothing is sent).
            TlkvError: the server refused the stream (nothing stored).
        """
        env = decode(envelope)
        hashes = env.hashes
        kept = None
        if tokens is not None:
            kept = tokens_for(hashes, env.geometry.block_tokens, tokens, parent)
        full = np.flatnonzero(hashes != NO_HASH)
        held: set[int] = set()
        if len(full):
            try:
                present = self.has_blocks(hashes[full]).present
            except NotFoundError:  # a model not created yet, or a token that may only write
                present = [False] * len(full)
            held = {int(hashes[i]) for i, here in zip(full.tolist(), present) if here}
        try:
            return self._push(env, held, sequence, kept)
        except TlkvError as exc:
            code = getattr(exc, "grpc_code", None)
            if not held or code != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            if not isinstance(exc, NotFoundError):
                raise
            return self._push(env, set(), sequence, kept)

    def _push(
        self, env: Envelope, held: set[int], sequence: str | None, tokens: BlockTokens | None
    ) -> PushReport:
        plan = plan_push(env, held, sequence, tokens)  # refused as the server would refuse it

        def chunks() -> Iterator[kv_pb2.KvChunk]:
            for i, (c, reference) in enumerate(plan):
                if reference:
                    yield kv_pb2.KvChunk(
                        block_hash=c.block_hash,
                        n_tokens=c.n_tokens,
                        kv_format=c.kv_format,
                        sequence=c.sequence,
                        parent_hash=c.parent_hash,
                        token_ids=c.token_ids,
                    )
                    continue
                payload = bytes(env.data) if len(env) == 1 else env.single(i)
                yield kv_pb2.KvChunk(
                    block_hash=c.block_hash,
                    n_tokens=c.n_tokens,
                    kv_format=c.kv_format,
                    payload=payload,
                    crc32c=envelope_crc_to_chunk_crc(payload),
                    sequence=c.sequence,
                    parent_hash=c.parent_hash,
                    token_ids=c.token_ids,
                )

        try:
            reply = self._stub.PushKv(chunks(), timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise error_from_status(exc) from None
        return PushReport(
            reply.blocks, reply.referenced, reply.stored, reply.duplicate, reply.payload_bytes
        )

    def fetch(
        self,
        tokens: Sequence[int] | None = None,
        hashes: Iterable[Any] | None = None,
        kv_format: int = 0,
    ) -> bytes:
        """The longest prefix the server holds, as one envelope (``b""`` when it holds none:
        an empty stream carries no geometry to build an envelope with).

        ``kv_format`` 0 keeps the stored format (of the first block); 1 or 2 transcodes.
        Every chunk is checked (its CRC, every reader rule, its fields) before it is used.
        :meth:`fetch_blocks` streams the same checked blocks without joining them.

        Raises:
            ValueError: neither or both of ``tokens`` and ``hashes``.
            FormatError: a chunk failed a check.  TlkvError: the server refused the call.
        """
        request = _fetch_request(tokens, hashes, kv_format)
        # The envelope is written as the chunks arrive into the bytes object returned
        # (codec.builder.BytesBuilder: each record copied and checksummed in one pass,
        # without the GIL, onto pages populated by one call per record instead of 512 page
        # faults; no join at the end), sized once the first chunk gives the geometry for
        # as many blocks as were asked for. The header's block count and the trailer's CRC
        # are written once the stream has ended; the trailer's CRC is combined from the
        # records', not computed by another pass.
        checks = FetchChecks(kv_format)
        out: BytesBuilder | None = None
        records_crc = 0
        try:
            for chunk in self._fetch(request, timeout=self._timeout, metadata=self._metadata):
                if out is None:
                    checks.check(chunk)
                    assert checks.geometry is not None and checks.single is not None
                    out = BytesBuilder(_fetch_capacity(request, checks.geometry, checks.single))
                    out.write(bytes(HEADER_SIZE))
                    out.write(record_of(chunk.payload))
                    records_crc = checks.single.record_crc(chunk.payload)
                    continue
                assert checks.single is not None
                records_crc = checks.single.shift(records_crc) ^ checks.append(chunk, out)
        except grpc.RpcError as exc:
            raise error_from_status(exc) from None
        if out is None:
            return b""
        assert checks.geometry is not None and checks.single is not None
        header = pack_header(checks.version, checks.geometry, checks.count)
        out.write_at(0, header)
        crc = crc_combine(crc32c(header), records_crc, checks.count * checks.single.record_bytes)
        out.write(TRAILER.pack(crc))
        return out.finish()

    def fetch_blocks(
        self,
        tokens: Sequence[int] | None = None,
        hashes: Iterable[Any] | None = None,
        kv_format: int = 0,
    ) -> Generator[Envelope, None, None]:
        """The longest prefix the server holds, streamed: one checked single-block
        ``Envelope`` per block, in order, as its chunk arrives (``env[0]`` is the block).

        The chunks are checked as :meth:`fetch` checks them; the envelopes are views into
        the received messages (no copy, no join), valid for as long as they are held. An
        engine loading blocks one by one into its own cache needs nothing more. Stopping
        early cancels the call.

        Raises:
            ValueError: neither or both of ``tokens`` and ``hashes``.
            FormatError: a chunk failed a check.  TlkvError: the server refused the call.
        """
        request = _fetch_request(tokens, hashes, kv_format)
        checks = FetchChecks(kv_format)
        call = self._fetch(request, timeout=self._timeout, metadata=self._metadata)
        try:
            for chunk in call:
                yield checks.check(chunk)
        except grpc.RpcError as exc:
            raise error_from_status(exc) from None
        finally:
            call.cancel()  # a no-op once the stream has ended
