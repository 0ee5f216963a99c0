"""Engine layouts <-> blocks: per-layer K/V arrays cut into ``Block``s, and block views
concatenated back into per-layer arrays (numpy only; torch is never imported).

Engines keep a sequence's KV per layer, head-major: ``[Hkv, T, D]`` or ``[1, Hkv, T, D]``
for each layer's keys and values (Hugging Face's ``DynamicCache``, vLLM's CPU tensors).
The envelope wants each block as ``[L][2][Hkv][B][D]``. Nothing here copies payload data
more than once: ``blocks_from_layers`` hands out blocks whose ``kv`` refers to the
layer arrays (``encode`` does the one copy, into the envelope), and ``layers_from_views``
copies each block's filled positions straight into its output arrays.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from .codec.envelope import Block, BlockView
from .codec.geometry import Geometry
from .codec.hashing import chain_hashes
from .codec.numerics import as_array
from .errors import ShapeError

__all__ = ["LayerSlices", "blocks_from_layers", "fill_layers", "layers_from_views"]

_FLOATS = (
    np.dtype(np.float16),
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(np.float32),
    np.dtype(np.float64),
)
# e4m3_to_f32 of every code byte (ml_dtypes' E4M3FN): dequantizes v2 straight into an output.
_E4M3_TO_F32 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


class LayerSlices:
    """One block's KV as a window on per-layer arrays, without a copy.

    ``np.asarray(slices)`` gives the ``[L][2][Hkv][B][D]`` array (positions past
    ``n_tokens`` are zero), in the layers' dtype. ``encode`` asks ``payload_parts`` for
    the v1 payload instead, which costs no copy when the layers are f16 with contiguous
    token rows (``[Hkv, T, D]`` head-major, the usual engine layout).
    """

    __slots__ = ("dtype", "geometry", "keys", "n_tokens", "start", "values")

    def __init__(
        self,
        keys: Sequence[np.ndarray],
        values: Sequence[np.ndarray],
        start: int,
        n_tokens: int,
        geometry: Geometry,
        dtype: np.dtype,
    ) -> None:
        self.keys = keys
        self.values = values
        self.start = start
        self.n_tokens = n_tokens
        self.geometry = geometry
        self.dtype = dtype

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """``[L][2][Hkv][B][D]``."""
        return self.geometry.kv_shape

    @property
    def ndim(self) -> int:
        return 5

    def layer(self, index: int, kv: int) -> np.ndarray:
        """The window of layer ``index``'s keys (``kv`` 0) or values (1): ``[Hkv][n][D]``."""
        src = self.keys if kv == 0 else self.values
        return src[index][:, self.start : self.start + self.n_tokens]

    def payload_parts(self, version: int) -> list[Any] | None:
        """The v1 payload ``[L][2][Hkv][B][D]`` f16 as buffers in order, or None (v2).

        f16 layers whose token rows are contiguous give views, one per (layer, K/V) (per
        head, followed by zeros, in a partial block): the envelope's join is the only copy.
        Other dtypes and strides are converted into one f16 array (numpy's round to
        nearest even; bf16 goes through its exact f32 value). The values are not checked
        here: ``encode`` checks the payload it built (finite, within f16's range).
        """
        if version != 1:
            return None
        g = self.geometry
        n, d = self.n_tokens, g.head_dim
        if self.dtype == np.float16 and all(
            a.strides[1:] == (2 * d, 2) for a in (*self.keys, *self.values)
        ):
            windows = [self.layer(i, kv) for i in range(g.n_layers) for kv in (0, 1)]
            if n == g.block_tokens:  # strided [Hkv][B][D] views, read in C order by the join
                return windows
            pad = bytes(2 * d * (g.block_tokens - n))
            return [part for w in windows for head in w for part in (head, pad)]
        with np.errstate(over="ignore", invalid="ignore"):  # refused by encode's check
            return [self.__array__(np.float16)]

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        g = self.geometry
        out = np.empty(g.kv_shape, dtype=self.dtype if dtype is None else dtype)
        n = self.n_tokens
        if n < g.block_tokens:
            out[..., n:, :] = 0
        for index in range(g.n_layers):
            out[index, 0, :, :n] = self.layer(index, 0)
            out[index, 1, :, :n] = self.layer(index, 1)
        return out

    def __repr__(self) -> str:
        return (
            f"LayerSlices(start={self.start}, n_tokens={self.n_tokens}, "
            f"geometry={self.geometry.as_tuple()}, dtype={self.dtype})"
        )


def _layer_array(x: Any, what: str, geometry: Geometry, n_tokens: int) -> np.ndarray:
    """One layer's ``[Hkv, T, D]`` (or ``[1, Hkv, T, D]``) as a 3-D numpy view."""
    arr = as_array(x)
    if arr.ndim == 4:
        if arr.shape[0] != 1:
            raise ShapeError(
                f"{what}: batch size must be 1 (one sequence per call), found shape {arr.shape}"
            )
        arr = arr[0]
    if arr.ndim != 3:
        raise ShapeError(f"{what}: expected [Hkv, T, D] or [1, Hkv, T, D], found shape {arr.shape}")
    h, t, d = arr.shape
    if (h, d) != (geometry.n_kv_heads, geometry.head_dim):
        raise ShapeError(
            f"{what}: expected Hkv={geometry.n_kv_heads}, D={geometry.head_dim} "
            f"(geometry {geometry.as_tuple()}), found shape {arr.shape}"
        )
    if t < n_tokens:
        raise ShapeError(f"{what}: holds {t} token positions, fewer than the {n_tokens} tokens")
    if arr.dtype not in _FLOATS:
        raise ValueError(
            f"{what}: kv must be float16, bfloat16, float32 or float64, found {arr.dtype}"
        )
    return arr


def blocks_from_layers(
    keys: Sequence[Any],
    values: Sequence[Any],
    tokens: Any,
    geometry: Geometry,
    *,
    parent: int = 0,
    tail: bool = True,
) -> list[Block]:
    """Cut per-layer K/V into blocks of ``geometry.block_tokens`` tokens, hashed by chain.

    Args:
        keys, values: one array per layer, ``[Hkv, T, D]`` or ``[1, Hkv, T, D]``, any float
            dtype (f16, bf16, f32, f64), any strides; numpy arrays, CPU torch tensors or
            anything with ``__array__``. ``T`` may exceed ``len(tokens)`` (a preallocated
            cache): positions from ``len(tokens)`` on are ignored.
        tokens: the 1-D token ids the KV belongs to.
        geometry: the block geometry; ``L``, ``Hkv`` and ``D`` must match the arrays.
        parent: hash of the block before ``tokens[0]`` (0 at the start of a sequence).
        tail: also return the partial last block (hash 0) when ``len(tokens)`` is not a
            multiple of ``B`` (a prefix cache stores only full blocks: pass False).

    Returns:
        The blocks in order; each ``kv`` is a ``LayerSlices`` window on the arrays (no
        copy), valid as long as the arrays are not modified.

    Raises:
        ShapeError: a layer count, head count, head dim or length does not match, or a
            batch dimension is not 1.
        ValueError: tokens are not 1-D u32 ids, or a dtype is not a float.
    """
    toks = as_array(tokens)
    hashes = chain_hashes(toks, geometry.block_tokens, parent)  # refuses a non-1-D input
    n_total = len(toks)
    if len(keys) != geometry.n_layers or len(values) != geometry.n_layers:
        raise ShapeError(
            f"expected {geometry.n_layers} layers of keys and values (geometry "
            f"{geometry.as_tuple()}), found {len(keys)} and {len(values)}"
        )
    ks = [_layer_array(k, f"keys[{i}]", geometry, n_total) for i, k in enumerate(keys)]
    vs = [_layer_array(v, f"values[{i}]", geometry, n_total) for i, v in enumerate(values)]
    dtype = np.result_type(*(a.dtype for a in (*ks, *vs)))
    b = geometry.block_tokens
    blocks = [
        Block(h, b, LayerSlices(ks, vs, i * b, b, geometry, dtype)) for i, h in enumerate(hashes)
    ]
    rest = n_total - len(hashes) * b
    if tail and rest:
        blocks.append(Block(0, rest, LayerSlices(ks, vs, n_total - rest, rest, geometry, dtype)))
    return blocks


def layers_from_views(
    views: Iterable[BlockView], dtype: Any = None, *, out: np.ndarray | None = None
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Concatenate blocks' filled positions into per-layer ``[Hkv, T, D]`` keys and values.

    Each view's data is copied once, straight into the output (v2 codes are dequantized on
    the way: ``e4m3_to_f32(code) * scale``). The per-layer arrays are views into one
    C-contiguous ``[L][2][Hkv][T][D]`` allocation, so each is C-contiguous itself.

    Args:
        views: ``BlockView``s in sequence order (from ``decode`` or a store reader); all
            of one geometry. Read them inside their reader's ``with`` block.
        dtype: output dtype (f16, bf16, f32, f64); default f16 when every view is v1,
            else f32 (``out``'s dtype when it is given).
        out: an array ``[L][2][Hkv][>=T][D]`` to fill instead of a new one (an engine's
            own buffer: memory reused, already faulted in); positions from ``T`` on are
            left as they are.

    Returns:
        ``(keys, values)``: one array per layer each, ``T`` = the sum of the fills; with
        no views, two empty lists.

    Raises:
        ShapeError: the views' geometries differ, or ``out`` does not fit them.
    """
    views = list(views)
    if not views:
        return [], []
    g = views[0].geometry
    for i, bv in enumerate(views):
        if bv.geometry != g:
            raise ShapeError(
                f"view {i}: geometry {bv.geometry.as_tuple()} differs from view 0's {g.as_tuple()}"
            )
    if dtype is None:
        if out is not None:
            dtype = out.dtype
        else:
            dtype = np.float16 if all(bv.version == 1 for bv in views) else np.float32
    out_dtype = np.dtype(dtype)
    if out_dtype not in _FLOATS:
        raise ValueError(f"dtype must be float16, bfloat16, float32 or float64, found {dtype}")
    total = sum(bv.n_tokens for bv in views)
    shape = (g.n_layers, 2, g.n_kv_heads, total, g.head_dim)
    if out is None:
        out = np.empty(shape, dtype=out_dtype)
    elif (
        out.ndim != 5
        or out.shape[:3] + out.shape[4:] != shape[:3] + shape[4:]
        or out.shape[3] < total
        or out.dtype != out_dtype
    ):
        raise ShapeError(
            f"out: expected {out_dtype} [L][2][Hkv][>={total}][D] = {shape}, found "
            f"{out.dtype} {out.shape}"
        )
    else:
        out = out[:, :, :, :total]
    pos = 0
    for bv in views:
        n = bv.n_tokens
        dst = out[:, :, :, pos : pos + n]
        if bv.version == 1:
            dst[...] = bv.kv[:, :, :, :n]
        else:
            scales = bv.scales
            assert scales is not None
            codes = bv.kv[:, :, :, :n]
            if out_dtype == np.float32:
                np.take(_E4M3_TO_F32, codes, out=dst)
                dst *= scales[..., None, None]
            else:
                dst[...] = _E4M3_TO_F32[codes] * scales[..., None, None]
        pos += n
    return [out[i, 0] for i in range(g.n_layers)], [out[i, 1] for i in range(g.n_layers)]


def fill_layers(
    views: Iterable[BlockView], keys: Sequence[np.ndarray], values: Sequence[np.ndarray]
) -> int:
    """Copy blocks' filled positions into an engine's own per-layer buffers.

    Like ``layers_from_views`` with ``out=``, for an engine whose layers are separate
    arrays (a preallocated cache per layer): each view's data is copied once, straight into
    ``keys[i][:, pos:pos + n]`` and ``values[i][...]`` (v2 dequantized on the way).

    Args:
        views: ``BlockView``s in sequence order, all of one geometry.
        keys, values: one ``[Hkv, >=T, D]`` float array per layer (numpy views of the
            engine's tensors); positions from ``T`` on are left as they are.

    Returns:
        ``T``, the number of positions filled.

    Raises:
        ShapeError: the views' geometries differ, or a buffer does not fit them.
    """
    views = list(views)
    if not views:
        return 0
    g = views[0].geometry
    total = sum(bv.n_tokens for bv in views)
    if len(keys) != g.n_layers or len(values) != g.n_layers:
        raise ShapeError(
            f"expected {g.n_layers} layers of keys and values, found {len(keys)} and {len(values)}"
        )
    for i, buf in enumerate((*keys, *values)):
        if (
            buf.ndim != 3
            or (buf.shape[0], buf.shape[2]) != (g.n_kv_heads, g.head_dim)
            or buf.shape[1] < total
            or buf.dtype not in _FLOATS
        ):
            raise ShapeError(
                f"buffer {i}: expected a float [Hkv={g.n_kv_heads}][>={total}][D={g.head_dim}], "
                f"found {buf.dtype} {buf.shape}"
            )
    pos = 0
    for j, bv in enumerate(views):
        if bv.geometry != g:
            raise ShapeError(
                f"view {j}: geometry {bv.geometry.as_tuple()} differs from view 0's {g.as_tuple()}"
            )
        n = bv.n_tokens
        if bv.version == 1:
            src = bv.kv[:, :, :, :n]
        else:
            scales = bv.scales
            assert scales is not None
            src = _E4M3_TO_F32[bv.kv[:, :, :, :n]]
            src *= scales[..., None, None]
        for index in range(g.n_layers):
            keys[index][:, pos : pos + n] = src[index, 0]
            values[index][:, pos : pos + n] = src[index, 1]
        pos += n
    return total
