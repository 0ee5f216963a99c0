"""vLLM's paged KV cache <-> tlkv blocks: the layout check at registration, one gather per
layer for the blocks saved; for the blocks loaded, stored v1 envelopes copied straight into
their paged blocks with each CRC checked in the same pass (compiled ``scatter_crc``, a CPU
f16 cache), else checked views copied per block and layer. ``PagedCache`` is the
``BlockSlots`` a target loads into.

The one paged layout read and written here is vLLM's CPU attention backend (``CPU_ATTN``):
each layer's cache is ``[num_blocks, Hkv, B, 2 * D]`` whose memory per (block, head) is the
block's ``B`` key rows then its ``B`` value rows (``cpu_attn.py`` views it as
``[num_blocks, Hkv, 2 * B, D]`` and chunks dim 2), i.e. a ``[num_blocks, Hkv, 2, B, D]``
view; a block of the envelope is ``[L][2][Hkv][B][D]``. Any other backend, a quantized
``kv_cache_dtype``, MLA, sliding windows, several KV cache groups or tensor/pipeline
parallelism is refused with ``UnsupportedLayoutError``. Every fact the connector relies on
is checked against what vLLM registered, or refused.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from ..codec.checksum import scatter_crc
from ..codec.envelope import Block, BlockView, encode
from ..codec.geometry import Geometry
from ..codec.layout import HEADER_SIZE, RECORD_SIZE
from ..errors import CacheLayoutError
from ..kvlayout import layers_from_views

__all__ = ["KNOWN_BACKENDS", "PagedCache", "UnsupportedLayoutError", "check_config"]

KNOWN_BACKENDS = ("CPU_ATTN",)  # paged layouts this module reads and writes


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
    if cache.cache_dtype != "auto":
        raise UnsupportedLayoutError(
            f"kv_cache_dtype {cache.cache_dtype!r} is a quantized cache (only 'auto' is read)"
        )
    if getattr(model, "use_mla", False):
        raise UnsupportedLayoutError("MLA (latent KV) caches are not read")
    if model.get_sliding_window() is not None:
        raise UnsupportedLayoutError(
            f"sliding-window attention (window {model.get_sliding_window()}) is not read"
        )
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise UnsupportedLayoutError(
            f"tensor/pipeline parallel shards (tp={parallel.tensor_parallel_size}, "
            f"pp={parallel.pipeline_parallel_size}) are not read"
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
    return Geometry(int(spec.block_size), n_layers, int(spec.num_kv_heads), int(spec.head_size))


def _layer_index(name: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return int(extract_layer_index(name))


class PagedCache:
    """The registered per-layer caches of one worker, in layer order, as
    ``[num_blocks, Hkv, 2, B, D]`` views."""

    def __init__(
        self, kv_caches: Mapping[str, Any], geometry: Geometry, backends: Mapping[str, str]
    ) -> None:
        import torch

        names = sorted(kv_caches, key=_layer_index)
        if [_layer_index(n) for n in names] != list(range(geometry.n_layers)):
            raise UnsupportedLayoutError(
                f"layers {names} are not the model's {geometry.n_layers} layers in order"
            )
        b, h, d = geometry.block_tokens, geometry.n_kv_heads, geometry.head_dim
        views = []
        for name in names:
            backend = backends.get(name, "?")
            if backend not in KNOWN_BACKENDS:
                raise UnsupportedLayoutError(
                    f"layer {name}: attention backend {backend} has a paged layout this "
                    f"connector does not read (known: {', '.join(KNOWN_BACKENDS)})"
                )
            t = kv_caches[name]
            if t.dim() != 4 or tuple(t.shape[1:]) != (h, b, 2 * d) or not t.is_contiguous():
                raise UnsupportedLayoutError(
                    f"layer {name}: {backend} cache of shape {tuple(t.shape)} (contiguous="
                    f"{t.is_contiguous()}), expected [num_blocks, {h}, {b}, {2 * d}]"
                )
            if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
                raise UnsupportedLayoutError(f"layer {name}: cache dtype {t.dtype} is not read")
            views.append(t.view(t.shape[0], h, 2, b, d))
        self.geometry = geometry
        self.layers = views
        self.dtype = views[0].dtype
        self.device = views[0].device
        # numpy views sharing the paged memory (CPU): the v1 load path writes through them
        self._np_layers = [self._numpy(v) for v in views] if self.device.type == "cpu" else []

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

    def gather(self, block_ids: Sequence[int]) -> np.ndarray:
        """A copy of the full blocks ``block_ids`` as ``[n][L][2][Hkv][B][D]`` (one gather
        per layer): the engine may reuse the blocks as soon as this returns."""
        import torch

        g = self.geometry
        ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        out = torch.empty(
            (len(block_ids), g.n_layers, 2, g.n_kv_heads, g.block_tokens, g.head_dim),
            dtype=self.dtype,
        )
        for i, layer in enumerate(self.layers):
            out[:, i] = layer.index_select(0, ids).transpose(1, 2).cpu()
        return self._numpy(out)

    def encode(self, blocks: np.ndarray, hashes: Sequence[int], version: int) -> bytes:
        """One envelope of gathered blocks (``gather``), hashed ``hashes``: one encode."""
        g = self.geometry
        return encode(
            g, [Block(int(h), g.block_tokens, blocks[i]) for i, h in enumerate(hashes)], version
        )

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
        if self.device.type == "cpu" and all(bv.version == 1 for bv in views):
            dst = self._np_layers
            for bv, block in zip(views, block_ids):
                src = bv.kv.transpose(0, 2, 1, 3, 4)  # [L][Hkv][2][B][D]
                for i, layer in enumerate(dst):
                    layer[block] = src[i]
        else:
            self._scatter_staged(views, block_ids)
        return sum(len(bv.raw) for bv in views)

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

        if self.device.type != "cpu" or self.dtype != torch.float16 or sys.byteorder != "little":
            return None
        g = self.geometry
        run = g.block_tokens * g.head_dim * 2  # one (K or V, head) row block of f16
        return scatter_crc(
            envelopes,
            HEADER_SIZE + RECORD_SIZE,
            self._np_layers,
            block_ids,
            g.n_kv_heads,
            run,
            RECORD_SIZE if joined else None,
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
        if np_dtype == np.dtype(ml_dtypes.bfloat16):
            src = torch.from_numpy(shaped.view(np.int16)).view(torch.bfloat16)
        else:
            src = torch.from_numpy(shaped)
        ids = torch.as_tensor(list(block_ids[:n]), dtype=torch.long, device=self.device)
        for i, layer in enumerate(self.layers):
            layer.index_copy_(0, ids, src[i].permute(2, 1, 0, 3, 4).to(self.device))
