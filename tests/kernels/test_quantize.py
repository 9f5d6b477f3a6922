"""FP8 quantization: the reference against plain Python, the kernel against the reference.

Also holds the independent FP8/bf16 rules (Python floats and integer bit tricks, no
ml_dtypes casts) that the gather tests reuse.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

import rowcache.kernels
from rowcache.errors import ConfigError
from rowcache.kernels.reference import BF16, E4M3, quantize_fp8_reference
from tests.kernels.support import e4m3_value

DIMS = (1, 7, 130, 256, 3072)


# --- independent rules -------------------------------------------------------------


def e4m3_encode_satfinite(v: float) -> int:
    """Nearest E4M3 code to ``v`` (ties to even code), magnitudes clamped to 448, sign kept."""
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0x00
    a = Fraction(min(abs(v), 448.0))
    best = min(range(0x7F), key=lambda c: (abs(Fraction(e4m3_value(c)) - a), c & 1))
    return sign | best


def random_rows(rng: np.random.Generator, n: int, d: int, dtype: np.dtype = BF16) -> np.ndarray:
    """Finite rows of very different magnitudes, with an all-zero row, a -0 row and a spike."""
    mag = (10.0 ** rng.uniform(-30, 30, size=(n, 1))).astype(np.float32)
    x = (rng.standard_normal((n, d), dtype=np.float32) * mag).astype(dtype)
    if n >= 4:
        x[1] = 0
        x[2] = -0.0
        x[3, rng.integers(d)] = -448.0 * 3
    return x


def reciprocal_sensitive_rows(rng: np.random.Generator, count: int) -> np.ndarray:
    """bf16 rows [count, 64] whose codes differ between ``x / scale`` and ``x * (1 / scale)``."""
    x = rng.standard_normal((4000, 64), dtype=np.float32).astype(BF16)
    x32 = x.astype(np.float32)
    scales = np.abs(x32).max(axis=1) / np.float32(448.0)
    div = np.clip(x32 / scales[:, None], -448, 448).astype(E4M3).view(np.uint8)
    mul = np.clip(x32 * (np.float32(1.0) / scales)[:, None], -448, 448).astype(E4M3).view(np.uint8)
    rows = np.flatnonzero((div != mul).any(axis=1))
    assert rows.size >= count, "the generator should find rows where the two roundings differ"
    return x[rows[:count]]


# --- the reference against per-element Python --------------------------------------


def test_e4m3_value_agrees_with_ml_dtypes_for_every_code():
    codes = np.arange(256, dtype=np.uint8)
    ml = codes.view(E4M3).astype(np.float64)
    mine = np.array([e4m3_value(int(c)) for c in codes])
    assert np.array_equal(ml, mine, equal_nan=True)


def test_quantize_reference_matches_python_rule(rng):
    x = random_rows(rng, 6, 9)
    x[4, :3] = [448.0, -224.0, 0.0078125]  # exact powers of two next to the range ends
    codes, scales = quantize_fp8_reference(x)
    for r in range(x.shape[0]):
        row = [np.float32(v) for v in x[r].astype(np.float32)]
        amax = max(abs(v) for v in row)
        scale = np.float32(1.0) if amax == 0 else np.float32(amax) / np.float32(448.0)
        assert scales[r].view(np.uint32) == np.float32(scale).view(np.uint32)
        expect = [e4m3_encode_satfinite(float(np.float32(v) / scale)) for v in row]
        assert codes[r].tolist() == expect, f"row {r}"


def test_quantize_reference_divides_by_the_scale(rng):
    x = reciprocal_sensitive_rows(rng, 2)
    codes, scales = quantize_fp8_reference(x)
    for r in range(x.shape[0]):
        scale = scales[r]
        expect = [e4m3_encode_satfinite(float(np.float32(v) / scale)) for v in x[r]]
        assert codes[r].tolist() == expect


def test_quantize_reference_all_zero_and_negative_zero_rows():
    x = np.zeros((2, 5), dtype=BF16)
    x[1] = -0.0
    codes, scales = quantize_fp8_reference(x)
    assert scales.tolist() == [1.0, 1.0]
    assert codes[0].tolist() == [0] * 5
    assert codes[1].tolist() == [0x80] * 5


def test_quantize_reference_row_max_maps_to_448(rng):
    x = random_rows(rng, 8, 33, np.dtype(np.float32))
    codes, _ = quantize_fp8_reference(x)
    top = np.abs(x).argmax(axis=1)
    for r in range(x.shape[0]):
        if x[r, top[r]] != 0:
            assert codes[r, top[r]] & 0x7F == 0x7E  # +-448, the largest finite code


# --- the public CPU path -------------------------------------------------------------


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float32)])
def test_quantize_fp8_cpu_is_the_reference(rng, d, dtype):
    x = random_rows(rng, 5, d, dtype)
    codes, scales = rowcache.kernels.quantize_fp8(x)
    ref_codes, ref_scales = quantize_fp8_reference(x)
    assert codes.dtype == np.uint8 and codes.shape == (5, d)
    assert scales.dtype == np.float32 and scales.shape == (5,)
    assert np.array_equal(codes, ref_codes)
    assert np.array_equal(scales.view(np.uint32), ref_scales.view(np.uint32))


def test_quantize_fp8_cpu_fills_given_outputs(rng):
    x = random_rows(rng, 4, 7)
    codes = np.full((4, 7), 0x7F, dtype=np.uint8)
    scales = np.full(4, np.nan, dtype=np.float32)
    got_codes, got_scales = rowcache.kernels.quantize_fp8(x, codes=codes, scales=scales)
    assert got_codes is codes and got_scales is scales
    ref_codes, ref_scales = quantize_fp8_reference(x)
    assert np.array_equal(codes, ref_codes)
    assert np.array_equal(scales, ref_scales)


def test_quantize_fp8_cpu_empty():
    codes, scales = rowcache.kernels.quantize_fp8(np.zeros((0, 8), dtype=BF16))
    assert codes.shape == (0, 8) and scales.shape == (0,)
    codes, scales = rowcache.kernels.quantize_fp8(np.zeros((3, 0), dtype=BF16))
    assert codes.shape == (3, 0) and scales.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"x": np.zeros((2, 3), dtype=np.float16)}, "x"),
        ({"x": np.zeros(6, dtype=BF16)}, "x"),
        ({"x": [[1.0, 2.0]]}, "x"),
        ({"x": np.zeros((2, 3), dtype=BF16), "codes": np.zeros((2, 4), np.uint8)}, "codes"),
        ({"x": np.zeros((2, 3), dtype=BF16), "codes": np.zeros((2, 3), np.int8)}, "codes"),
        ({"x": np.zeros((2, 3), dtype=BF16), "scales": np.zeros(3, np.float32)}, "scales"),
        ({"x": np.zeros((2, 3), dtype=BF16), "scales": np.zeros(2, np.float64)}, "scales"),
    ],
)
def test_quantize_fp8_rejects_bad_arguments(kwargs, name):
    with pytest.raises(ConfigError, match=name):
        rowcache.kernels.quantize_fp8(**kwargs)


# --- the kernel against the reference --------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("d", (*DIMS, 33, 1000))
@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float32)])
def test_quantize_fp8_gpu_bitexact(rng, d, dtype):
    import cupy as cp

    n = 37
    x = random_rows(rng, n, d, dtype)
    codes = cp.full((n, d), 0x7F, dtype=cp.uint8)  # poison: NaN codes everywhere
    scales = cp.full(n, np.nan, dtype=cp.float32)
    got_codes, got_scales = rowcache.kernels.quantize_fp8(cp.asarray(x), codes=codes, scales=scales)
    assert got_codes is codes and got_scales is scales
    ref_codes, ref_scales = quantize_fp8_reference(x)
    assert np.array_equal(codes.get(), ref_codes)
    assert np.array_equal(scales.get().view(np.uint32), ref_scales.view(np.uint32))


@pytest.mark.gpu
def test_quantize_fp8_gpu_divides_not_multiplies_by_reciprocal(rng):
    import cupy as cp

    x = reciprocal_sensitive_rows(rng, 64)
    codes, scales = rowcache.kernels.quantize_fp8(cp.asarray(x))
    ref_codes, ref_scales = quantize_fp8_reference(x)
    assert np.array_equal(codes.get(), ref_codes)
    assert np.array_equal(scales.get(), ref_scales)


@pytest.mark.gpu
def test_quantize_fp8_gpu_allocates_and_handles_many_rows(rng):
    import cupy as cp

    x = random_rows(rng, 70_000, 16)  # more rows than blocks: the grid strides
    codes, scales = rowcache.kernels.quantize_fp8(cp.asarray(x))
    ref_codes, ref_scales = quantize_fp8_reference(x)
    assert codes.dtype == cp.uint8 and scales.dtype == cp.float32
    assert np.array_equal(codes.get(), ref_codes)
    assert np.array_equal(scales.get(), ref_scales)


@pytest.mark.gpu
def test_quantize_fp8_gpu_strided_rows(rng):
    import cupy as cp

    full = random_rows(rng, 9, 40)
    x = cp.asarray(full)[:, 3:30]  # row stride 40, rows of 27
    codes, scales = rowcache.kernels.quantize_fp8(x)
    ref_codes, ref_scales = quantize_fp8_reference(full[:, 3:30])
    assert np.array_equal(codes.get(), ref_codes)
    assert np.array_equal(scales.get(), ref_scales)


@pytest.mark.gpu
def test_quantize_fp8_gpu_empty():
    import cupy as cp

    codes, scales = rowcache.kernels.quantize_fp8(cp.zeros((0, 8), dtype=BF16))
    assert codes.shape == (0, 8) and scales.shape == (0,)
    codes, scales = rowcache.kernels.quantize_fp8(cp.zeros((2, 0), dtype=BF16))
    assert codes.shape == (2, 0) and scales.get().tolist() == [1.0, 1.0]


@pytest.mark.gpu
def test_quantize_fp8_gpu_rejects_host_outputs_and_column_strides():
    import cupy as cp

    x = cp.zeros((2, 3), dtype=BF16)
    with pytest.raises(ConfigError, match="codes"):
        rowcache.kernels.quantize_fp8(x, codes=np.zeros((2, 3), np.uint8))
    with pytest.raises(ConfigError, match="x"):
        rowcache.kernels.quantize_fp8(cp.zeros((3, 4), dtype=BF16).T)


# --- rows too small for a scale (issue 51, item 1) -------------------------------------------


def test_quantize_reference_a_row_too_small_for_a_scale_is_signed_zeros():
    # [1e-45, 0, ...] had scale 0: the zeros became 0/0 = NaN codes, served as NaN.
    x = np.zeros((4, 6), dtype=np.float32)
    x[0, 0] = 1e-45
    x[1, :] = [-1e-45, 1e-45, -0.0, 0.0, 2e-45, -2.8e-45]
    x[2, 3] = np.float32(448 * 2.0**-150)  # the largest amax whose quotient is 0 (a tie to even)
    x[3, 3] = np.nextafter(x[2, 3], np.float32(1))  # the next one has a scale, 2**-149
    codes, scales = quantize_fp8_reference(x)
    assert scales[:3].tolist() == [1.0, 1.0, 1.0]
    assert scales[3] == np.float32(2.0**-149)
    assert codes[0].tolist() == [0] * 6
    assert codes[1].tolist() == [0x80, 0, 0x80, 0, 0, 0x80]  # signs kept
    deq = rowcache.kernels.reference.dequantize_fp8_reference(codes, scales)
    assert np.isfinite(deq.astype(np.float32)).all()
    assert not deq.astype(np.float32).any()


def tiny_rows_strategy():
    """Rows [n, d] of float32 values whose magnitudes are subnormal or barely normal, with
    zeros and signs mixed in: the range where the scale is subnormal or underflows."""
    from hypothesis import strategies as st
    from hypothesis.extra.numpy import arrays

    # 2**e * m with e down to float32's smallest subnormal, m in [1, 2)
    elem = st.one_of(
        st.just(0.0),
        st.just(-0.0),
        st.builds(
            lambda s, e, m: s * m * 2.0**e,
            st.sampled_from([1.0, -1.0]),
            st.integers(-149, -110),
            st.floats(1.0, 2.0, exclude_max=True),
        ),
    )
    shapes = st.tuples(st.integers(1, 5), st.integers(1, 40))
    return shapes.flatmap(lambda sh: arrays(np.float32, sh, elements=elem.map(np.float32)))


def served_error_bound(x: np.ndarray) -> np.ndarray:
    """How far a served value may be from ``x`` under the FP8 rule: E4M3's 3 mantissa bits
    (1/16 of the value, halved by rounding, plus bf16's cut), a subnormal code's step
    (amax / 448 / 512), and the gathers' flush of products below 2**-126 (of the whole row
    where the scale is subnormal, amax < 448 * 2**-126)."""
    x32 = x.astype(np.float32).astype(np.float64)
    amax = np.abs(x32).max(axis=1, keepdims=True)
    flush = np.where(amax < 448 * 2.0**-126, amax, 2.0**-126)
    return np.abs(x32) * 0.07 + amax / 448 / 512 + flush


def test_quantize_tiny_rows_round_trip_finite_and_close_property():
    from hypothesis import given, settings

    @settings(max_examples=300, deadline=None)
    @given(tiny_rows_strategy())
    def check(x):
        for rows in (x, x.astype(BF16)):
            codes, scales = quantize_fp8_reference(rows)
            assert np.isfinite(scales).all() and (scales > 0).all()
            assert not ((codes & 0x7F) == 0x7F).any(), "no NaN code from finite rows"
            served = rowcache.kernels.reference.dequantize_fp8_reference(codes, scales)
            served64 = served.astype(np.float32).astype(np.float64)
            assert np.isfinite(served64).all()
            err = np.abs(served64 - rows.astype(np.float32).astype(np.float64))
            assert (err <= served_error_bound(rows)).all()

    check()


def test_quantize_native_pages_equal_the_reference_on_tiny_rows_property():
    pytest.importorskip("rowcache.kernels._quantize", reason="the native quantize is not built")
    from hypothesis import given, settings

    from rowcache.format import layout as fmt
    from rowcache.kernels import quantize as kq

    @settings(max_examples=200, deadline=None)
    @given(tiny_rows_strategy())
    def check(x):
        for rows in (x, x.astype(BF16)):
            rpp, page_bytes = fmt.page_packing(rows.shape[1] + 4)
            pages = -(-rows.shape[0] // rpp) * page_bytes
            want, got = np.zeros(pages, np.uint8), np.zeros(pages, np.uint8)
            codes, scales = quantize_fp8_reference(rows)
            kq.place_records(want, 0, codes, scales, rows_per_page=rpp, page_bytes=page_bytes)
            assert kq.quantize_fp8_pages(rows, got, rows_per_page=rpp, page_bytes=page_bytes) == 0
            np.testing.assert_array_equal(got, want)
            assert not ((codes & 0x7F) == 0x7F).any(), "no NaN code from finite rows"

    check()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float32)])
def test_quantize_fp8_gpu_rows_too_small_for_a_scale_are_finite(dtype):
    # The kernel takes scale 1.0 where amax / 448 is 0, as the reference does. (Where the GPU
    # flushes a subnormal quotient the scale is 1.0 too: signed zeros either way.)
    import cupy

    x = np.zeros((4, 64), dtype=np.float32)
    x[0, 0] = 1e-45
    x[1, :3] = [-1e-45, 2.8e-43, -0.0]
    x[2, 9] = np.float32(448 * 2.0**-150)
    x[3] = np.linspace(-1e-40, 1e-40, 64)
    x = x.astype(dtype)
    codes, scales = rowcache.kernels.quantize_fp8(cupy.asarray(x))
    codes, scales = codes.get(), scales.get()
    assert np.isfinite(scales).all() and (scales > 0).all()
    assert not ((codes & 0x7F) == 0x7F).any()
    served = rowcache.kernels.reference.dequantize_fp8_reference(codes, scales)
    assert not served.astype(np.float32).any()
