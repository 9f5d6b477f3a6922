"""The block-scaled FP8 gather (codec ``fp8_block_e8m0``): E4M3 codes, one UE8M0 byte a block.

The reference against an independent per-element rule (the exact product in float64,
rounded to bf16 by integer arithmetic) for every code times every scale byte, against torch's
``float8_e4m3fn.float() * float8_e8m0fnu.float()`` rounded to bfloat16, and its specials (the
scale bytes 0 and 255, NaN codes, overflow, subnormal results); the CPU path against the
reference over the two parts of an arena of records; the argument checks; on the GPU the
``.cu`` kernel against the reference bit for bit, every code and byte included, with odd
blocks, strided outputs, record arenas and tables in mapped pinned host memory.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

import rowcache.kernels
from rowcache.errors import ConfigError
from rowcache.kernels.reference import (
    BF16,
    BF16_NAN_BITS,
    batched_embed_fp8_block_reference,
    dequantize_fp8_block_reference,
)
from tests.kernels.support import bf16_bits_rne, e4m3_value, mapped_host_array

ALL = np.arange(256, dtype=np.uint8)
ID_DTYPES = (np.int32, np.int64)
POISON = 0xFFFF
# (dim, block): V4.1's 256 / 32, smaller blocks, a block of one, odd blocks and dims
SHAPES = ((256, 32), (64, 32), (96, 16), (21, 7), (8, 1), (5, 5), (160, 32))


def python_rule(code: int, e: int) -> int:
    """bf16 bits of bf16_rn(e4m3(code) * 2**(e - 127)), from the exact product: an E4M3 value
    times a power of two is exact in float64 and in float32 (4 significant bits, magnitudes
    2**-136 .. 1.75 * 2**135, beyond float32's range only past 2**128, where it is Inf)."""
    v = e4m3_value(code)
    if v != v or e == 255:
        return BF16_NAN_BITS
    prod = v * 2.0 ** (e - 127)
    with np.errstate(over="ignore"):
        f = np.float32(prod)
    assert np.isinf(f) or Fraction(float(f)) == Fraction(v) * Fraction(2) ** (e - 127)
    return bf16_bits_rne(f)


def every_code_every_byte() -> tuple[np.ndarray, np.ndarray]:
    """Row ``e`` holds all 256 codes in blocks of 32, each block scaled by the byte ``e``."""
    codes = np.tile(ALL, (256, 1))
    scales = np.repeat(ALL[:, None], 8, axis=1)
    return codes, scales


def test_reference_matches_the_exact_rule_for_every_code_and_byte():
    codes, scales = every_code_every_byte()
    got = dequantize_fp8_block_reference(codes, scales).view(np.uint16)
    want = np.array([[python_rule(c, e) for c in range(256)] for e in range(256)], np.uint16)
    np.testing.assert_array_equal(got, want)


def test_reference_is_exact_except_bf16_subnormal_steps_at_bytes_0_to_2():
    """The docstring's claim: the result is the exact product wherever it is finite, except
    where it falls below bf16's subnormal step (``e <= 2`` only)."""
    codes, scales = every_code_every_byte()
    got = dequantize_fp8_block_reference(codes, scales).astype(np.float64)
    inexact = set()
    for e in range(255):
        for c in range(256):
            v = e4m3_value(c)
            if v != v or np.isinf(got[e, c]):
                continue
            if Fraction(float(got[e, c])) != Fraction(v) * Fraction(2) ** (e - 127):
                inexact.add(e)
    assert inexact == {0, 1, 2}


def test_reference_specials():
    codes = np.array([[0x00, 0x80, 0x38, 0x01, 0x7E, 0xFE, 0x7F, 0xFF]], np.uint8)

    def row(e):
        return dequantize_fp8_block_reference(codes, np.array([[e]], np.uint8)).view(np.uint16)[0]

    # e = 127: 2**0, the codes' own values; signed zeros kept; NaN codes NaN
    assert row(127).tolist() == [0x0000, 0x8000, 0x3F80, 0x3B00, 0x43E0, 0xC3E0, 0x7FC0, 0x7FC0]
    # e = 0: 2**-127 (OCP), a bf16 subnormal: 1.0 -> 0x0040; 2**-9 * 2**-127 rounds to +0
    assert row(0).tolist()[:4] == [0x0000, 0x8000, 0x0040, 0x0000]
    # e = 254: 2**127; 448 * 2**127 overflows to +-Inf
    assert row(254).tolist()[2:6] == [0x7F00, 0x7A80, 0x7F80, 0xFF80]
    # e = 255: the UE8M0 NaN, so every value of its block is NaN, zero codes included
    assert row(255).tolist() == [BF16_NAN_BITS] * 8
    # a NaN byte spoils its own block only
    two = np.array([[0x38, 0x38]], np.uint8)
    got = dequantize_fp8_block_reference(two, np.array([[255, 127]], np.uint8)).view(np.uint16)
    assert got.tolist() == [[BF16_NAN_BITS, 0x3F80]]


def test_reference_equals_torch_bit_for_bit_except_nan_payload():
    torch = pytest.importorskip("torch")
    codes, scales = every_code_every_byte()
    vals = torch.from_numpy(codes.copy()).view(torch.float8_e4m3fn).float()
    s = torch.from_numpy(scales.copy()).view(torch.float8_e8m0fnu).float()
    t = (vals.reshape(256, 8, 32) * s[:, :, None]).reshape(256, 256).to(torch.bfloat16)
    t = t.view(torch.int16).numpy().view(np.uint16)
    ref = dequantize_fp8_block_reference(codes, scales).view(np.uint16)
    t_nan, ref_nan = (t & 0x7FFF) > 0x7F80, (ref & 0x7FFF) > 0x7F80
    np.testing.assert_array_equal(ref_nan, t_nan)
    np.testing.assert_array_equal(ref[~ref_nan], t[~t_nan])


def records(rng, rows, dim, block):
    """An arena-like table of records: ``dim`` codes, then ``dim // block`` scale bytes."""
    rec = rng.integers(0, 256, size=(rows, dim + dim // block), dtype=np.uint8)
    rec[0, :dim] = np.resize(ALL, dim)
    rec[1, dim:] = np.resize(np.array([0, 255, 254, 1, 127], np.uint8), dim // block)
    return rec


@pytest.mark.parametrize("id_dtype", ID_DTYPES)
@pytest.mark.parametrize(("dim", "block"), SHAPES)
def test_cpu_path_equals_reference_over_an_arena_of_records(rng, id_dtype, dim, block):
    rec = records(rng, 300, dim, block)
    codes, scales = rec[:, :dim], rec[:, dim:]  # views: strided rows, as a cache's arena
    ids = rng.integers(0, 300, size=200).astype(id_dtype)
    ids[:2] = [0, 1]
    got = rowcache.kernels.batched_embed_fp8_block(ids, codes, scales)
    want = batched_embed_fp8_block_reference(ids, codes.copy(), scales.copy())
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    out = np.full((200, 2 * dim), POISON, np.uint16).view(BF16)
    rowcache.kernels.batched_embed_fp8_block(ids, codes, scales, out[:, dim:])
    np.testing.assert_array_equal(out[:, dim:].view(np.uint16), want.view(np.uint16))
    assert (out[:, :dim].view(np.uint16) == POISON).all()


def test_argument_checks():
    codes, scales = np.zeros((4, 64), np.uint8), np.zeros((4, 2), np.uint8)
    ids = np.array([0, 3])
    assert rowcache.kernels.batched_embed_fp8_block(ids, codes, scales).shape == (2, 64)
    for c, s, match in (
        (codes, np.zeros((4, 3), np.uint8), "number of blocks dividing 64"),
        (codes, np.zeros((3, 2), np.uint8), r"scales must be \[4, d / block\]"),
        (codes, np.zeros((4, 0), np.uint8), "number of blocks"),
        (codes[:, :1], np.zeros((4, 2), np.uint8), "number of blocks"),
        (codes, scales.astype(np.float32), "scales must be 2-D with dtype uint8"),
        (codes.view(np.int8), scales, "codes must be 2-D with dtype uint8"),
        (codes, scales[:, 0], "scales must be 2-D"),
    ):
        with pytest.raises(ConfigError, match=match) as e:
            rowcache.kernels.batched_embed_fp8_block(ids, c, s)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="out must have shape"):
        rowcache.kernels.batched_embed_fp8_block(ids, codes, scales, np.zeros((2, 63), BF16))
    with pytest.raises(IndexError):
        rowcache.kernels.batched_embed_fp8_block(np.array([4]), codes, scales)


# --- the kernel against the reference --------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(("dim", "block"), SHAPES)
@pytest.mark.parametrize("id_dtype", ID_DTYPES)
def test_gpu_kernel_equals_reference(rng, dim, block, id_dtype):
    import cupy as cp

    rows = 700
    rec = records(rng, rows, dim, block)
    dev = cp.asarray(rec)
    two_tensors = (
        cp.asarray(np.ascontiguousarray(rec[:, :dim])),
        cp.asarray(np.ascontiguousarray(rec[:, dim:])),
    )
    for codes, scales in ((dev[:, :dim], dev[:, dim:]), two_tensors):  # an arena; a table
        ids = rng.integers(0, rows, size=513).astype(id_dtype)
        ids[:3] = [0, rows - 1, 1]
        want = batched_embed_fp8_block_reference(ids, rec[:, :dim], rec[:, dim:])
        got = rowcache.kernels.batched_embed_fp8_block(cp.asarray(ids), codes, scales)
        np.testing.assert_array_equal(got.get().view(np.uint16), want.view(np.uint16))
        # a poisoned, column-offset output (odd offsets force narrow words)
        out = cp.full((513, dim + 3), POISON, cp.uint16).view(BF16)
        rowcache.kernels.batched_embed_fp8_block(ids, codes, scales, out[:, 1:-2])
        host = out.get().view(np.uint16)
        np.testing.assert_array_equal(host[:, 1:-2], want.view(np.uint16))
        assert (host[:, 0] == POISON).all() and (host[:, -2:] == POISON).all()


@pytest.mark.gpu
def test_gpu_kernel_every_code_every_byte():
    """Every code times every scale byte: the bytes 0 (a subnormal bf16 scale, 2**-127),
    1 and 2 (bf16 subnormal results, rounded), 247..254 (overflow) and 255 (NaN)."""
    import cupy as cp

    codes, scales = every_code_every_byte()
    ids = np.arange(256)
    want = batched_embed_fp8_block_reference(ids, codes, scales)
    got = rowcache.kernels.batched_embed_fp8_block(
        cp.asarray(ids), cp.asarray(codes), cp.asarray(scales)
    )
    np.testing.assert_array_equal(got.get().view(np.uint16), want.view(np.uint16))


@pytest.mark.gpu
def test_gpu_kernel_reads_mapped_host_records_and_empty_batches(rng):
    import cupy as cp

    rec = records(rng, 300, 256, 32)
    mapped = mapped_host_array(cp, rec)
    ids = rng.integers(0, 300, size=200)
    want = batched_embed_fp8_block_reference(ids, rec[:, :256], rec[:, 256:])
    got = rowcache.kernels.batched_embed_fp8_block(
        cp.asarray(ids), mapped[:, :256], mapped[:, 256:]
    )
    np.testing.assert_array_equal(got.get().view(np.uint16), want.view(np.uint16))
    empty = rowcache.kernels.batched_embed_fp8_block(
        cp.zeros(0, cp.int64), cp.asarray(rec[:, :256]), cp.asarray(rec[:, 256:])
    )
    assert empty.shape == (0, 256)
