"""What the transformers bridge knows of a transformers ``Cache``: which token positions
each layer holds, which layouts it refuses, and how an empty cache is filled.

The bridge reads and fills only layer kinds whose every attribute it understands, checked
by exact class (a subclass may keep its positions differently):

- ``DynamicLayer``: positions ``0..T-1`` in ``keys[:, :, :T]``.
- ``DynamicSlidingWindowLayer``: the last ``keys.shape[-2]`` of ``cumulative_length``
  positions (at most ``sliding_window - 1`` once the window is full, all of them while
  it records its past).
- ``StaticLayer``: positions ``0..cumulative_length-1`` of a preallocated buffer.
- ``StaticSlidingWindowLayer``: the last ``min(cumulative_length_int, max_cache_len)``
  positions of a buffer of ``max_cache_len = min(sliding_window, max_cache_len)``.

Everything else is refused by name: quantized layers and caches, offloaded caches,
encoder-decoder caches (cross-attention KV is not a prompt's), MLA caches (keys and values
of different head dims, or a config with ``kv_lora_rank``), linear-attention (recurrent
state) layers, KV-sharing placeholders (``DummyLayer``), indexed (DSA) layers, and any
class it does not know. A sliding-window layer that no longer holds position 0 cannot give
a prefix's blocks: ``SlidingWindowError`` names the layer and its window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from ..errors import CacheLayoutError, SlidingWindowError

__all__ = [
    "HeldLayer",
    "check_fits",
    "fill_cache",
    "held_layers",
    "refuse_cache",
    "set_length",
    "static_buffers",
    "window_error",
]


@dataclass(frozen=True)
class HeldLayer:
    """One layer of a cache as the bridge reads it: ``keys``/``values`` ``[Hkv, T, D]``
    (one batch row, views) hold positions ``start`` to ``end - 1``."""

    index: int
    keys: Any
    values: Any
    start: int
    end: int
    window: int | None  # the sliding window, None for full attention
    keeps: int | None  # the most positions the layer keeps (None: it grows)


def _classes() -> dict[str, type]:
    from transformers import cache_utils

    names = ("DynamicLayer", "DynamicSlidingWindowLayer", "StaticLayer", "StaticSlidingWindowLayer")
    return {n: getattr(cache_utils, n) for n in names if hasattr(cache_utils, n)}


def _is(layer: Any, classes: dict[str, type], name: str) -> bool:
    """Whether ``layer`` is exactly transformers' class ``name`` (not a subclass)."""
    return type(layer) is classes.get(name)


def _int(layer: Any, name: str, index: int) -> int:
    """An int attribute the bridge relies on; a layer without it (another transformers
    version) is refused rather than guessed."""
    value = getattr(layer, name, None)
    if value is None:
        raise CacheLayoutError(
            f"layer {index} ({type(layer).__name__}) has no {name}: a version of this layer "
            f"kind the bridge does not know"
        )
    return int(value)


def _refused_layer(layer: Any) -> str | None:
    """Why a layer's kind is refused, or None when the bridge knows it."""
    mro = {c.__name__ for c in type(layer).__mro__}
    name = type(layer).__name__
    if "Quantized" in name or "BaseQuantizedLayer" in mro:
        return f"a quantized cache layer ({name}): its KV is not held as plain tensors"
    if "LinearAttentionCacheLayerMixin" in mro:
        return f"a linear-attention layer ({name}): it holds a recurrent state, not per-token KV"
    if name == "DummyLayer":
        return f"a KV-sharing placeholder ({name}): its KV is another layer's"
    if "Indexed" in name:
        return f"an indexed-attention (DSA) layer ({name}): its indexer keys are not stored"
    if type(layer) not in _classes().values():
        return f"a cache layer of kind {name}, whose layout this bridge does not know"
    return None


def refuse_cache(cache: Any, config: Any = None) -> None:
    """Raise ``CacheLayoutError`` for a cache kind the bridge refuses as a whole."""
    name = type(cache).__name__
    if hasattr(cache, "self_attention_cache") or hasattr(cache, "cross_attention_cache"):
        raise CacheLayoutError(
            f"an encoder-decoder cache ({name}) is refused: its cross-attention KV belongs "
            f"to the encoder's input, not to the prompt's tokens"
        )
    if "Quantized" in name:
        raise CacheLayoutError(
            f"a quantized cache ({name}) is refused: its KV is not held as plain tensors"
        )
    if getattr(cache, "offloading", False):
        raise CacheLayoutError(
            f"an offloaded cache ({name} with offloading=True) is refused: its layers move "
            f"between devices on a side stream; use a cache without offloading"
        )
    rank = getattr(config, "kv_lora_rank", None) if config is not None else None
    if rank:
        raise CacheLayoutError(
            f"an MLA (multi-head latent attention) model (kv_lora_rank={rank}) is refused: "
            f"its cache is not one K and one V of one head dim per layer"
        )


def _row(t: Any, index: int, what: str, row: int | None) -> Any:
    """``[Hkv, T, D]`` of one batch row of a layer's ``[batch, Hkv, T, D]`` tensor."""
    if t.ndim != 4:
        raise CacheLayoutError(
            f"layer {index} {what}: expected [batch, Hkv, T, D], found shape {tuple(t.shape)}"
        )
    batch = int(t.shape[0])
    if row is None:
        if batch != 1:
            raise CacheLayoutError(
                f"batch size must be 1 (one sequence per call), found layer {index} {what} "
                f"of shape {tuple(t.shape)}; pass row=i to save one row of a batch"
            )
        return t[0]
    if not 0 <= row < batch:
        raise CacheLayoutError(f"row={row} is outside the cache's batch of {batch}")
    return t[row]


def held_layers(cache: Any, row: int | None = None, config: Any = None) -> list[HeldLayer]:
    """Every layer of ``cache`` with the positions it holds (the legacy tuple of
    ``(key, value)`` pairs included).

    Raises:
        CacheLayoutError: a refused cache or layer kind, no KV yet, keys and values of
            different shapes (MLA), or a batch without ``row``.
    """
    refuse_cache(cache, config)
    layers = getattr(cache, "layers", None)
    cls = _classes()
    out: list[HeldLayer] = []
    raw: list[tuple[Any, Any, int, int | None, int | None, int | None]] = []
    if layers is None:  # the legacy tuple of (key, value) per layer
        for i, item in enumerate(cache):
            if len(item) > 2 and item[2] is not None:  # DynamicCache's (k, v, sliding_window)
                raise CacheLayoutError(
                    f"layer {i} of the tuple is a sliding-window layer (window "
                    f"{int(item[2])}), whose positions a tuple does not tell: pass the cache"
                )
            raw.append((item[0], item[1], 0, None, None, None))
    else:
        for i, layer in enumerate(layers):
            why = _refused_layer(layer)
            if why is not None:
                raise CacheLayoutError(f"layer {i} is {why}")
            keys = getattr(layer, "keys", None)
            if keys is None or not keys.numel() or not getattr(layer, "is_initialized", True):
                raise CacheLayoutError(
                    f"layer {i} holds no keys and values (run the model on the prompt)"
                )
            kind = type(layer)
            if kind is cls.get("DynamicSlidingWindowLayer"):
                end, sw = _int(layer, "cumulative_length", i), _int(layer, "sliding_window", i)
                raw.append((keys, layer.values, end - int(keys.shape[-2]), end, sw, sw - 1))
            elif kind is cls.get("StaticLayer"):
                end = _int(layer, "cumulative_length", i)
                raw.append((keys, layer.values, 0, end, None, None))
            elif kind is cls.get("StaticSlidingWindowLayer"):
                end, cap = _int(layer, "cumulative_length_int", i), _int(layer, "max_cache_len", i)
                raw.append((keys, layer.values, max(end - cap, 0), end, cap, cap))
            else:  # DynamicLayer
                raw.append((keys, layer.values, 0, None, None, None))
    if not raw:
        raise CacheLayoutError("the cache holds no keys and values (run the model on the prompt)")
    for i, (k, v, start, last, window, keeps) in enumerate(raw):
        if tuple(k.shape[:-1]) != tuple(v.shape[:-1]) or k.shape[-1] != v.shape[-1]:
            raise CacheLayoutError(
                f"layer {i}: keys {tuple(k.shape)} and values {tuple(v.shape)} differ in shape "
                f"(an MLA cache, or K and V of different head dims): refused"
            )
        kr, vr = _row(k, i, "keys", row), _row(v, i, "values", row)
        held = int(kr.shape[1])
        stop = start + held if last is None else int(last)
        if held > stop - start:  # a static buffer not yet full
            kr, vr = kr[:, : stop - start], vr[:, : stop - start]
        out.append(HeldLayer(i, kr, vr, start, stop, window, keeps))
    return out


def window_error(layer: HeldLayer, n_tokens: int, block_tokens: int) -> SlidingWindowError:
    """The refusal of a save whose ``n_tokens`` (full blocks) a sliding layer lost."""
    w, most = layer.window, layer.keeps or 0
    keep = most // block_tokens * block_tokens
    return SlidingWindowError(
        f"layer {layer.index} is a sliding-window layer (sliding_window={w}): it holds "
        f"positions {layer.start}-{layer.end - 1} of {layer.end}, not the first {n_tokens} "
        f"tokens of the prefix's blocks; save a prompt of at most {most} tokens "
        f"(its first {keep} tokens in blocks of {block_tokens}) so that every layer holds "
        f"all of it. Nothing was stored.",
        layer=layer.index,
        window=w,
    )


def layer_limits(cache: Any) -> list[tuple[int | None, int | None]]:
    """For each layer of an empty ``cache`` to fill: ``(most positions it keeps, window)``
    (``(None, None)`` for a full-attention layer that grows)."""
    cls = _classes()
    out: list[tuple[int | None, int | None]] = []
    for i, layer in enumerate(getattr(cache, "layers", None) or []):
        why = _refused_layer(layer)
        if why is not None:
            raise CacheLayoutError(f"layer {i} is {why}")
        kind = type(layer)
        if kind is cls.get("DynamicSlidingWindowLayer"):
            sw = _int(layer, "sliding_window", i)
            out.append((sw - 1, sw))
        elif kind is cls.get("StaticSlidingWindowLayer"):
            cap = _int(layer, "max_cache_len", i)
            out.append((cap, cap))
        elif kind is cls.get("StaticLayer"):
            out.append((_int(layer, "max_cache_len", i), None))
        else:
            out.append((None, None))
    return out


def check_fits(cache: Any, n_tokens: int) -> None:
    """Refuse to fill ``cache`` with ``n_tokens`` positions some layer cannot keep."""
    for i, (most, window) in enumerate(layer_limits(cache)):
        if most is None or n_tokens <= most:
            continue
        if window is not None:
            raise SlidingWindowError(
                f"layer {i} is a sliding-window layer (sliding_window={window}): it keeps at "
                f"most {most} positions, the stored prefix has {n_tokens} tokens; the KV of "
                f"positions it would drop cannot be shown right for it. Nothing was loaded: "
                f"load a prompt of at most {most + 1} tokens.",
                layer=i,
                window=window,
            )
        raise CacheLayoutError(
            f"layer {i} is a static layer of max_cache_len={most}, the stored prefix has "
            f"{n_tokens} tokens: give a larger cache. Nothing was loaded."
        )


def _numpy_of(torch: Any, t: Any) -> np.ndarray:
    """A numpy view of a CPU tensor (bf16 through int16)."""
    if t.dtype == torch.bfloat16:
        return np.asarray(t.view(torch.int16).numpy()).view(ml_dtypes.bfloat16)
    return np.asarray(t.numpy())


def _static(cache: Any) -> bool:
    cls = _classes()
    static = {cls.get("StaticLayer"), cls.get("StaticSlidingWindowLayer")} - {None}
    layers = getattr(cache, "layers", None) or []
    return bool(layers) and all(type(layer) in static for layer in layers)


def static_buffers(
    torch: Any, cache: Any, n_heads: int, head_dim: int, dtype: Any, device: Any
) -> tuple[list[np.ndarray], list[np.ndarray]] | None:
    """Numpy views ``[Hkv, max_cache_len, D]`` of an empty static cache's preallocated
    CPU buffers, allocated first by ``Cache.early_initialization`` when still lazy; None
    when ``cache`` is not a static cache of batch 1 on the CPU."""
    if not _static(cache):
        return None
    if not getattr(cache, "is_initialized", False):
        if not hasattr(cache, "early_initialization"):
            return None  # filled through each layer's update instead
        cache.early_initialization(1, n_heads, head_dim, dtype, torch.device(device))
    layers = cache.layers
    if any(layer.keys.device.type != "cpu" or layer.keys.shape[0] != 1 for layer in layers):
        return None
    return (
        [_numpy_of(torch, layer.keys[0]) for layer in layers],
        [_numpy_of(torch, layer.values[0]) for layer in layers],
    )


def set_length(cache: Any, n_tokens: int) -> None:
    """Mark a static cache filled in place as holding its first ``n_tokens`` positions."""
    for layer in cache.layers:
        layer.cumulative_length.fill_(n_tokens)
        if hasattr(layer, "cumulative_length_int"):
            layer.cumulative_length_int = n_tokens


def fill_cache(cache: Any, keys: list[Any], values: list[Any]) -> None:
    """Put per-layer ``[1, Hkv, T, D]`` tensors into an empty ``cache``.

    A plain ``DynamicLayer`` is handed the tensors themselves (``update`` would copy them
    onto an empty tensor); every other layer goes through its own ``update`` (a static
    layer copies them into its buffer, a sliding one keeps what its window holds).
    """
    cls = _classes()
    layers: Any = getattr(cache, "layers", None)
    if layers is not None and not layers and getattr(cache, "layer_class_to_replicate", None):
        layers.extend(cache.layer_class_to_replicate() for _ in keys)
    if layers is not None and len(layers) != len(keys):
        raise CacheLayoutError(f"the cache has {len(layers)} layers, the prefix {len(keys)}")
    for i, (k, v) in enumerate(zip(keys, values)):
        layer: Any = layers[i] if layers is not None else None
        if layer is not None and _is(layer, cls, "DynamicLayer"):
            layer.update(k[..., :0, :], v[..., :0, :])  # initializes dtype and device
            layer.keys, layer.values = k, v
        else:
            cache.update(k, v, i)
