"""The parts of the vLLM connector (``kvstore.engines.vllm``) that are not vLLM's API:
namespaces, the three targets behind one interface, and vLLM's paged cache layout.

- Namespace: ``<served model name or path>@<revision>/<kv dtype>``, characters outside
  the model-id rule replaced by ``_``, a digest in place of the end when it is longer
  than 200; a request's ``cache_salt`` adds ``+salt:<first 16 hex digits of its
  SHA-256>`` (the salt itself is never stored, sent or logged).
- Targets: a store directory (one ``Store`` per process and path, shared by the
  scheduler's and the worker's connector: LMDB allows one environment per process), a
  ``tlkv serve`` over HTTP (``Client``) or tl.kv.v1 (``TransferClient``). A namespace the
  server does not have yet holds nothing; the first save creates it.
- Layout: the one paged layout read and written here is vLLM's CPU attention backend
  (``CPU_ATTN``): each layer's cache is ``[num_blocks, Hkv, B, 2 * D]`` whose memory per
  (block, head) is the block's ``B`` key rows then its ``B`` value rows
  (``cpu_attn.py`` views it as ``[num_blocks, Hkv, 2 * B, D]`` and chunks dim 2). Any
  other backend, a quantized ``kv_cache_dtype``, MLA, sliding windows, several KV cache
  groups or tensor/pipeline parallelism is refused with ``UnsupportedLayoutError``.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import queue
import re
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..client import Client
from ..codec.assembly import pack_header
from ..codec.envelope import BlockView, decode
from ..codec.geometry import Geometry
from ..codec.layout import HEADER_SIZE, RECORD, TRAILER_SIZE, VERSION_V1
from ..codec.tokens import BlockTokens
from ..errors import NotFoundError, TlkvError
from ..fileio import populate_mapped_pages
from ..protocol import MODEL_ID_MAX
from ..store import Store
from ..transfer import GRPC_SCHEME, TransferClient
from ._vllm_buffers import ReceiveBuffers

if TYPE_CHECKING:
    from ._vllm_paged import PagedCache

__all__ = [
    "KNOWN_BACKENDS",
    "Saver",
    "Target",
    "UnsupportedLayoutError",
    "namespace",
    "open_target",
    "salted",
]

KNOWN_BACKENDS = ("CPU_ATTN",)  # paged layouts this module reads and writes
_ID_CHARS = re.compile(r"[^A-Za-z0-9._:@/+-]")
_SALT_DIGITS = 16
_DIGEST_DIGITS = 16


class UnsupportedLayoutError(TlkvError, ValueError):
    """vLLM's KV cache is laid out in a way the connector cannot show it reads and fills
    exactly (another attention backend, a quantized kv_cache_dtype, MLA, sliding windows,
    hybrid groups, parallel shards): the connector stays off and vLLM computes every token."""

    kind = "cache_layout"
    http_status = 422
    grpc_status = "INVALID_ARGUMENT"


def _fit(text: str, room: int) -> str:
    """``text`` in the model-id alphabet, at most ``room`` characters (a digest of the
    whole at the end when it had to be cut)."""
    clean = _ID_CHARS.sub("_", text) or "_"
    if len(clean) <= room:
        return clean
    digest = hashlib.sha256(text.encode()).hexdigest()[:_DIGEST_DIGITS]
    return f"{clean[: room - _DIGEST_DIGITS - 1]}+{digest}"


_SALT_ROOM = len("+salt:") + _SALT_DIGITS


def namespace(name: str, revision: str | None, kv_dtype: str) -> str:
    """The default namespace of a model: ``name@revision/kv_dtype`` as a model id, with
    room left for a salt suffix."""
    return _fit(f"{name}@{revision or 'main'}/{kv_dtype}", MODEL_ID_MAX - _SALT_ROOM)


def salted(base: str, salt: str | None) -> str:
    """The namespace of a request with ``cache_salt`` ``salt`` (``base`` without one)."""
    if not salt:
        return base
    digest = hashlib.sha256(salt.encode()).hexdigest()[:_SALT_DIGITS]
    return f"{base[: MODEL_ID_MAX - _SALT_ROOM]}+salt:{digest}"


class Target:
    """One namespace of a target: what the connector asks of it, one round trip each.

    ``longest_prefix``/``has`` answer 0 / all False for a namespace not created yet;
    transport and service errors are raised to the connector, which counts them and
    falls back to computing.
    """

    def geometry(self) -> Geometry | None:
        """The namespace's block geometry; None when it holds none (or cannot tell)."""
        raise NotImplementedError

    def longest_prefix(self, hashes: Sequence[int]) -> int:
        """How many leading ``hashes`` are held."""
        raise NotImplementedError

    def has(self, hashes: Sequence[int]) -> list[bool]:
        """Whether each hash is held."""
        raise NotImplementedError

    def put(self, envelope: bytes, tokens: BlockTokens | None = None) -> int:
        """Store an envelope's blocks with their token ids (one row and parent per full
        block, checked by the target); returns how many were new (where known)."""
        raise NotImplementedError

    def views(self, hashes: Sequence[int]) -> contextlib.AbstractContextManager[list[BlockView]]:
        """Checked views of the longest held prefix of ``hashes``, valid in the block."""
        raise NotImplementedError

    def load(
        self, hashes: Sequence[int], paged: PagedCache, block_ids: Sequence[int]
    ) -> tuple[int, int]:
        """Copy the longest held prefix of ``hashes`` into the paged blocks ``block_ids``,
        every block checked (CRC, reader rules, its hash the one asked for) before the
        engine can use it; returns (blocks in place, payload bytes read)."""
        with self.views(hashes) as views:
            views = views[: _same_hashes(views, hashes)]
            return len(views), paged.scatter(views, block_ids)

    def close(self) -> None:
        """Release connections (a shared store stays open for the process)."""


_stores: dict[tuple[int, str], Store] = {}
_stores_lock = threading.Lock()


def _shared_store(path: str) -> Store:
    """The process's one ``Store`` on ``path`` (opened after any fork)."""
    key = (os.getpid(), os.path.realpath(path))
    with _stores_lock:
        store = _stores.get(key)
        if store is None:
            store = _stores[key] = Store(path)
        return store


class _StoreTarget(Target):
    def __init__(self, path: str, model: str) -> None:
        self.store = _shared_store(path).model(model)

    def geometry(self) -> Geometry | None:
        return self.store.geometry

    def longest_prefix(self, hashes: Sequence[int]) -> int:
        return int(self.store.longest_prefix(list(hashes))) if len(hashes) else 0

    def has(self, hashes: Sequence[int]) -> list[bool]:
        return list(self.store.has(list(hashes))) if len(hashes) else []

    def put(self, envelope: bytes, tokens: BlockTokens | None = None) -> int:
        return int(self.store.put(envelope, tokens=tokens).stored)

    @contextlib.contextmanager
    def views(self, hashes: Sequence[int]) -> Iterator[list[BlockView]]:
        with self.store.reader() as reader:
            held = []
            for h in hashes:
                buf = reader.envelope(h)
                if buf is None:
                    break
                held.append(buf)
            populate_mapped_pages(held)  # LMDB maps without readahead: one call, not a fault a page
            out: list[BlockView] = []
            for h in hashes[: len(held)]:
                bv = reader.view(h, verify=True)  # a corrupt block is quarantined: a miss
                if bv is None:
                    break
                out.append(bv)
            del held
            yield out

    def load(
        self, hashes: Sequence[int], paged: PagedCache, block_ids: Sequence[int]
    ) -> tuple[int, int]:
        """The stored envelopes straight into the paged blocks: every reader rule but the
        CRC checked first (``_full_v1_blocks``), then one pass that copies each block and
        checks its CRC (``PagedCache.scatter_envelopes``). A block whose CRC fails ends the
        loaded prefix (it and the blocks after it are reported not loaded, the engine
        computes them) and is quarantined. Envelopes that are not all full v1 blocks, or a
        cache that is not CPU f16, take ``views`` and ``scatter``."""
        with self.store.reader() as reader:
            held = []
            buf = None
            for h in hashes:
                buf = reader.envelope(h)
                if buf is None:
                    break
                held.append(buf)
            populate_mapped_pages(held)  # LMDB maps without readahead: one call, not a fault a page
            done: int | None = None
            if _full_v1_blocks(held, paged.geometry):
                done = paged.scatter_envelopes(held, block_ids[: len(held)])
            if done is not None and done < len(held):  # checked alone: quarantined if corrupt
                reader.view(hashes[done], verify=True)
            del held, buf  # no view outlives the reader
        if done is None:
            return super().load(hashes, paged, block_ids)
        return done, done * paged.geometry.record_bytes(VERSION_V1)


def _same_hashes(views: Sequence[BlockView], hashes: Sequence[int]) -> int:
    """How many leading ``views`` are the blocks asked for: a block under another hash
    (a server's mistake, or another namespace's block) ends what is loaded."""
    for i, (bv, h) in enumerate(zip(views, hashes)):
        if bv.hash != h:
            return i
    return min(len(views), len(hashes))


def _joined_v1_blocks(data: Any, g: Geometry, hashes: Sequence[int]) -> int | None:
    """How many full v1 blocks of geometry ``g`` the joined envelope ``data`` holds, when
    it is one by every reader rule but the CRC and its blocks are the leading ``hashes``,
    in order: its header is the one such an envelope has, its length the one that header
    implies, every record's ``n_tokens`` is ``B`` and its hash the one asked for (the
    records are read as one strided array). None: anything else, for ``decode`` to judge.
    """
    stride = RECORD.size + g.payload_bytes(VERSION_V1)
    n, extra = divmod(len(data) - HEADER_SIZE - TRAILER_SIZE, stride)
    if (
        extra
        or not 0 < n <= len(hashes)
        or bytes(data[:HEADER_SIZE]) != pack_header(VERSION_V1, g, n)
    ):
        return None
    records = np.frombuffer(data, np.uint8, n * stride, HEADER_SIZE).reshape(n, stride)
    got = records[:, :8].copy().view("<u8").reshape(n)
    fill = records[:, 8:12].copy().view("<u4").reshape(n)
    want = np.asarray(hashes[:n], dtype=np.uint64)
    return n if (got == want).all() and (fill == g.block_tokens).all() else None


def _full_v1_blocks(envelopes: Sequence[memoryview], g: Geometry) -> bool:
    """Whether each envelope is one full v1 block of geometry ``g`` by every reader rule
    but the CRC: its 28 header bytes are the ones such an envelope has (magic, version,
    dtype, one block, ``g``), its length is the one they imply and its ``n_tokens`` is
    ``B`` (which any block hash allows). Anything else is for ``decode`` to judge."""
    head = pack_header(VERSION_V1, g, 1)
    size = g.envelope_bytes(1, VERSION_V1)
    return all(
        len(e) == size
        and e[:HEADER_SIZE] == head
        and RECORD.unpack_from(e, HEADER_SIZE)[1] == g.block_tokens
        for e in envelopes
    )


class _HttpTarget(Target):
    def __init__(self, url: str, model: str, token: str | None, timeout: float) -> None:
        self.client = Client(url, token, timeout=timeout, model=model)
        self._buffers = ReceiveBuffers()

    def geometry(self) -> Geometry | None:
        try:
            g = self.client.info()["geometry"]
        except NotFoundError:
            return None
        return None if g is None else Geometry.from_dict(g)

    def longest_prefix(self, hashes: Sequence[int]) -> int:
        if not len(hashes):
            return 0
        try:
            ask = np.asarray(hashes, dtype=np.uint64)
            return int(self.client.has_blocks(ask, tier=True).prefix)  # a tier's count too
        except NotFoundError:
            return 0

    def has(self, hashes: Sequence[int]) -> list[bool]:
        if not len(hashes):
            return []
        try:
            return list(self.client.has_blocks(np.asarray(hashes, dtype=np.uint64)).present)
        except NotFoundError:
            return [False] * len(hashes)

    def put(self, envelope: bytes, tokens: BlockTokens | None = None) -> int:
        return len(self.client.put(envelope, tokens=tokens).stored)

    def _fetch(self, hashes: Sequence[int], size: int) -> tuple[Any, np.ndarray]:
        """The envelope of the longest held prefix of ``hashes`` (``/v1/prefix``, at most
        ``size`` bytes when it is v1), read into a buffer of ``_buffers`` (given back by
        ``load``): (the envelope, the buffer)."""
        buf = self._buffers.take(size)
        try:
            ask = np.asarray(hashes, dtype=np.uint64)
            return self.client.prefix_into(buf, hashes=ask), buf
        except NotFoundError:
            return b"", buf

    @contextlib.contextmanager
    def views(self, hashes: Sequence[int]) -> Iterator[list[BlockView]]:
        data, buf = self._fetch(hashes, 0)  # a buffer of any size: new bytes if too small
        try:
            yield list(decode(data)) if len(data) else []  # the CRC and every rule checked
        finally:
            del data
            self._buffers.give(buf)

    def load(
        self, hashes: Sequence[int], paged: PagedCache, block_ids: Sequence[int]
    ) -> tuple[int, int]:
        """The prefix's one envelope straight into the paged blocks: every reader rule but
        the CRC and each block's hash checked first (``_joined_v1_blocks``), then one pass
        that copies the blocks and checks the envelope's CRC (``PagedCache.
        scatter_envelopes``); a CRC that fails loads none of them (the engine computes
        them). Anything else (v2 blocks, a cache that is not CPU f16) is decoded, checked
        and scattered."""
        g = paged.geometry
        data, buf = self._fetch(hashes, g.envelope_bytes(len(hashes), VERSION_V1))
        try:
            if not len(data):
                return 0, 0
            n = _joined_v1_blocks(data, g, hashes)
            done = None
            if n is not None:
                done = paged.scatter_envelopes([data], block_ids[:n], joined=True)
            if done is None:
                views = list(decode(data))  # decode checks the CRC and every rule
                views = views[: _same_hashes(views, hashes)]
                loaded, nbytes = len(views), paged.scatter(views, block_ids)
                del views  # they view the buffer
                return loaded, nbytes
            return done, done * g.record_bytes(VERSION_V1)
        finally:
            del data
            self._buffers.give(buf)  # no view of it is left

    def close(self) -> None:
        self.client.close()


class _GrpcTarget(Target):
    def __init__(self, target: str, model: str, token: str | None, timeout: float) -> None:
        self.client = TransferClient(target, token, timeout=timeout, model=model)

    def geometry(self) -> Geometry | None:
        return None  # tl.kv.v1 carries none: a server of another geometry refuses the push

    def longest_prefix(self, hashes: Sequence[int]) -> int:
        if not len(hashes):
            return 0
        try:
            return int(self.client.has_blocks(np.asarray(hashes, dtype=np.uint64)).prefix)
        except NotFoundError:
            return 0

    def has(self, hashes: Sequence[int]) -> list[bool]:
        if not len(hashes):
            return []
        try:
            return list(self.client.has_blocks(np.asarray(hashes, dtype=np.uint64)).present)
        except NotFoundError:
            return [False] * len(hashes)

    def put(self, envelope: bytes, tokens: BlockTokens | None = None) -> int:
        return int(self.client.push(envelope, tokens=tokens).stored)

    @contextlib.contextmanager
    def views(self, hashes: Sequence[int]) -> Iterator[list[BlockView]]:
        try:
            blocks = [env[0] for env in self.client.fetch_blocks(hashes=list(hashes))]
        except NotFoundError:
            blocks = []
        yield blocks  # every chunk checked (CRC, reader rules, fields) as it arrived

    def close(self) -> None:
        self.client.close()


def open_target(spec: str, model: str, token: str | None, timeout: float) -> Target:
    """The target named by ``spec`` (a directory, ``http(s)://...`` or ``grpc://...``),
    addressing namespace ``model``."""
    if spec.startswith(("http://", "https://")):
        return _HttpTarget(spec, model, token, timeout)
    if spec.startswith(GRPC_SCHEME):
        return _GrpcTarget(spec, model, token, timeout)
    return _StoreTarget(spec, model)


# Queued saves are finished before the interpreter's thread pools stop taking work (a large
# put writes through the store's helper pool): ``threading._register_atexit`` runs its
# callbacks before that, ``atexit`` after it. Where the former is missing, the latter.
_at_exit = getattr(threading, "_register_atexit", atexit.register)
_SAVE_QUEUE_BYTES = 1 << 30  # gathered blocks waiting for the saver; beyond, saves drop


class Saver:
    """One thread that runs ``save(model, hashes, blocks, *rest)`` for queued saves, in
    order (``rest``: what else ``submit`` was given, such as the blocks' token ids).

    At most ``_SAVE_QUEUE_BYTES`` wait (``submit`` returns False beyond: the save is
    dropped); ``close`` (called by the connector's ``shutdown`` and at interpreter exit)
    finishes what is queued.
    """

    def __init__(self, save: Any) -> None:
        self._save = save
        self._queue: queue.Queue[Any] = queue.Queue()
        self._bytes = 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, model: str, hashes: list[int], blocks: Any, *rest: Any) -> bool:
        with self._lock:
            if self._bytes + blocks.nbytes > _SAVE_QUEUE_BYTES:
                return False
            self._bytes += blocks.nbytes
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tlkv-saver", daemon=True)
                self._thread.start()
                _at_exit(self.close)
        self._queue.put((model, hashes, blocks, *rest))
        return True

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._save(*item)
            finally:
                with self._lock:
                    self._bytes -= item[2].nbytes

    def close(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()
