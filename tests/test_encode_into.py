"""``encode_into``: ``encode`` written into a caller's buffer, byte for byte the same
envelope, or the same error as ``encode`` (a buffer too small or read-only: untouched).
Random geometries, versions, fills and dtypes: test_envelope's round-trip property."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import SMALL, make_blocks

from kvstore import Block, Geometry, ShapeError, decode, encode
from kvstore.codec import encode_into
from kvstore.kvlayout import blocks_from_layers

SENTINEL = 0xAB


def _room(n: int) -> bytearray:
    return bytearray([SENTINEL]) * n


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize(
    ("geometry", "n_tokens"), [(SMALL, 10), (Geometry(3, 2, 1, 5), 7), (Geometry(1, 1, 1, 1), 2)]
)
def test_a_strided_kv_is_written_into_the_buffer_and_nothing_past_it(
    geometry: Geometry, n_tokens: int, version: int, join: str
) -> None:
    blocks = make_blocks(geometry, n_tokens, seed=n_tokens)
    wide = [np.repeat(np.asarray(b.kv), 2, axis=-1)[..., ::2] for b in blocks]  # strided
    blocks = [Block(b.hash, b.n_tokens, w) for b, w in zip(blocks, wide)]
    expected = encode(geometry, blocks, version)
    out = _room(len(expected) + 9)
    got = encode_into(out, geometry, blocks, version)
    assert bytes(got) == expected and len(got) == len(expected)
    assert np.shares_memory(np.frombuffer(got, np.uint8), np.frombuffer(out, np.uint8))
    assert out[len(expected) :] == bytes([SENTINEL]) * 9
    decode(got, geometry)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("n_tokens", [3 * SMALL.block_tokens, 3 * SMALL.block_tokens - 1])
def test_encode_into_takes_layer_windows_as_encode_does(dtype: type, n_tokens: int) -> None:
    """Blocks cut from per-layer arrays (``kvlayout``): their payload comes as strided
    views and zero pads, not a ``[L][2][Hkv][B][D]`` array; a value out of f16's range
    in them is refused by the same check on the bytes written."""
    g = SMALL
    rng = np.random.default_rng(6)
    shape = (g.n_kv_heads, n_tokens + 5, g.head_dim)  # a preallocated cache, longer
    keys: list[np.ndarray] = [rng.standard_normal(shape).astype(dtype) for _ in range(g.n_layers)]
    values: list[np.ndarray] = [rng.standard_normal(shape).astype(dtype) for _ in range(g.n_layers)]
    tokens = rng.integers(0, 2**32, n_tokens, dtype=np.uint64)
    blocks = blocks_from_layers(keys, values, tokens, g)
    expected = encode(g, blocks)
    out = _room(len(expected))
    assert bytes(encode_into(out, g, blocks)) == expected
    keys[1][0, 2, 0] = np.inf
    with pytest.raises(ValueError, match="block 0: kv values must be finite") as by_encode:
        encode(g, blocks)
    with pytest.raises(ValueError) as by_into:
        encode_into(out, g, blocks)
    assert str(by_into.value) == str(by_encode.value)


def test_a_buffer_too_small_read_only_or_overlapping_a_block_is_refused_untouched(
    join: str,
) -> None:
    blocks = make_blocks(SMALL, 8, seed=4)
    size = len(encode(SMALL, blocks))
    out = _room(size - 1)
    with pytest.raises(ValueError, match=f"out holds {size - 1} bytes, the envelope {size}"):
        encode_into(out, SMALL, blocks)
    assert out == bytes([SENTINEL]) * (size - 1)
    with pytest.raises(ValueError, match="read-only"):
        encode_into(bytes(size), SMALL, blocks)
    # a buffer whose bytes are also a block's kv (the envelope would overwrite its source)
    shared = np.zeros(size + 4096, np.uint8)
    kv = np.ndarray(blocks[0].kv.shape, np.float16, shared, offset=64)
    kv[...] = blocks[0].kv
    before = shared.copy()
    with pytest.raises(ValueError, match="overlaps out"):
        encode_into(shared, SMALL, [Block(blocks[0].hash, blocks[0].n_tokens, kv)])
    assert np.array_equal(shared, before)


def test_encode_into_fails_as_encode_does() -> None:
    (good,) = make_blocks(SMALL, SMALL.block_tokens, seed=5)
    kv = np.array(good.kv, dtype=np.float32)
    kv[0, 0, 0, 0, 0] = np.inf
    cases = [
        [Block(good.hash, good.n_tokens, kv)],  # not finite (v1)
        [Block(good.hash, good.n_tokens, kv[..., :1])],  # another shape
        [Block(2**64, good.n_tokens, good.kv)],  # a hash beyond u64
    ]
    for blocks in cases:
        with pytest.raises((ValueError, ShapeError)) as by_encode:
            encode(SMALL, blocks)
        with pytest.raises(type(by_encode.value)) as by_into:
            encode_into(_room(1 << 16), SMALL, blocks)
        assert str(by_into.value) == str(by_encode.value)
