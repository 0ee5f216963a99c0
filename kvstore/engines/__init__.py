"""Bridges between inference engines and tlkv, and the block targets they save to.

One module per engine (``kvstore.engines.transformers``: Hugging Face transformers, the
``tlkv[hf]`` extra); each imports its framework lazily. What an engine bridge needs from
the place that holds blocks is ``BlockTarget``: a ``Store``, an HTTP ``Client``, a tl.kv.v1
``TransferClient``, or any object with these four methods, which ``as_target`` passes
through as it is. A target that cannot tell its geometry (``knows_geometry = False``, as
tl.kv.v1's) also has ``prefix_views_for_tokens``: the source hashes the tokens itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

from ..codec.envelope import BlockView, decode
from ..codec.geometry import Geometry
from ..codec.tokens import BlockTokens
from ..errors import NotFoundError
from ..store import Store
from ..store.protocols import BlockStore

__all__ = ["BlockTarget", "ClientTarget", "StoreTarget", "TransferTarget", "as_target"]


@runtime_checkable
class BlockTarget(Protocol):
    """Where an engine bridge saves full blocks and loads prefixes from."""

    def block_geometry(self) -> Geometry | None:
        """The geometry every block there has (None while it holds none and has none)."""
        ...

    def has_blocks(self, hashes: Sequence[int]) -> list[bool]:
        """Whether each full-block hash is held."""
        ...

    def put_envelope(self, envelope: bytes, tokens: BlockTokens | None = None) -> int:
        """Store an envelope's full blocks (with their token ids: one row and parent per
        full block, checked by the target); returns how many were newly stored. A target
        whose ``put_envelope`` has no ``tokens`` parameter is called without them."""
        ...

    def prefix_views(self, hashes: Sequence[int]) -> AbstractContextManager[Sequence[BlockView]]:
        """Views of the longest held prefix of ``hashes``, in order, valid in the block."""
        ...


class StoreTarget:
    """A local ``Store``: zero-copy reader views, one transaction per put.

    Views are CRC-checked before use (a block that fails reads as absent, ends the prefix
    and is quarantined, as ``Store.get`` does): KV fed to a model is never unverified. On a
    store with a tier, the local misses of a prefix are read through first (validated and
    kept locally, as the server's ``/v1/prefix`` does), and a store without a geometry yet
    takes its namespace's from the tier.
    """

    def __init__(self, store: BlockStore) -> None:
        self.store = store

    def block_geometry(self) -> Geometry | None:
        return self.store.geometry

    def has_blocks(self, hashes: Sequence[int]) -> list[bool]:
        return self.store.has(hashes)

    def put_envelope(self, envelope: bytes, tokens: BlockTokens | None = None) -> int:
        return self.store.put(envelope, tokens=tokens).stored

    @contextlib.contextmanager
    def prefix_views(self, hashes: Sequence[int]) -> Iterator[Sequence[BlockView]]:
        if self.store.tier is not None and len(hashes):
            self.store.read_through(hashes)
        with self.store.reader() as reader:
            views: list[BlockView] = []
            for h in hashes:
                bv = reader.view(h, verify=True)
                if bv is None:  # absent, corrupt, or evicted since a has(): the prefix ends
                    break
                views.append(bv)
            yield views


class ClientTarget:
    """A ``tlkv serve`` over HTTP: has-blocks, one PUT, one ``/v1/prefix`` round trip.

    A model (namespace) the server does not have yet (404 ``not_found``, which is also
    the answer for one the token may not read) has no geometry and holds nothing: the
    first save creates it with its PUT, as any first PUT does (a token that may not write
    it gets that PUT's 404 or 403), and a load finds nothing.
    """

    def __init__(self, client: Any) -> None:
        self.client = client

    def block_geometry(self) -> Geometry | None:
        try:
            g = self.client.info()["geometry"]
        except NotFoundError:
            return None
        if g is None:
            return None
        return Geometry.from_dict(g)

    def has_blocks(self, hashes: Sequence[int]) -> list[bool]:
        if not len(hashes):
            return []
        try:
            return list(self.client.has_blocks(hashes).present)
        except NotFoundError:
            return [False] * len(hashes)

    def put_envelope(self, envelope: bytes, tokens: BlockTokens | None = None) -> int:
        return len(self.client.put(envelope, tokens=tokens).stored)

    @contextlib.contextmanager
    def prefix_views(self, hashes: Sequence[int]) -> Iterator[Sequence[BlockView]]:
        if not len(hashes):
            yield []
            return
        try:
            data = self.client.prefix(hashes=hashes)
        except NotFoundError:
            data = b""
        yield list(decode(data)) if data else []


class TransferTarget:
    """A ``tlkv serve --grpc-port`` over tl.kv.v1: HasBlocks, one PushKv in which only the
    blocks the server lacks carry payloads, one FetchKv whose checked chunks are used as
    they arrived (``TransferClient.fetch_blocks``: no joined envelope, no second CRC pass).

    The protocol carries no geometry, so ``block_geometry`` is None and ``knows_geometry``
    False: a save uses the model's (a server holding another geometry refuses the push by
    the reader rules, ``ShapeError``), and a load asks by tokens
    (``prefix_views_for_tokens``: the server hashes them with its geometry, which the
    blocks then carry). A model the server does not have yet holds nothing; the first push
    creates it.
    """

    knows_geometry = False  # None from block_geometry means "unknown", not "none held"

    def __init__(self, client: Any) -> None:
        self.client = client

    def block_geometry(self) -> Geometry | None:
        return None

    def has_blocks(self, hashes: Sequence[int]) -> list[bool]:
        if not len(hashes):
            return []
        try:
            return list(self.client.has_blocks(hashes).present)
        except NotFoundError:
            return [False] * len(hashes)

    def put_envelope(self, envelope: bytes, tokens: BlockTokens | None = None) -> int:
        return int(self.client.push(envelope, tokens=tokens).stored)

    def _views(self, **query: Any) -> list[BlockView]:
        try:
            return [env[0] for env in self.client.fetch_blocks(**query)]
        except NotFoundError:
            return []

    @contextlib.contextmanager
    def prefix_views(self, hashes: Sequence[int]) -> Iterator[Sequence[BlockView]]:
        yield self._views(hashes=list(hashes)) if len(hashes) else []

    @contextlib.contextmanager
    def prefix_views_for_tokens(self, tokens: Sequence[int]) -> Iterator[Sequence[BlockView]]:
        """Views of the longest held prefix of ``tokens``, hashed by the server."""
        yield self._views(tokens=[int(t) for t in tokens]) if len(tokens) else []


def as_target(obj: Any) -> BlockTarget:
    """``obj`` as a ``BlockTarget``: a ``Store``, a ``kvstore.client.Client``, a
    ``kvstore.transfer.TransferClient``, or an object that implements the protocol already
    (passed through).

    Raises:
        TypeError: ``obj`` is none of these.
    """
    if isinstance(obj, Store):
        return StoreTarget(obj)
    from ..client import Client

    if isinstance(obj, Client):
        return ClientTarget(obj)
    from ..transfer import TransferClient

    if isinstance(obj, TransferClient):
        return TransferTarget(obj)
    if isinstance(obj, BlockTarget):
        return obj
    raise TypeError(
        f"expected a kvstore Store, Client, TransferClient or a BlockTarget, "
        f"found {type(obj).__name__}"
    )
