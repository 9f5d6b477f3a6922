"""The table-scaled FP8 gather (codec ``fp8_table_scale``): E4M3 codes and ONE bf16 scale.

The reference against an independent per-element rule (exact products in float64, rounded
to bf16 by integer arithmetic) and against torch's ``float8_e4m3fn.to(bfloat16) * scale``;
the CPU path against the reference; the scale's checks; on the GPU the ``.cu`` kernel
against the reference bit for bit, NaN codes, subnormal products and infinite scales
included, with odd dims, strided outputs and tables in mapped pinned host memory.
"""

from __future__ import annotations

import numpy as np
import pytest

import rowcache.kernels
from rowcache.errors import ConfigError
from rowcache.kernels.reference import (
    BF16,
    BF16_NAN_BITS,
    batched_embed_fp8_table_scale_reference,
    dequantize_fp8_table_scale_reference,
)
from tests.kernels.support import bf16_bits_rne, e4m3_value, mapped_host_array

DIMS = (1, 7, 130, 160, 256)
ID_DTYPES = (np.int32, np.int64)
ALL_CODES = np.arange(256, dtype=np.uint8)
POISON = 0xFFFF


def bf16_of(bits: int) -> np.ndarray:
    return np.array(bits, dtype=np.uint16).view(BF16)


def random_finite_bf16(rng: np.random.Generator, n: int) -> list[int]:
    """Random finite bf16 bit patterns of both signs, normal and subnormal."""
    b = rng.integers(0, 1 << 16, size=4 * n, dtype=np.uint32).astype(np.uint16)
    return [int(x) for x in b[(b & 0x7F80) != 0x7F80][:n]]


# bf16 scales that matter: one, tiny normal, subnormal (products far below float32's
# normal range), largest finite (products overflow), negative, zero
SPECIAL_SCALES = (0x3F80, 0x0080, 0x0001, 0x0003, 0x8001, 0x7F7F, 0xFF7F, 0xBC00, 0x0000, 0x8000)


def python_rule(code: int, scale_bits: int) -> int:
    """bf16 bits of bf16_rn(e4m3(code) * scale): the product is exact in float64 (at most
    12 significant bits, exponents -142..136) and in float32 (subnormals included)."""
    v = e4m3_value(code)
    s = float(bf16_of(scale_bits).astype(np.float64))
    if v != v or s != s:
        return BF16_NAN_BITS
    prod = v * s
    if prod != prod:  # 0 * inf
        return BF16_NAN_BITS
    with np.errstate(over="ignore"):
        return bf16_bits_rne(np.float32(prod))


@pytest.mark.parametrize("scale_bits", (*SPECIAL_SCALES, 0x7F80, 0xFF80, 0x7FC0))
def test_reference_matches_python_rule_for_every_code(scale_bits):
    got = dequantize_fp8_table_scale_reference(ALL_CODES, bf16_of(scale_bits)).view(np.uint16)
    want = [python_rule(c, scale_bits) for c in range(256)]
    assert got.tolist() == want


def test_reference_matches_python_rule_random_scales(rng):
    for sb in random_finite_bf16(rng, 64):
        got = dequantize_fp8_table_scale_reference(ALL_CODES, bf16_of(sb)).view(np.uint16)
        assert got.tolist() == [python_rule(c, sb) for c in range(256)], hex(sb)


def test_reference_specials():
    nan_codes = np.array([0x7F, 0xFF], np.uint8)
    got = dequantize_fp8_table_scale_reference(nan_codes, bf16_of(0x3F80)).view(np.uint16)
    assert got.tolist() == [BF16_NAN_BITS] * 2  # NaN stays NaN, one canonical pattern
    zero = np.array([0x00, 0x80, 0x08], np.uint8)  # +0, -0, a normal code
    got = dequantize_fp8_table_scale_reference(zero, bf16_of(0x7F80)).view(np.uint16)
    assert got.tolist() == [BF16_NAN_BITS, BF16_NAN_BITS, 0x7F80]  # 0 * inf is NaN
    got = dequantize_fp8_table_scale_reference(zero, bf16_of(0x3F80)).view(np.uint16)
    assert got.tolist()[:2] == [0x0000, 0x8000]  # signed zeros kept
    got = dequantize_fp8_table_scale_reference(ALL_CODES, bf16_of(0x7FC0)).view(np.uint16)
    assert set(got.tolist()) == {BF16_NAN_BITS}


def test_reference_equals_torch_bit_for_bit_except_nan_payload(rng):
    """torch's ``codes.view(float8_e4m3fn).to(bfloat16) * scale`` on the CPU: the same bits
    for every non-NaN result, NaN where torch has NaN (torch writes other NaN bits)."""
    torch = pytest.importorskip("torch")
    codes = torch.from_numpy(ALL_CODES.copy()).view(torch.float8_e4m3fn).to(torch.bfloat16)
    for sb in (*SPECIAL_SCALES, *random_finite_bf16(rng, 200)):
        scale = torch.from_numpy(np.array([sb], np.uint16).view(np.int16)).view(torch.bfloat16)
        t = (codes * scale[0]).view(torch.int16).numpy().view(np.uint16)
        ref = dequantize_fp8_table_scale_reference(ALL_CODES, bf16_of(sb)).view(np.uint16)
        t_nan = (t & 0x7FFF) > 0x7F80
        ref_nan = (ref & 0x7FFF) > 0x7F80
        np.testing.assert_array_equal(ref_nan, t_nan, err_msg=hex(sb))
        np.testing.assert_array_equal(ref[~ref_nan], t[~t_nan], err_msg=hex(sb))


# --- the CPU path -------------------------------------------------------------------------


@pytest.mark.parametrize("id_dtype", ID_DTYPES)
def test_cpu_path_equals_reference(rng, id_dtype):
    codes = rng.integers(0, 256, size=(500, 160), dtype=np.uint8)  # NaN codes included
    codes[3, :8] = [0x7F, 0xFF, 0x01, 0x81, 0x07, 0x00, 0x80, 0x7E]  # NaN, subnormal, zeros, max
    for sb in (*SPECIAL_SCALES, *random_finite_bf16(rng, 20)):
        ids = rng.integers(0, 500, size=300).astype(id_dtype)
        ids[0] = 3
        got = rowcache.kernels.batched_embed_fp8_table_scale(ids, codes, bf16_of(sb))
        want = batched_embed_fp8_table_scale_reference(ids, codes, bf16_of(sb))
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
        out = np.full((300, 320), POISON, np.uint16).view(BF16)
        rowcache.kernels.batched_embed_fp8_table_scale(ids, codes, bf16_of(sb), out[:, 160:])
        np.testing.assert_array_equal(out[:, 160:].view(np.uint16), want.view(np.uint16))
        assert (out[:, :160].view(np.uint16) == POISON).all()


def test_scale_forms_and_refusals():
    codes = np.arange(64, dtype=np.uint8).reshape(4, 16)
    ids = np.array([0, 3])
    want = batched_embed_fp8_table_scale_reference(ids, codes, bf16_of(0x3E00))  # 0.125
    for scale in (0.125, np.float32(0.125), np.array([0.125], BF16), bf16_of(0x3E00), 0.125):
        got = rowcache.kernels.batched_embed_fp8_table_scale(ids, codes, scale)
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    assert rowcache.kernels.batched_embed_fp8_table_scale(ids, codes, 2).dtype == BF16
    for bad, match in (
        (0.1, "not a bfloat16 value"),
        (np.ones(2, BF16), "one bfloat16 value"),
        (True, "one bfloat16 value"),
        ("0.5", "one bfloat16 value"),
    ):
        with pytest.raises(ConfigError, match=match) as e:
            rowcache.kernels.batched_embed_fp8_table_scale(ids, codes, bad)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="codes"):
        rowcache.kernels.batched_embed_fp8_table_scale(ids, codes.view(np.int8), 1.0)
    with pytest.raises(IndexError):
        rowcache.kernels.batched_embed_fp8_table_scale(np.array([4]), codes, 1.0)


# --- the kernel against the reference --------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("id_dtype", ID_DTYPES)
def test_gpu_kernel_equals_reference(rng, dim, id_dtype):
    import cupy as cp

    rows = 700
    codes = rng.integers(0, 256, size=(rows, dim), dtype=np.uint8)  # every code, NaN too
    flat = codes.reshape(-1)
    flat[:256] = ALL_CODES  # every code appears (rows x dim >= 700 > 256)
    dev_codes = cp.asarray(codes)
    scales = (*SPECIAL_SCALES, 0x7F80, 0xFF80, 0x7FC0, *random_finite_bf16(rng, 12))
    for sb in scales:
        ids = rng.integers(0, rows, size=513).astype(id_dtype)
        ids[:3] = [0, rows - 1, 1]
        want = batched_embed_fp8_table_scale_reference(ids, codes, bf16_of(sb))
        got = rowcache.kernels.batched_embed_fp8_table_scale(
            cp.asarray(ids), dev_codes, bf16_of(sb)
        )
        np.testing.assert_array_equal(got.get().view(np.uint16), want.view(np.uint16), hex(sb))
        # a poisoned, column-offset output (odd offsets force narrow words)
        out = cp.full((513, dim + 3), POISON, cp.uint16).view(BF16)
        rowcache.kernels.batched_embed_fp8_table_scale(ids, dev_codes, bf16_of(sb), out[:, 1:-2])
        host = out.get().view(np.uint16)
        np.testing.assert_array_equal(host[:, 1:-2], want.view(np.uint16))
        assert (host[:, 0] == POISON).all() and (host[:, -2:] == POISON).all()


@pytest.mark.gpu
def test_gpu_kernel_every_code_every_subnormal_scale():
    """Every code times every subnormal and smallest-normal bf16 scale: the products fall
    far below float32's normal range, where a flush to zero would show."""
    import cupy as cp

    codes = np.tile(ALL_CODES, (2, 1))
    dev = cp.asarray(codes)
    ids = np.array([0, 1])
    for sb in [*range(1, 0x81), *range(0x8001, 0x8081)]:
        want = batched_embed_fp8_table_scale_reference(ids, codes, bf16_of(sb))
        got = rowcache.kernels.batched_embed_fp8_table_scale(cp.asarray(ids), dev, bf16_of(sb))
        np.testing.assert_array_equal(got.get().view(np.uint16), want.view(np.uint16), hex(sb))


@pytest.mark.gpu
def test_gpu_kernel_reads_mapped_host_codes_and_empty_batches(rng):
    import cupy as cp

    codes = rng.integers(0, 256, size=(300, 160), dtype=np.uint8)
    mapped = mapped_host_array(cp, codes)
    ids = rng.integers(0, 300, size=200)
    want = batched_embed_fp8_table_scale_reference(ids, codes, bf16_of(0x3C23))
    got = rowcache.kernels.batched_embed_fp8_table_scale(cp.asarray(ids), mapped, bf16_of(0x3C23))
    np.testing.assert_array_equal(got.get().view(np.uint16), want.view(np.uint16))
    empty = rowcache.kernels.batched_embed_fp8_table_scale(
        cp.zeros(0, cp.int64), cp.asarray(codes), 1.0
    )
    assert empty.shape == (0, 160)
