"""The chained FNV-1a block hash of FORMAT.md (section 1).

``hash(block i) = H(hash(block i-1), tokens[i*B:(i+1)*B])`` with
``H(parent, toks) = fnv1a64(le_u64(parent) || le_u32(toks[0]) || ...)``, a 0 result
replaced by 1. The compiled kernel in ``kvstore.codec._native`` does the work when it was
built; the pure-Python functions here are the fallback and the test oracle.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from .layout import NO_HASH, U32_MAX, U64_MAX

try:  # the optional C kernels; see setup.py
    from . import _native
except ImportError:  # pragma: no cover - exercised only where the build had no compiler
    _native = None  # type: ignore[assignment]

FNV_OFFSET_BASIS = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
_PARENT = struct.Struct("<Q")

TokenInput = Sequence[int] | np.ndarray


def _fnv1a64_py(data: bytes | bytearray | memoryview, h: int = FNV_OFFSET_BASIS) -> int:
    """Pure-Python fnv1a64 (the oracle for the compiled kernel)."""
    for byte in bytes(data):
        h = ((h ^ byte) * FNV_PRIME) & U64_MAX
    return h


def fnv1a64(data: Any, h: int = FNV_OFFSET_BASIS) -> int:
    """FNV-1a 64 of the bytes of ``data`` (any buffer), continuing from ``h``."""
    if not 0 <= h <= U64_MAX:
        raise ValueError(f"fnv1a64: h must fit u64, found {h}")
    if _native is not None:
        return int(_native.fnv1a64(data, h))
    return _fnv1a64_py(memoryview(data).cast("B"), h)


def _as_u32_tokens(tokens: TokenInput) -> np.ndarray:
    """Tokens as a contiguous little-endian u32 array; ValueError if any does not fit u32."""
    if isinstance(tokens, np.ndarray):
        arr = tokens
    else:
        try:
            arr = np.asarray(tokens)
        except OverflowError as exc:
            raise ValueError(f"token ids must fit u32: {exc}") from None
    if arr.ndim != 1:  # a [batch, seq] array would otherwise hash its rows glued together
        raise ValueError(
            f"token ids must be a 1-D sequence, found shape {arr.shape} "
            "(hash one sequence at a time, e.g. input_ids[0])"
        )
    if arr.size == 0:
        return np.zeros(0, dtype="<u4")
    if arr.dtype == object and all(isinstance(t, int) for t in arr.flat):
        raise ValueError(f"token ids must fit u32 (0..{U32_MAX}), found {max(arr.flat, key=abs)}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, found dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi > U32_MAX:
        bad = lo if lo < 0 else hi
        raise ValueError(f"token ids must fit u32 (0..{U32_MAX}), found {bad}")
    return np.ascontiguousarray(arr, dtype="<u4")


def _block_hash_py(parent: int, toks: np.ndarray) -> int:
    h = _fnv1a64_py(_PARENT.pack(parent) + toks.astype("<u4").tobytes())
    return h or 1


def block_hash(parent: int, tokens: TokenInput) -> int:
    """Hash of one full block: fnv1a64(le_u64(parent) || le_u32 tokens...), 0 becomes 1."""
    if not 0 <= parent <= U64_MAX:
        raise ValueError(f"parent hash must fit u64, found {parent}")
    toks = _as_u32_tokens(tokens)
    h = fnv1a64(_PARENT.pack(parent))
    h = fnv1a64(toks, h)
    return h or 1


def _chain_hashes_py(
    tokens: TokenInput, block_tokens: int = 16, parent: int = NO_HASH
) -> list[int]:
    """Pure-Python chain (the oracle for ``chain_hashes``)."""
    toks = _as_u32_tokens(tokens)
    out = []
    for i in range(len(toks) // block_tokens):
        parent = _block_hash_py(parent, toks[i * block_tokens : (i + 1) * block_tokens])
        out.append(parent)
    return out


def chain_hashes(tokens: TokenInput, block_tokens: int = 16, parent: int = NO_HASH) -> list[int]:
    """Hashes of every *full* block of ``tokens``, in order; the partial tail has none.

    Args:
        tokens: token ids (a list or a numpy integer array), each fitting u32.
        block_tokens: B, token positions per block.
        parent: hash of the block before ``tokens[0]`` (0 for the start of a sequence).

    Raises:
        ValueError: a token does not fit u32, or ``block_tokens`` < 1.
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, found {block_tokens}")
    if not 0 <= parent <= U64_MAX:
        raise ValueError(f"parent hash must fit u64, found {parent}")
    if _native is None:
        return _chain_hashes_py(tokens, block_tokens, parent)
    hashes: list[int] = chain_hashes_array(tokens, block_tokens, parent).tolist()
    return hashes


def chain_hashes_array(
    tokens: TokenInput, block_tokens: int = 16, parent: int = NO_HASH
) -> np.ndarray:
    """Like ``chain_hashes`` but returns a ``<u8`` numpy array (no per-hash Python ints)."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, found {block_tokens}")
    if _native is not None and isinstance(tokens, (list, tuple)):
        # Hashed straight from the ints (no int64 inference); None sends anything unusual,
        # including an id that does not fit, down the general path and its error.
        packed = _native.fnv_chain_list(tokens, block_tokens, parent)
        if packed is not None:
            return np.frombuffer(packed, dtype="<u8")
    toks = _as_u32_tokens(tokens)
    if _native is None:
        return np.array(_chain_hashes_py(toks, block_tokens, parent), dtype="<u8")
    return np.frombuffer(_native.fnv_chain(toks, block_tokens, parent), dtype="<u8")


def exact_u64_array(items: list[Any] | tuple[Any, ...]) -> np.ndarray | None:
    """``items`` as a read-only ``<u8`` array when every one is an exact int in
    0..2**64-1, converted in one compiled pass (no per-item type check in Python first);
    None when an item is anything else or the compiled kernels are not built: the caller
    then takes its general path, which converts other hash forms and names a bad one."""
    if _native is None:
        return None
    packed = _native.u64_list(items)
    return None if packed is None else np.frombuffer(packed, dtype="<u8")
