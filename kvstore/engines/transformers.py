"""Hugging Face transformers <-> tlkv: a model's KV cache saved and loaded in one call each.

``save_prefix(target, input_ids, cache)`` stores every full block of the prompt that the
target lacks; ``load_prefix(source, input_ids)`` returns the longest stored prefix as a
``DynamicCache`` ready for ``model(input_ids[:, n:], past_key_values=cache)`` (``cache=``
from transformers 5 on) or ``model.generate``. torch and transformers are imported on the
first call (``pip install 'tlkv[hf]'``), never by ``import kvstore``.

Choices where an engine has several reasonable answers:

- Geometry: ``L``, ``Hkv`` and ``D`` come from the model's config (``num_hidden_layers``,
  ``num_key_value_heads``, ``head_dim``) when ``config=`` is given, else from the cache's
  tensors; ``B`` from the target (its geometry once it has one), else ``block_tokens``
  (default 16). A target holding another geometry is refused with ``ShapeError``: a store
  holds one geometry, and a hash names tokens, not the model that computed them.
- Only full blocks are stored (the partial tail is never hashed, per the spec), and only
  those the target lacks are encoded and sent.
- ``load_prefix`` leaves at least one prompt token to compute: a prompt wholly in the
  store loads ``len - 1`` tokens rounded down to a block, as vLLM does, so the model
  still produces the next-token logits.
- dtype: the cache is returned in ``dtype``, else the model's (``config=model``), else
  the stored one (f16 for v1, f32 for dequantized v2). Batch size 1 only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..codec.envelope import encode
from ..codec.geometry import Geometry
from ..codec.hashing import chain_hashes
from ..errors import ShapeError
from ..kvlayout import blocks_from_layers, layers_from_views
from . import as_target

__all__ = ["DEFAULT_BLOCK_TOKENS", "load_prefix", "model_geometry", "save_prefix"]

DEFAULT_BLOCK_TOKENS = 16  # the spec's engine value, used when the target has no geometry


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "kvstore.engines.transformers needs torch and transformers: pip install 'tlkv[hf]'"
        ) from exc
    return torch


def _config_of(config: Any) -> Any:
    """A model's config (``config=model``) or the config itself; its text part if any."""
    cfg = getattr(config, "config", config)
    text = getattr(cfg, "get_text_config", None)
    return text(decoder=True) if callable(text) else cfg


def model_geometry(config: Any, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> Geometry:
    """Geometry of a model from its config (or the model): ``num_hidden_layers``,
    ``num_key_value_heads`` (default ``num_attention_heads``) and ``head_dim`` (default
    ``hidden_size // num_attention_heads``)."""
    cfg = _config_of(config)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return Geometry(block_tokens, int(cfg.num_hidden_layers), int(kv_heads), int(head_dim))


def _one_sequence(input_ids: Any) -> np.ndarray:
    """Token ids of the one sequence in ``input_ids`` (``[1, T]`` or ``[T]``)."""
    if hasattr(input_ids, "detach"):
        input_ids = input_ids.detach().cpu()
    ids = np.asarray(input_ids)
    if ids.ndim == 2:
        if ids.shape[0] != 1:
            raise ValueError(
                f"batch size must be 1 (one sequence per call), found input_ids of shape "
                f"{tuple(ids.shape)}"
            )
        ids = ids[0]
    if ids.ndim != 1:
        raise ValueError(f"input_ids must be [1, T] or [T], found shape {tuple(ids.shape)}")
    return ids


def _cache_layers(cache: Any) -> tuple[list[Any], list[Any]]:
    """Per-layer key and value tensors ``[batch, Hkv, T, D]`` of a transformers cache
    (``Cache.layers`` from 4.54 on, ``key_cache``/``value_cache`` before) or of the
    legacy tuple of ``(key, value)`` pairs."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        keys, values = [layer.keys for layer in layers], [layer.values for layer in layers]
    elif hasattr(cache, "key_cache"):
        keys, values = list(cache.key_cache), list(cache.value_cache)
    else:
        keys, values = [kv[0] for kv in cache], [kv[1] for kv in cache]
    if not keys or any(k is None for k in keys):
        raise ValueError("the cache holds no keys and values (run the model on the prompt)")
    for i, k in enumerate(keys):
        if k.ndim != 4 or k.shape[0] != 1:
            raise ValueError(
                f"batch size must be 1 (one sequence per call), found layer {i} keys of "
                f"shape {tuple(k.shape)}"
            )
    return keys, values


def _check_geometry(stored: Geometry | None, model: Geometry) -> Geometry:
    """The target's geometry when it matches the model's (its ``B`` wins), else the model's."""
    if stored is None:
        return model
    if stored.as_tuple()[1:] != model.as_tuple()[1:]:
        raise ShapeError(
            f"the target holds geometry (B, L, Hkv, D) = {stored.as_tuple()}, the model has "
            f"L={model.n_layers}, Hkv={model.n_kv_heads}, D={model.head_dim} "
            f"({model.as_tuple()} with block_tokens {model.block_tokens})"
        )
    return stored


def save_prefix(
    target: Any,
    input_ids: Any,
    past_key_values: Any,
    *,
    version: int = 1,
    config: Any = None,
    block_tokens: int | None = None,
) -> int:
    """Store every full block of the prompt's KV that ``target`` lacks.

    Args:
        target: a ``Store``, a ``kvstore.client.Client`` or a ``BlockTarget``.
        input_ids: the prompt, ``[1, T]`` or ``[T]`` (tensor, array or list).
        past_key_values: the model's cache after running it on the prompt (a
            ``DynamicCache`` or the legacy tuple of ``(key, value)`` per layer); it may
            hold fewer positions than ``input_ids`` (after ``generate``, the last token
            has none): the positions it holds are saved.
        version: 1 (f16: exact for f16 models, and for bf16 ones above f16's normal
            range) or 2 (FP8 E4M3 with per-slab scales).
        config: the model or its config: checks the cache and the target against it.
        block_tokens: ``B`` for a target without geometry yet (default 16).

    Returns:
        The number of blocks newly stored (0 when all were there: nothing is encoded
        or sent).

    Raises:
        ValueError: batch size is not 1.  ShapeError: the cache, the model and the
        target disagree on the geometry.  TypeError: unknown target.
    """
    _torch()
    tgt = as_target(target)
    ids = _one_sequence(input_ids)
    keys, values = _cache_layers(past_key_values)
    _, n_heads, held, head_dim = keys[0].shape
    b = block_tokens or DEFAULT_BLOCK_TOKENS
    model = Geometry(b, len(keys), int(n_heads), int(head_dim))
    if config is not None:
        expected = model_geometry(config, b)
        if expected != model:
            raise ShapeError(
                f"the cache has L={model.n_layers}, Hkv={model.n_kv_heads}, "
                f"D={model.head_dim}; the model's config says L={expected.n_layers}, "
                f"Hkv={expected.n_kv_heads}, D={expected.head_dim}"
            )
    stored = tgt.block_geometry()
    if stored is not None and block_tokens is not None and stored.block_tokens != block_tokens:
        raise ShapeError(
            f"the target holds block_tokens {stored.block_tokens}, asked for {block_tokens}"
        )
    g = _check_geometry(stored, model)
    ids = ids[: min(len(ids), int(held))]
    hashes = chain_hashes(ids, g.block_tokens)
    if not hashes:
        return 0
    present = tgt.has_blocks(hashes)
    if all(present):
        return 0
    cpu_keys = [k.detach().cpu() for k in keys]  # no copy for CPU tensors
    cpu_values = [v.detach().cpu() for v in values]
    blocks = blocks_from_layers(cpu_keys, cpu_values, ids, g, tail=False)
    missing = [blk for blk, here in zip(blocks, present) if not here]
    return tgt.put_envelope(encode(g, missing, version))


def _to_torch(torch: Any, arr: np.ndarray, dtype: Any, device: Any) -> Any:
    """A numpy ``[Hkv, T, D]`` array as a ``[1, Hkv, T, D]`` tensor (no copy on the CPU)."""
    if arr.dtype.itemsize == 2 and arr.dtype.name == "bfloat16":
        t = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(arr)
    return t.unsqueeze(0).to(device=device, dtype=dtype)


def _numpy_dtype(torch: Any, dtype: Any) -> Any:
    if dtype is None:
        return None
    if dtype == torch.bfloat16:
        import ml_dtypes

        return ml_dtypes.bfloat16
    return torch.empty(0, dtype=dtype).numpy().dtype


def _make_cache(keys: list[Any], values: list[Any], config: Any) -> Any:
    """A ``DynamicCache`` holding the tensors themselves, not a copy.

    ``DynamicCache.update`` concatenates onto an empty tensor (a copy); a plain
    ``DynamicLayer`` is given the tensors after its public initialization instead. Other
    layer kinds (sliding windows, from a config) go through ``update``.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer  # 4.54 and later

    cache = DynamicCache(config=_config_of(config)) if config is not None else DynamicCache()
    for i, (k, v) in enumerate(zip(keys, values)):
        layers = getattr(cache, "layers", None)
        if layers is not None and i < len(layers) and type(layers[i]) is DynamicLayer:
            layers[i].update(k[..., :0, :], v[..., :0, :])  # initializes dtype and device
            layers[i].keys, layers[i].values = k, v
        else:
            cache.update(k, v, i)
    return cache


def load_prefix(
    source: Any,
    input_ids: Any,
    *,
    dtype: Any = None,
    device: Any = "cpu",
    config: Any = None,
    block_tokens: int | None = None,
) -> tuple[int, Any]:
    """The longest stored prefix of the prompt as a transformers cache.

    Args:
        source: a ``Store``, a ``kvstore.client.Client`` or a ``BlockTarget``.
        input_ids: the prompt, ``[1, T]`` or ``[T]``.
        dtype: torch dtype of the cache; default the model's (``config=model``), else
            f16 for v1 blocks and f32 for dequantized v2 blocks.
        device: where the cache's tensors go.
        config: the model or its config: the source's geometry is checked against it.
        block_tokens: B, for a source that cannot tell its geometry (a tl.kv.v1
            ``TransferClient``: the protocol carries none), which is then read with the
            model's (``config`` required; default 16).

    Returns:
        ``(n_tokens, cache)``: ``n_tokens`` is a multiple of the source's block_tokens
        and below ``len(input_ids)``; run the model on ``input_ids[:, n_tokens:]`` with
        ``cache``. ``(0, None)`` when nothing is stored.

    Raises:
        ValueError: batch size is not 1.  ShapeError: the source holds blocks of a
        geometry other than the model's.
    """
    torch = _torch()
    src = as_target(source)
    ids = _one_sequence(input_ids)
    g = src.block_geometry()
    if g is None and config is not None and not getattr(src, "knows_geometry", True):
        g = model_geometry(config, block_tokens or DEFAULT_BLOCK_TOKENS)
    if g is None:
        return 0, None
    if config is not None:
        _check_geometry(g, model_geometry(config, g.block_tokens))
        if dtype is None:
            dtype = getattr(config, "dtype", None) if hasattr(config, "config") else None
    hashes = chain_hashes(ids[: max(len(ids) - 1, 0)], g.block_tokens)
    if not hashes:
        return 0, None
    with src.prefix_views(hashes) as views:
        if not views:
            return 0, None
        n_tokens = sum(bv.n_tokens for bv in views)
        keys, values = layers_from_views(views, _numpy_dtype(torch, dtype))
    tk = [_to_torch(torch, k, dtype, device) for k in keys]
    tv = [_to_torch(torch, v, dtype, device) for v in values]
    return n_tokens, _make_cache(tk, tv, config)
