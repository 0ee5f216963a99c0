"""vLLM's fp8 e4m3 KV cache <-> format v2 envelopes, byte for byte.

vLLM's fp8 cache (``kv_cache_dtype`` ``fp8`` / ``fp8_e4m3``) holds E4M3 codes with one f32
scale per layer for K (``k_scale``) and one for V (``v_scale``); a v2 payload is E4M3
codes ``[L][2][Hkv][B][D]`` with one f32 scale per (layer, K or V, head) slab
(FORMAT.md). A block is stored with its codes as they are and each slab's scale set to
its layer's scale: nothing is re-quantized. A block is loaded only into a cache whose
layer scales equal the stored ones, bit for bit (``ScalesMismatchError`` otherwise: a
miss, counted, never rescaled), and only from a v2 envelope: a v1 (f16) block is never
loaded into an fp8 cache (an fp8 engine's namespace, named by its cache dtype, holds
none; a target that hands one over gets ``ScalesMismatchError`` too).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..codec.assembly import assemble, pack_header
from ..codec.decoding import decode
from ..codec.envelope import BlockView
from ..codec.geometry import Geometry
from ..codec.layout import RECORD, SCALE_DTYPE, VERSION_V2
from ..errors import CacheLayoutError

__all__ = ["FP8_CACHE_DTYPES", "ScalesMismatchError", "encode_fp8", "fp8_codes", "slab_scales"]

FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")  # vLLM's names of an E4M3 cache (e5m2 is not v2)


class ScalesMismatchError(CacheLayoutError):
    """A block's format or scales are not the fp8 cache's: loading it would need a
    conversion, which the connector never does silently (the block is a miss)."""


def slab_scales(geometry: Geometry, scales: Sequence[tuple[float, float]]) -> np.ndarray:
    """The v2 scales ``[L][2][Hkv]`` (f32) of a cache whose layer ``l`` has K scale
    ``scales[l][0]`` and V scale ``scales[l][1]``."""
    per_layer = np.asarray(scales, dtype=np.float32).reshape(geometry.n_layers, 2, 1)
    return np.ascontiguousarray(
        np.broadcast_to(per_layer, (geometry.n_layers, 2, geometry.n_kv_heads))
    ).astype(SCALE_DTYPE)


def encode_fp8(
    geometry: Geometry,
    codes: Sequence[np.ndarray] | np.ndarray,
    scales: np.ndarray,
    hashes: Sequence[int],
) -> bytes:
    """One v2 envelope of full blocks whose E4M3 codes are ``codes`` (uint8, each block's
    ``[L][2][Hkv][B][D]``), every slab's scale from ``scales`` (``slab_scales``); the
    reader rules are checked on the result (no NaN code, scales finite and > 0).

    Raises:
        FormatError: a rule does not hold.
    """
    parts: list[Any] = [pack_header(VERSION_V2, geometry, len(hashes))]
    for i, h in enumerate(hashes):
        parts += [RECORD.pack(int(h), geometry.block_tokens), codes[i], scales]
    data = assemble(parts)
    decode(data)  # every reader rule, as any reader would
    return data


def fp8_codes(views: Sequence[BlockView], scales: np.ndarray) -> list[np.ndarray]:
    """The E4M3 codes ``[L][2][Hkv][B][D]`` of checked views, each a v2 block whose slab
    scales are ``scales`` bit for bit.

    Raises:
        ScalesMismatchError: naming the first block that is not.
    """
    out = []
    want = scales.view(np.uint32)
    for i, bv in enumerate(views):
        got = bv.scales
        if bv.version != VERSION_V2 or got is None:
            raise ScalesMismatchError(
                f"block {i} ({bv.hash:016x}) is format v{bv.version}: an fp8 cache loads "
                "only v2 blocks (no conversion)"
            )
        if not np.array_equal(np.asarray(got, dtype=SCALE_DTYPE).view(np.uint32), want):
            raise ScalesMismatchError(
                f"block {i} ({bv.hash:016x}) has scales other than the engine's layer "
                "scales (k_scale, v_scale): never rescaled"
            )
        out.append(np.asarray(bv.kv))
    return out
