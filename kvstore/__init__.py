"""tlkv: a persistent, memory-mapped store and archive format for LLM KV-cache blocks.

The codec, the store and the error tree are re-exported here; the archive functions live
in ``kvstore.archive`` and the HTTP client in ``kvstore.client`` (imported on demand, so
``import kvstore`` needs neither zstd nor httpx).
"""

from .checksum import crc32c
from .envelope import Block, BlockView, Envelope, decode, encode, join, split, transcode
from .errors import (
    ArchiveError,
    BadMagicError,
    ChecksumError,
    EnvelopeError,
    FormatError,
    InvalidRequestError,
    MethodNotAllowedError,
    NotFoundError,
    PinnedError,
    ServiceError,
    ShapeError,
    StoreError,
    StoreFullError,
    TlkvError,
    TooLargeError,
    TruncatedArchiveError,
    TruncatedError,
    UnauthorizedError,
    UnsafeArchiveError,
    UnsupportedVersionError,
    ViewClosedError,
)
from .geometry import Geometry
from .hashing import block_hash, chain_hashes, fnv1a64
from .numerics import as_array
from .store import PutReport, PutResult, Store

__version__ = "0.1.0"

__all__ = [
    "ArchiveError",
    "BadMagicError",
    "Block",
    "BlockView",
    "ChecksumError",
    "Envelope",
    "EnvelopeError",
    "FormatError",
    "Geometry",
    "InvalidRequestError",
    "MethodNotAllowedError",
    "NotFoundError",
    "PinnedError",
    "PutReport",
    "PutResult",
    "ServiceError",
    "ShapeError",
    "Store",
    "StoreError",
    "StoreFullError",
    "TlkvError",
    "TooLargeError",
    "TruncatedArchiveError",
    "TruncatedError",
    "UnauthorizedError",
    "UnsafeArchiveError",
    "UnsupportedVersionError",
    "ViewClosedError",
    "__version__",
    "as_array",
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
