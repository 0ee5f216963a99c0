"""vLLM's paged KV cache <-> tlkv blocks: the layout check at registration, one gather per
layer for the blocks saved; for the blocks loaded, stored v1 envelopes copied straight into
their paged blocks with each CRC checked in the same pass (compiled ``scatter_crc``, a CPU
f16 cache laid out B keys then B values, or the "vec" kernels' keys transposed on the
way), else checked views copied per block and layer. ``PagedCache`` is the
``BlockSlots`` a target loads into.

Each layer's cache is registered as a tensor of logical shape ``[num_blocks, h, B, 2 * D]``;
where a backend puts keys and values inside it is its ``Layout`` (``BACKEND_LAYOUTS``, by
backend and, for vLLM's CPU backend, the kernels' ISA: its "vec" kernels store a block's
keys transposed, D rows of B tokens, then B value rows; its "amx" kernels, bf16 on a CPU
with AMX, store both in tiles), viewed without a copy as keys and values ``[num_blocks,
h, B, D]`` (tiles: with B and D each split in two, ``split_block``) and proven at
registration (``_vllm_proof``); a block of the envelope is ``[L][2][Hkv][B][D]``. Under
tensor parallelism a rank's cache
holds the heads ``[r*H/t, (r+1)*H/t)`` (``head_range``): blocks are stored whole (every
head), so that engines of any TP size share them. An fp8 E4M3 cache is stored as v2
(``_vllm_fp8``). Any other backend or ISA, another quantized ``kv_cache_dtype``, MLA,
sliding windows, several KV cache groups, KV heads replicated across ranks or pipeline
parallelism is refused with ``UnsupportedLayoutError``. Every fact the connector relies
on is checked against what vLLM registered, or refused.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from ..codec.checksum import scatter_crc
from ..codec.envelope import Block, BlockView, encode, encode_into
from ..codec.geometry import Geometry
from ..codec.layout import HEADER_SIZE, RECORD_SIZE
from ..errors import CacheLayoutError
from ..kvlayout import layers_from_views
from ._buffers import KeptBuffers
from ._vllm_fp8 import FP8_CACHE_DTYPES, encode_fp8, fp8_codes, slab_scales

__all__ = [
    "BACKEND_LAYOUTS",
    "BLOCK_KV",
    "CPU_AMX",
    "CPU_VEC",
    "KNOWN_BACKENDS",
    "TOKEN_KV",
    "Layout",
    "PagedCache",
    "UnsupportedLayoutError",
    "check_config",
    "head_range",
    "split_block",
]


@dataclass(frozen=True)
class Layout:
    """How a backend lays out one layer's paged cache: vLLM registers it as a tensor of
    logical shape ``[num_blocks, h, B, C]`` (``C = 2 * D``; its strides are the physical
    order), and ``view`` maps it, without a copy, to the layer's keys and values, two
    ``[num_blocks, h, B, D]`` views, or for a layout of tiles two views with B and D each
    split in two (``[num_blocks, h, B/b, b, D/d, d]``): a block's ``[h][B][D]`` is shaped
    as either by splitting its last two dimensions (``split_block``)."""

    name: str
    view: Callable[[Any, int, int, int], tuple[Any, Any]]  # (cache, h, B, D) -> (K, V)


def split_block(x: Any, view: Any) -> Any:
    """``x`` (``[..., B, D]``, numpy or torch) shaped as one block of ``view`` (a layer's
    key or value view, ``[num_blocks, h, ...]``): its last two dimensions split as the
    view's are; a view of ``x`` where its strides allow (a split always does for torch)."""
    return x.reshape(*x.shape[:-2], *view.shape[2:])


def _block_kv(t: Any, h: int, b: int, d: int) -> tuple[Any, Any]:
    # Each (block, head) plane is B key rows, then B value rows.
    planes = t.view(t.shape[0], h, 2, b, d)
    return planes[:, :, 0], planes[:, :, 1]


def _cpu_vec(t: Any, h: int, b: int, d: int) -> tuple[Any, Any]:
    # vLLM's CPU attention with its "vec" kernels (x86 without AMX, or bf16 not on AMX):
    # each (block, head) plane is the keys transposed, D rows of B tokens, then B value
    # rows (shown by its cpu_attn_reshape_and_cache: the layout proof).
    keys = t.view(t.shape[0], h, 2, d, b)[:, :, 0].transpose(2, 3)
    return keys, t.view(t.shape[0], h, 2, b, d)[:, :, 1]


def _cpu_amx(t: Any, h: int, b: int, d: int) -> tuple[Any, Any]:
    # vLLM's CPU attention with its "amx" kernels (bf16 on a CPU with AMX tiles): each
    # (block, head) plane holds the keys in tiles of 16 tokens, each tile D/2 rows of 16
    # (token, 2 dims) pairs, then the values in tiles of 16 dims, each tile B/2 rows of 16
    # (dim, 2 tokens) pairs (shown by its cpu_attn_reshape_and_cache: the layout proof).
    # Neither is a [B, D] strided view: the views split B and D, in that order.
    planes = t.view(t.shape[0], h, 2, b * d)
    keys = planes[:, :, 0].view(t.shape[0], h, b // 16, d // 2, 16, 2).permute(0, 1, 2, 4, 3, 5)
    values = planes[:, :, 1].view(t.shape[0], h, d // 16, b // 2, 16, 2)
    return keys, values.permute(0, 1, 3, 5, 2, 4)


def _token_kv(t: Any, h: int, b: int, d: int) -> tuple[Any, Any]:
    # Each token's content is its key's D values, then its value's D values (the GPU
    # backends: ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``).
    kv = t.unflatten(3, (2, d))
    return kv[:, :, :, 0], kv[:, :, :, 1]


BLOCK_KV = Layout("per block and head: B keys, then B values", _block_kv)
CPU_VEC = Layout("per block and head: keys as D rows of B tokens, then B values", _cpu_vec)
CPU_AMX = Layout(
    "per block and head: keys in 16-token tiles of dim pairs, values in 16-dim tiles of "
    "token pairs",
    _cpu_amx,
)
TOKEN_KV = Layout("per token: its key, then its value", _token_kv)
# The layouts the connector reads, by attention backend (vLLM's CPU backend: by the
# kernels' ISA, ``<backend>/<isa>``). Each is proven at registration by the backend's own
# cache-write op (``_vllm_proof``); any other backend or ISA is refused by name.
BACKEND_LAYOUTS: dict[str, Layout] = {
    "CPU_ATTN/vec": CPU_VEC,
    "CPU_ATTN/amx": CPU_AMX,
    "FLASH_ATTN": TOKEN_KV,
    "TRITON_ATTN": TOKEN_KV,
    "FLASHINFER": TOKEN_KV,
}
KNOWN_BACKENDS = tuple(BACKEND_LAYOUTS)


class UnsupportedLayoutError(CacheLayoutError):
    """vLLM's KV cache is laid out in a way the connector cannot show it reads and fills
    exactly (another attention backend, a quantized kv_cache_dtype, MLA, sliding windows,
    hybrid groups, parallel shards): the connector stays off and vLLM computes every token."""


def check_config(vllm_config: Any, kv_cache_config: Any) -> Geometry:
    """The block geometry of an engine whose KV cache layout the connector understands.

    Raises:
        UnsupportedLayoutError: naming the first reason it does not.
    """
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    if cache.cache_dtype not in ("auto", *FP8_CACHE_DTYPES):
        raise UnsupportedLayoutError(
            f"kv_cache_dtype {cache.cache_dtype!r} is not read (only 'auto' and the E4M3 "
            f"caches {', '.join(FP8_CACHE_DTYPES)}, kept as v2 envelopes)"
        )
    if getattr(model, "use_mla", False):
        raise UnsupportedLayoutError("MLA (latent KV) caches are not read")
    if model.get_sliding_window() is not None:
        raise UnsupportedLayoutError(
            f"sliding-window attention (window {model.get_sliding_window()}) is not read"
        )
    if parallel.pipeline_parallel_size != 1:
        raise UnsupportedLayoutError(
            f"pipeline parallel stages (pp={parallel.pipeline_parallel_size}) are not read: "
            "each stage holds only its own layers"
        )
    tp = int(parallel.tensor_parallel_size)
    total_heads = int(model.get_total_num_kv_heads())
    if total_heads % tp:
        raise UnsupportedLayoutError(
            f"{total_heads} KV heads over tensor_parallel_size {tp}: heads replicated across "
            "ranks are not read (each rank must hold a distinct head range)"
        )
    groups = list(getattr(kv_cache_config, "kv_cache_groups", []) or [])
    if len(groups) != 1:
        raise UnsupportedLayoutError(
            f"{len(groups)} KV cache groups (hybrid models) are not read; one is"
        )
    spec = groups[0].kv_cache_spec
    if type(spec).__name__ != "FullAttentionSpec" or getattr(spec, "sliding_window", None):
        raise UnsupportedLayoutError(f"KV cache spec {type(spec).__name__} is not read")
    n_layers = len(groups[0].layer_names)
    expected = model.get_num_layers(parallel)
    if n_layers != expected:
        raise UnsupportedLayoutError(
            f"{n_layers} attention layers in the KV cache group, the model has {expected}"
        )
    if int(spec.num_kv_heads) * tp != total_heads:
        raise UnsupportedLayoutError(
            f"a rank's cache holds {spec.num_kv_heads} KV heads, the model has {total_heads} "
            f"over tensor_parallel_size {tp}"
        )
    return Geometry(int(spec.block_size), n_layers, total_heads, int(spec.head_size))


def head_range(geometry: Geometry, rank: int, world: int) -> tuple[int, int]:
    """The KV heads ``[start, stop)`` rank ``rank`` of ``world`` tensor-parallel ranks holds
    (vLLM splits them in order: ``[r*H/t, (r+1)*H/t)``)."""
    per = geometry.n_kv_heads // world
    return rank * per, (rank + 1) * per


def _layer_index(name: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return int(extract_layer_index(name))


class PagedCache:
    """The registered per-layer caches of one worker, in layer order, as
    ``[num_blocks, h, 2, B, D]`` views of the heads ``heads`` (``[start, stop)``: a
    tensor-parallel rank's share; all of them by default) of blocks of ``geometry``
    (the whole model's: what the target holds). Loads copy the rank's heads out of whole
    blocks; ``gather`` copies out the rank's heads only (the connector joins the ranks'
    parts before it saves)."""

    def __init__(
        self,
        kv_caches: Mapping[str, Any],
        geometry: Geometry,
        backends: Mapping[str, str],
        heads: tuple[int, int] | None = None,
        fp8_scales: Mapping[str, tuple[float, float]] | None = None,
    ) -> None:
        import torch

        names = sorted(kv_caches, key=_layer_index)
        if [_layer_index(n) for n in names] != list(range(geometry.n_layers)):
            raise UnsupportedLayoutError(
                f"layers {names} are not the model's {geometry.n_layers} layers in order"
            )
        self.heads = heads or (0, geometry.n_kv_heads)
        self._save_buffers = KeptBuffers(keep=1)  # ``encoded``'s
        self._gathers = KeptBuffers(keep=1)  # ``gather_kept``'s
        b, h, d = geometry.block_tokens, self.heads[1] - self.heads[0], geometry.head_dim
        keys, values, layouts = [], [], []
        for name in names:
            backend = backends.get(name, "?")
            layout = BACKEND_LAYOUTS.get(backend)
            if layout is None:
                raise UnsupportedLayoutError(
                    f"layer {name}: attention backend {backend} has a paged layout this "
                    f"connector does not read (known: {', '.join(BACKEND_LAYOUTS)})"
                )
            t = kv_caches[name]
            if t.dim() != 4 or tuple(t.shape[1:]) != (h, b, 2 * d):
                raise UnsupportedLayoutError(
                    f"layer {name}: {backend} cache of shape {tuple(t.shape)}, expected "
                    f"[num_blocks, {h}, {b}, {2 * d}]"
                )
            if fp8_scales is not None and t.dtype in (torch.uint8, torch.float8_e4m3fn):
                t = t.view(torch.uint8)  # E4M3 codes, copied as they are
            elif t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
                raise UnsupportedLayoutError(f"layer {name}: cache dtype {t.dtype} is not read")
            try:
                k, v = layout.view(t, h, b, d)
            except RuntimeError as exc:  # strides the layout cannot view
                raise UnsupportedLayoutError(
                    f"layer {name}: {backend} cache of strides {t.stride()} is not laid out "
                    f"{layout.name}: {exc}"
                ) from exc
            keys.append(k)
            values.append(v)
            layouts.append(layout)
        self.names = names
        self.layout_names = [x.name for x in layouts]
        self.geometry = geometry
        self.whole = self.heads == (0, geometry.n_kv_heads)
        self.keys, self.values = keys, values  # [num_blocks, h, B, D] each, or split
        # the compiled copy (``scatter_envelopes``) writes BLOCK_KV's contiguous planes,
        # and CPU_VEC's with each key run transposed on the way
        self._planes = len(set(layouts)) == 1 and layouts[0] in (BLOCK_KV, CPU_VEC)
        self._planes &= all(kv_caches[n].is_contiguous() for n in names)
        self._keys_transposed = layouts[0] is CPU_VEC
        self._caches = [kv_caches[n] for n in names]
        self.dtype = keys[0].dtype
        # an fp8 cache: its v2 slab scales, from the layers' k_scale and v_scale
        self.fp8 = (
            None if fp8_scales is None else slab_scales(geometry, [fp8_scales[n] for n in names])
        )
        self.device = keys[0].device
        # numpy views sharing the paged memory (CPU): the v1 load path writes through them
        cpu = self.device.type == "cpu"
        self._np_keys = [self._numpy(x) for x in keys] if cpu else []
        self._np_values = [self._numpy(x) for x in values] if cpu else []

    def _numpy(self, t: Any) -> np.ndarray:
        import torch

        if t.dtype == torch.bfloat16:
            return np.asarray(t.view(torch.int16).numpy()).view(ml_dtypes.bfloat16)
        return np.asarray(t.numpy())

    def _np_dtype(self) -> Any:
        import torch

        if self.dtype == torch.bfloat16:
            return np.dtype(ml_dtypes.bfloat16)
        return np.dtype(np.float16 if self.dtype == torch.float16 else np.float32)

    def gather(self, block_ids: Sequence[int], out: Any = None) -> Any:
        """A copy of this cache's heads of the full blocks ``block_ids``, a CPU tensor
        ``[n][L][2][h][B][D]`` (one gather per layer; into ``out``, such a tensor, when
        given): the engine may reuse the blocks as soon as this returns. ``as_numpy`` of
        it (whole heads) is what ``encode`` takes."""
        import torch

        g = self.geometry
        h = self.heads[1] - self.heads[0]
        ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        if out is None:
            out = torch.empty(
                (len(block_ids), g.n_layers, 2, h, g.block_tokens, g.head_dim), dtype=self.dtype
            )
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            split_block(out[:, i, 0], k).copy_(k.index_select(0, ids).cpu())
            split_block(out[:, i, 1], v).copy_(v.index_select(0, ids).cpu())
        return out

    def gather_kept(self, block_ids: Sequence[int]) -> tuple[Any, Callable[[], None]]:
        """``gather`` into a buffer this cache keeps (one, of at most 256 MiB, ``_buffers``:
        the page faults of a new 128 MiB tensor cost the engine's step more than the copy;
        a second save queued meanwhile takes new memory), and the function that gives the
        buffer back once nothing reads the blocks any more (called once)."""
        import torch

        g = self.geometry
        h = self.heads[1] - self.heads[0]
        shape = (len(block_ids), g.n_layers, 2, h, g.block_tokens, g.head_dim)
        nbytes = int(np.prod(shape)) * self.dtype.itemsize
        buf = self._gathers.take(nbytes)
        try:
            out = torch.from_numpy(buf[:nbytes]).view(self.dtype).view(shape)
            return self.gather(block_ids, out), functools.partial(self._gathers.give, buf)
        except BaseException:
            self._gathers.give(buf)
            raise

    def as_numpy(self, blocks: Any) -> np.ndarray:
        """A numpy view of gathered blocks (a CPU tensor of this cache's dtype)."""
        return self._numpy(blocks)

    def encode(
        self,
        blocks: Sequence[np.ndarray] | np.ndarray,
        hashes: Sequence[int],
        version: int,
        out: Any = None,
    ) -> Any:
        """One envelope of gathered blocks (``gather``'s, each ``[L][2][Hkv][B][D]``), hashed
        ``hashes``: one encode (an fp8 cache's: always v2, its codes as they are,
        ``_vllm_fp8``): a new ``bytes``, or with ``out`` (a writable buffer of at least
        the envelope's size; not for an fp8 cache) a view of ``out`` (``encode_into``)."""
        g = self.geometry
        if self.fp8 is not None:
            return encode_fp8(g, blocks, self.fp8, hashes)
        listed = [Block(int(h), g.block_tokens, blocks[i]) for i, h in enumerate(hashes)]
        if out is not None:
            return encode_into(out, g, listed, version)
        return encode(g, listed, version)

    @contextlib.contextmanager
    def encoded(
        self, blocks: Sequence[np.ndarray], hashes: Sequence[int], version: int
    ) -> Iterator[Any]:
        """``encode``, into a buffer this cache keeps for the next save (up to 256 MiB,
        ``_buffers``: its pages stay mapped, where a new ``bytes`` of 128 MiB takes 32,768
        page faults); the envelope is valid inside the block. One saver thread uses it;
        an fp8 cache's envelope is a new ``bytes``."""
        if self.fp8 is not None:
            yield self.encode(blocks, hashes, version)
            return
        buf = self._save_buffers.take(self.geometry.envelope_bytes(len(hashes), version))
        try:
            yield self.encode(blocks, hashes, version, buf)
        finally:
            self._save_buffers.give(buf)

    def scatter(self, views: Sequence[BlockView], block_ids: Sequence[int]) -> int:
        """Copy checked block views into the paged blocks ``block_ids`` (in order); returns
        the payload bytes read.

        v1 blocks: one copy per block and layer straight from the view into the paged
        block (converted to the cache's dtype on the way). v2 blocks are dequantized into a
        staging array first (``layers_from_views``), then scattered per layer.
        """
        g = self.geometry
        n = len(views)
        if n == 0:
            return 0
        for i, bv in enumerate(views):
            if bv.geometry != g or bv.n_tokens != g.block_tokens:
                raise UnsupportedLayoutError(
                    f"block {i} has geometry {bv.geometry.as_tuple()} and {bv.n_tokens} "
                    f"tokens, the engine's is {g.as_tuple()} (full blocks)"
                )
        if self.fp8 is not None:  # the codes as they are, only under the engine's scales
            self._copy_blocks(fp8_codes(views, self.fp8), block_ids)
        elif self.device.type == "cpu" and all(bv.version == 1 for bv in views):
            self._copy_blocks([bv.kv for bv in views], block_ids)
        else:
            self._scatter_staged(views, block_ids)
        return sum(len(bv.raw) for bv in views)

    def _copy_blocks(self, blocks: Sequence[np.ndarray], block_ids: Sequence[int]) -> None:
        """Copy whole blocks ``[L][2][Hkv][B][D]`` (this cache's heads of them) into the
        paged blocks ``block_ids``: through numpy views of a CPU cache, else per block."""
        import torch

        h0, h1 = self.heads
        for kv, block in zip(blocks, block_ids):
            src = kv[:, :, h0:h1]  # [L][2][h][B][D]
            if self._np_keys:
                for i, (k, v) in enumerate(zip(self._np_keys, self._np_values)):
                    k[block] = split_block(src[i, 0], k)
                    v[block] = split_block(src[i, 1], v)
                continue
            t = torch.from_numpy(np.ascontiguousarray(src)).to(self.device)
            for i, (k, v) in enumerate(zip(self.keys, self.values)):
                k[block].copy_(split_block(t[i, 0], k))
                v[block].copy_(split_block(t[i, 1], v))

    def scatter_envelopes(
        self, envelopes: Sequence[Any], block_ids: Sequence[int], *, joined: bool = False
    ) -> int | None:
        """Copy v1 envelopes of full blocks (every reader rule but the CRC already checked,
        geometry equal to the engine's) into the paged blocks ``block_ids``, each
        envelope's CRC checked in the same pass; returns how many leading blocks are in
        envelopes that matched their CRC and are in place (the blocks of the first that did
        not may be partly written: they and the ones after them are not loaded). Single-
        block envelopes (the store's), or ``joined``: envelopes of several blocks (a
        server's prefix). None when this cache cannot take them that way (not a CPU f16
        cache): ``scatter`` of checked views then.
        """
        import torch

        if (
            self.device.type != "cpu"
            or self.dtype != torch.float16
            or sys.byteorder != "little"
            or not self.whole  # a rank's heads: checked views, sliced (``scatter``)
            or not self._planes
        ):
            return None
        g = self.geometry
        run = g.block_tokens * g.head_dim * 2  # one (K or V, head) row block of f16
        return scatter_crc(
            envelopes,
            HEADER_SIZE + RECORD_SIZE,
            [self._numpy(c.view(c.shape[0], g.n_kv_heads, 2, -1)) for c in self._caches],
            block_ids,
            g.n_kv_heads,
            run,
            RECORD_SIZE if joined else None,
            g.block_tokens if self._keys_transposed else 0,
        )

    def _scatter_staged(self, views: Sequence[BlockView], block_ids: Sequence[int]) -> None:
        import torch

        g = self.geometry
        n = len(views)
        np_dtype = self._np_dtype()
        staging = np.empty(
            (g.n_layers, 2, g.n_kv_heads, n * g.block_tokens, g.head_dim), dtype=np_dtype
        )
        layers_from_views(views, np_dtype, out=staging)
        shaped = staging.reshape(g.n_layers, 2, g.n_kv_heads, n, g.block_tokens, g.head_dim)
        shaped = shaped[:, :, self.heads[0] : self.heads[1]]
        if np_dtype == np.dtype(ml_dtypes.bfloat16):
            src = torch.from_numpy(shaped.view(np.int16)).view(torch.bfloat16)
        else:
            src = torch.from_numpy(shaped)
        ids = torch.as_tensor(list(block_ids[:n]), dtype=torch.long, device=self.device)
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            k.index_copy_(0, ids, split_block(src[i, 0].permute(1, 0, 2, 3), k).to(self.device))
            v.index_copy_(0, ids, split_block(src[i, 1].permute(1, 0, 2, 3), v).to(self.device))
