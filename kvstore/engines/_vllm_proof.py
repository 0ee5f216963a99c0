"""The layout proof of the vLLM connector: before it reads or writes a paged cache, the
connector shows that its view of every layer (``PagedCache``, from the backend's
``Layout``) is where the backend itself puts keys and values.

For each layer, a known pattern of keys and values for the ``B`` tokens of one scratch
block is written through the backend's own cache-write op (``impl.do_kv_cache_update``,
the op vLLM's attention layer calls with the step's slot mapping), read back through the
connector's view and compared byte for byte; the block's bytes are restored afterwards.
The scratch block is vLLM's null block (block 0: the block pool keeps it out of every
request). A mismatch, a backend whose forward writes the cache itself (no separate op to
prove with) or an op that fails refuses the layout with ``UnsupportedLayoutError`` naming
the layer and the reason: the connector stays off.

Copies between the device and the host are synchronous (``.cpu()``): correct first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._vllm_paged import PagedCache, UnsupportedLayoutError

__all__ = ["SCRATCH_BLOCK", "prove_layout"]

SCRATCH_BLOCK = 0  # vLLM's null block: never holds a request's tokens


def _pattern(shape: tuple[int, ...], dtype: Any, seed: int, scale: float | None) -> tuple[Any, Any]:
    """Random values of ``dtype`` (a fixed seed), and the bytes the cache must hold for
    them: every byte of K and V differs from its neighbours' with near certainty, so a
    view that reads the wrong element fails. ``scale`` (an fp8 cache's layer scale): the
    values are E4M3 codes (no NaN) times ``scale``, which the cache-write op quantizes back
    to the same codes (the rounding error of the product is far below half an E4M3 step),
    and the bytes are the codes. Neither NaN nor -0 is among them: -0 equals 0, and a
    quantizer may write either (vLLM's CPU op on AVX-512 writes 0x00 for -0)."""
    import ml_dtypes
    import numpy as np
    import torch

    gen = torch.Generator().manual_seed(seed)
    if scale is None:
        values = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
        return values, values
    codes = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3F  # the NaN codes: 1.875 instead
    codes[codes == 0x80] = 0xBF  # -0: -1.875 instead
    exact = codes.numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return (torch.from_numpy(exact) * scale).to(dtype), codes


def prove_layout(
    paged: PagedCache,
    kv_caches: Mapping[str, Any],
    layers: Mapping[str, Any],
    backend_classes: Mapping[str, Any],
    act_dtype: Any = None,
    block: int = SCRATCH_BLOCK,
) -> None:
    """Prove ``paged``'s view of every layer against the backend's cache-write op.

    Args:
        paged: the connector's views of the registered caches.
        kv_caches: the registered caches by layer name (as vLLM hands them over).
        layers: vLLM's attention layer modules by name (``impl`` is the backend's).
        backend_classes: each layer's attention backend class.
        act_dtype: the keys' and values' dtype (the model's; default: the cache's).
        block: the scratch block written and restored.

    Raises:
        UnsupportedLayoutError: naming the layer and why its layout is not proven.
    """
    import torch

    g = paged.geometry
    h = paged.heads[1] - paged.heads[0]
    for i, name in enumerate(paged.names):
        layer, backend = layers.get(name), backend_classes.get(name)
        impl = getattr(layer, "impl", None)
        op = getattr(impl, "do_kv_cache_update", None)
        label = getattr(backend, "get_name", lambda: "unknown")()
        if getattr(backend, "forward_includes_kv_cache_update", True) or op is None:
            raise UnsupportedLayoutError(
                f"layer {name}: attention backend {label} has no separate cache-write op "
                "(do_kv_cache_update) to prove the connector's layout with"
            )
        cache = kv_caches[name]
        shape = (g.block_tokens, h, g.head_dim)
        fp8: tuple[float | None, float | None] = (None, None)
        if paged.fp8 is not None:  # the layer's K and V scales
            fp8 = (float(paged.fp8[i, 0, 0]), float(paged.fp8[i, 1, 0]))
        dtype = act_dtype if paged.fp8 is not None else cache.dtype
        key, key_bytes = _pattern(shape, dtype, 2 * i, fp8[0])
        value, value_bytes = _pattern(shape, dtype, 2 * i + 1, fp8[1])
        slots = torch.arange(g.block_tokens, dtype=torch.long) + block * g.block_tokens
        saved = cache[block].clone()
        try:
            op(layer, key.to(cache.device), value.to(cache.device), cache, slots.to(cache.device))
            # each as [h][B][D] (a view of tiles, B and D split, joined back: a copy)
            got = torch.stack(
                [
                    x[block].cpu().reshape(h, g.block_tokens, g.head_dim)
                    for x in (paged.keys[i], paged.values[i])
                ],
                1,
            )
        except Exception as exc:
            raise UnsupportedLayoutError(
                f"layer {name}: {label}'s cache-write op failed in the layout proof: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        finally:
            cache[block].copy_(saved)
        want = torch.stack([key_bytes.transpose(0, 1), value_bytes.transpose(0, 1)], dim=1)
        a, b = got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
        bad = int((a != b).sum())
        if bad:
            raise UnsupportedLayoutError(
                f"layer {name}: layout proof failed: {bad} of {a.numel()} bytes written by "
                f"{label}'s cache-write op ({type(impl).__name__}.do_kv_cache_update) read "
                f"back differently through the connector's layout ({paged.layout_names[i]})"
            )
