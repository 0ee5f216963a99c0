"""The checks of the ``Store`` API's arguments: hashes, bounds, sequence names and the
blocks of a sequence (the codec checks the envelopes themselves)."""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from ..codec.envelope import Envelope
from ..codec.geometry import Geometry
from ..codec.layout import HEADER_SIZE, NO_HASH, U64_MAX
from ..errors import FormatError
from ..protocol import MAX_MODELS_LIMIT, check_sequence_name


def check_hash(block_hash: Any) -> int:
    """``block_hash`` as an int, checked to fit u64."""
    h = operator.index(block_hash)
    if not 0 <= h <= U64_MAX:
        raise ValueError(f"a block hash must fit u64, found {h}")
    return h


def check_bound(what: str, value: Any) -> None:
    """A bound (``capacity_bytes``, ``quota_bytes``) is None or an int > 0."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise TypeError(f"{what} must be an int, found {type(value).__name__}")
    if value is not None and value <= 0:
        raise ValueError(f"{what} must be > 0, found {value}")


def check_open(
    geometry: Any, capacity_bytes: Any, map_bytes: Any, max_models: Any, preallocate_bytes: Any = 0
) -> None:
    """The arguments that open a ``Store`` (see its docstring)."""
    if isinstance(preallocate_bytes, bool) or not isinstance(preallocate_bytes, int):
        raise TypeError(
            f"preallocate_bytes must be an int, found {type(preallocate_bytes).__name__}"
        )
    if preallocate_bytes < 0:
        raise ValueError(f"preallocate_bytes must be >= 0, found {preallocate_bytes}")
    if max_models is not None and (
        isinstance(max_models, bool)
        or not isinstance(max_models, int)
        or not 0 <= max_models <= MAX_MODELS_LIMIT
    ):
        raise ValueError(
            f"max_models must be an int in 0..{MAX_MODELS_LIMIT}, found {max_models!r}"
        )
    if map_bytes is not None and (isinstance(map_bytes, bool) or not isinstance(map_bytes, int)):
        raise TypeError(f"map_bytes must be an int, found {type(map_bytes).__name__}")
    if map_bytes is not None and map_bytes <= 0:
        raise ValueError(f"map_bytes must be > 0, found {map_bytes}")
    if geometry is not None and not isinstance(geometry, Geometry):
        raise TypeError(f"geometry must be a Geometry, found {type(geometry).__name__}")
    check_bound("capacity_bytes", capacity_bytes)


def seq_key(name: Any) -> bytes:
    """The ``seqs`` key of a sequence name, the name checked first."""
    return check_sequence_name(name).encode("ascii")


def check_sequence_blocks(env: Envelope) -> None:
    """A sequence holds at least one block; a partial block (hash 0) may only be its last."""
    if len(env) == 0:
        raise ValueError("a sequence holds at least one block; the envelope has none")
    if len(env) > 1:
        zeros = np.flatnonzero(env.hashes[:-1] == NO_HASH)
        if zeros.size:
            i = int(zeros[0])
            raise FormatError(
                f"block {i} at offset {HEADER_SIZE + i * env.record_bytes}: a partial block "
                f"(hash 0) may only be the last block of a sequence, found at position {i} "
                f"of {len(env)}"
            )
