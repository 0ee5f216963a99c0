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
    elif numerics._fp8 is None:
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
