"""The targets over a ``tlkv serve``: ``HttpTarget`` (its HTTP API, through ``Client``)
and ``GrpcTarget`` (tl.kv.v1, through ``TransferClient``), with the vocabulary of
``targets.Target``. ``targets.open_target``/``as_target`` make them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..codec.decoding import plain_v1_blocks
from ..codec.envelope import BlockView, decode
from ..codec.geometry import Geometry
from ..codec.hashing import chain_hashes
from ..codec.layout import VERSION_V1
from ..codec.tokens import BlockTokens
from ..errors import NotFoundError
from ..results import HasResult
from ._buffers import KeptBuffers
from .targets import BlockSlots, Target, same_hashes

if TYPE_CHECKING:
    from ..client import Client
    from ..transfer import TransferClient

__all__ = ["GrpcTarget", "HttpTarget"]


def _u64(hashes: Sequence[int]) -> np.ndarray:
    return np.asarray(hashes, dtype=np.uint64)


def _asked(client: Any, hashes: Sequence[int], **query: Any) -> HasResult:
    """A server's has-blocks answer for ``hashes`` (one round trip, none when empty); a
    namespace it does not have yet (404 ``not_found``) holds none of them."""
    if not len(hashes):
        return HasResult([], 0)
    try:
        got = client.has_blocks(_u64(hashes), **query)
    except NotFoundError:
        return HasResult([False] * len(hashes), 0)
    return HasResult([bool(p) for p in got.present], int(got.prefix))


class HttpTarget(Target):
    """A model of a ``tlkv serve`` over HTTP: has-blocks, one PUT, one ``/v1/prefix``
    round trip read into a receive buffer used again (its pages stay mapped).

    A model the server does not have yet (404 ``not_found``, which is also the answer for
    one the token may not read) has no geometry and holds nothing: the first put creates
    it, as any first PUT does (a token that may not write it gets that PUT's 404 or 403).
    ``longest_prefix`` counts the blocks the server's tier holds (its prefix reads them
    through).
    """

    def __init__(self, client: Client, *, owned: bool = False) -> None:
        self.client = client
        self._owned = owned  # opened by open_target: closed by close()
        self._buffers = KeptBuffers()

    def geometry(self) -> Geometry | None:
        try:
            g = self.client.info()["geometry"]
        except NotFoundError:
            return None
        return None if g is None else Geometry.from_dict(g)

    def longest_prefix(self, hashes: Sequence[int]) -> int:
        return _asked(self.client, hashes, tier=True).prefix

    def has(self, hashes: Sequence[int]) -> list[bool]:
        return _asked(self.client, hashes).present

    def put(self, envelope: Any, tokens: BlockTokens | None = None) -> int:
        return len(self.client.put(envelope, tokens=tokens).stored)

    def prepare(self, max_bytes: int = 0) -> None:
        """Open a keep-alive connection (one ``/healthz``) and map a receive buffer of
        ``max_bytes``."""
        self._buffers.reserve(max_bytes)
        self.client.health()

    def _fetch(self, hashes: Sequence[int], size: int) -> tuple[Any, np.ndarray]:
        """The envelope of the longest held prefix of ``hashes`` (``/v1/prefix``, at most
        ``size`` bytes when it is v1), read into a buffer of ``_buffers`` (given back by
        the caller): (the envelope, the buffer)."""
        buf = self._buffers.take(size)
        try:
            return self.client.prefix_into(buf, hashes=_u64(hashes)), buf
        except NotFoundError:
            return b"", buf

    @contextlib.contextmanager
    def held_views(self, hashes: Sequence[int]) -> Iterator[list[BlockView]]:
        data, buf = self._fetch(hashes, 0)  # a buffer of any size: new bytes if too small
        try:
            yield list(decode(data)) if len(data) else []  # the CRC and every rule checked
        finally:
            del data
            self._buffers.give(buf)

    def load(
        self, hashes: Sequence[int], slots: BlockSlots, slot_ids: Sequence[int]
    ) -> tuple[int, int]:
        """The prefix's one envelope straight into the slots: every reader rule but the
        CRC and each block's hash checked first (``plain_v1_blocks``), then one pass that
        copies the blocks and checks the envelope's CRC (``BlockSlots.scatter_envelopes``);
        a CRC that fails loads none of them. Anything else (v2 blocks, slots that take
        only views) is decoded, checked and scattered."""
        if not len(hashes):
            return 0, 0
        g = slots.geometry
        data, buf = self._fetch(hashes, g.envelope_bytes(len(hashes), VERSION_V1))
        try:
            if not len(data):
                return 0, 0
            n = plain_v1_blocks(data, g, hashes)
            done = None
            if n is not None:
                done = slots.scatter_envelopes([data], slot_ids[:n], joined=True)
            if done is None:
                views = list(decode(data))  # decode checks the CRC and every rule
                views = views[: same_hashes(views, hashes)]
                loaded, nbytes = len(views), slots.scatter(views, slot_ids)
                del views  # they view the buffer
                return loaded, nbytes
            return done, done * g.record_bytes(VERSION_V1)
        finally:
            del data
            self._buffers.give(buf)  # no view of it is left

    def close(self) -> None:
        if self._owned:
            self.client.close()


class GrpcTarget(Target):
    """A model of a ``tlkv serve --grpc-port`` over tl.kv.v1: HasBlocks, one PushKv in
    which only the blocks the server lacks carry payloads, one FetchKv whose checked
    chunks are used as they arrived (``TransferClient.fetch_blocks``: no joined envelope,
    no second CRC pass).

    The protocol carries no geometry, so ``geometry`` is None and ``knows_geometry``
    False: a put uses the engine's (a server holding another geometry refuses the push by
    the reader rules, ``ShapeError``), and ``views_for_tokens`` lets the server hash the
    tokens with its geometry (the blocks that come back are checked against the chain
    hashes of that geometry). A model the server does not have yet holds nothing; the
    first push creates it.
    """

    knows_geometry = False

    def __init__(self, client: TransferClient, *, owned: bool = False) -> None:
        self.client = client
        self._owned = owned

    def geometry(self) -> Geometry | None:
        return None

    def longest_prefix(self, hashes: Sequence[int]) -> int:
        return _asked(self.client, hashes).prefix

    def has(self, hashes: Sequence[int]) -> list[bool]:
        return _asked(self.client, hashes).present

    def put(self, envelope: Any, tokens: BlockTokens | None = None) -> int:
        return int(self.client.push(envelope, tokens=tokens).stored)

    def prepare(self, max_bytes: int = 0) -> None:
        """Connect the channel (a fetch's chunks arrive in gRPC's own buffers)."""
        self.client.connect()

    def _fetched(self, **query: Any) -> list[BlockView]:
        """Every chunk checked (CRC, reader rules, fields) as it arrived."""
        try:
            return [env[0] for env in self.client.fetch_blocks(**query)]
        except NotFoundError:
            return []

    @contextlib.contextmanager
    def held_views(self, hashes: Sequence[int]) -> Iterator[list[BlockView]]:
        yield self._fetched(hashes=list(hashes)) if len(hashes) else []

    @contextlib.contextmanager
    def views_for_tokens(self, tokens: Sequence[int]) -> Iterator[list[BlockView]]:
        """Checked views of the longest held prefix of ``tokens``, hashed by the server;
        each block's hash is checked against the chain of its own ``block_tokens``."""
        views = self._fetched(tokens=[int(t) for t in tokens]) if len(tokens) else []
        if views:
            hashes = chain_hashes(tokens, views[0].geometry.block_tokens)
            views = views[: same_hashes(views, hashes)]
        yield views

    def close(self) -> None:
        if self._owned:
            self.client.close()
