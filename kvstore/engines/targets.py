"""The places an engine saves KV blocks to and loads them from: one ``Target`` per
namespace, over a store directory (``Store``), a ``tlkv serve`` over HTTP (``Client``) or
one over tl.kv.v1 (``TransferClient``; those two in ``server_targets``), with one
vocabulary for every engine.

``open_target(spec, model=...)`` opens one from its spec (a directory, ``http(s)://...``,
``grpc://...``); ``as_target(obj)`` wraps an open ``Store``, ``Client`` or
``TransferClient`` (a ``Target`` passes through). Every engine bridge (the transformers
bridge, the vLLM connector, the SGLang backend) asks a target the same questions:

- ``geometry()``: the namespace's block geometry (None: it holds none yet, or, where
  ``knows_geometry`` is False as on tl.kv.v1, it cannot tell);
- ``has(hashes)`` / ``longest_prefix(hashes)``: one round trip, a namespace not created
  yet holds nothing;
- ``put(envelope)``: store the envelope's blocks, returns how many were new; the first
  put creates the namespace;
- ``views(hashes)``: a context manager giving checked ``BlockView``s (CRC and every reader
  rule) of the longest held prefix of ``hashes``, valid inside the ``with``. A block
  under a hash other than the one asked for ends the prefix, as does a block that fails
  its CRC (a store quarantines it); ``views_for_tokens(tokens)`` asks by token ids;
- ``load(hashes, slots, slot_ids)``: the same prefix copied straight into an engine's
  block slots (``BlockSlots``: a paged cache), every block checked before the engine can
  use it; returns (blocks in place, payload bytes read);
- ``prepare(max_bytes)``: do at start-up what a first load would do on the way (connect
  to a server, map receive buffers of up to ``max_bytes``), so that the first load costs
  what the next ones do;
- ``close()``: release connections (a shared store stays open for the process).

Transport and service errors are raised to the engine, which counts them and computes
instead. A new engine backend needs nothing else: open its target once per namespace with
``open_target`` (or take the user's object through ``as_target``), hash the prompt with
``kvstore.codec.hashing.chain_hashes`` and the target's ``block_tokens``, save with
``has`` then ``put`` of the blocks it lacks, and load with ``views`` (or ``load`` into its
own ``BlockSlots``). An outside target subclasses ``Target`` (``geometry``, ``has``,
``put``, ``held_views``) and runs ``kvstore.testing.TargetTests`` against itself.
"""

from __future__ import annotations

import abc
import contextlib
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from ..codec.decoding import plain_v1_blocks
from ..codec.envelope import BlockView
from ..codec.geometry import Geometry
from ..codec.hashing import chain_hashes
from ..codec.layout import VERSION_V1
from ..codec.tokens import BlockTokens
from ..errors import InvalidRequestError
from ..fileio import populate_mapped_pages
from ..store import Store

if TYPE_CHECKING:
    from ..store.protocols import BlockStore

__all__ = [
    "BlockSlots",
    "StoreOptions",
    "StoreTarget",
    "Target",
    "as_target",
    "open_target",
    "store_options",
]

DEFAULT_TIMEOUT = 5.0  # seconds per call to a server


class BlockSlots(Protocol):
    """An engine's cache as numbered block slots that ``Target.load`` copies blocks into
    (vLLM's paged cache is one)."""

    geometry: Geometry

    def scatter(self, views: Sequence[BlockView], slot_ids: Sequence[int]) -> int:
        """Copy checked views into the slots ``slot_ids``, in order; returns the payload
        bytes read."""
        ...

    def scatter_envelopes(
        self, envelopes: Sequence[Any], slot_ids: Sequence[int], *, joined: bool = False
    ) -> int | None:
        """Copy v1 envelopes of full blocks of ``geometry`` (every reader rule but the CRC
        checked by the caller) into the slots, each CRC checked in the same pass; returns
        how many leading blocks are in place, or None when these slots take blocks only
        through ``scatter``. ``joined``: envelopes of several blocks, else one each."""
        ...


class Target(abc.ABC):
    """One namespace of a place that holds blocks (see the module docstring).

    Subclasses implement ``geometry``, ``has``, ``put`` and ``held_views``; the rest is
    derived from them and may be overridden for speed (one round trip, fused copies).
    """

    knows_geometry = True  # False: geometry() is None because the target cannot tell

    @abc.abstractmethod
    def geometry(self) -> Geometry | None:
        """The namespace's block geometry; None when it holds none (or cannot tell)."""

    @abc.abstractmethod
    def has(self, hashes: Sequence[int]) -> list[bool]:
        """Whether each hash is held."""

    @abc.abstractmethod
    def put(self, envelope: Any, tokens: BlockTokens | None = None) -> int:
        """Store an envelope's blocks with their token ids when given (one row and parent
        per full block, checked by the target against each block's name); returns how many
        were newly stored."""

    @abc.abstractmethod
    def held_views(self, hashes: Sequence[int]) -> AbstractContextManager[Sequence[BlockView]]:
        """Checked views (CRC and reader rules) of the blocks held for the leading
        ``hashes``, in order, stopping at the first missing or corrupt one; ``views``
        checks that each is the block asked for."""

    def longest_prefix(self, hashes: Sequence[int]) -> int:
        """How many leading ``hashes`` are held (blocks a tier holds count where the
        target reads through it)."""
        present = self.has(hashes)
        return next((i for i, here in enumerate(present) if not here), len(present))

    @contextlib.contextmanager
    def views(self, hashes: Sequence[int]) -> Iterator[list[BlockView]]:
        """Checked views of the longest held prefix of ``hashes``, valid in the block; a
        block under another hash than the one asked for ends the prefix."""
        if not len(hashes):
            yield []
            return
        with self.held_views(hashes) as held:
            yield list(held[: same_hashes(held, hashes)])

    @contextlib.contextmanager
    def views_for_tokens(self, tokens: Sequence[int]) -> Iterator[list[BlockView]]:
        """Checked views of the longest held prefix of the full blocks of ``tokens``,
        hashed with the target's geometry (none held: none).

        Raises:
            InvalidRequestError: the target cannot tell its geometry and does not hash
                tokens itself.
        """
        if not self.knows_geometry:
            raise InvalidRequestError(
                f"{type(self).__name__} cannot tell its geometry and does not hash tokens "
                f"itself: pass config= and block_tokens="
            )
        g = self.geometry()
        with self.views(chain_hashes(tokens, g.block_tokens) if g else []) as views:
            yield views

    def load(
        self, hashes: Sequence[int], slots: BlockSlots, slot_ids: Sequence[int]
    ) -> tuple[int, int]:
        """Copy the longest held prefix of ``hashes`` into the slots ``slot_ids``, every
        block checked (CRC, reader rules, its hash the one asked for) before the engine
        can use it; returns (blocks in place, payload bytes read)."""
        with self.views(hashes) as views:
            return len(views), slots.scatter(views, slot_ids)

    def prepare(self, max_bytes: int = 0) -> None:  # noqa: B027 - nothing to do by default
        """Do now what a first load would do on the way (connect, map receive buffers of
        up to ``max_bytes``): an engine calls it at start-up. Transport errors are raised
        (the engine goes on: its first load tries again)."""

    def close(self) -> None:  # noqa: B027 - a target without connections has nothing to do
        """Release connections (a shared store stays open for the process)."""


def same_hashes(views: Sequence[BlockView], hashes: Sequence[int]) -> int:
    """How many leading ``views`` are the blocks asked for: a block under another hash
    (a server's mistake, or another namespace's block) ends what is loaded."""
    for i, (bv, h) in enumerate(zip(views, hashes)):
        if bv.hash != h:
            return i
    return min(len(views), len(hashes))


class StoreTarget(Target):
    """A ``Store`` (or one model's handle of it): zero-copy reader views, one transaction
    per put. On a store with a tier, ``longest_prefix`` counts the blocks the tier holds
    and ``views``/``load`` read the local misses through first (validated and kept
    locally, as the server's ``/v1/prefix`` does)."""

    def __init__(self, store: BlockStore) -> None:
        self.store = store

    def geometry(self) -> Geometry | None:
        return self.store.geometry

    def has(self, hashes: Sequence[int]) -> list[bool]:
        return list(self.store.has(list(hashes))) if len(hashes) else []

    def longest_prefix(self, hashes: Sequence[int]) -> int:
        if not len(hashes):
            return 0
        hashes = hashes if type(hashes) is list else list(hashes)
        return int(self.store.longest_prefix(hashes, tier=self.store.tier is not None))

    def put(self, envelope: Any, tokens: BlockTokens | None = None) -> int:
        return int(self.store.put(envelope, tokens=tokens).stored)

    def _read_through(self, hashes: Sequence[int]) -> None:
        if self.store.tier is not None and len(hashes):
            self.store.read_through(list(hashes))

    @contextlib.contextmanager
    def held_views(self, hashes: Sequence[int]) -> Iterator[list[BlockView]]:
        self._read_through(hashes)
        with self.store.reader() as reader:
            held = _held_envelopes(reader, hashes)
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
        self, hashes: Sequence[int], slots: BlockSlots, slot_ids: Sequence[int]
    ) -> tuple[int, int]:
        """The stored envelopes straight into the slots: every reader rule but the CRC
        checked first (the codec's ``plain_v1_blocks``), then one pass that copies each
        block and checks its CRC (``BlockSlots.scatter_envelopes``). A block whose CRC
        fails ends the loaded prefix (it and the blocks after it are reported not loaded)
        and is quarantined. Envelopes that are not all full v1 blocks of the hashes asked for, or
        slots that take only views, go through ``views`` and ``scatter``."""
        self._read_through(hashes)
        with self.store.reader() as reader:
            held = _held_envelopes(reader, hashes)
            populate_mapped_pages(held)  # LMDB maps without readahead: one call, not a fault a page
            done: int | None = None
            g = slots.geometry
            if all(plain_v1_blocks(e, g, hashes[i : i + 1]) for i, e in enumerate(held)):
                done = slots.scatter_envelopes(held, slot_ids[: len(held)])
            if done is not None and done < len(held):  # checked alone: quarantined if corrupt
                reader.view(hashes[done], verify=True)
            del held  # no view outlives the reader
        if done is None:
            return super().load(hashes, slots, slot_ids)
        return done, done * slots.geometry.record_bytes(VERSION_V1)


def _held_envelopes(reader: Any, hashes: Sequence[int]) -> list[memoryview]:
    """The stored envelopes of the leading held ``hashes`` (unchecked), up to the first
    missing one."""
    held = []
    for h in hashes:
        buf = reader.envelope(h)
        if buf is None:
            break
        held.append(buf)
    return held


_stores: dict[tuple[int, str], Store] = {}
_stores_lock = threading.Lock()


def _shared_store(path: str, sync: bool = True, preallocate: int = 0) -> Store:
    """The process's one ``Store`` on ``path``, opened after any fork (LMDB allows one
    environment per process and path: every target and engine of the process shares it).

    Raises:
        ValueError: the store is open in this process with the other ``sync`` or another
            ``preallocate``.
    """
    key = (os.getpid(), os.path.realpath(path))
    with _stores_lock:
        store = _stores.get(key)
        if store is None:
            store = _stores[key] = Store(path, sync=sync, preallocate_bytes=preallocate)
        elif store.sync != sync:
            raise ValueError(
                f"store directory {path} is open in this process with sync={store.sync}; "
                f"a target asked for sync={sync} (one setting per directory and process)"
            )
        elif store.preallocate_bytes != preallocate:
            raise ValueError(
                f"store directory {path} is open in this process with preallocate="
                f"{store.preallocate_bytes}; a target asked for {preallocate} (one setting "
                "per directory and process)"
            )
        return store


def open_target(
    spec: str | os.PathLike[str],
    *,
    model: str | None = None,
    token: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    sync: bool = True,
    preallocate: int = 0,
) -> Target:
    """The target named by ``spec``, addressing namespace ``model`` (None: ``default``).

    Args:
        spec: a store directory (the process's one ``Store`` on it, shared with every
            other target and engine of the process), ``http(s)://host:port`` or
            ``grpc://host:port``.
        model: the namespace (a model id).
        token: the server's bearer token.
        timeout: seconds per call to a server.
        sync: a store directory's ``Store(sync=)``: False commits without an fsync
            (``Store``'s documented risk: for a cache that can be rebuilt). A server
            keeps its own setting.
        preallocate: a store directory's ``Store(preallocate_bytes=)`` (0: off); a server
            keeps its own (``tlkv serve --preallocate``).

    Raises:
        ValueError: the store directory is open in this process with the other ``sync``
            or another ``preallocate``.
    """
    from ..transfer import GRPC_SCHEME
    from .server_targets import GrpcTarget, HttpTarget

    text = os.fspath(spec)
    if text.startswith(("http://", "https://")):
        from ..client import Client

        return HttpTarget(Client(text, token, timeout=timeout, model=model), owned=True)
    if text.startswith(GRPC_SCHEME):
        from ..transfer import TransferClient

        return GrpcTarget(TransferClient(text, token, timeout=timeout, model=model), owned=True)
    store = _shared_store(text, sync, preallocate)
    return StoreTarget(store.model(model) if model is not None else store)


class StoreOptions(NamedTuple):
    """A store directory's options in an engine's config: ``sync`` and ``preallocate``,
    passed on to ``open_target``."""

    sync: bool = True
    preallocate: int = 0


def store_options(config: Mapping[str, Any]) -> StoreOptions:
    """The store-directory options of an engine's extra config: ``"sync"`` 1 (default:
    each put fsynced before it returns) or 0 (``Store(sync=False)``), ``"preallocate"``
    bytes, an int >= 0 (``Store(preallocate_bytes=)``; default 0, off). A server target
    keeps its own settings and ignores both.

    Raises:
        ValueError: a value other than these, naming its key.
    """
    sync = config.get("sync", 1)
    if sync not in (0, 1):  # True and False compare equal to 1 and 0
        raise ValueError(f"tlkv 'sync' must be 1 or 0, found {sync!r}")
    size = config.get("preallocate", 0)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"tlkv 'preallocate' must be an int of bytes >= 0, found {size!r}")
    return StoreOptions(bool(sync), size)


def as_target(obj: Any) -> Target:
    """``obj`` as a ``Target``: a ``Store`` (or a model's handle), a
    ``kvstore.client.Client``, a ``kvstore.transfer.TransferClient``, or a ``Target``
    (passed through). Closing the target leaves ``obj`` open.

    Raises:
        TypeError: ``obj`` is none of these.
    """
    if isinstance(obj, Target):
        return obj
    if isinstance(obj, Store):
        return StoreTarget(obj)
    from ..client import Client
    from .server_targets import GrpcTarget, HttpTarget

    if isinstance(obj, Client):
        return HttpTarget(obj)
    from ..transfer import TransferClient

    if isinstance(obj, TransferClient):
        return GrpcTarget(obj)
    raise TypeError(
        f"expected a kvstore Store, Client, TransferClient or a Target, found {type(obj).__name__}"
    )


def __getattr__(name: str) -> Any:
    """``HttpTarget`` and ``GrpcTarget``, still importable from here (they live in
    ``server_targets``, which imports this module)."""
    if name in ("GrpcTarget", "HttpTarget"):
        from . import server_targets

        return getattr(server_targets, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
