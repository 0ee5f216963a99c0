"""Block routes: put, get/head (with transcoding and ETag), delete, has-blocks and prefix.

Envelopes go out verbatim as ``application/vnd.tlkv`` bytes (no serialization layer).
Plain single-block reads run on the event loop (an LMDB read plus a CRC check, well under
a millisecond for 2 MiB). Everything that takes milliseconds runs in the thread pool:
writes and deletes (they wait for a durable commit), every read with ``?format=`` (it may
transcode 2 MiB), and the reads of ``/v1/prefix``: one call per window of up to
``PREFIX_WINDOW_BYTES`` that reads its blocks (transcoding them if needed) and folds them
into the running CRC of the envelope (``kvstore.codec.assembly.EnvelopeStream``).

Zero copy: ``GET /v1/blocks/{hash}`` and every window of a ``/v1/prefix`` answer are sent
straight from LMDB's map (``Store.get_buffers``: every block CRC-checked first). The
transport may keep a body after ``send`` returns (uvloop queues what the socket did not
take), so the read snapshot is not ended there: it ends when the transport releases the
last buffer (the store watches the arrays exporting them). A client that stops reading
would hold its snapshot open: ``api.bodywatch`` aborts the connection of a body whose
transport makes no progress for ``BODY_HOLD_SECONDS``. A prefix's later windows are read
from snapshots of their own: a block evicted meanwhile aborts the answer (its header has
promised it), a block gone before the first window cuts the answer there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Path, Query, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from kvstore.codec.assembly import EnvelopeStream, envelope_version
from kvstore.codec.builder import BytesBuilder
from kvstore.codec.envelope import encode
from kvstore.codec.geometry import Geometry
from kvstore.codec.layout import VERSION_V1
from kvstore.codec.tokens import BlockTokens, pack_records, split_records
from kvstore.errors import NotFoundError, StoreBusyError, StoreError, TlkvError
from kvstore.protocol import (
    PREFIX_HEADER,
    READER_CHECKS_CRC,
    READER_CHECKS_HEADER,
    TOKEN_RECORDS_HEADER,
    parse_hash_hex,
)
from kvstore.store import Store, transcode_stored

from ..blockread import (
    ROUTE,
    BlockAnswer,
    block_answer,
    block_not_found,
    owner_refs,
    plain_block_read,
)
from ..bodies import read_envelope
from ..bodywatch import watch_body_of
from ..errors import send_error
from ..formats import read_version, require_formats
from ..modelscope import model_store
from ..tokenbody import token_records_of
from .common import (
    ENVELOPE_BODY,
    ENVELOPE_MEDIA_TYPE,
    ENVELOPE_RESPONSE,
    HASH_PATTERN,
    HASHES_BODY,
    hex_list,
    json_response,
    max_body_of,
    request_hashes,
    require_envelope_type,
    store_of,
)

router = APIRouter(tags=["blocks"])

# A prefix answer is read and sent a window of up to this many bytes at a time (v1 block
# sizes; at least one block): a window's blocks come from one read snapshot, held while
# they are sent, and memory stays flat whatever the prefix length.
PREFIX_WINDOW_BYTES = 64 * 1024 * 1024

HashPath = Annotated[str, Path(pattern=HASH_PATTERN, description="16 lowercase hex digits")]
FormatQuery = Annotated[
    int | None, Query(ge=1, le=2, description="transcode to this format version")
]
TokensQuery = Annotated[
    int | None,
    Query(ge=0, le=1, description="1: the block's token record follows its envelope, if kept"),
]
TierQuery = Annotated[
    int | None,
    Query(
        ge=0,
        le=1,
        description="1: a hash absent here counts when the object-store tier has an object "
        "under its key (existence only: a read checks the object and may refuse it)",
    ),
]


async def _read(store: Store, h: int, version: int | None) -> bytes | None:
    """``store.get``: on the event loop when plain, in the thread pool with a ``version``
    (transcoding quantizes or widens 2 MiB) or a tier (a miss reads through)."""
    if version is None and store.tier is None:
        try:
            return store.get(h)
        except StoreBusyError:  # a remap the loop's thread may not wait for: in the pool
            pass
    return await run_in_threadpool(functools.partial(store.get, h, version=version))


@router.put("/v1/blocks", openapi_extra=ENVELOPE_BODY)
async def put_blocks(request: Request) -> Response:
    """Store every full block of an envelope under its hash (partial blocks are counted);
    with ``x-tlkv-token-records``, their token records follow the envelope (checked)."""
    require_envelope_type(request)
    store = store_of(request)
    records = token_records_of(request)
    body = await read_envelope(request, store.geometry, max_body_of(request), token_records=records)
    envelope, tokens = split_records(body, records)
    checked = require_formats(envelope, request.app.state.settings.formats)
    stored, duplicate, partial = await run_in_threadpool(_put, store, checked, tokens)
    return json_response(
        {"stored": hex_list(stored), "duplicate": hex_list(duplicate), "partial": partial}
    )


def _put(store: Store, body: Any, tokens: BlockTokens | None) -> tuple[list[int], list[int], int]:
    """``store.put`` of the body (or of the envelope ``require_formats`` decoded) with the
    hashes it stored and those already present (from one snapshot, exact under
    concurrent puts: its write transaction, or a read one when it holds them all)."""
    report = store.put_report(body, tokens=tokens)
    return report.stored, report.duplicate, report.partial


class _Answer(Response):
    """A ``BlockAnswer`` as a Starlette response: its status, raw headers and body."""

    def __init__(self, answer: BlockAnswer) -> None:
        super().__init__(status_code=answer.status)
        self.raw_headers = answer.headers
        self.body = answer.take_body()


@router.api_route(ROUTE, methods=["GET", "HEAD"], responses={**ENVELOPE_RESPONSE, 304: {}})
async def get_block(
    request: Request, hash: HashPath, format: FormatQuery = None, tokens: TokensQuery = None
) -> Response:
    """The stored single-block envelope, verbatim (or transcoded with ``?format=``); with
    ``?tokens=1`` followed by its token record when it was stored with one
    (``x-tlkv-token-records``: 1, else 0)."""
    version = read_version(format, request.app.state.settings.formats)
    h = parse_hash_hex(hash)
    store = store_of(request)
    data = await _read(store, h, version)
    if tokens and data is not None:
        return _with_tokens(store, h, data)
    # The body goes with a HEAD too: the server drops it, as for every route.
    return _Answer(block_answer(h, [] if data is None else [data], request.scope["headers"]))


def _with_tokens(store: Store, h: int, data: bytes) -> Response:
    """A block's envelope and, when it has one, its token record after it."""
    found = store.block_tokens([h])[0]
    records = b""
    if found is not None:
        parent, ids = found
        records = pack_records(BlockTokens(np.array([parent], "<u8"), ids.reshape(1, -1)))
    return Response(
        data + records,
        media_type=ENVELOPE_MEDIA_TYPE,
        headers={TOKEN_RECORDS_HEADER: "1" if records else "0"},
    )


async def _read_buffers(store: Store, h: int) -> list[Any]:
    """Block ``h`` as ``Store.get_buffers`` finds it (zero copy) on the event loop; in the
    thread pool when the store may not wait on the loop's thread or a tier reads through."""
    try:
        found: list[Any] = store.get_buffers([h])
    except StoreError:  # a remap this thread may not wait for: read in the pool
        found = [memoryview(b) for b in [await run_in_threadpool(store.get, h)] if b]
    if not found and store.tier is not None:  # a local miss reads through, off the loop
        data = await run_in_threadpool(store.get_from_tier, h)
        found = [memoryview(data)] if data is not None else []
    return found


class BlockReadFastPath:
    """Pure-ASGI fast path of ``GET``/``HEAD /v1/blocks/{hash}`` without a query string.

    The hottest route skips FastAPI's routing and parameter solving (about a third of a
    2 MiB read's CPU time here); ``api.blockread`` decides whether it answers and what,
    as for ``get_block``. Anything else -- a query string, a malformed hash, another
    route -- goes on to the app.
    """

    route = SimpleNamespace(path=ROUTE)  # the metrics' route label

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        h = None
        if scope["type"] == "http":
            state = scope["app"].state
            h = plain_block_read(
                scope.get("path", ""),
                scope["method"],
                scope.get("query_string", b""),
                state.settings.formats,
                getattr(state, "store", None),
            )
        if h is None:
            await self.app(scope, receive, send)
            return
        scope["route"] = self.route
        try:
            found = await _read_buffers(model_store(scope, state.store), h)
        except TlkvError as exc:
            await send_error(send, exc)
            return
        answer = block_answer(h, found, scope["headers"], scope["method"] == "HEAD")
        start = {"type": "http.response.start", "status": answer.status, "headers": answer.headers}
        await send(start)
        body = answer.take_body()
        await send({"type": "http.response.body", "body": body})
        del body
        # One part: uvicorn writes it before send returns (it waits for the client only
        # before a write, never after), so the watch starts with its first byte.
        watch_body_of(scope, answer.owners)


@router.delete("/v1/blocks/{hash}", status_code=204)
async def delete_block(request: Request, hash: HashPath) -> Response:
    """Delete a block: 204, 404 when absent, 409 when a sequence pins it."""
    store = store_of(request)
    if not await run_in_threadpool(store.delete, parse_hash_hex(hash)):
        raise block_not_found(hash)
    return Response(status_code=204)


# "true," and "false," as rows of one table (the first padded with a NUL, dropped).
_BOOL_ROWS = np.frombuffer(b"false,true,\0", np.uint8).reshape(2, 6)
_BOOLS_PER_PART = 1 << 16


def _present_json(present: np.ndarray, prefix: int) -> bytes:
    """``{"present":[true,false,...],"prefix":N}`` written from the bool array a part at a
    time into one bytes object: no Python object per hash, and for a query of millions of
    hashes a few MiB of work space besides the answer (a list of bools and its encoded
    string took ~70 MiB more for 3.3 million)."""
    n_true = int(np.count_nonzero(present))
    size = 5 * n_true + 6 * (present.size - n_true) - (present.size > 0)
    head = b'{"present":['
    tail = f'],"prefix":{prefix}}}'.encode()
    out = BytesBuilder(len(head) + size + len(tail))
    out.write(head)
    last = present.size - 1
    for start in range(0, present.size, _BOOLS_PER_PART):
        rows = _BOOL_ROWS[present[start : start + _BOOLS_PER_PART].view(np.uint8)].reshape(-1)
        part = rows[rows != 0]
        out.write(part[:-1] if start + _BOOLS_PER_PART > last else part)  # no comma after the last
    out.write(tail)
    return out.finish()


@router.post("/v1/has-blocks", openapi_extra=HASHES_BODY)
async def has_blocks(request: Request, tier: TierQuery = None) -> Response:
    """Which of the hashes are stored, and how many leading ones (``prefix``); with
    ``tier=1`` also those the object-store tier holds (HEADs, nothing read through): an
    object's existence, not its validity, which a read checks and may refuse."""
    store = store_of(request)
    hashes = await request_hashes(request, store)
    if tier == 1 and store.tier is not None and len(hashes):
        present = await run_in_threadpool(functools.partial(store.has_mask, hashes, tier=True))
    else:
        present = store.has_mask(hashes)
    prefix = int(np.argmin(present)) if not present.all() else present.size
    return Response(_present_json(present, prefix), media_type="application/json")


def _empty(geometry: Geometry | None, version: int) -> bytes:
    if geometry is None:
        raise NotFoundError(
            "the store holds no block and has no geometry yet: no envelope to answer with"
        )
    return encode(geometry, [], version)


def _window(
    store: Store, hashes: np.ndarray, version: int, out: EnvelopeStream, check_crc: bool
) -> list[Any]:
    """The records of the blocks of ``hashes``, in ``version``, accounted for in ``out``'s
    CRC: zero-copy views over one snapshot of LMDB's map (``Store.get_buffers``: each
    block CRC-checked unless the reader checks the answer: ``check_crc``), unless
    transcoded. A block gone raises ``NotFoundError``: the header has promised it
    already."""
    blocks: list[Any] = store.get_buffers(hashes, check_crc=check_crc)
    if len(blocks) < len(hashes):
        # The client sees a short body: the answer is aborted, never completed wrongly.
        h = int(hashes[len(blocks)])
        raise NotFoundError(f"block {h:016x} vanished while streaming the prefix")
    return _records(blocks, hashes, version, out)


def _records(blocks: list[Any], hashes: np.ndarray, version: int, out: EnvelopeStream) -> list[Any]:
    """The records of the stored envelopes ``blocks`` (of ``hashes``) in ``version``,
    accounted for in ``out``'s CRC (each entry of ``blocks`` is released as it is used)."""
    records = []
    for i in range(len(blocks)):
        data, blocks[i] = blocks[i], b""  # the record keeps what it needs alive
        if envelope_version(data) != version:  # a new envelope: its CRC is right
            data = transcode_stored(int(hashes[i]), data, version)
        records.append(out.add_checked_single(data))
    return records


@dataclass
class _Begun:
    """A prefix answer begun: its blocks, version and stream, and the first window's
    records (accounted for in the stream)."""

    hashes: np.ndarray
    version: int
    out: EnvelopeStream
    records: list[Any]
    check_crc: bool


def _first_window(
    store: Store,
    hashes: np.ndarray,
    per: int,
    version: int | None,
    geometry: Geometry,
    check_crc: bool,
) -> _Begun | None:
    """The answer for the prefix ``hashes`` begun with its first window (cut to the blocks
    that window still holds, if one is gone); None when the first block is gone.
    ``version``: the answer's (None: the first block's). ``check_crc``: as ``_window``."""
    first = hashes[:per]
    blocks: list[Any] = store.get_buffers(first, check_crc=check_crc)
    if not blocks:
        return None
    version = version or envelope_version(blocks[0])
    kept = hashes if len(blocks) == len(first) else first[: len(blocks)]
    out = EnvelopeStream(version, geometry, len(kept))
    records = _records(blocks, kept, version, out)
    return _Begun(kept, version, out, records, check_crc)


class _Windows(Response):
    """A prefix envelope sent from LMDB's map a window at a time: header, the records of
    each window (read in the thread pool, zero copy, once the window before is handed to
    the transport), trailer. The body watch covers each window's buffers
    (``api.bodywatch``)."""

    media_type = ENVELOPE_MEDIA_TYPE

    def __init__(self, store: Store, begun: _Begun, geometry: Geometry, per: int) -> None:
        n = len(begun.hashes)
        size = geometry.envelope_bytes(n, begun.version)
        super().__init__(None, headers={PREFIX_HEADER: str(n), "content-length": str(size)})
        self.store, self.begun, self.per = store, begun, per

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        begun, store, per = self.begun, self.store, self.per
        records, begun.records = begun.records, []
        hashes, version, out = begun.hashes, begun.version, begun.out
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        await send({"type": "http.response.body", "body": out.header, "more_body": True})
        at = len(records)
        while True:
            watch_body_of(scope, owner_refs(records))  # before sending: a send may wait
            for i in range(len(records)):
                part, records[i] = records[i], b""
                await send({"type": "http.response.body", "body": part, "more_body": True})
                del part
            if at >= len(hashes):
                break
            nxt = hashes[at : at + per]
            records = await run_in_threadpool(_window, store, nxt, version, out, begun.check_crc)
            at += len(nxt)
        await send({"type": "http.response.body", "body": out.trailer(), "more_body": False})


@router.post("/v1/prefix", openapi_extra=HASHES_BODY, responses=ENVELOPE_RESPONSE)
async def prefix(request: Request, format: FormatQuery = None) -> Response:
    """One envelope with the longest stored prefix's blocks, in order (possibly none).

    A request with ``READER_CHECKS_HEADER: crc32c`` gets the stored blocks unchecked: its
    reader checks the answer's CRC-32C as it arrives (the trailer is still that of the
    stored bytes, combined from each block's own: a block that rotted fails it)."""
    format = read_version(format, request.app.state.settings.formats)
    check_crc = request.headers.get(READER_CHECKS_HEADER) != READER_CHECKS_CRC
    store = store_of(request)
    hashes = await request_hashes(request, store)
    if store.tier is not None and len(hashes):  # local misses read through, in order
        k = await run_in_threadpool(store.read_through, hashes)
    else:
        k = store.longest_prefix(hashes) if len(hashes) else 0
    geometry = store.geometry
    if k and geometry is not None:
        # Off the event loop: a window's reads, CRC checks and transcodes.
        per = max(1, PREFIX_WINDOW_BYTES // geometry.envelope_bytes(1, VERSION_V1))
        begun = await run_in_threadpool(
            _first_window, store, hashes[:k], per, format, geometry, check_crc
        )
        if begun is not None:
            return _Windows(store, begun, geometry, per)
    return Response(
        _empty(geometry, format or VERSION_V1),
        media_type=ENVELOPE_MEDIA_TYPE,
        headers={PREFIX_HEADER: "0"},
    )
