"""The sans-IO codec: block hash, CRC-32C, f16/e4m3 numerics, geometry and the envelope.

Pure functions over bytes and numpy arrays: nothing here imports lmdb, zstandard or an
HTTP library, or touches a file. Every wire fact of FORMAT.md lives in ``layout``.
"""

from .checksum import crc32c
from .envelope import (
    Block,
    BlockView,
    Envelope,
    decode,
    encode,
    encode_into,
    join,
    split,
    transcode,
)
from .geometry import Geometry
from .hashing import block_hash, chain_hashes, fnv1a64

__all__ = [
    "Block",
    "BlockView",
    "Envelope",
    "Geometry",
    "block_hash",
    "chain_hashes",
    "crc32c",
    "decode",
    "encode",
    "encode_into",
    "fnv1a64",
    "join",
    "split",
    "transcode",
]
