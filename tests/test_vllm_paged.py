"""vLLM's CPU "vec" paged cache (keys as D rows of B tokens, then B value rows), below the
engine: stored v1 blocks loaded through the compiled copy that transposes the keys while
it checks each CRC land exactly where the checked-view copy puts them; a block whose CRC
fails is not loaded. tests/test_engine_vllm.py runs the same layout in a real engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import make_blocks

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from kvstore import Geometry  # noqa: E402
from kvstore.codec.envelope import decode, encode  # noqa: E402
from kvstore.engines._vllm_paged import PagedCache  # noqa: E402
from kvstore.engines.targets import open_target  # noqa: E402

G = Geometry(16, 3, 2, 64)  # B, L, Hkv, D: the bench model's head size
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(G.n_layers)]


def _caches() -> dict[str, Any]:
    shape = (10, G.n_kv_heads, G.block_tokens, 2 * G.head_dim)
    return {n: torch.zeros(shape, dtype=torch.float16) for n in NAMES}


def _paged(caches: dict[str, Any]) -> PagedCache:
    return PagedCache(caches, G, dict.fromkeys(caches, "CPU_ATTN/vec"))


def _expected(kv: np.ndarray) -> np.ndarray:
    """One block ``[L][2][H][B][D]`` as a "vec" plane per layer: ``[L][H][2 * B * D]``."""
    keys = kv[:, 0].transpose(0, 1, 3, 2).reshape(G.n_layers, G.n_kv_heads, -1)
    values = kv[:, 1].reshape(G.n_layers, G.n_kv_heads, -1)
    return np.concatenate([keys, values], axis=2)


def test_the_fused_load_transposes_keys_as_the_checked_views_do(tmp_path: Path) -> None:
    blocks = make_blocks(G, 4 * G.block_tokens, seed=11)
    hashes = [b.hash for b in blocks]
    target = open_target(tmp_path / "data", model="m")
    target.put(encode(G, blocks, 1))
    fused, viewed = _caches(), _caches()
    slots = [7, 1, 4, 0]
    assert target.load(hashes, _paged(fused), slots)[0] == 4
    envelope = decode(encode(G, blocks, 1))
    assert _paged(viewed).scatter(list(envelope), slots) > 0
    for layer, name in enumerate(NAMES):
        for b, slot in zip(blocks, slots, strict=True):
            want = _expected(np.asarray(b.kv, np.float16))[layer]
            assert fused[name][slot].numpy().reshape(G.n_kv_heads, -1).tobytes() == want.tobytes()
        assert torch.equal(fused[name], viewed[name])
    target.close()


def test_the_fused_path_serves_the_vec_layout_and_stops_at_a_bad_crc() -> None:
    blocks = make_blocks(G, 3 * G.block_tokens, seed=12)
    envs = [bytearray(encode(G, [b], 1)) for b in blocks]
    envs[1][-100] ^= 0x20  # a value byte of the second block
    caches = _caches()
    assert _paged(caches).scatter_envelopes(envs, [2, 3, 5]) == 1
    assert caches[NAMES[0]][2].any() and not any(caches[n][5].any() for n in NAMES)
