"""f16 and E4M3 conversions: the compiled kernel against the straightforward ml_dtypes path."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.codec import numerics


def _reference(x: np.ndarray, filled: int) -> tuple[np.ndarray, np.ndarray]:
    xf = x[:, :filled].astype(np.float32)
    amax = np.abs(xf).max(axis=1)
    scales = np.where(amax == 0, np.float32(1), amax / np.float32(448)).astype(np.float32)
    codes = np.zeros(x.shape, dtype=np.uint8)
    with np.errstate(all="ignore"):  # tiny slabs: the literal rule divides by a zero scale
        codes[:, :filled] = (xf / scales[:, None]).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return codes, scales


@pytest.fixture(params=["kernel", "numpy"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "numpy":
        monkeypatch.setattr(numerics, "_fp8", None)
    elif numerics._fp8 is None:  # type: ignore[attr-defined]  # the module's private kernel
        pytest.skip("compiled kernel not built")
    return str(request.param)


def test_quantize_matches_reference_on_a_wide_spread(kernel: str) -> None:
    rng = np.random.default_rng(5)
    # Magnitudes from f32 subnormals to 1e30, so scale and quotient cover every E4M3 range.
    mags = 10.0 ** rng.uniform(-44, 30, (64, 1))
    x = (rng.standard_normal((64, 256)) * mags).astype(np.float32)
    x[3] = 0
    x[4, ::7] = 0
    for filled in (256, 255, 1, 100):
        codes, scales = numerics.quantize_e4m3(x, filled)
        ref_codes, ref_scales = _reference(x, filled)
        assert np.array_equal(scales.view(np.uint32), ref_scales.view(np.uint32))
        assert np.array_equal(codes, ref_codes)


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(
        st.floats(allow_nan=False, allow_infinity=False, width=32), min_size=1, max_size=40
    ),
    extra=st.integers(0, 5),
)
def test_quantize_property(values: list[float], extra: int) -> None:
    x = np.zeros((1, len(values) + extra), dtype=np.float32)
    x[0, : len(values)] = values
    codes, scales = numerics.quantize_e4m3(x, len(values))
    ref_codes, ref_scales = _reference(x, len(values))
    assert np.array_equal(codes, ref_codes) and np.array_equal(scales, ref_scales)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_quantize_refuses_non_finite(kernel: str, bad: float) -> None:
    x = np.ones((2, 8), dtype=np.float32)
    x[1, 5] = bad
    with pytest.raises(ValueError, match="finite"):
        numerics.quantize_e4m3(x, 8)
    x[1, 5] = 1
    x[1, 7] = bad  # past the filled positions: never read
    numerics.quantize_e4m3(x, 6)


def test_f64_overflowing_f32_is_refused(kernel: str) -> None:
    x = np.full((1, 4), 1e300, dtype=np.float64)
    with pytest.raises(ValueError):
        numerics.quantize_e4m3(x, 4)


def test_decode_table_is_ml_dtypes() -> None:
    ref = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert np.array_equal(numerics.E4M3_TO_F32.view(np.uint32), ref.view(np.uint32))


def test_to_f16_refuses_overflow_and_keeps_f16_without_copy() -> None:
    with pytest.raises(ValueError, match="overflow"):
        numerics.to_f16(np.array([65520.0]))  # rounds past 65504
    assert numerics.to_f16(np.array([65504.0]))[0] == 65504
    a = np.ones(8, dtype=np.float16)
    assert numerics.to_f16(a) is a
    a[3] = np.inf
    with pytest.raises(ValueError):
        numerics.to_f16(a)


BF16 = np.dtype(ml_dtypes.bfloat16)


def test_to_f16_of_bf16_is_the_rounding_of_its_exact_f32() -> None:
    # Every finite bf16 bit pattern within f16's range: bf16 -> f32 is exact, then one RNE.
    bits = np.arange(1 << 16, dtype=np.uint16)
    x = bits.view(BF16)
    f32 = x.astype(np.float32)
    keep = np.isfinite(f32) & (np.abs(f32) <= 65504)
    out = numerics.to_f16(x[keep])
    assert out.dtype == np.float16 and out.flags.c_contiguous
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(out.view(np.uint16), f32[keep].astype(np.float16).view("<u2"))


def test_bf16_in_f16_normal_range_round_trips_exactly() -> None:
    # bf16 keeps 8 significant bits, f16 11: a normal-range value survives bf16 -> f16 -> bf16.
    x = np.array([6.103515625e-05, 1.0, -3.140625, 65280.0, -0.0001220703125], dtype=BF16)
    np.testing.assert_array_equal(
        numerics.to_f16(x).astype(BF16).view(np.uint16), x.view(np.uint16)
    )


def test_bf16_below_f16_normal_range_rounds_to_subnormals_or_zero() -> None:
    tiny = np.array([1e-5, -3e-7, 1e-8, 1e-30], dtype=BF16)
    out = numerics.to_f16(tiny)
    np.testing.assert_array_equal(out, tiny.astype(np.float32).astype(np.float16))
    assert out[2] == 0 and out[3] == 0  # below half the smallest f16 subnormal
    assert float(out[1]) != float(tiny[1])  # a deep subnormal keeps fewer bits than bf16


@pytest.mark.parametrize("value", [65536.0, -1e10, np.inf, -np.inf, np.nan])
def test_bf16_values_f16_cannot_hold_are_refused(value: float) -> None:
    x = np.array([1.0, value], dtype=np.float32).astype(BF16)
    with pytest.raises(ValueError, match=r"finite|overflow"):
        numerics.to_f16(x)


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32, np.float64])
def test_to_f16_of_any_strides_is_c_contiguous(dtype: np.dtype) -> None:
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4).astype(dtype)
    for view in (x.transpose(2, 0, 1), x[:, ::2], x[..., ::-1], np.asfortranarray(x)):
        out = numerics.to_f16(view)
        assert out.flags.c_contiguous
        np.testing.assert_array_equal(out, view.astype(np.float32).astype(np.float16))


@pytest.mark.hf
def test_as_array_takes_torch_tensors_of_every_float_dtype_without_a_copy() -> None:
    torch = pytest.importorskip("torch", reason="torch is in the hf extra")
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        t = base.to(dtype).t()  # a transposed view
        arr = numerics.as_array(t)
        assert arr.shape == (4, 3)
        np.testing.assert_array_equal(arr.astype(np.float32), t.float().numpy())
        assert arr.__array_interface__["data"][0] == t.data_ptr()  # a view, not a copy
