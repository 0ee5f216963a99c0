"""kvlayout: per-layer K/V <-> blocks, for every layout, dtype and stride engines hand out."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import Block, Geometry, ShapeError, Store, chain_hashes, decode, encode
from kvstore.kvlayout import LayerSlices, blocks_from_layers, fill_layers, layers_from_views

G = Geometry(block_tokens=4, n_layers=3, n_kv_heads=2, head_dim=8)
BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)]


def _layers(t: int, seed: int = 0, g: Geometry = G) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Contiguous f32 ``[Hkv, T, D]`` keys and values per layer, exactly representable in
    bf16 and in f16 (8 significant bits, magnitudes in f16's normal range)."""
    rng = np.random.default_rng(seed)
    shape = (2, g.n_layers, g.n_kv_heads, t, g.head_dim)
    x = rng.standard_normal(shape).astype(np.float32)
    x = np.where(np.abs(x) < 1e-3, np.float32(0.5), x).astype(BF16).astype(np.float32)
    return list(x[0]), list(x[1])


def _reference_blocks(
    ks: list[np.ndarray], vs: list[np.ndarray], tokens: list[int], g: Geometry, parent: int = 0
) -> list[Block]:
    """The blocks built the obvious way: one stacked [L][2][Hkv][B][D] array each."""
    b = g.block_tokens
    hashes = chain_hashes(tokens, b, parent)
    out = []
    for i in range(-(-len(tokens) // b)):
        n = min(b, len(tokens) - i * b)
        kv = np.zeros(g.kv_shape, dtype=np.float32)
        for layer in range(g.n_layers):
            kv[layer, 0, :, :n] = ks[layer][:, i * b : i * b + n]
            kv[layer, 1, :, :n] = vs[layer][:, i * b : i * b + n]
        out.append(Block(hashes[i] if i < len(hashes) else 0, n, kv))
    return out


# Each layout turns a contiguous [Hkv, T, D] array into the same values in another memory order.
LAYOUTS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "head-major": lambda a: a,
    "batch-1": lambda a: a[None],
    "token-major": lambda a: np.ascontiguousarray(a.transpose(1, 0, 2)).transpose(1, 0, 2),
    "fortran": np.asfortranarray,
    "preallocated": lambda a: np.concatenate([a, np.full_like(a, np.nan)], axis=1),
    "every-other-d": lambda a: np.repeat(a, 2, axis=2)[..., ::2],
    "reversed-heads": lambda a: np.ascontiguousarray(a[::-1])[::-1],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("version", [1, 2])
def test_blocks_from_layers_encode_like_the_obvious_stacking(
    layout: str, dtype: np.dtype, version: int, join: str
) -> None:
    tokens = list(range(100, 111))  # 2 full blocks and a tail of 3
    ks, vs = _layers(len(tokens))
    keys = [LAYOUTS[layout](k.astype(dtype)) for k in ks]
    values = [LAYOUTS[layout](v.astype(dtype)) for v in vs]
    blocks = blocks_from_layers(keys, values, tokens, G)
    expected = encode(G, _reference_blocks(ks, vs, tokens, G), version)
    assert encode(G, blocks, version) == expected


def test_hashes_fills_parent_and_tail() -> None:
    tokens = list(range(11))
    ks, vs = _layers(11)
    blocks = blocks_from_layers(ks, vs, tokens, G, parent=0x1234)
    assert [b.hash for b in blocks] == [*chain_hashes(tokens, 4, 0x1234), 0]
    assert [b.n_tokens for b in blocks] == [4, 4, 3]
    assert len(blocks_from_layers(ks, vs, tokens, G, tail=False)) == 2
    assert len(blocks_from_layers(ks, vs, tokens[:8], G)) == 2  # no tail when none is left
    assert blocks_from_layers(ks, vs, [], G) == []


def test_blocks_refer_to_the_layers_without_a_copy() -> None:
    ks, _ = _layers(8)
    f16 = [k.astype(np.float16) for k in ks]
    blocks = blocks_from_layers(f16, f16, list(range(8)), G)
    window = blocks[1].kv
    assert isinstance(window, LayerSlices)
    assert np.shares_memory(window.layer(2, 0), f16[2])
    assert window.shape == G.kv_shape and window.dtype == np.float16


def test_layer_slices_as_an_array_is_the_stacked_block_zero_padded() -> None:
    ks, vs = _layers(6)
    tail = blocks_from_layers(ks, vs, list(range(6)), G)[1]
    ref = _reference_blocks(ks, vs, list(range(6)), G)[1]
    np.testing.assert_array_equal(np.asarray(tail.kv), ref.kv)
    assert np.asarray(tail.kv, dtype=np.float16).dtype == np.float16


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_v1_is_exact(dtype: np.dtype) -> None:
    tokens = list(range(13))
    ks, vs = _layers(13, seed=4)
    keys = [k.astype(dtype) for k in ks]
    env = decode(encode(G, blocks_from_layers(keys, vs, tokens, G), 1), G)
    k2, v2 = layers_from_views(env)
    assert len(k2) == G.n_layers and k2[0].dtype == np.float16
    for a, b in zip([*ks, *vs], [*k2, *v2]):
        assert b.shape == (G.n_kv_heads, 13, G.head_dim) and b.flags.c_contiguous
        np.testing.assert_array_equal(a, b)
    k3, _ = layers_from_views(env, dtype=dtype)
    assert k3[0].dtype == dtype
    np.testing.assert_array_equal(k3[1].astype(np.float32), ks[1])


def test_round_trip_v2_is_the_dequantized_blocks() -> None:
    tokens = list(range(10))
    ks, vs = _layers(10, seed=5)
    env = decode(encode(G, blocks_from_layers(ks, vs, tokens, G), 2), G)
    k2, v2 = layers_from_views(env)
    assert k2[0].dtype == np.float32
    for i, bv in enumerate(env):
        ref = bv.to_float32()
        n = bv.n_tokens
        np.testing.assert_array_equal(k2[1][:, 4 * i : 4 * i + n], ref[1, 0, :, :n])
        np.testing.assert_array_equal(v2[2][:, 4 * i : 4 * i + n], ref[2, 1, :, :n])
    k16, _ = layers_from_views(env, dtype=np.float16)
    np.testing.assert_array_equal(k16[0], k2[0].astype(np.float16))
    assert np.abs(k2[0] - ks[0]).max() <= 0.07 * np.abs(ks[0]).max()


def test_bf16_edge_cases_subnormals_round_and_overflow_is_refused() -> None:
    ks, vs = _layers(4)
    keys = [k.astype(BF16) for k in ks]
    keys[0][0, 0, :4] = np.array([1e-5, -3e-7, 1e-30, 6.103515625e-05], dtype=np.float32)
    env = decode(encode(G, blocks_from_layers(keys, vs, range(4), G), 1))
    k2, _ = layers_from_views(env, dtype=BF16)
    got = k2[0][0, 0, :4].astype(np.float32)
    # below f16's normal range: rounded to an f16 subnormal (or zero); at its edge: exact
    assert got[0] == np.float32(np.float16(keys[0][0, 0, 0]))
    assert got[1] != keys[0][0, 0, 1] and got[2] == 0 and got[3] == keys[0][0, 0, 3]
    np.testing.assert_array_equal(k2[0][1], keys[0][1])  # everything else bit-exact
    keys[1][1, 2, 3] = 1e5  # beyond f16: refused by v1, taken by v2
    blocks = blocks_from_layers(keys, vs, range(4), G)
    with pytest.raises(ValueError, match="within f16's range"):
        encode(G, blocks, 1)
    assert len(decode(encode(G, blocks, 2))) == 1


def test_layers_from_views_of_a_store_reader(tmp_path: Path) -> None:
    tokens = list(range(12))
    ks, vs = _layers(12, seed=6)
    with Store(tmp_path / "s") as store:
        store.put(encode(G, blocks_from_layers(ks, vs, tokens, G), 1))
        with store.reader() as r:
            views = [r.view(h) for h in chain_hashes(tokens, 4)]
            k2, v2 = layers_from_views(v for v in views if v is not None)
    for a, b in zip(ks + vs, k2 + v2):
        np.testing.assert_array_equal(a, b)  # copies: usable after the reader closed


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda ks, vs: (ks[:2], vs), "expected 3 layers"),
        (lambda ks, vs: ([np.stack([k, k]) for k in ks], vs), "batch size must be 1"),
        (lambda ks, vs: ([k[:1] for k in ks], vs), "Hkv=2, D=8"),
        (lambda ks, vs: (ks, [v[..., :4] for v in vs]), "Hkv=2, D=8"),
        (lambda ks, vs: ([k[:, :3] for k in ks], vs), "fewer than the 4 tokens"),
        (lambda ks, vs: ([k[0] for k in ks], vs), r"expected \[Hkv, T, D\]"),
    ],
)
def test_shape_mismatches_are_refused(change: Callable[..., tuple], message: str) -> None:
    ks, vs = _layers(4)
    keys, values = change(ks, vs)
    with pytest.raises(ShapeError, match=message):
        blocks_from_layers(keys, values, range(4), G)


def test_bad_tokens_and_dtypes_are_refused() -> None:
    ks, vs = _layers(4)
    with pytest.raises(ValueError, match="1-D sequence"):
        blocks_from_layers(ks, vs, np.zeros((1, 4), np.int64), G)
    with pytest.raises(ValueError, match="float16, bfloat16"):
        blocks_from_layers([k.astype(np.int32) for k in ks], vs, range(4), G)
    env = decode(encode(G, blocks_from_layers(ks, vs, range(4), G)))
    with pytest.raises(ValueError, match="float16, bfloat16"):
        layers_from_views(env, dtype=np.int8)


def test_layers_from_views_edge_cases() -> None:
    assert layers_from_views([]) == ([], [])
    ks, vs = _layers(4)
    a = decode(encode(G, blocks_from_layers(ks, vs, range(4), G)))
    other = Geometry(4, 3, 2, 16)
    ko, vo = _layers(4, g=other)
    b = decode(encode(other, blocks_from_layers(ko, vo, range(4), other)))
    with pytest.raises(ShapeError, match="differs from view 0"):
        layers_from_views([a[0], b[0]])


@pytest.mark.hf
def test_torch_tensors_of_every_dtype_and_stride() -> None:
    torch = pytest.importorskip("torch", reason="torch is in the hf extra")
    tokens = list(range(9))
    ks, vs = _layers(9, seed=7)
    expected = encode(G, _reference_blocks(ks, vs, tokens, G), 1)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        token_major = [torch.from_numpy(k.transpose(1, 0, 2).copy()).to(dtype) for k in ks]
        keys = [t.permute(1, 0, 2).unsqueeze(0) for t in token_major]
        values = [torch.from_numpy(v).to(dtype)[None] for v in vs]
        assert encode(G, blocks_from_layers(keys, values, torch.tensor(tokens), G), 1) == expected


@settings(max_examples=30, deadline=None)
@given(
    b=st.integers(1, 5),
    n_layers=st.integers(1, 3),
    heads=st.integers(1, 3),
    d=st.integers(1, 6),
    t=st.integers(0, 17),
    version=st.sampled_from([1, 2]),
)
def test_round_trip_over_random_geometries(
    b: int, n_layers: int, heads: int, d: int, t: int, version: int
) -> None:
    g = Geometry(b, n_layers, heads, d)
    ks, vs = _layers(t, seed=t, g=g)
    blocks = blocks_from_layers(ks, vs, list(range(t)), g)
    assert sum(blk.n_tokens for blk in blocks) == t
    if not blocks:
        return
    env = decode(encode(g, blocks, version), g)
    k2, v2 = layers_from_views(env)
    ref = [bv.to_float32() for bv in env]
    got = np.concatenate([np.stack([k2, v2], axis=1)], axis=0)  # [L][2][Hkv][T][D]
    want = np.concatenate([r[..., : bv.n_tokens, :] for r, bv in zip(ref, env)], axis=3)
    np.testing.assert_array_equal(got.astype(np.float32), want)
    if version == 1:
        np.testing.assert_array_equal(np.stack(k2), np.stack(ks))


def test_layers_from_views_fills_a_given_output() -> None:
    ks, vs = _layers(10, seed=8)
    env = decode(encode(G, blocks_from_layers(ks, vs, range(10), G), 1))
    out = np.full((G.n_layers, 2, G.n_kv_heads, 12, G.head_dim), 7, dtype=np.float32)
    k2, v2 = layers_from_views(env, out=out)
    assert np.shares_memory(k2[0], out) and k2[0].dtype == np.float32
    for a, b in zip(ks + vs, k2 + v2):
        np.testing.assert_array_equal(a, b)
    assert (out[..., 10:, :] == 7).all()  # past T: untouched
    with pytest.raises(ShapeError, match="out: expected"):
        layers_from_views(env, out=out[:, :, :, :9])
    with pytest.raises(ShapeError, match="out: expected"):
        layers_from_views(env, np.float16, out=out)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32])
def test_fill_layers_fills_an_engines_buffers_as_layers_from_views_does(
    version: int, dtype: type
) -> None:
    ks, vs = _layers(10, seed=7)
    env = decode(encode(G, blocks_from_layers(ks, vs, range(10), G), version))
    want_k, want_v = layers_from_views(env, dtype=dtype)
    keys: list[np.ndarray] = [np.full((2, 16, 8), 7, dtype=dtype) for _ in range(3)]
    values: list[np.ndarray] = [np.full((2, 16, 8), 7, dtype=dtype) for _ in range(3)]
    assert fill_layers(env, keys, values) == 10
    for got, want in zip(keys + values, want_k + want_v):
        np.testing.assert_array_equal(got[:, :10], want)
        assert (got[:, 10:].astype(np.float32) == 7).all()  # the rest left as it was
    assert fill_layers([], keys, values) == 0
    with pytest.raises(ShapeError, match="buffer 0"):
        fill_layers(env, [k[:, :8] for k in keys], values)  # 8 positions < 10
    with pytest.raises(ShapeError, match="expected 3 layers"):
        fill_layers(env, keys[:2], values)
