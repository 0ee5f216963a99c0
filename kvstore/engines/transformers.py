"""Hugging Face transformers <-> tlkv: a model's KV cache saved and loaded in one call each.

``save_prefix(target, input_ids, cache)`` stores every full block of the prompt that the
target lacks; ``load_prefix(source, input_ids)`` returns the longest stored prefix as a
``DynamicCache`` ready for ``model(input_ids[:, n:], past_key_values=cache)`` (``cache=``
from transformers 5.24 on) or ``model.generate``. torch and transformers are imported on the
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
  the stored one (f16 for v1, f32 for dequantized v2). One sequence per call: ``row=``
  saves one row of a batched cache.
- Never wrong KV (``hfcache``): every layer's positions are read from the cache's own
  attributes. A sliding-window layer that has dropped the prompt's first positions is
  refused on save, and a prefix longer than a layer of the cache to fill keeps is refused
  on load (``SlidingWindowError``, before anything is stored or built); quantized,
  offloaded, encoder-decoder and MLA caches are refused by name (``CacheLayoutError``).
- ``load_prefix(..., cache=StaticCache(...))`` fills the engine's preallocated buffers in
  place; without ``cache=`` a new ``DynamicCache`` is built (with the model's layer kinds
  when ``config=`` is given).
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np

from ..codec.envelope import encode
from ..codec.geometry import Geometry
from ..codec.hashing import chain_hashes
from ..codec.tokens import chain_tokens
from ..errors import CacheLayoutError, ShapeError
from ..kvlayout import blocks_from_layers, fill_layers, layers_from_views
from .hfcache import (
    check_fits,
    fill_cache,
    held_layers,
    refuse_cache,
    set_length,
    static_buffers,
    window_error,
)
from .targets import Target, as_target

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


def _token_row(input_ids: Any, row: int | None = None) -> np.ndarray:
    """Token ids of one sequence of ``input_ids`` (``[1, T]`` or ``[T]``; row ``row`` of
    ``[batch, T]``)."""
    if hasattr(input_ids, "detach"):
        input_ids = input_ids.detach().cpu()
    ids = np.asarray(input_ids)
    if ids.ndim == 2:
        if row is not None and ids.shape[0] != 1:
            if not 0 <= row < ids.shape[0]:
                raise CacheLayoutError(f"row={row} is outside input_ids' batch of {ids.shape[0]}")
            return np.asarray(ids[row])
        if ids.shape[0] != 1:
            raise CacheLayoutError(
                f"batch size must be 1 (one sequence per call), found input_ids of shape "
                f"{tuple(ids.shape)}; pass row=i to save one row of a batch"
            )
        ids = ids[0]
    if ids.ndim != 1:
        raise ValueError(f"input_ids must be [1, T] or [T], found shape {tuple(ids.shape)}")
    return ids


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


def _the_cache(past_key_values: Any, cache: Any) -> Any:
    """The one cache given, as ``cache=`` (transformers' name from 5.24) or ``past_key_values``."""
    if cache is not None and past_key_values is not None:
        raise TypeError("give the cache once: as cache= or past_key_values, not both")
    found = cache if cache is not None else past_key_values
    if found is None:
        raise TypeError("save_prefix needs the model's cache: out.past_key_values (out.cache)")
    return found


def save_prefix(
    target: Any,
    input_ids: Any,
    past_key_values: Any = None,
    *,
    cache: Any = None,
    row: int | None = None,
    version: int = 1,
    config: Any = None,
    block_tokens: int | None = None,
) -> int:
    """Store every full block of the prompt's KV that ``target`` lacks.

    Args:
        target: a ``Store``, a ``kvstore.client.Client``, a ``TransferClient`` or a
            ``Target`` (``kvstore.engines.targets``).
        input_ids: the prompt, ``[1, T]`` or ``[T]`` (tensor, array or list); with
            ``row``, ``[batch, T]`` too.
        past_key_values, cache: the model's cache after running it on the prompt, given
            either way (``out.past_key_values`` on every transformers the ``hf`` extra
            admits; ``cache=out.cache`` from 5.24 on): a ``DynamicCache``, a
            ``StaticCache`` or the legacy tuple of ``(key, value)`` per layer. It may
            hold fewer positions than ``input_ids`` (after ``generate``, the last token
            has none): the positions it holds are saved.
        row: the batch row to save, for a batched cache (one unpadded sequence per row:
            a left-padded row's KV sits at shifted positions).
        version: 1 (f16: exact for f16 models, and for bf16 ones above f16's normal
            range) or 2 (FP8 E4M3 with per-slab scales).
        config: the model or its config: checks the cache and the target against it.
        block_tokens: ``B`` for a target without geometry yet (default 16).

    Returns:
        The number of blocks newly stored (0 when all were there: nothing is encoded
        or sent). Their token ids go with them (the target checks each block's name
        against them and keeps them: KV events announce them, ``docs/events.md``).

    Raises:
        SlidingWindowError: a sliding-window layer no longer holds the prompt's first
            positions (nothing is stored).  CacheLayoutError: a cache the bridge refuses
            (quantized, offloaded, encoder-decoder, MLA, a batch without ``row``).
        ShapeError: the cache, the model and the target disagree on the geometry.
        TypeError: unknown target, or no cache.
    """
    _torch()
    the_cache = _the_cache(past_key_values, cache)
    tgt = as_target(target)
    ids = _token_row(input_ids, row)
    layers = held_layers(the_cache, row, _config_of(config) if config is not None else None)
    ends = {layer.end for layer in layers}
    if len(ends) != 1:
        raise CacheLayoutError(
            f"the cache's layers hold different numbers of positions ({sorted(ends)}): refused"
        )
    n_heads, _, head_dim = (int(x) for x in layers[0].keys.shape)
    b = block_tokens or DEFAULT_BLOCK_TOKENS
    model = Geometry(b, len(layers), n_heads, head_dim)
    if config is not None:
        expected = model_geometry(config, b)
        if expected != model:
            raise ShapeError(
                f"the cache has L={model.n_layers}, Hkv={model.n_kv_heads}, "
                f"D={model.head_dim}; the model's config says L={expected.n_layers}, "
                f"Hkv={expected.n_kv_heads}, D={expected.head_dim}"
            )
    stored = tgt.geometry()
    if stored is not None and block_tokens is not None and stored.block_tokens != block_tokens:
        raise ShapeError(
            f"the target holds block_tokens {stored.block_tokens}, asked for {block_tokens}"
        )
    g = _check_geometry(stored, model)
    ids = ids[: min(len(ids), ends.pop())]
    hashes = chain_hashes(ids, g.block_tokens)
    if not hashes:
        return 0
    for layer in layers:
        if layer.start > 0:  # checked before anything is asked of the target
            raise window_error(layer, len(hashes) * g.block_tokens, g.block_tokens)
    present = tgt.has(hashes)
    if all(present):
        return 0
    cpu_keys = [layer.keys.detach().cpu() for layer in layers]  # no copy for CPU tensors
    cpu_values = [layer.values.detach().cpu() for layer in layers]
    blocks = blocks_from_layers(cpu_keys, cpu_values, ids, g, tail=False)
    missing = [blk for blk, here in zip(blocks, present) if not here]
    envelope = encode(g, missing, version)
    if not _takes_tokens(tgt.put):  # a target written before token ids
        return tgt.put(envelope)
    # Their token ids go with them (the target checks each block's name against them).
    tokens = chain_tokens(ids[: len(hashes) * g.block_tokens], hashes, g.block_tokens)
    rows = np.logical_not(np.asarray(present, dtype=bool))
    return tgt.put(envelope, tokens=tokens.take(rows))


def _takes_tokens(put: Any) -> bool:
    """Whether a target's ``put`` takes ``tokens=`` (a ``Target`` subclass
    written before token ids takes the envelope alone)."""
    try:
        params = inspect.signature(put).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "tokens" or p.kind is p.VAR_KEYWORD for p in params)


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


def _empty_cache(config: Any) -> Any:
    """A new ``DynamicCache``: with the model's layer kinds (sliding windows) when
    ``config`` is given."""
    from transformers import DynamicCache

    return DynamicCache(config=_config_of(config)) if config is not None else DynamicCache()


def _fetch_geometry(src: Target, config: Any, block_tokens: int | None) -> Geometry | None:
    """The geometry to hash the prompt with: the source's, or for a source that cannot
    tell it (tl.kv.v1) None, which makes ``load_prefix`` fetch by tokens."""
    g = src.geometry()
    if g is not None or src.knows_geometry:
        return g
    if block_tokens is not None:
        if config is None:
            raise ValueError("block_tokens= needs config= (the model's L, Hkv and D)")
        return model_geometry(config, block_tokens)
    return None


def load_prefix(
    source: Any,
    input_ids: Any,
    *,
    cache: Any = None,
    dtype: Any = None,
    device: Any = "cpu",
    config: Any = None,
    block_tokens: int | None = None,
) -> tuple[int, Any]:
    """The longest stored prefix of the prompt as a transformers cache.

    Args:
        source: a ``Store`` (reading through its tier), a ``kvstore.client.Client``, a
            ``TransferClient`` or a ``Target`` (``kvstore.engines.targets``).
        input_ids: the prompt, ``[1, T]`` or ``[T]``.
        cache: an empty cache of the engine's to fill instead of a new ``DynamicCache``:
            a ``StaticCache`` (its preallocated buffers are filled in place, allocated by
            transformers first if still lazy) or a ``DynamicCache``; returned filled.
        dtype: torch dtype of the cache; default the static cache's, else the model's
            (``config=model``), else f16 for v1 blocks and f32 for dequantized v2 blocks.
        device: where the cache's tensors go.
        config: the model or its config: the source's geometry is checked against it,
            and the new cache has the model's layer kinds (sliding windows: pass it for a
            sliding-window model).
        block_tokens: B, to hash the prompt with on a source that cannot tell its
            geometry (a tl.kv.v1 ``TransferClient``) with ``config``. Without it such a
            source is asked by tokens and hashes them with its own geometry.

    Returns:
        ``(n_tokens, cache)``: ``n_tokens`` is a multiple of the source's block_tokens
        and below ``len(input_ids)``; run the model on ``input_ids[:, n_tokens:]`` with
        ``cache``. ``(0, None)`` when nothing is stored (``(0, cache)`` with ``cache=``,
        left empty).

    Raises:
        SlidingWindowError: the stored prefix is longer than a sliding-window layer of
            the cache keeps (nothing is loaded).  CacheLayoutError: ``cache`` is not
            empty or of a refused kind, or a batch.  ShapeError: the source holds blocks
            of a geometry other than the model's.
    """
    torch = _torch()
    src = as_target(source)
    ids = _token_row(input_ids)
    if cache is not None:
        refuse_cache(cache)
        if cache.get_seq_length() != 0:
            raise CacheLayoutError(
                f"cache= must be empty, it holds {cache.get_seq_length()} positions"
            )
    if config is not None:
        refuse_cache(None, _config_of(config))
    g = _fetch_geometry(src, config, block_tokens)
    if g is None and src.knows_geometry:
        return 0, cache
    if g is not None and config is not None:
        _check_geometry(g, model_geometry(config, g.block_tokens))
    if dtype is None and config is not None and hasattr(config, "config"):
        dtype = getattr(config, "dtype", None)
    target = cache if cache is not None else _empty_cache(config)
    prompt = ids[: max(len(ids) - 1, 0)]
    if g is not None:
        hashes = chain_hashes(prompt, g.block_tokens)
        views_cm = src.views(hashes) if hashes else None
    else:  # a source that cannot tell its geometry hashes the tokens itself, or refuses
        views_cm = src.views_for_tokens(prompt.tolist()) if len(prompt) else None
    if views_cm is None:
        return 0, cache
    with views_cm as views:
        if not views:
            return 0, cache
        n_tokens = sum(bv.n_tokens for bv in views)
        vg = views[0].geometry
        if config is not None:
            _check_geometry(vg, model_geometry(config, vg.block_tokens))
        check_fits(target, n_tokens)
        static = static_buffers(
            torch, target, vg.n_kv_heads, vg.head_dim, dtype or _stored_dtype(torch, views), device
        )
        if static is not None:
            fill_layers(views, *static)
            set_length(target, n_tokens)
            return n_tokens, target
        if dtype is None and cache is not None and getattr(cache, "layers", None):
            held = getattr(cache.layers[0], "keys", None)  # a static cache's own buffers
            dtype = held.dtype if held is not None and held.numel() else None
        keys, values = layers_from_views(views, _numpy_dtype(torch, dtype))
    tk = [_to_torch(torch, k, dtype, device) for k in keys]
    tv = [_to_torch(torch, v, dtype, device) for v in values]
    fill_cache(target, tk, tv)
    return n_tokens, target


def _stored_dtype(torch: Any, views: Any) -> Any:
    """f16 when every view is v1, else f32 (what v2 dequantizes to)."""
    return torch.float16 if all(bv.version == 1 for bv in views) else torch.float32
