"""scatter_crc_views: envelopes' block payloads copied into one strided view per block
(SGLang's host pool pages and flat pages are transposed views of the block), each CRC
checked in the same pass; the compiled kernel and the NumPy fallback against a plain
NumPy assignment."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvstore.codec import checksum
from kvstore.codec.envelope import Block, encode
from kvstore.codec.geometry import Geometry
from kvstore.codec.layout import HEADER_SIZE, RECORD_SIZE

G = Geometry(16, 3, 2, 8)  # B, L, Hkv, D
OFFSET = HEADER_SIZE + RECORD_SIZE
# block axes [L][2][H][B][D] of SGLang's pages: layer_first [2][L][B][H][D], page_first
# [2][B][L][H][D]
TO_BLOCK = {"layer_first": (1, 0, 3, 2, 4), "page_first": (2, 0, 3, 1, 4)}


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


def _blocks(n: int, seed: int = 0, g: Geometry = G) -> tuple[np.ndarray, list[bytes]]:
    kv = np.random.default_rng(seed).standard_normal((n, *g.kv_shape)).astype(np.float16)
    return kv, [encode(g, [Block(1000 + i, g.block_tokens, kv[i])]) for i in range(n)]


def _pool(layout: str, pages: int, g: Geometry = G) -> np.ndarray:
    """A pool of ``pages`` pages, [2][L][tokens][H][D] or [2][tokens][L][H][D], filled
    with a pattern a copy must not leave behind."""
    t = pages * g.block_tokens
    shape = {"layer_first": (2, g.n_layers, t, g.n_kv_heads, g.head_dim),
             "page_first": (2, t, g.n_layers, g.n_kv_heads, g.head_dim)}[layout]  # fmt: skip
    return np.full(shape, -7.0, np.float16)


def _page(pool: np.ndarray, layout: str, start: int, g: Geometry = G) -> np.ndarray:
    window = (
        pool[:, :, start : start + g.block_tokens]
        if layout == "layer_first"
        else (pool[:, start : start + g.block_tokens])
    )
    return window.transpose(TO_BLOCK[layout])


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_each_block_lands_in_its_page_and_nothing_else_changes(impl: str, layout: str) -> None:
    kv, envs = _blocks(3)
    pool = _pool(layout, 6)
    starts = [5 * 16, 0, 2 * 16]
    want = pool.copy()
    for i, s in enumerate(starts):
        _page(want, layout, s)[...] = kv[i]
    got = checksum.scatter_crc_views(
        [memoryview(e) for e in envs], OFFSET, [_page(pool, layout, s) for s in starts]
    )
    assert got == 3
    assert pool.tobytes() == want.tobytes()
    assert checksum.scatter_crc_views([], OFFSET, []) == 0


def test_contiguous_and_flat_pages_too(impl: str) -> None:
    """A C-contiguous block (rows back to back: one fused copy per run) and SGLang's flat
    layer_first page copy ([2][L][B][H][D] memory)."""
    kv, envs = _blocks(2, seed=3)
    plain = np.zeros(G.kv_shape, np.float16)
    flat = np.zeros(G.elements, np.float16)
    flat_view = flat.reshape(2, G.n_layers, G.block_tokens, G.n_kv_heads, G.head_dim)
    flat_block = flat_view.transpose(1, 0, 3, 2, 4)
    assert checksum.scatter_crc_views(envs, OFFSET, [plain, flat_block]) == 2
    assert plain.tobytes() == kv[0].tobytes()
    assert flat_block.tobytes() == kv[1].tobytes()


@pytest.mark.parametrize("where", ["header", "record", "payload", "last payload byte", "trailer"])
def test_stops_at_the_first_block_whose_crc_fails(impl: str, where: str) -> None:
    kv, envs = _blocks(4, seed=1)
    at = {
        "header": 5,
        "record": HEADER_SIZE + 3,
        "payload": OFFSET + 123,
        "last payload byte": len(envs[2]) - 5,
        "trailer": len(envs[2]) - 1,
    }[where]
    bad = bytearray(envs[2])
    bad[at] ^= 0x10
    pool = _pool("layer_first", 4)
    pages = [_page(pool, "layer_first", 16 * i) for i in range(4)]
    got = checksum.scatter_crc_views([envs[0], envs[1], bytes(bad), envs[3]], OFFSET, pages)
    assert got == 2
    for i in range(2):
        assert pages[i].tobytes() == kv[i].tobytes()
    assert (pages[3] == -7.0).all()  # never reached


def test_joined_envelopes_go_block_by_block(impl: str) -> None:
    kv = np.random.default_rng(5).standard_normal((5, *G.kv_shape)).astype(np.float16)
    first = encode(G, [Block(10 + i, G.block_tokens, kv[i]) for i in range(3)])
    second = encode(G, [Block(20 + i, G.block_tokens, kv[3 + i]) for i in range(2)])
    pool = _pool("page_first", 5)
    pages = [_page(pool, "page_first", 16 * i) for i in (4, 3, 2, 1, 0)]
    got = checksum.scatter_crc_views([first, second], OFFSET, pages, RECORD_SIZE)
    assert got == 5
    for i in range(5):
        assert pages[i].tobytes() == kv[i].tobytes()
    bad = bytearray(second)
    bad[-1] ^= 1
    pool[...] = -7.0
    assert checksum.scatter_crc_views([first, bytes(bad)], OFFSET, pages, RECORD_SIZE) == 3
    assert [pages[i].tobytes() == kv[i].tobytes() for i in range(3)] == [True] * 3


def test_a_geometry_whose_rows_fit_no_vector_width(impl: str) -> None:
    g = Geometry(3, 2, 5, 7)
    kv, envs = _blocks(2, seed=9, g=g)
    pool = _pool("layer_first", 3, g)
    pages = [_page(pool, "layer_first", 3 * i, g) for i in (2, 0)]
    assert checksum.scatter_crc_views(envs, OFFSET, pages) == 2
    assert pages[0].tobytes() == kv[0].tobytes() and pages[1].tobytes() == kv[1].tobytes()
    assert (_page(pool, "layer_first", 3, g) == -7.0).all()


def test_bad_arguments_raise_before_anything_is_written(impl: str) -> None:
    _, envs = _blocks(2, seed=2)
    pool = _pool("layer_first", 2)
    pages = [_page(pool, "layer_first", 16 * i) for i in range(2)]
    cases = [
        ([envs[0]], pages, None, "one block per envelope"),
        (envs, [pages[0], pages[1].astype(np.float32)], None, "2-byte elements"),
        (envs, [pages[0], pages[1][:, :, :, :, ::2]], None, "last axis is contiguous"),
        (envs, [pages[0], pages[1][:1]], None, "shape differs"),
        (envs, [pages[0], np.zeros(G.kv_shape, np.float16)[:, :, :, :, :4]], None, "differs"),
        (envs, [pages[0][:, :1], pages[1][:, :1]], None, r"\[L\]\[2\]\[H\]\[B\]\[D\]"),
        ([envs[0][:-9], envs[1]], pages, None, "fewer than its payload needs"),
        ([envs[0] + b"xx"], pages[:1], RECORD_SIZE, "not a whole number of blocks"),
        ([envs[0]], pages, RECORD_SIZE, "the envelopes hold 1 blocks, 2 blocks given"),
        (envs, pages, -1, "record_bytes None or >= 0"),
    ]
    readonly = pages[1].copy()
    readonly.flags.writeable = False
    cases.append((envs, [pages[0], readonly], None, "read-only|writable"))
    for env_list, blocks, rec, message in cases:
        with pytest.raises(ValueError, match=message):
            checksum.scatter_crc_views(env_list, OFFSET, blocks, rec)
    assert (pool == -7.0).all()
