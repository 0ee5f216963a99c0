"""vLLM fp8 (E4M3) caches as v2 envelopes, below the engine: caches shaped like vLLM's
CPU fp8 paged cache (this machine's vLLM refuses to run an fp8 cache without AVX-512 or
AMX; tests/test_engine_vllm.py runs one where the CPU allows), a real store.

A block's codes are stored as they are with each slab's scale its layer's, and loaded
back byte for byte only into a cache of the same layer scales; other scales or a v1
block are refused (``ScalesMismatchError``: a miss, never rescaled or converted).
"""

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
from kvstore.codec.hashing import chain_hashes  # noqa: E402
from kvstore.engines._vllm_fp8 import ScalesMismatchError  # noqa: E402
from kvstore.engines._vllm_paged import PagedCache  # noqa: E402
from kvstore.engines.targets import open_target  # noqa: E402

G = Geometry(32, 2, 2, 32)
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(G.n_layers)]
SCALES = {NAMES[0]: (0.5, 0.0625), NAMES[1]: (0.01171875, 3.0)}
HASHES = chain_hashes(list(range(4 * 32)), 32)[:2]


def _caches(fill: bool, heads: int = 2) -> dict[str, Any]:
    """fp8 caches ``[num_blocks, h, B, 2 * D]`` as vLLM's CPU backend allocates them,
    random E4M3 codes (no NaN) or zeros."""
    rng = np.random.default_rng(7)
    out = {}
    for name in NAMES:
        codes = rng.integers(0, 256, (12, heads, 32, 64), dtype=np.uint8) if fill else None
        if codes is not None:
            codes[(codes & 0x7F) == 0x7F] = 0x11
        t = torch.from_numpy(codes) if fill else torch.zeros((12, heads, 32, 64), dtype=torch.uint8)
        out[name] = t.view(torch.float8_e4m3fn)
    return out


def _paged(caches: dict[str, Any], scales: dict[str, Any] = SCALES, heads: Any = None) -> Any:
    return PagedCache(caches, G, dict.fromkeys(caches, "CPU_ATTN/vec"), heads, scales)


def _raw(cache: Any, block: int) -> bytes:
    return bytes(cache.view(torch.uint8)[block].numpy().tobytes())


def test_fp8_blocks_are_v2_envelopes_byte_for_byte(tmp_path: Path) -> None:
    src = _caches(True)
    paged = _paged(src)
    blocks = paged.as_numpy(paged.gather([3, 7]))
    env = decode(paged.encode(blocks, HASHES, 1))  # an fp8 cache writes v2 whatever asked
    assert env.version == 2 and len(env.data) == G.envelope_bytes(2, 2)
    for bv, block in zip(env, [3, 7]):
        for layer, name in enumerate(NAMES):
            raw = src[name].view(torch.uint8)[block].numpy()  # [h][B][2 * D], the "vec" plane
            planes = raw.reshape(2, 2, -1)  # per head: keys (D rows of B), then values
            keys = planes[:, 0].reshape(2, 32, 32).transpose(0, 2, 1)  # [h][B][D]
            values = planes[:, 1].reshape(2, 32, 32)
            assert np.array_equal(bv.kv[layer, 0], keys)
            assert np.array_equal(bv.kv[layer, 1], values)
            k, v = SCALES[name]
            assert bv.scales is not None
            assert bv.scales[layer].tolist() == [[k, k], [v, v]]

    target = open_target(tmp_path / "data", model="m@main/fp8_e4m3")
    target.put(bytes(env.data))
    dst = _caches(False)
    assert target.load(HASHES, _paged(dst), [5, 9])[0] == 2
    for name in NAMES:  # byte for byte, nothing re-quantized
        assert _raw(dst[name], 5) == _raw(src[name], 3)
        assert _raw(dst[name], 9) == _raw(src[name], 7)

    rank1 = _caches(False, heads=1)  # a TP=2 rank's half: its head of the whole blocks
    assert target.load(HASHES, _paged(rank1, heads=(1, 2)), [2, 4])[0] == 2
    for name in NAMES:
        half = src[name].view(torch.uint8)[3, 1:2]
        assert bytes(rank1[name].view(torch.uint8)[2].numpy().tobytes()) == bytes(half.numpy())

    other = dict(SCALES)
    other[NAMES[1]] = (0.01171875, 2.0)  # one layer's V scale differs
    zeros = _caches(False)
    with pytest.raises(ScalesMismatchError, match="scales other than the engine's"):
        target.load(HASHES, _paged(zeros, other), [5, 9])
    assert all(not zeros[n].view(torch.uint8).any() for n in NAMES)  # nothing written
    target.close()


def test_v1_blocks_never_load_into_an_fp8_cache(tmp_path: Path) -> None:
    blocks = make_blocks(G, 64, seed=3)
    target = open_target(tmp_path / "data", model="m")
    target.put(encode(G, blocks, 1))
    zeros = _caches(False)
    with pytest.raises(ScalesMismatchError, match="is format v1: an fp8 cache loads only v2"):
        target.load([b.hash for b in blocks], _paged(zeros), [1, 2])
    assert all(not zeros[n].view(torch.uint8).any() for n in NAMES)
    target.close()


def test_an_fp8_cache_without_its_scales_is_refused() -> None:
    from kvstore.engines._vllm_paged import UnsupportedLayoutError

    caches = _caches(False)
    with pytest.raises(UnsupportedLayoutError, match=r"cache dtype torch\.float8_e4m3fn"):
        PagedCache(caches, G, dict.fromkeys(caches, "CPU_ATTN/vec"))


def test_the_layout_proofs_fp8_pattern_holds_only_codes_a_quantizer_keeps() -> None:
    """The proof's fp8 pattern: E4M3 codes times the layer scale, with neither NaN nor -0
    among the codes (vLLM's CPU cache-write op on AVX-512 writes 0x00 for -0, and the
    proof failed on 22 of 4,096 bytes there); the values quantize back to the codes."""
    import ml_dtypes

    from kvstore.engines._vllm_proof import _pattern

    values, codes = _pattern((32, 2, 64), torch.float16, 3, 0.25)
    held = codes.numpy()
    assert not ((held & 0x7F) == 0x7F).any() and not (held == 0x80).any()
    assert len(np.unique(held)) > 200  # every other code is there
    back = (values.float().numpy() / 0.25).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert np.array_equal(back, held)
