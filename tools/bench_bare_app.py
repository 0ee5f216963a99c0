"""The HTTP bench's baseline server: a bare ASGI app that answers every request with the
same bytes from memory (optionally checking their CRC-32C first, or storing a PUT's body
with ``Store.put``), run by ``bench_servers.start_bare`` under uvicorn with the same workers,
loop and HTTP parser as ``tlkv serve``; its workers import this module."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from bench_servers import BARE_CRC_ENV, BARE_STORE_ENV, BLOB_ENV, GEOMETRY

from kvstore.protocol import ENVELOPE_MEDIA_TYPE

_BLOB: list[bytes] = []
_STORE: list[Any] = []


async def bare_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A bare ASGI app: every HTTP request gets the same bytes, held in memory.

    With ``TLKV_BENCH_BARE_CRC=1`` it first checks the envelope's CRC-32C (kvstore's
    ``crc_matches``, the check tlkv runs on every read) and answers 500 if it fails: the
    fair baseline of a server that promises to verify what it serves. With
    ``TLKV_BENCH_BARE_STORE`` set, a PUT's body is read into one buffer of its
    Content-Length and stored with ``Store.put`` in a worker thread (as tlkv does), then
    answered ``{}``.
    """
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                if os.environ.get(BLOB_ENV):
                    _BLOB.append(Path(os.environ[BLOB_ENV]).read_bytes())
                if os.environ.get(BARE_STORE_ENV):
                    from kvstore import Geometry, Store

                    _STORE.append(Store(os.environ[BARE_STORE_ENV], geometry=Geometry(*GEOMETRY)))
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                for store in _STORE:
                    store.close()
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["method"] == "PUT" and _STORE:
        await _bare_put(scope, receive, send)
        return
    body = _BLOB[0] if _BLOB else b"{}"  # the PUT server's health checks
    ok = not _CHECK_CRC or crc_matches(body)
    await send(
        {
            "type": "http.response.start",
            "status": 200 if ok else 500,
            "headers": [
                (b"content-type", ENVELOPE_MEDIA_TYPE.encode()),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _bare_put(scope: dict[str, Any], receive: Any, send: Any) -> None:
    import asyncio

    length = int(dict(scope["headers"]).get(b"content-length", b"0"))
    buf = bytearray(length)
    view, pos, more = memoryview(buf), 0, True
    while more:
        message = await receive()
        chunk = message.get("body", b"")
        view[pos : pos + len(chunk)] = chunk
        pos += len(chunk)
        more = message.get("more_body", False)
    await asyncio.to_thread(_STORE[0].put, buf)
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
    )
    await send({"type": "http.response.body", "body": b"{}"})


_CHECK_CRC = os.environ.get(BARE_CRC_ENV) == "1"
if _CHECK_CRC:
    from kvstore.codec.assembly import crc_matches
