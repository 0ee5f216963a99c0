"""vLLM's CPU "vec" paged cache (keys as D rows of B tokens, then B value rows), below the
engine: stored v1 blocks loaded through the compiled copy that transposes the keys while
it checks each CRC land exactly where the checked-view copy puts them; a block whose CRC
fails is not loaded. The "amx" kernels' tiles (bf16 on a CPU with AMX): loaded, gathered
and copied through checked views where the kernels' offsets put them, and those offsets
are where vLLM's own cache-write op writes (on a CPU with AMX). tests/test_engine_vllm.py
runs both layouts in a real engine (bf16 takes the "amx" kernels where the CPU has AMX)."""

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


# vLLM's CPU "amx" kernels (bf16 on a CPU with AMX tiles) tile a block's keys and values.
AMX = Geometry(32, 2, 2, 64)


def _amx_plane(kv: np.ndarray) -> np.ndarray:
    """One block ``[L][2][H][B][D]`` as the "amx" kernels lay out each (layer, head) plane,
    element by element from their offsets: key (t, d) at ``(t//16)*16D + (d//2)*32 +
    (t%16)*2 + d%2``, then value (t, d) at ``B*D + (d//16)*16B + (t//2)*32 + (d%16)*2 +
    t%2``."""
    b, d = AMX.block_tokens, AMX.head_dim
    t, c = np.meshgrid(np.arange(b), np.arange(d), indexing="ij")
    key_at = (t // 16) * 16 * d + (c // 2) * 32 + (t % 16) * 2 + c % 2
    value_at = b * d + (c // 16) * 16 * b + (t // 2) * 32 + (c % 16) * 2 + t % 2
    plane = np.zeros((AMX.n_layers, AMX.n_kv_heads, 2 * b * d), kv.dtype)
    plane[:, :, key_at] = kv[:, 0]
    plane[:, :, value_at] = kv[:, 1]
    return plane


def _bf16(a: np.ndarray) -> Any:
    return torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(torch.bfloat16)


def test_the_amx_layout_loads_and_gathers_its_tiles(tmp_path: Path) -> None:
    blocks = make_blocks(AMX, 3 * AMX.block_tokens, seed=13, dtype=np.float16)
    shape = (6, AMX.n_kv_heads, AMX.block_tokens, 2 * AMX.head_dim)
    names = NAMES[: AMX.n_layers]
    caches = {n: torch.zeros(shape, dtype=torch.bfloat16) for n in names}
    paged = PagedCache(caches, AMX, dict.fromkeys(caches, "CPU_ATTN/amx"))
    target = open_target(tmp_path / "data", model="m")
    target.put(encode(AMX, blocks, 1))
    slots = [4, 1, 5]
    assert target.load([b.hash for b in blocks], paged, slots)[0] == 3
    for b, slot in zip(blocks, slots, strict=True):
        want = _bf16(_amx_plane(np.asarray(b.kv, np.float32)))
        for layer, name in enumerate(names):
            got = caches[name][slot].reshape(AMX.n_kv_heads, -1)
            assert torch.equal(got.view(torch.int16), want[layer].view(torch.int16))
    gathered = paged.gather(slots)  # [n][L][2][H][B][D]
    for i, b in enumerate(blocks):
        assert torch.equal(gathered[i].view(torch.int16), _bf16(b.kv).view(torch.int16))
    # the checked views' copy (v2 blocks and a rank's heads go this way) agrees
    viewed = {n: torch.zeros(shape, dtype=torch.bfloat16) for n in names}
    envelope = decode(encode(AMX, blocks, 1))
    PagedCache(viewed, AMX, dict.fromkeys(viewed, "CPU_ATTN/amx")).scatter(list(envelope), slots)
    assert all(torch.equal(viewed[n], caches[n]) for n in names)
    target.close()


@pytest.mark.skipif(
    not torch.cpu._is_amx_tile_supported(), reason="vLLM's amx kernels need a CPU with AMX"
)
def test_the_amx_offsets_are_where_vllms_own_op_writes() -> None:
    from vllm import _custom_ops as ops

    b, h, d = AMX.block_tokens, AMX.n_kv_heads, AMX.head_dim
    cache = torch.zeros((3, h, b, 2 * d), dtype=torch.bfloat16)
    key_cache, value_cache = cache.view(3, h, 2 * b, d).chunk(2, dim=2)
    gen = torch.Generator().manual_seed(5)
    key, value = (torch.randn((b, h, d), generator=gen).to(torch.bfloat16) for _ in range(2))
    slots = torch.arange(b, 2 * b)  # block 1
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, "amx")
    kv = torch.stack([key, value]).permute(0, 2, 1, 3)[None].float().numpy()  # [1][2][H][B][D]
    want = _bf16(_amx_plane(np.broadcast_to(kv, (AMX.n_layers, *kv.shape[1:])))[0])
    assert torch.equal(cache[1].reshape(h, -1).view(torch.int16), want.view(torch.int16))
    assert not cache[0].any() and not cache[2].any()


def test_a_kept_gather_is_the_gather_and_its_buffer_is_used_again_only_once_given_back(
    tmp_path: Path,
) -> None:
    """``gather_kept``: the same blocks as ``gather``; a buffer not given back is never
    handed out again (a second save queued meanwhile gets its own), one given back is;
    ``encoded`` writes the envelope ``encode`` writes, into its own kept buffer."""
    caches = _caches()
    blocks = make_blocks(G, 4 * G.block_tokens, seed=12)
    paged = _paged(caches)
    target = open_target(tmp_path / "data", model="m")
    target.put(encode(G, blocks, 1))
    assert target.load([b.hash for b in blocks], paged, [7, 1, 4, 0])[0] == 4
    first, give_first = paged.gather_kept([4, 0])
    second, give_second = paged.gather_kept([7, 1])
    assert torch.equal(first, paged.gather([4, 0])) and torch.equal(second, paged.gather([7, 1]))
    assert not np.shares_memory(paged.as_numpy(first), paged.as_numpy(second))
    give_first()
    third, give_third = paged.gather_kept([1, 7])
    assert np.shares_memory(paged.as_numpy(third), paged.as_numpy(first))  # used again
    assert torch.equal(third, paged.gather([1, 7]))
    give_second()
    give_third()
    arrays = paged.as_numpy(third)
    hashes = [blocks[1].hash, blocks[0].hash]
    with paged.encoded([arrays[0], arrays[1]], hashes, 1) as env:
        assert bytes(env) == paged.encode(arrays, hashes, 1)
        assert bytes(env) == encode(G, [blocks[1], blocks[0]], 1)
