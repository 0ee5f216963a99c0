"""tlkv: a persistent, memory-mapped store and archive format for LLM KV-cache blocks.

The everyday API is here: the codec (``encode``, ``decode``, ``chain_hashes``, ...),
``Geometry``, ``Block``, ``Store`` and the base errors. Everything else lives in its
subpackage: ``kvstore.codec``, ``kvstore.store``, ``kvstore.archive``, ``kvstore.client``,
``kvstore.errors`` (the whole error tree), ``kvstore.protocol``.

Attributes load on first use (PEP 562), so ``import kvstore`` imports nothing heavy and
using the codec never imports lmdb, zstandard or an HTTP library.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

# public name -> the module that defines it
_EXPORTS = {
    "Block": "kvstore.codec.envelope",
    "BlockView": "kvstore.codec.envelope",
    "Envelope": "kvstore.codec.envelope",
    "decode": "kvstore.codec.envelope",
    "encode": "kvstore.codec.envelope",
    "join": "kvstore.codec.envelope",
    "split": "kvstore.codec.envelope",
    "transcode": "kvstore.codec.envelope",
    "crc32c": "kvstore.codec.checksum",
    "Geometry": "kvstore.codec.geometry",
    "block_hash": "kvstore.codec.hashing",
    "chain_hashes": "kvstore.codec.hashing",
    "fnv1a64": "kvstore.codec.hashing",
    "PutReport": "kvstore.store.store",
    "PutResult": "kvstore.store.store",
    "Store": "kvstore.store.store",
    "TlkvError": "kvstore.errors",
    "EnvelopeError": "kvstore.errors",
    "FormatError": "kvstore.errors",
    "ChecksumError": "kvstore.errors",
    "ShapeError": "kvstore.errors",
    "UnsupportedVersionError": "kvstore.errors",
    "StoreError": "kvstore.errors",
    "StoreFullError": "kvstore.errors",
    "NotFoundError": "kvstore.errors",
    "ArchiveError": "kvstore.errors",
}

__all__ = [
    "ArchiveError",
    "Block",
    "BlockView",
    "ChecksumError",
    "Envelope",
    "EnvelopeError",
    "FormatError",
    "Geometry",
    "NotFoundError",
    "PutReport",
    "PutResult",
    "ShapeError",
    "Store",
    "StoreError",
    "StoreFullError",
    "TlkvError",
    "UnsupportedVersionError",
    "__version__",
    "block_hash",
    "chain_hashes",
    "crc32c",
    "decode",
    "encode",
    "fnv1a64",
    "join",
    "split",
    "transcode",
]

if TYPE_CHECKING:  # what the lazy attributes are, for type checkers
    from .codec.checksum import crc32c
    from .codec.envelope import Block, BlockView, Envelope, decode, encode, join, split, transcode
    from .codec.geometry import Geometry
    from .codec.hashing import block_hash, chain_hashes, fnv1a64
    from .errors import (
        ArchiveError,
        ChecksumError,
        EnvelopeError,
        FormatError,
        NotFoundError,
        ShapeError,
        StoreError,
        StoreFullError,
        TlkvError,
        UnsupportedVersionError,
    )
    from .store.store import PutReport, PutResult, Store


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
