"""The typed interfaces of the store that the layers above it call: each names only the
``Store`` methods its callers use, so that a second backend (or a test double of another
component) is checked against what is really needed, and ``Store`` satisfies them all.

- ``ArchiveSource``: what ``archive.create`` reads (a snapshot of models).
- ``RestoreTarget``: what the archive restore writes through (journals, batches).
- ``BlockStore``: what an engine target uses (``engines.targets.StoreTarget``).
- ``HandleCounters`` and ``ServedStore``: what the service's metrics read.
- ``BufferSource``: what the HTTP fast path reads (zero-copy buffers).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from ..codec.geometry import Geometry
from ..codec.tokens import BlockTokens
from .journal import RestoreJournal
from .reader import Reader
from .results import PutResult

__all__ = [
    "ArchiveSource",
    "BlockStore",
    "BufferSource",
    "HandleCounters",
    "RestoreTarget",
    "ServedStore",
]


class ArchiveSource(Protocol):
    """A store (or a model's handle) that an archive is created from."""

    @property
    def geometry(self) -> Geometry | None: ...
    @property
    def model_id(self) -> str: ...
    def model(self, model_id: str) -> ArchiveSource: ...
    def models(self) -> list[str]: ...
    def has_model(self, model_id: str) -> bool: ...
    def get(self, block_hash: int, *, version: int | None = None) -> bytes | None: ...
    def reader(self) -> Reader: ...


class RestoreTarget(Protocol):
    """A store (or a model's handle) that an archive is restored into."""

    @property
    def capacity_bytes(self) -> int | None: ...
    def total_bytes(self) -> int: ...
    def model(self, model_id: str) -> RestoreTarget: ...
    def has(self, hashes: Iterable[int], *, tier: bool = False) -> list[bool]: ...
    def reader(self) -> Reader: ...
    def import_batch(
        self,
        blocks: Iterable[Any] = (),
        sequences: Iterable[tuple[str, Any]] = (),
        *,
        journal: RestoreJournal | None = None,
        tokens: Iterable[BlockTokens | None] | None = None,
    ) -> PutResult: ...
    def begin_restore(self) -> RestoreJournal: ...
    def end_restore(self, journal: RestoreJournal, *, keep: bool) -> None: ...
    def keep_restores(self, journals: Iterable[RestoreJournal]) -> None: ...


class BlockStore(Protocol):
    """A local store as an engine adapter uses it."""

    @property
    def geometry(self) -> Geometry | None: ...
    @property
    def tier(self) -> Any: ...
    def has(self, hashes: Iterable[int], *, tier: bool = False) -> list[bool]: ...
    def longest_prefix(self, hashes: Iterable[int], *, tier: bool = False) -> int: ...
    def read_through(self, hashes: Iterable[int]) -> int: ...
    def put(self, envelope: Any, *, tokens: BlockTokens | None = None) -> PutResult: ...
    def reader(self) -> Reader: ...


class HandleCounters(Protocol):
    """One open handle's counters of this process (``api.opsmetrics``)."""

    @property
    def model_id(self) -> str: ...
    @property
    def hits(self) -> int: ...
    @property
    def misses(self) -> int: ...
    @property
    def tier_hits(self) -> int: ...
    @property
    def served_bytes(self) -> int: ...
    @property
    def written_bytes(self) -> int: ...


class ServedStore(Protocol):
    """The store a service worker serves, as its metrics read it (``api.metrics``)."""

    def open_handles(self) -> Sequence[HandleCounters]: ...
    def held_snapshots(self) -> tuple[int, float]: ...


class BufferSource(Protocol):
    """The store as the HTTP fast path reads it (``api.http_protocol``)."""

    @property
    def tier(self) -> Any: ...
    def get_buffers(self, hashes: Iterable[int], *, check_crc: bool = True) -> list[memoryview]: ...
