"""scatter_crc: stored single-block envelopes copied into a vLLM-style paged cache with each
CRC checked in the same pass, the compiled kernel and the NumPy fallback against a plain
NumPy oracle (the block's ``[L][2][Hkv][B][D]`` payload transposed per layer)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvstore.codec import checksum
from kvstore.codec.envelope import Block, encode
from kvstore.codec.geometry import Geometry
from kvstore.codec.layout import HEADER_SIZE, RECORD_SIZE

G = Geometry(16, 3, 2, 8)  # B, L, Hkv, D
RUN = G.block_tokens * G.head_dim * 2
OFFSET = HEADER_SIZE + RECORD_SIZE


@pytest.fixture(params=["native", "numpy"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Both implementations: the fallback is the one the module picks without the build."""
    if request.param == "native":
        native = checksum._native  # type: ignore[attr-defined]  # the module's private kernel
        if native is None or checksum._crc32c is not native.crc32c:
            pytest.skip("the compiled kernel is not the module's CRC here")
    else:
        monkeypatch.setattr(checksum, "_native", None)
    yield request.param


def _blocks(n: int, seed: int = 0) -> tuple[np.ndarray, list[bytes]]:
    kv = np.random.default_rng(seed).standard_normal((n, *G.kv_shape)).astype(np.float16)
    return kv, [encode(G, [Block(1000 + i, G.block_tokens, kv[i])]) for i in range(n)]


def _layers(n_blocks: int = 9) -> list[np.ndarray]:
    shape = (n_blocks, G.n_kv_heads, 2, G.block_tokens, G.head_dim)
    return [np.zeros(shape, np.float16) for _ in range(G.n_layers)]


def _expect(layers: list[np.ndarray], kv: np.ndarray, ids: list[int]) -> list[np.ndarray]:
    out = [layer.copy() for layer in layers]
    for i, b in enumerate(ids):
        for lyr in range(G.n_layers):
            out[lyr][b] = kv[i, lyr].transpose(1, 0, 2, 3)  # [2][H] -> [H][2]
    return out


def test_copies_every_block_into_its_place(impl: str) -> None:
    kv, envs = _blocks(4)
    layers = _layers()
    ids = [7, 0, 3, 8]
    want = _expect(layers, kv, ids)
    got = checksum.scatter_crc(
        [memoryview(e) for e in envs], OFFSET, layers, ids, G.n_kv_heads, RUN
    )
    assert got == 4
    for a, b in zip(layers, want, strict=True):
        assert a.tobytes() == b.tobytes()
    assert checksum.scatter_crc([], OFFSET, layers, [], G.n_kv_heads, RUN) == 0


@pytest.mark.parametrize("where", ["header", "record", "payload", "last payload byte", "trailer"])
def test_stops_at_the_first_block_whose_crc_fails(impl: str, where: str) -> None:
    kv, envs = _blocks(4, seed=1)
    at = {
        "header": 5,
        "record": HEADER_SIZE + 3,
        "payload": OFFSET + 1234,
        "last payload byte": len(envs[2]) - 5,
        "trailer": len(envs[2]) - 1,
    }[where]
    bad = bytearray(envs[2])
    bad[at] ^= 0x10
    layers = _layers()
    ids = [1, 2, 3, 4]
    want = _expect(layers, kv[:2], ids[:2])
    got = checksum.scatter_crc([envs[0], envs[1], bad, envs[3]], OFFSET, layers, ids, 2, RUN)
    assert got == 2
    for a, b in zip(layers, want, strict=True):  # blocks before it in place, after it untouched
        assert a[[1, 2, 4]].tobytes() == b[[1, 2, 4]].tobytes()


def test_bad_arguments_raise_before_anything_is_written(impl: str) -> None:
    _, envs = _blocks(2, seed=2)
    layers = _layers(4)
    with pytest.raises(ValueError, match="block id"):
        checksum.scatter_crc(envs, OFFSET, layers, [0, 4], G.n_kv_heads, RUN)
    with pytest.raises(ValueError, match="block id"):
        checksum.scatter_crc(envs, OFFSET, layers, [-1, 0], G.n_kv_heads, RUN)
    with pytest.raises(ValueError, match="one block id per envelope"):
        checksum.scatter_crc(envs, OFFSET, layers, [0], G.n_kv_heads, RUN)
    with pytest.raises(ValueError, match=r"shorter|fewer"):
        checksum.scatter_crc([envs[0], envs[1][:-8]], OFFSET, layers, [0, 1], 2, RUN)
    with pytest.raises(ValueError, match="same whole number"):
        checksum.scatter_crc(envs, OFFSET, [*layers[:2], _layers(5)[0]], [0, 1], 2, RUN)
    assert all(not layer.any() for layer in layers)
    frozen = _layers(4)
    frozen[1].flags.writeable = False
    with pytest.raises((ValueError, BufferError)):
        checksum.scatter_crc(envs, OFFSET, frozen, [0, 1], G.n_kv_heads, RUN)


def _joined(kv: np.ndarray, first: int = 0) -> bytes:
    """One envelope of the blocks of ``kv`` (a prefix as ``/v1/prefix`` answers)."""
    return encode(G, [Block(2000 + first + i, G.block_tokens, k) for i, k in enumerate(kv)])


def test_joined_envelopes_go_block_by_block_into_their_places(impl: str) -> None:
    kv, _ = _blocks(5, seed=3)
    layers = _layers()
    ids = [8, 2, 0, 5, 6]
    want = _expect(layers, kv, ids)
    envs = [_joined(kv[:3]), memoryview(_joined(kv[3:], first=3))]  # 3 blocks, then 2
    got = checksum.scatter_crc(envs, OFFSET, layers, ids, G.n_kv_heads, RUN, RECORD_SIZE)
    assert got == 5
    for a, b in zip(layers, want, strict=True):
        assert a.tobytes() == b.tobytes()
    one = [_joined(kv[:1])]  # a joined envelope of one block is a single-block envelope
    assert checksum.scatter_crc(one, OFFSET, _layers(), [4], 2, RUN, RECORD_SIZE) == 1


@pytest.mark.parametrize("where", ["header", "first record", "middle record", "payload", "trailer"])
def test_a_joined_envelope_whose_crc_fails_loads_none_of_its_blocks(impl: str, where: str) -> None:
    kv, _ = _blocks(5, seed=4)
    first, second = _joined(kv[:2]), _joined(kv[2:], first=2)
    stride = (len(second) - HEADER_SIZE - 4) // 3  # one record and its payload
    at = {
        "header": 9,
        "first record": HEADER_SIZE + 2,
        "middle record": HEADER_SIZE + stride + 1,  # the 2nd block's hash
        "payload": len(second) - 100,
        "trailer": len(second) - 2,
    }[where]
    bad = bytearray(second)
    bad[at] ^= 0x01
    layers = _layers()
    ids = [1, 2, 3, 4, 5]
    want = _expect(layers, kv[:2], ids[:2])
    assert checksum.scatter_crc([first, bad], OFFSET, layers, ids, 2, RUN, RECORD_SIZE) == 2
    for a, b in zip(layers, want, strict=True):  # the first envelope's blocks in place
        assert a[[1, 2]].tobytes() == b[[1, 2]].tobytes()


def test_joined_envelopes_refuse_sizes_that_are_not_whole_blocks(impl: str) -> None:
    kv, _ = _blocks(3, seed=5)
    env = _joined(kv)
    layers = _layers()
    with pytest.raises(ValueError, match="whole number of blocks"):
        checksum.scatter_crc([env[:-5] + env[-4:]], OFFSET, layers, [0, 1, 2], 2, RUN, 12)
    with pytest.raises(ValueError, match="3 blocks, 2 block ids"):
        checksum.scatter_crc([env], OFFSET, layers, [0, 1], 2, RUN, RECORD_SIZE)
    with pytest.raises(ValueError, match="record_bytes"):
        checksum.scatter_crc([env], OFFSET, layers, [0, 1, 2], 2, RUN, -1)
    assert all(not layer.any() for layer in layers)


@pytest.mark.parametrize(
    "geometry",
    [G, Geometry(16, 2, 3, 64), Geometry(5, 2, 2, 6)],  # 8x8 tiles, vLLM-like, element by element
    ids=["16x8", "16x64", "5x6"],
)
@pytest.mark.parametrize("joined", [False, True])
def test_keys_transposed_land_as_d_rows_of_b_tokens(
    impl: str, geometry: Geometry, joined: bool
) -> None:
    g = geometry
    b, d, h = g.block_tokens, g.head_dim, g.n_kv_heads
    kv = np.random.default_rng(6).standard_normal((4, *g.kv_shape)).astype(np.float16)
    blocks = [Block(3000 + i, b, kv[i]) for i in range(4)]
    envs = [encode(g, blocks)] if joined else [encode(g, [x]) for x in blocks]
    # a CPU "vec" paged cache: per (block, head) the keys as D rows of B, then B value rows
    layers = [np.zeros((6, h, 2, b * d), np.float16) for _ in range(g.n_layers)]
    ids = [5, 0, 3, 2]
    run = b * d * 2
    got = checksum.scatter_crc(
        envs, OFFSET, layers, ids, h, run, RECORD_SIZE if joined else None, b
    )
    assert got == 4
    for lyr, layer in enumerate(layers):
        for i, slot in enumerate(ids):
            keys = layer[slot, :, 0].reshape(h, d, b)
            values = layer[slot, :, 1].reshape(h, b, d)
            assert keys.tobytes() == kv[i, lyr, 0].transpose(0, 2, 1).tobytes()
            assert values.tobytes() == kv[i, lyr, 1].tobytes()
        assert not layer[[1, 4]].any()


def test_transposed_keys_still_stop_at_a_failed_crc(impl: str) -> None:
    _, envs = _blocks(3, seed=7)
    bad = bytearray(envs[1])
    bad[OFFSET + 3] ^= 0x04  # a key byte: the CRC covers the run as stored
    layers = _layers()
    assert (
        checksum.scatter_crc([envs[0], bad, envs[2]], OFFSET, layers, [0, 1, 2], 2, RUN, None, 16)
        == 1
    )
    assert not any(layer[2].any() for layer in layers)
    with pytest.raises(ValueError, match="key_tokens"):
        checksum.scatter_crc(envs, OFFSET, layers, [0, 1, 2], 2, RUN, None, 3)  # 16*8 % 3
    with pytest.raises(ValueError, match="key_tokens"):
        checksum.scatter_crc(envs, OFFSET, layers, [0, 1, 2], 2, RUN, None, -1)
    with pytest.raises(ValueError, match="key_tokens"):  # 2 * it wraps to -2 in 64 bits
        checksum.scatter_crc(envs, OFFSET, layers, [0, 1, 2], 2, RUN, None, 2**63 - 1)
    assert not any(layer[2].any() for layer in layers)
