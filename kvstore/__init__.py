"""tlkv: a persistent, memory-mapped store and archive format for LLM KV-cache blocks.

The everyday API is here: the codec (``encode``, ``decode``, ``chain_hashes``, ...),
``Geometry``, ``Block``, ``Store`` and the base errors. Everything else lives in its
subpackage: ``kvstore.codec``, ``kvstore.store``, ``kvstore.archive``, ``kvstore.client``,
``kvstore.errors`` (the whole error tree), ``kvstore.protocol``.

Attributes load on first use (PEP 562), so ``import kvstore`` imports nothing heavy and
using the codec never imports lmdb, zstandard or an HTTP library.
"""

from __future__ import annotations

import ast
import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__

if TYPE_CHECKING:  # THE list of exports: read by type checkers, and by _exports() below
    from .codec.checksum import crc32c as crc32c
    from .codec.envelope import Block as Block
    from .codec.envelope import BlockView as BlockView
    from .codec.envelope import Envelope as Envelope
    from .codec.envelope import decode as decode
    from .codec.envelope import encode as encode
    from .codec.envelope import join as join
    from .codec.envelope import split as split
    from .codec.envelope import transcode as transcode
    from .codec.geometry import Geometry as Geometry
    from .codec.hashing import block_hash as block_hash
    from .codec.hashing import chain_hashes as chain_hashes
    from .codec.hashing import fnv1a64 as fnv1a64
    from .codec.numerics import as_array as as_array
    from .errors import ArchiveError as ArchiveError
    from .errors import ChecksumError as ChecksumError
    from .errors import EnvelopeError as EnvelopeError
    from .errors import FormatError as FormatError
    from .errors import NotFoundError as NotFoundError
    from .errors import ShapeError as ShapeError
    from .errors import StoreError as StoreError
    from .errors import StoreFullError as StoreFullError
    from .errors import TlkvError as TlkvError
    from .errors import UnsupportedVersionError as UnsupportedVersionError
    from .results import PutReport as PutReport
    from .results import PutResult as PutResult
    from .store.store import Store as Store


def _exports() -> dict[str, str]:
    """Public name -> the module defining it, read from the ``TYPE_CHECKING`` imports of
    this file (the one place the exports are listed), as ``lazy_loader.attach_stub``
    reads a stub. Parsing this small file costs well under a millisecond."""
    with open(__file__, encoding="utf-8") as source:
        tree = ast.parse(source.read())
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    )
    return {
        alias.name: f"{__name__}.{node.module}"
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


_EXPORTS = _exports()
__all__ = sorted(["__version__", *_EXPORTS])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
