"""Read-through validation: an object from the tier is used only if it is the block.

Every reader rule of the spec (length, magic, version, geometry, fills, CRC) through the
codec's ``decode``, then the tier's own rules: exactly one full block, whose hash is the
one its key names; and the finite-values rule unless the store allows non-finite data.
"""

from __future__ import annotations

from typing import Any

from ..codec.envelope import Envelope, check_finite, decode
from ..codec.geometry import Geometry
from ..errors import FormatError
from ..protocol import hash_hex


def check_block_object(
    data: Any, block_hash: int, geometry: Geometry | None, *, allow_nonfinite: bool = False
) -> Envelope:
    """The decoded single-block envelope of the object read for ``block_hash``.

    Raises:
        EnvelopeError: a reader rule failed (``ShapeError`` for another geometry,
            ``ChecksumError`` for a bad CRC), or the object holds other than exactly the
            block ``block_hash``.
    """
    env = decode(data, geometry)
    if len(env) != 1:
        raise FormatError(
            f"object of block {hash_hex(block_hash)}: expected a one-block envelope, "
            f"found {len(env)} blocks"
        )
    found = int(env.hashes[0])
    if found != block_hash:
        raise FormatError(
            f"object of block {hash_hex(block_hash)}: the envelope holds block {hash_hex(found)}"
        )
    if not allow_nonfinite:
        check_finite(env)
    return env
