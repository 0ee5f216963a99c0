"""tl.kv.v1 over gRPC: the ``KvTransfer`` servicer on a worker's ``Store``, and its server.

Design: every uvicorn worker starts one ``grpc.aio`` server in its FastAPI lifespan
(``api.app``), on the worker's own event loop (uvloop) and the ``Store`` that worker
opened, so one ``tlkv serve`` answers both protocols from the same processes, with no
extra process to supervise. The port is bound with ``SO_REUSEPORT`` (gRPC's default on
Linux, asked for explicitly here): with ``--workers N`` the N servers share it and the
kernel spreads connections among them; the store (LMDB) is shared by the processes.

- ``PushKv`` parses chunks without copying their payloads (``parse_chunk``), checks each
  as it arrives by the stream rules (``kvstore.transfer.PushStream``: the payload's one
  CRC pass in the thread pool, overlapping the next chunk's arrival) and keeps the
  payloads in memory; after the last chunk everything is committed in one store
  transaction (``api.grpc_push.PushCommit``), so a failed or cancelled stream stores
  nothing. A stream is bounded by ``grpc_max_stream`` payload bytes (RESOURCE_EXHAUSTED
  beyond).
- ``FetchKv`` streams ``Store.get`` results (CRC-checked, written by ``serialize_chunk``),
  reading block i+1 in the thread pool while block i is sent; a block evicted meanwhile
  ends the stream (a shorter prefix).
- ``HasBlocks`` is ``Store.has`` (read-only, no write lock).

Errors map to status codes by ``kvstore.transfer.grpc_status_of``; the trailing metadata
``tlkv-error-kind`` carries the error's kind for our client; every call is counted by
``Metrics.observe_grpc`` (full method name, status code name, duration). The bearer token
of the HTTP service guards every KvTransfer call (``authorization: Bearer`` metadata); the standard
health service (``grpc.health.v1``) answers without it, like ``/healthz``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvstore import Store, chain_hashes, decode
from kvstore.codec.layout import SUPPORTED_VERSIONS
from kvstore.errors import (
    InvalidRequestError,
    TlkvError,
    TooLargeError,
    UnauthorizedError,
)
from kvstore.protocol import DEFAULT_MODEL, MODEL_HEADER, check_model_id, hash_hex
from kvstore.store.memory import keep_freed_memory
from kvstore.transfer import (
    ERROR_KIND_KEY,
    MAX_CHUNK_PAYLOAD,
    MAX_MESSAGE_BYTES,
    MISSING_BLOCK_KEY,
    SERVICE_NAME,
    Checked,
    WireChunk,
    envelope_crc_to_chunk_crc,
    grpc_status_of,
    parse_chunk,
    serialize_chunk,
)
from kvstore.transfer._tlkv_v1 import kv_pb2, kv_pb2_grpc

from .access import EVERYTHING, Access, TokenTable, check_access
from .formats import read_version
from .grpc_push import PushCommit
from .lookup import LookupQuery, lookup
from .metrics import Metrics
from .middleware import bearer_access
from .modelscope import handle_of

log = logging.getLogger("tlkv.grpc")

DEFAULT_MAX_STREAM = 1 << 30  # payload bytes one PushKv stream may buffer before it commits
_MAX_DETAILS = 1000

T = TypeVar("T")


class KvTransferService(kv_pb2_grpc.KvTransferServicer):
    """The tl.kv.v1 servicer on one open ``Store``.

    Args:
        store: the worker's store.
        token: the bearer token every call must carry (None: no auth).
        tokens: tokens and the models each may read and write (``api.access``; wins over
            ``token``). A call addresses the model its ``x-tlkv-model`` metadata names
            (``default`` without one), refused as the HTTP routes refuse it.
        formats: envelope versions this server reads (``--formats``).
        max_stream: payload bytes one PushKv may buffer.
        metrics: the worker's metrics (calls counted by method and code), if any.
    """

    def __init__(
        self,
        store: Store,
        *,
        token: str | None = None,
        formats: Sequence[int] = SUPPORTED_VERSIONS,
        max_stream: int = DEFAULT_MAX_STREAM,
        metrics: Metrics | None = None,
        tokens: TokenTable | None = None,
        quotas: tuple[tuple[str, int], ...] = (),
    ) -> None:
        self.store = store
        self.quotas = quotas
        self.tokens = tokens if tokens is not None or token is None else TokenTable.single(token)
        self.formats = tuple(formats)
        self.max_stream = max_stream
        self.metrics = metrics

    # --- plumbing -------------------------------------------------------------------

    def _authorize(self, context: grpc.aio.ServicerContext) -> Access:
        """The access of the call's one ``authorization`` (sent twice: refused, as HTTP)."""
        given = [v for k, v in context.invocation_metadata() or () if k == "authorization"]
        if len(given) > 1:
            raise InvalidRequestError("rule 'Authorization is sent at most once' failed")
        if self.tokens is None:
            return EVERYTHING
        if given:
            raw = given[0].encode() if isinstance(given[0], str) else bytes(given[0])
            access = bearer_access(self.tokens, raw)
            if access is not None:
                return access
        raise UnauthorizedError("missing or wrong bearer token")

    def _store_for(self, context: grpc.aio.ServicerContext, access: Access, write: bool) -> Store:
        """The handle on the model the call's ``x-tlkv-model`` metadata names."""
        model = DEFAULT_MODEL
        for key, value in context.invocation_metadata() or ():
            if key == MODEL_HEADER:
                model = check_model_id(value if isinstance(value, str) else bytes(value).decode())
        check_access(access, model, write, self.store.has_model)
        return handle_of(self.store, model, self.quotas)

    def _observe(
        self, method: str, code: grpc.StatusCode, started: float, service: str = SERVICE_NAME
    ) -> None:
        if self.metrics is not None:
            seconds = time.perf_counter() - started
            self.metrics.observe_grpc(f"/{service}/{method}", code.name, seconds)
            self.metrics.ops.observe_handles(self.store.open_handles())  # its reads, by model

    async def _fail(self, context: grpc.aio.ServicerContext, exc: Exception) -> grpc.StatusCode:
        """Abort the call with the status of ``exc`` (raises ``grpc.aio.AbortError``)."""
        if isinstance(exc, TlkvError | ValueError):
            code = grpc_status_of(exc)
            kind = exc.kind if isinstance(exc, TlkvError) else InvalidRequestError.kind
        else:
            log.error("unexpected %s in a tl.kv.v1 call", type(exc).__name__, exc_info=exc)
            code, kind = grpc.StatusCode.INTERNAL, "internal"
            exc = RuntimeError(f"internal error ({type(exc).__name__}); see the log")
        if code is grpc.StatusCode.INTERNAL and kind != "internal":
            log.error("tl.kv.v1 call failed: %r", exc)
        trailing: list[tuple[str, str]] = [(ERROR_KIND_KEY, kind)]
        missing = getattr(exc, "missing_hash", None)
        if missing is not None:
            trailing.append((MISSING_BLOCK_KEY, hash_hex(missing)))
        message = str(exc) or kind
        if len(message) > _MAX_DETAILS:
            message = message[: _MAX_DETAILS - 3] + "..."
        await context.abort(code, message, trailing_metadata=tuple(trailing))
        return code  # not reached: abort raises

    @contextlib.asynccontextmanager
    async def _frame(
        self, method: str, context: grpc.aio.ServicerContext, service: str = SERVICE_NAME
    ) -> AsyncIterator[None]:
        """One RPC's frame: map a failure to its status (aborting the call), and count the
        call with its code and duration in ``/metrics`` (under ``service``)."""
        code = grpc.StatusCode.OK
        started = time.perf_counter()
        try:
            yield
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:
            if isinstance(exc, grpc.aio.AbortError):
                raise
            code = _code_of(exc)
            await self._fail(context, exc)
            raise  # not reached: _fail aborts
        finally:
            self._observe(method, code, started, service)

    @contextlib.asynccontextmanager
    async def _call(
        self,
        method: str,
        context: grpc.aio.ServicerContext,
        write: bool = False,
        *,
        service: str = SERVICE_NAME,
        select: Callable[[Access], Store] | None = None,
    ) -> AsyncIterator[Store]:
        """``_frame`` of an RPC on one model: authorize, select the model (the
        ``x-tlkv-model`` metadata's, or what ``select`` makes of the caller's access)."""
        async with self._frame(method, context, service):
            access = self._authorize(context)
            yield self._store_for(context, access, write) if select is None else select(access)

    async def _unary(
        self,
        method: str,
        context: grpc.aio.ServicerContext,
        body: Callable[[Store], Awaitable[T]],
        write: bool = False,
    ) -> T:
        async with self._call(method, context, write) as store:
            return await body(store)
        raise AssertionError("unreachable: _call re-raises")  # for type checkers

    # --- RPCs -------------------------------------------------------------------------

    async def HasBlocks(  # the generated servicer names the RPCs
        self, request: kv_pb2.HasBlocksRequest, context: grpc.aio.ServicerContext
    ) -> kv_pb2.HasBlocksResponse:
        """``present`` per hash and ``prefix_blocks``, the leading run present."""

        async def body(store: Store) -> kv_pb2.HasBlocksResponse:
            hashes = np.asarray(request.block_hashes, dtype=np.uint64)
            if not hashes.size:
                return kv_pb2.HasBlocksResponse()
            present = store.has(hashes)
            try:
                prefix = present.index(False)
            except ValueError:
                prefix = len(present)
            return kv_pb2.HasBlocksResponse(present=present, prefix_blocks=prefix)

        return await self._unary("HasBlocks", context, body)

    async def PushKv(  # the generated servicer names the RPCs
        self, request_iterator: AsyncIterator[kv_pb2.KvChunk], context: grpc.aio.ServicerContext
    ) -> kv_pb2.PushKvResponse:
        """Receive a KV state chunk by chunk; commit all or nothing after the last."""

        async def body(store: Store) -> kv_pb2.PushKvResponse:
            push = PushCommit(store, self.formats, self.max_stream)
            loop = asyncio.get_running_loop()
            chunks: list[Any] = []
            checks: list[asyncio.Future[Checked]] = []
            failed = 0  # checks before this index are known to have passed
            async for chunk in request_iterator:
                index = push.note(chunk)
                chunks.append(chunk)
                checks.append(loop.run_in_executor(None, push.check, index, chunk))
                while failed < len(checks) and checks[failed].done():
                    checks[failed].result()  # fail fast: raises the first failed check
                    failed += 1
            checked = [await c for c in checks]  # in stream order: the first failure wins
            push.take(checked, chunks)
            await _confirm_half_closed(context)
            return await loop.run_in_executor(None, push.commit)

        return await self._unary("PushKv", context, body, write=True)

    async def Lookup(  # the generated servicer names the RPCs
        self, request: kv_pb2.LookupRequest, context: grpc.aio.ServicerContext
    ) -> kv_pb2.LookupResponse:
        """tlkv's extension: the longest stored prefix per model (``api.lookup``)."""
        async with self._frame("Lookup", context):
            access = self._authorize(context)
            tokens = np.asarray(request.tokens, np.uint32) if len(request.tokens) else None
            hashes = np.asarray(request.block_hashes, np.uint64) if tokens is None else None
            query = LookupQuery(tokens, hashes, list(request.models) or None)
            loop = asyncio.get_running_loop()
            found = await loop.run_in_executor(None, lookup, self.store, access, query)
            return kv_pb2.LookupResponse(
                models=[
                    kv_pb2.ModelPrefix(**{**m, "block_tokens": m["block_tokens"] or 0})
                    for m in found
                ]
            )
        raise AssertionError("unreachable: _frame re-raises")  # for type checkers

    async def FetchKv(  # the generated servicer names the RPCs
        self, request: kv_pb2.FetchKvRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[WireChunk]:
        """The longest present prefix, one chunk per block (an empty stream for none)."""
        async with self._call("FetchKv", context) as store:
            async for chunk in self._fetch(request, store):
                yield chunk

    async def _fetch(
        self, request: kv_pb2.FetchKvRequest, store: Store
    ) -> AsyncIterator[WireChunk]:
        if len(request.block_hashes) and len(request.tokens):
            raise InvalidRequestError("FetchKv takes block_hashes or tokens, not both")
        kv_format = read_version(request.kv_format or None, self.formats)
        geometry = store.geometry
        if len(request.tokens):
            if geometry is None:
                return  # no geometry yet: the store holds no block
            hashes = chain_hashes(list(request.tokens), geometry.block_tokens)
        else:
            hashes = list(request.block_hashes)
        loop = asyncio.get_running_loop()
        if store.tier is not None and hashes:  # local misses read through, in order
            k = await loop.run_in_executor(None, store.read_through, hashes)
        else:
            k = store.longest_prefix(hashes) if hashes else 0
        if not k:
            return
        loop = asyncio.get_running_loop()
        first = await loop.run_in_executor(None, _get, store, hashes[0], kv_format)
        if first is None:
            return
        version = decode(first, verify_crc=False).version
        if len(first) > MAX_CHUNK_PAYLOAD:
            raise TooLargeError(
                f"a block of this store is {len(first)} bytes in format v{version}, over "
                f"the spec's {MAX_CHUNK_PAYLOAD}-byte chunk limit: fetch it with kv_format=2"
            )
        data: bytes | None = first
        for i in range(k):
            assert data is not None
            nxt = (
                loop.run_in_executor(None, _get, store, hashes[i + 1], version)
                if i + 1 < k
                else None
            )
            yield WireChunk(
                block_hash=hashes[i],
                n_tokens=geometry.block_tokens if geometry else 0,
                kv_format=version,
                payload=data,
                crc32c=envelope_crc_to_chunk_crc(data),
            )
            if nxt is None:
                break
            data = await nxt
            if data is None:
                break  # evicted meanwhile: the prefix ends here


async def _confirm_half_closed(context: grpc.aio.ServicerContext) -> None:
    """Tell a client's end of stream from a cancelled stream before anything is committed.

    grpc.aio ends the request iterator the same way for both (a cancelled read is reported
    as end of stream), and cancels the handler only a moment later. gRPC's core has already
    marked the call cancelled when the read ended, so one more operation on the call (the
    response's initial metadata, sent a little early) completes after the cancellation has
    reached this task: it raises ``CancelledError`` then, and nothing is stored.
    """
    try:
        await context.send_initial_metadata(())
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # the operation failed on a call that is gone
        raise asyncio.CancelledError() from exc


def _get(store: Store, h: int, version: int | None) -> bytes | None:
    return store.get(h, version=version)


def _code_of(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, TlkvError | ValueError):
        return grpc_status_of(exc)
    return grpc.StatusCode.INTERNAL


def _add_service(service: KvTransferService, server: grpc.aio.Server) -> None:
    """Register KvTransfer as the generated ``add_KvTransferServicer_to_server`` does, but
    with PushKv's requests parsed by ``parse_chunk`` and FetchKv's chunks written by
    ``serialize_chunk`` (``kvstore.transfer.wirechunk``: payloads not copied by protobuf)."""
    handlers = {
        "HasBlocks": grpc.unary_unary_rpc_method_handler(
            service.HasBlocks,
            request_deserializer=kv_pb2.HasBlocksRequest.FromString,
            response_serializer=kv_pb2.HasBlocksResponse.SerializeToString,
        ),
        "PushKv": grpc.stream_unary_rpc_method_handler(
            service.PushKv,
            request_deserializer=parse_chunk,
            response_serializer=kv_pb2.PushKvResponse.SerializeToString,
        ),
        "FetchKv": grpc.unary_stream_rpc_method_handler(
            service.FetchKv,
            request_deserializer=kv_pb2.FetchKvRequest.FromString,
            response_serializer=serialize_chunk,
        ),
        "Lookup": grpc.unary_unary_rpc_method_handler(
            service.Lookup,
            request_deserializer=kv_pb2.LookupRequest.FromString,
            response_serializer=kv_pb2.LookupResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


class TransferServer:
    """One worker's running gRPC server (KvTransfer and health)."""

    def __init__(self, server: grpc.aio.Server, health_servicer: Any) -> None:
        self.server = server
        self.health = health_servicer

    async def stop(self, grace: float) -> None:
        """Report NOT_SERVING on the health service (to its watchers too), then stop:
        calls in flight get ``grace`` seconds to finish."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)

    async def wait_for_termination(self) -> None:
        """Wait until the server stops."""
        await self.server.wait_for_termination()


async def start_server(
    store: Store,
    address: str,
    *,
    token: str | None = None,
    formats: Sequence[int] = SUPPORTED_VERSIONS,
    max_stream: int = DEFAULT_MAX_STREAM,
    metrics: Metrics | None = None,
    tokens: TokenTable | None = None,
    quotas: tuple[tuple[str, int], ...] = (),
) -> TransferServer:
    """Start a grpc.aio server on ``address`` (``host:port``) serving KvTransfer, tlkv's own
    ``tlkv.v1.Models`` (``api.grpc_models``) and health.

    Also makes this process keep freed memory (``kvstore.store.memory``): a PushKv stream
    holds all its chunks (gRPC hands each 2 MiB message over in newly allocated memory)
    until LMDB copies them into its dirty pages, and without it every push faults both in
    afresh (PushKv into a store at capacity ran faster with it: BENCHMARKS.md, "Measurements
    behind design choices"). A worker's RSS stays at its peak plus up to 512 MiB of free
    heap instead of shrinking after a large push.

    Raises:
        RuntimeError: the address cannot be bound.
    """
    if not keep_freed_memory():
        log.info("mallopt unavailable: freed memory goes back to the system after each push")
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 1),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
    )
    service = KvTransferService(
        store,
        token=token,
        formats=formats,
        max_stream=max_stream,
        metrics=metrics,
        tokens=tokens,
        quotas=quotas,
    )
    _add_service(service, server)
    from .grpc_models import ModelsService, add_models_service  # it builds on this module

    add_models_service(ModelsService(service), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(address)
    await server.start()
    serving = health_pb2.HealthCheckResponse.SERVING
    await health_servicer.set("", serving)
    await health_servicer.set(SERVICE_NAME, serving)
    return TransferServer(server, health_servicer)
