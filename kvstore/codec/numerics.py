"""Element conversions of the payloads: f16 (format v1) and FP8 E4M3 with per-slab scales (v2).

v2 quantization is deterministic so that output is byte-identical across implementations:
per slab (layer, K/V, head) over the filled positions, ``amax = max|float32(x)|``,
``scale = float32(amax) / float32(448)`` (1.0 when amax == 0), and each element is
``float32(x) / scale`` rounded to OCP E4M3FN (``ml_dtypes.float8_e4m3fn``) to nearest even.
Within a slab ``[B][D]`` the filled positions are the first ``n_tokens * D`` elements.

The rule is applied literally, also where it degrades: a slab whose amax is an f32
subnormal below about 6e-43 gets a scale that rounds to 0 or loses precision, and its codes
saturate to the NaN pattern, exactly as the reference ``ml_dtypes`` path does. KV values
that small do not occur in practice; f16 input never reaches that range.
"""

from __future__ import annotations

import sys
from typing import Any

import ml_dtypes
import numpy as np

try:
    from . import _native
except ImportError:  # pragma: no cover - only where the build had no compiler
    _native = None  # type: ignore[assignment]
try:
    from . import _fp8
except ImportError:  # pragma: no cover - only where the build had no compiler
    _fp8 = None  # type: ignore[assignment]

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3_MAX = np.float32(448.0)  # largest finite E4M3FN value: "scale = amax / 448"
F16 = np.dtype("<f2")
F32 = np.dtype("<f4")
BF16 = np.dtype(ml_dtypes.bfloat16)
FLOAT_DTYPES = (F16, BF16, F32, np.dtype(np.float64))

# e4m3_to_f32 of every byte, the decode table (0x7F and 0xFF are NaN).
E4M3_TO_F32 = np.arange(256, dtype=np.uint8).view(E4M3).astype(F32)
E4M3_TO_F32.setflags(write=False)


def as_array(x: Any) -> np.ndarray:
    """``x`` as a numpy array, a view where possible: ndarrays as they are, anything with
    ``__array__`` or ``__dlpack__`` (CPU torch tensors), and torch bfloat16 tensors, which
    numpy cannot read, viewed bit for bit as ``ml_dtypes.bfloat16``. torch is never
    imported here: a tensor exists only once its caller has imported it."""
    if isinstance(x, np.ndarray):
        return x
    if str(getattr(x, "dtype", "")) == "torch.bfloat16":
        torch = sys.modules["torch"]
        return np.asarray(x.detach().view(torch.int16)).view(BF16)
    if not hasattr(x, "__array__") and hasattr(x, "__dlpack__"):
        return np.from_dlpack(x)
    return np.asarray(x)


def check_float_dtype(arr: np.ndarray) -> None:
    """Raise ValueError unless ``arr`` holds f16, bf16, f32 or f64 values."""
    if arr.dtype not in FLOAT_DTYPES:
        raise ValueError(f"kv must be float16, bfloat16, float32 or float64, found {arr.dtype}")


def all_finite_f16(arr: Any) -> bool:
    """Whether no f16 value of ``arr`` (an f16 array, or a buffer of f16 bytes) is NaN/Inf."""
    if not isinstance(arr, np.ndarray):
        arr = np.frombuffer(arr, dtype=F16)
    if _native is not None and hasattr(_native, "f16_finite") and arr.flags.c_contiguous:
        return bool(_native.f16_finite(arr))
    return bool(np.isfinite(arr).all())


# E4M3FN has no infinity; S.1111.111 (0x7F, 0xFF) is its NaN.
E4M3_NAN_MASK = 0x7F
# The largest scale whose product with every E4M3 value stays finite in f32 (448 * s).
SCALE_MAX = np.float32(np.finfo(np.float32).max / 448.0)


def to_f16(arr: np.ndarray) -> np.ndarray:
    """``arr`` as a C-contiguous f16 array by round-to-nearest-even, whatever its strides;
    no copy when it already is contiguous f16, one copy otherwise. bf16, f32 and f64 follow
    one rule: values beyond f16's range are refused, values below its normal range round
    to f16 subnormals (or zero), exactly as numpy's f32 -> f16 cast does.

    Raises:
        ValueError: a value is NaN or infinite, or overflows f16 (|x| rounds past 65504).
    """
    check_float_dtype(arr)
    if arr.dtype == np.float16:
        out = np.ascontiguousarray(arr, dtype=F16)
        if not all_finite_f16(out):
            raise ValueError("kv values must be finite (found NaN or Inf in f16 input)")
        return out
    if not np.isfinite(arr).all():
        raise ValueError("kv values must be finite (found NaN or Inf)")
    if arr.dtype == BF16:  # bf16 -> f32 is exact, so f32 -> f16 rounds once, to nearest even
        arr = arr.astype(F32)
    with np.errstate(over="ignore"):  # overflow is detected below and refused
        out = arr.astype(F16, order="C")  # "K" would keep a transposed input's strides
    if not np.isfinite(out).all():
        raise ValueError("kv values overflow f16 (|x| > 65504 after rounding)")
    return out


def quantize_e4m3(slabs: np.ndarray, filled: int) -> tuple[np.ndarray, np.ndarray]:
    """Quantize slabs to E4M3FN codes with one f32 scale per slab (the v2 writer rule).

    Args:
        slabs: float array of shape ``(S, E)``: S slabs of E = B*D elements each.
        filled: how many leading elements of each slab are filled (n_tokens * D).

    Returns:
        ``(codes, scales)``: uint8 ``(S, E)`` with 0x00 past ``filled``, and f32 ``(S,)``.

    Raises:
        ValueError: a filled value is NaN or infinite.
    """
    check_float_dtype(slabs)
    n_slabs, elems = slabs.shape
    codes = np.zeros((n_slabs, elems), dtype=np.uint8)
    if filled == 0 or n_slabs == 0:
        return codes, np.ones(n_slabs, dtype=F32)
    with np.errstate(over="ignore"):  # an f64 beyond f32 becomes Inf and is refused below
        x = np.ascontiguousarray(slabs[:, :filled], dtype=F32)
    if _fp8 is not None:
        scales = np.empty(n_slabs, dtype=F32)
        if not _fp8.e4m3_quantize(x, codes, scales, filled):
            raise ValueError("kv values must be finite (found NaN or Inf, or overflow of f32)")
        return codes, scales
    if not np.isfinite(x).all():
        raise ValueError("kv values must be finite (found NaN or Inf, or overflow of f32)")
    amax = np.abs(x).max(axis=1)
    scales = np.where(amax == 0, np.float32(1.0), amax / E4M3_MAX).astype(F32)
    with np.errstate(all="ignore"):  # see the note on tiny slabs above
        codes[:, :filled] = (x / scales[:, None]).astype(E4M3).view(np.uint8)
    return codes, scales


def dequantize_e4m3(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """``e4m3_to_f32(code) * scale`` in f32; ``scales`` broadcasts over the last two axes."""
    out = np.take(E4M3_TO_F32, codes)
    with np.errstate(over="ignore"):  # a scale past SCALE_MAX gives Inf; callers refuse it
        out *= scales[..., None, None]
    return out
