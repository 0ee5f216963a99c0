"""Random full blocks for the conformance classes."""

from __future__ import annotations

import numpy as np

from ..codec.envelope import Block
from ..codec.geometry import Geometry
from ..codec.hashing import chain_hashes

SMALL = Geometry(block_tokens=4, n_layers=2, n_kv_heads=2, head_dim=8)  # 1 KiB of f16 a block


def random_blocks(
    geometry: Geometry, n: int, seed: int = 0
) -> tuple[list[int], list[int], list[Block]]:
    """``n`` full blocks of random tokens and f16-exact values: (tokens, hashes, blocks)."""
    rng = np.random.default_rng(seed)
    tokens = [int(t) for t in rng.integers(0, 2**31, n * geometry.block_tokens)]
    hashes = chain_hashes(tokens, geometry.block_tokens)
    blocks = [
        Block(h, geometry.block_tokens, rng.standard_normal(geometry.kv_shape).astype(np.float16))
        for h in hashes
    ]
    return tokens, hashes, blocks
