"""The persistent block store: one LMDB environment of content-addressed KV blocks.

``Store`` is the index of the API: each public method is a short delegate, with its
docstring, to the code that does it over a model handle (``state.Handle``, the model's
state on the one ``environment.Environment``): ``reads`` (get, has, longest_prefix, views,
sequences), ``writes`` (put, import, delete), ``restores`` (restore journals), ``models``
and ``stats``; the administrative half (models, the KV event log, restores, counters, the
tier) is in its base, ``store_admin.StoreAdmin``. The on-disk layout is declared in
``diskformat``, the write transaction in ``writetxn`` and ``seqtxn``, zero-copy readers in
``reader``; the codec (``envelope``) validates every envelope, and a block is stored as its
verbatim single-block envelope.

Choices:

- ``bytes``/``capacity_bytes`` count stored values: block envelopes plus sequence records
  (which hold a sequence's partial tail). Capacity is the store's (every
  handle of it enforces it).
- ``hits``/``misses`` count this process's reads since it opened the store; the other
  ``stats()`` are persisted.
- A block failing its CRC is removed from the block space and counted; sequences keep
  their reference, and ``get_sequence`` returns None until a block with that hash is put
  again. A sequence record failing its own CRC is removed and every pin recounted.
- Models (namespaces): ``Store.model(id)`` is a handle on one model's blocks and
  sequences, with this whole API; the ``Store`` itself is the model ``default``. A
  model is created by its first write (reads of a model not created yet find nothing),
  its geometry fixed by its first put. Capacity and the LRU order are store-wide; a
  handle's ``quota_bytes`` bounds its model's bytes (evicting its own blocks first).
- Recency: reads record hits in process memory; the next write transaction, a background
  flush at most every ``state._FLUSH_INTERVAL`` seconds, or ``close`` persists them (LRU order
  is approximate across processes and survives reopening).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import numpy as np

from ..codec.geometry import Geometry
from ..codec.hashing import TokenInput
from ..codec.tokens import BlockTokens
from ..protocol import DEFAULT_MODEL
from ..tier import Tier
from . import kvevents as _kvevents
from . import reads as _reads
from . import restores as _restores
from . import writes as _writes
from .checks import check_open
from .journal import RestoreJournal
from .reader import Reader
from .reads import transcode_stored
from .results import PutReport, PutResult
from .state import open_root
from .store_admin import StoreAdmin

__all__ = ["PutReport", "PutResult", "Reader", "Store", "transcode_stored"]


class Store(StoreAdmin):
    """A persistent, content-addressed store of KV blocks in one LMDB environment.

    Args:
        path: directory of the environment (created if missing).
        geometry: the store's block geometry; a new store without one adopts the geometry
            of its first successful put.
        capacity_bytes: bound on the stored bytes (block envelopes + sequence records);
            a put beyond it first evicts least-recently-used unpinned blocks. None: the
            store grows until the disk is full (then ``StoreFullError``).
        sync: True: a write returns once LMDB has fsynced its commit (durable; a commit of
            8 MiB or more starts the disk while LMDB still copies, ``writebehind``). False
            (LMDB's MDB_NOSYNC): a commit survives a crash of the process, but an OS crash
            or power loss may undo the latest ones and, on a filesystem that does not
            preserve write order, may corrupt the environment (LMDB's documented risk);
            ``close`` syncs. Use it only for a cache that can be rebuilt.
        map_bytes: the initial size of LMDB's memory map (default 64 MiB, or twice the
            capacity); it grows on demand by at least doubling, invisibly to the user.
        allow_nonfinite: False (default): a put, sequence or restore holding a NaN or an
            infinity (v1 f16, v2 E4M3 NaN codes) or a v2 scale that is not finite, > 0 and
            at most ``numerics.SCALE_MAX`` is refused (``FormatError``); True stores such
            envelopes verbatim, as the spec's reader rules allow, and a transcoding ``get``
            of one raises ``UnconvertibleError``.
        tier: a shared object-store tier behind the store (``s3://bucket/prefix``,
            ``file:///path``, or a :class:`~kvstore.tier.Tier`): new blocks are uploaded
            in the background (a persistent pending set; pending blocks are never
            evicted), and a local miss of ``get``/``get_many``/``read_through`` reads the
            block through from it, validated, into the store.
        tier_endpoint: the S3-compatible server of a ``tier`` URL (default: the
            ``AWS_ENDPOINT_URL`` environment variable, else AWS).
        max_models: the models besides ``default`` this store admits (0 to
            ``protocol.MAX_MODELS_LIMIT``): a write that would create one more raises
            ``ModelLimitError``. The limit belongs to the store: a value given here is
            kept in it (the last opener to give one sets it), None keeps the store's
            (200 for a store that never had one). Every process sharing the store checks
            the same limit in the write that registers a model, and opens every model any
            of them made; a store holding more already (registered under a higher limit)
            opens and serves them all.
        events: the KV event log (``set_events``): a bound in batches turns it on, 0 off,
            None (default) keeps the store's setting. It is a setting of the store, so
            every process writing to it logs its changes while it is on.
        preallocate_bytes: room kept past the last page of the data file, allocated on
            disk and in the page cache, so puts that grow the store write into pages the
            kernel already holds instead of waiting for new ones; with ``sync`` the room is
            written with zeros, so durable commits into it flush no new extents
            (``prealloc``; measured in BENCHMARKS.md, "Preallocation"). Opening makes the
            first room and fills it before returning; a commit that leaves less than half
            extends the file again and a helper thread fills the new range. Costs that much
            disk ahead of the data and up to that much page cache. 0 (default): off.

    Raises:
        ShapeError: the store exists with another geometry.
        StoreError: the directory holds something else, or another store format.

    Open a store in the process that uses it (after fork): a ``Store`` used in a forked
    child raises ``StoreError``. Several processes may open the same path and read and
    write concurrently. Threads may share a ``Store``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        geometry: Geometry | None = None,
        capacity_bytes: int | None = None,
        sync: bool = True,
        map_bytes: int | None = None,
        allow_nonfinite: bool = False,
        tier: str | Tier | None = None,
        tier_endpoint: str | None = None,
        max_models: int | None = None,
        events: int | None = None,
        preallocate_bytes: int = 0,
    ) -> None:
        check_open(geometry, capacity_bytes, map_bytes, max_models, preallocate_bytes)
        h = open_root(
            os.fspath(path),
            geometry=geometry,
            capacity=capacity_bytes,
            sync=bool(sync),
            map_bytes=map_bytes,
            allow_nonfinite=bool(allow_nonfinite),
            max_models=max_models,
            tier=tier,
            tier_endpoint=tier_endpoint,
            preallocate=preallocate_bytes,
        )
        self._h = h
        h.facade = self
        _restores.roll_back_killed_restores(h)
        if events is not None:
            _kvevents.set_events(h, events)
        if h.tier is not None:
            for model in self.models():  # every model's uploads resume (their handles)
                self.model(model)

    # --- properties and life cycle -----------------------------------------------------

    @property
    def path(self) -> str:
        """The environment's directory."""
        return self._h.env.path

    @property
    def geometry(self) -> Geometry | None:
        """The store's block geometry (None until given or adopted by a first put); with a
        tier, until then the geometry of its namespace in the tier, if any (which a put or
        a read-through then adopts)."""
        return self._h.current_geometry()

    @property
    def map_bytes(self) -> int:
        """The size of LMDB's memory map now (it grows on demand)."""
        return int(self._h.env.lmdb.env.info()["map_size"])

    @property
    def capacity_bytes(self) -> int | None:
        """The capacity this handle enforces (None: unbounded)."""
        return self._h.env.capacity

    @property
    def sync(self) -> bool:
        """Whether a write returns only once its commit is fsynced (``sync`` at open)."""
        return bool(self._h.env.sync)

    @property
    def preallocate_bytes(self) -> int:
        """The room kept past the data file's last page (``preallocate_bytes`` at open)."""
        return int(self._h.env.lmdb.prealloc.nbytes)

    @property
    def hits(self) -> int:
        """This handle's reads in this process that found their block."""
        return self._h.hits

    @property
    def misses(self) -> int:
        """This handle's reads in this process that did not (answered by the tier or not)."""
        return self._h.misses

    @property
    def tier_hits(self) -> int:
        """Local misses of this handle answered from the object tier (read through)."""
        return self._h.tier_hits

    @property
    def served_bytes(self) -> int:
        """Envelope bytes this handle handed out (get, get_many, get_buffers)."""
        return self._h.served_bytes

    @property
    def written_bytes(self) -> int:
        """Block bytes this handle wrote (puts, read-through copies, repairs)."""
        return self._h.written_bytes

    def close(self) -> None:
        """Persist pending recency, wait for this process's open readers, close LMDB (a
        model's handle: persist its recency; the store stays open)."""
        self._h.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        h = self._h
        state = "closed" if h.closed or h.env.closed else "open"
        model = "" if h.model == DEFAULT_MODEL else f", model={h.model!r}"
        return f"Store({h.env.path!r}{model}, geometry={h.geometry}, {state})"

    # --- reads -------------------------------------------------------------------------

    def get(self, block_hash: int, *, version: int | None = None) -> bytes | None:
        """The block's single-block envelope, CRC-verified; None when absent or corrupt
        (a corrupt block is quarantined). With ``version`` differing from the stored
        format, the block is transcoded on the way out."""
        return _reads.get_many(self._h, [block_hash], version)[0]

    def get_many(self, hashes: Iterable[int], *, version: int | None = None) -> list[bytes | None]:
        """``get`` of every hash, in one read transaction."""
        return _reads.get_many(self._h, hashes, version)

    def get_from_tier(self, block_hash: int) -> bytes | None:
        """The block a local read just missed (``get_buffers``), read through from the tier,
        validated (None without a tier or a valid copy there): counted as that lookup's
        tier hit, not as another lookup."""
        return _reads.get_from_tier(self._h, block_hash)

    def get_buffers(self, hashes: Iterable[int], *, check_crc: bool = True) -> list[memoryview]:
        """Zero-copy ``get_many`` of a chain's prefix: the stored envelopes of the leading
        hashes, each CRC-verified, up to the first one absent or corrupt, from one read
        snapshot, as read-only memoryviews straight over LMDB's map.

        ``check_crc=False``: for a reader that checks each envelope's CRC-32C itself as it
        arrives (``protocol.READER_CHECKS_HEADER``). The envelopes are handed over as
        stored, unread here: one pass over each block less. A corrupt one is then found by
        that reader (which asks again without the header: this store's check quarantines
        it) or by a scrub, not by this read.

        For handing to something that releases them later (an HTTP transport): the
        snapshot stays open until every returned memoryview, and everything made from
        them, is released, and ends at once then. Keep them only as long as needed: an
        open snapshot keeps its pages from being reused, and a remap of the map waits
        for it (``LmdbEnv.hold``). While a remap is pending they are copies.
        """
        return _reads.get_buffers(self._h, hashes, check_crc)

    def lingering_snapshots(self) -> int:
        """Snapshots of closed readers this process keeps open because zero-copy arrays
        taken from them are still referenced (their pages are not reused meanwhile)."""
        return self._h.env.lmdb.snapshots.lingering()

    def held_snapshots(self) -> tuple[int, float]:
        """Read snapshots held open for buffers of ``get_buffers`` in this process, and
        the age in seconds of the oldest (0 when none)."""
        return self._h.env.lmdb.snapshots.held()

    def set_loop_thread(self, ident: int | None) -> None:
        """Name the thread whose event loop releases ``get_buffers``' buffers: a remap it
        needs while some are held raises ``StoreError`` instead of waiting for them."""
        self._h.env.lmdb.loop_thread = ident

    def has(self, hashes: Iterable[int], *, tier: bool = False) -> list[bool]:
        """Whether each hash is stored; ``hashes`` are ints or a numpy integer array.

        One read transaction, no write lock. Large queries are answered from a sorted copy
        of the stored hashes, re-read (a page of hashes per LMDB call) only after a write.
        ``tier``: a hash absent here counts as present when the store's tier holds it
        (concurrent HEADs; nothing is read through).

        Raises:
            ValueError: a hash is not an integer in 0..2^64-1.
        """
        return _reads.has(self._h, hashes, tier).tolist()  # type: ignore[no-any-return]

    def has_mask(self, hashes: Iterable[int], *, tier: bool = False) -> np.ndarray:
        """``has`` as a numpy bool array (no Python object per hash: the service's answer
        to a query of millions of hashes is built from it)."""
        return _reads.has(self._h, hashes, tier)

    def longest_prefix(self, hashes: Iterable[int], *, tier: bool = False) -> int:
        """How many leading hashes are stored (the cached prefix of a chain); no write lock.

        ``tier``: the prefix continues through blocks the store's tier holds (HEADs).

        Raises:
            ValueError: a hash is not an integer in 0..2^64-1.
        """
        return _reads.longest_prefix(self._h, hashes, tier)

    def read_through(self, hashes: Iterable[int]) -> int:
        """Bring the leading blocks of a chain that are missing here in from the tier
        (validated, stored as evictable blocks), stopping at the first the tier lacks;
        returns the length of the prefix now stored. Without a tier: ``longest_prefix``.

        Raises:
            ValueError: a hash is not an integer in 0..2^64-1.
        """
        return _reads.read_through(self._h, hashes)

    def reader(self) -> Reader:
        """A read transaction for zero-copy views: ``with store.reader() as r: r.view(h)``.

        Views, memoryviews and arrays from it are valid only inside the ``with`` block;
        a resize of LMDB's map (a write in this process) waits until it closes.
        """
        return _reads.reader(self._h)

    def get_sequence(self, name: str) -> bytes | None:
        """The sequence's envelope, byte-identical to the canonical one put; None when
        absent or damaged (a block quarantined as corrupt and not put again)."""
        return _reads.get_sequence(self._h, name)

    def sequences(self) -> list[str]:
        """Names of every sequence, sorted."""
        return _reads.sequences(self._h)

    # --- writes ------------------------------------------------------------------------

    def put(
        self, envelope: Any, *, tokens: TokenInput | BlockTokens | None = None, parent: int = 0
    ) -> PutResult:
        """Store every full block of ``envelope`` under its hash, in one transaction.

        The envelope is validated by every reader rule against the store's geometry; the
        value stored per block is its verbatim single-block envelope, the bytes ``get``
        returns. Hashes already present are not rewritten (the first put wins); partial
        blocks (hash 0) are not stored.

        ``tokens``: the full blocks' token ids, one chain from ``parent`` (0: a sequence's
        start; B ids per block, then at most B - 1 of a tail), or a ``BlockTokens`` (a
        row and parent per block): each hash is checked to be ``H(parent, tokens)``
        first; the ids are kept (``block_tokens``) and announced (``docs/events.md``).

        Raises:
            EnvelopeError: a reader rule failed (nothing stored).
            TokenMismatchError: ``tokens`` do not hash to the blocks (nothing stored).
            StoreFullError: the blocks do not fit even after eviction (nothing stored).
        """
        return _writes.put_report(self._h, envelope, tokens, parent).counts()

    def put_report(
        self, envelope: Any, *, tokens: TokenInput | BlockTokens | None = None, parent: int = 0
    ) -> PutReport:
        """``put``, reporting the hashes stored and already present (the HTTP reply).

        ``envelope``: bytes (any buffer), or the ``Envelope`` that ``decode`` returned for
        them (not decoded again; the CRC is checked while the blocks are copied)."""
        return _writes.put_report(self._h, envelope, tokens, parent)

    def put_sequence(
        self,
        name: str,
        envelope: Any,
        *,
        tokens: TokenInput | BlockTokens | None = None,
        parent: int = 0,
    ) -> PutResult:
        """Store a named KV state, replacing any sequence of that name.

        Its full blocks are stored content-addressed (deduplicated) and pinned; its partial
        tail, if any, is kept inside the sequence record. ``get_sequence`` returns the
        envelope byte-identical (a block already stored in another format version or with
        other bytes is kept inside the record too, unpinned).

        Raises:
            ValueError: ``name`` is not 1-128 characters of ``[A-Za-z0-9._-]``, or the
                envelope has no block.
            FormatError: a partial block (hash 0) is not the last block.
            EnvelopeError: a reader rule failed.  StoreFullError: it does not fit.
            TokenMismatchError: ``tokens`` (as ``put``'s) do not hash to the blocks.
        """
        return _writes.put_named_sequence(self._h, name, envelope, tokens, parent)

    def import_batch(
        self,
        blocks: Iterable[Any] = (),
        sequences: Iterable[tuple[str, Any]] = (),
        *,
        journal: RestoreJournal | None = None,
        tokens: Iterable[BlockTokens | None] | None = None,
    ) -> PutResult:
        """Put many block envelopes, then sequences ``(name, envelope)``, in ONE write
        transaction: all or nothing (the archive restore path).

        Everything is validated before the transaction opens; an envelope may be bytes or
        the ``Envelope`` that ``decode`` returned for them (not decoded again). LMDB holds
        the batch's dirty pages in memory until it commits: size batches accordingly. With
        a ``journal`` (``begin_restore``), what the batch adds and replaces is noted in the
        same commit. ``tokens``: one entry per block envelope, its full blocks' token ids
        (checked as ``put`` checks them) or None.
        """
        return _writes.import_batch(self._h, blocks, sequences, journal, tokens)

    def delete(self, block_hash: int) -> bool:
        """Remove a block; False when absent.

        Raises:
            PinnedError: a sequence references the block (HTTP 409).
        """
        return _writes.delete(self._h, block_hash)

    def delete_sequence(self, name: str) -> bool:
        """Drop a sequence and its pins; False when absent."""
        return _writes.delete_sequence(self._h, name)

    def block_tokens(self, hashes: Iterable[int]) -> list[tuple[int, np.ndarray] | None]:
        """For each hash, ``(parent hash, token ids)`` of the stored block when it was
        written with its token ids (verified then); None otherwise."""
        return _kvevents.block_tokens(self._h, hashes)
