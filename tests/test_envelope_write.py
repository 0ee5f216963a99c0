"""Envelope writing: the writer's rules (fill, hash, shape, dtype, version, finite values,
f16 overflow), v2's FP8-e4m3 numerics against the straightforward ``ml_dtypes`` path bit for
bit, and encoding from any strides of any float dtype (numpy, bf16, torch)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import SMALL, make_blocks

from kvstore import Block, Geometry, ShapeError, UnsupportedVersionError, decode, encode


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf, 70000.0])
def test_non_finite_or_overflow_is_refused_v1(value: float) -> None:
    kv = np.zeros(SMALL.kv_shape, dtype=np.float32)
    kv[1, 1, 1, 1, 1] = value
    with pytest.raises(ValueError):
        encode(SMALL, [Block(0, 4, kv)])


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_is_refused_v2_and_f16(value: float) -> None:
    kv = np.zeros(SMALL.kv_shape, dtype=np.float16)
    kv[0, 0, 0, 0, 0] = value
    for version in (1, 2):
        with pytest.raises(ValueError):
            encode(SMALL, [Block(0, 4, kv)], version)


@pytest.mark.parametrize(("hash_", "n_tokens"), [(0, 0), (0, 5), (123, 3), (2**64, 4), (-1, 4)])
def test_fill_and_hash_rules_on_write(hash_: int, n_tokens: int) -> None:
    with pytest.raises(ValueError):
        encode(SMALL, [Block(hash_, n_tokens, np.zeros(SMALL.kv_shape))])


def test_wrong_kv_shape_on_write() -> None:
    with pytest.raises(ShapeError):
        encode(SMALL, [Block(0, 1, np.zeros((1, 2, 3)))])


def test_wrong_kv_dtype_on_write() -> None:
    with pytest.raises(ValueError):
        encode(SMALL, [Block(0, 1, np.zeros(SMALL.kv_shape, dtype=np.int32))])


def test_unknown_version_on_write() -> None:
    with pytest.raises(UnsupportedVersionError):
        encode(SMALL, [], 3)


# --- v2 numerics ------------------------------------------------------------------


def _reference_v2_payload(geometry: Geometry, block: Block) -> bytes:
    """The straightforward ml_dtypes astype path of the v2 rule, for bit-identity."""
    n, b, d = block.n_tokens, geometry.block_tokens, geometry.head_dim
    x = np.asarray(block.kv).reshape(geometry.n_slabs, b * d)[:, : n * d].astype(np.float32)
    amax = np.abs(x).max(axis=1)
    scales = np.where(amax == 0, np.float32(1), amax / np.float32(448)).astype(np.float32)
    codes = np.zeros((geometry.n_slabs, b * d), dtype=np.uint8)
    codes[:, : n * d] = (x / scales[:, None]).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return codes.tobytes() + scales.astype("<f4").tobytes()


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_v2_is_bit_identical_to_straightforward_path(dtype: type) -> None:
    blocks = make_blocks(SMALL, 11, seed=3, dtype=dtype, scale=7.0)
    env = decode(encode(SMALL, blocks, 2))
    for bv, block in zip(env, blocks):
        assert bytes(bv.raw[12:]) == _reference_v2_payload(SMALL, block)


def test_v2_all_zero_slab_has_scale_one() -> None:
    env = decode(encode(SMALL, [Block(0, 2, np.zeros(SMALL.kv_shape))], 2))
    assert (env[0].scales == 1.0).all() and not env[0].kv.any()


def test_v2_decode_is_lut_times_scale() -> None:
    env = decode(encode(SMALL, make_blocks(SMALL, 4, seed=9), 2))
    bv = env[0]
    expected = bv.kv.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * bv.scales[..., None, None]
    assert np.array_equal(bv.to_float32().view(np.uint32), expected.view(np.uint32))


_LAYOUT_GEOMETRY = Geometry(block_tokens=4, n_layers=2, n_kv_heads=3, head_dim=8)


def _strided_views(dtype: object) -> list[np.ndarray]:
    """The same [L][2][Hkv][B][D] values behind several memory layouts."""
    g = _LAYOUT_GEOMETRY
    rng = np.random.default_rng(3)
    base = rng.standard_normal(g.kv_shape).astype(np.float32).astype(dtype)  # type: ignore[call-overload]
    token_major = np.ascontiguousarray(base.transpose(3, 0, 1, 2, 4))  # [B][L][2][Hkv][D]
    reversed_axes = np.ascontiguousarray(base.transpose(4, 3, 2, 1, 0))
    padded = np.zeros((*g.kv_shape[:-1], 2 * g.head_dim), dtype=base.dtype)
    padded[..., ::2] = base
    return [
        base,
        token_major.transpose(1, 2, 3, 0, 4),
        reversed_axes.transpose(4, 3, 2, 1, 0),
        padded[..., ::2],
        np.asfortranarray(base),
    ]


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64], ids=str)
@pytest.mark.parametrize("n_tokens", [4, 3])
def test_encode_takes_any_strides_of_any_float_dtype(
    version: int, dtype: object, n_tokens: int
) -> None:
    g = _LAYOUT_GEOMETRY
    views = _strided_views(dtype)
    h = 7 if n_tokens == g.block_tokens else 0
    expected = encode(g, [Block(h, n_tokens, views[0])], version)
    for kv in views[1:]:
        assert encode(g, [Block(h, n_tokens, kv)], version) == expected


@pytest.mark.parametrize("version", [1, 2])
def test_bf16_encodes_like_its_exact_f32(version: int) -> None:
    g = _LAYOUT_GEOMETRY
    bf16 = _strided_views(ml_dtypes.bfloat16)[0]
    assert encode(g, [Block(7, 4, bf16)], version) == encode(
        g, [Block(7, 4, bf16.astype(np.float32))], version
    )


def test_bf16_beyond_f16_range_is_refused_by_v1_and_taken_by_v2() -> None:
    g = _LAYOUT_GEOMETRY
    kv = np.full(g.kv_shape, 1e6, dtype=ml_dtypes.bfloat16)
    with pytest.raises(ValueError, match="overflow f16"):
        encode(g, [Block(7, 4, kv)], 1)
    env = decode(encode(g, [Block(7, 4, kv)], 2))
    assert np.allclose(env[0].to_float32(), kv.astype(np.float32), rtol=0.07)


@pytest.mark.hf
@pytest.mark.parametrize("version", [1, 2])
def test_encode_takes_torch_tensors_of_every_float_dtype(version: int) -> None:
    torch = pytest.importorskip("torch", reason="torch is in the hf extra")
    g = _LAYOUT_GEOMETRY
    base = _strided_views(np.float32)[0]
    token_major = torch.from_numpy(np.ascontiguousarray(base.transpose(3, 0, 1, 2, 4)))
    for dtype, np_dtype in (
        (torch.float16, np.float16),
        (torch.bfloat16, ml_dtypes.bfloat16),
        (torch.float32, np.float32),
    ):
        tensor = token_major.to(dtype).permute(1, 2, 3, 0, 4)  # not contiguous
        expected = encode(g, [Block(7, 4, base.astype(np_dtype))], version)
        assert encode(g, [Block(7, 4, tensor)], version) == expected
