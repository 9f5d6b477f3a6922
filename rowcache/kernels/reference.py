"""NumPy references of the gather, scatter and FP8 kernels: the specification.

Every GPU kernel in this package is tested bit for bit against the function here of
the same name minus ``_reference``. These functions are also the CPU path of the
project (arena = NumPy array), so they are written to be fast in NumPy: no Python
loop per row. (The n-gram hash, stacked gather, GEMM and scaled-sum references live
beside their launchers in ``rowcache.kernels.ngram.hash``, the overlay's in ``rowcache.kernels.overlay.routed``,
each named ``<kernel>_reference``.) Rounding rules follow ``docs/platform.md``: float32 -> bfloat16 and
float32 -> E4M3 (satfinite) through ``ml_dtypes`` match CUDA's conversions exactly.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)  # OCP MX's UE8M0 scale: 2**(e - 127), 0xFF NaN
FP8_MAX = np.float32(448.0)
BF16_NAN_BITS = 0x7FC0  # the NaN every table-scaled FP8 gather writes (float32's quiet NaN, cut)
_E4M3_TO_F32 = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)
_F32_TINY = np.finfo(np.float32).tiny
# UE8M0 byte e -> 2**(e - 127) as float32, exact for every byte: 0 -> 2**-127 (a float32
# subnormal), 254 -> 2**127; 255 -> NaN (OCP MX v1.0, section 5.4.1).
_E8M0_TO_F32 = np.append(np.ldexp(np.float32(1.0), np.arange(-127, 128)), np.nan).astype(np.float32)


def quantize_fp8_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row absmax E4M3 quantization.

    Parameters
    ----------
    x : bfloat16[n, d] or float32[n, d]

    Returns
    -------
    codes : uint8[n, d]
        ``satfinite_e4m3(x / scale)`` with the division in float32.
    scales : float32[n]
        ``amax(|x|) / 448`` in float32, or 1.0 where that quotient is zero: an all-zero
        row, and a row so small that the division underflows (``0 < amax <= 448 * 2**-150``,
        about 3.1e-43). Such a row's codes are then ``e4m3(x)``, signed zeros, and it
        dequantizes to zeros: the nearest values the FP8 gathers can serve, since they flush
        any product below 2**-126 (:func:`dequantize_fp8_reference`) whatever the scale.
        (A scale of 0 made ``x / 0`` an Inf or, for a zero, a NaN code, served as NaN.)
    """
    x32 = np.asarray(x).astype(np.float32, copy=False)
    if x32.ndim != 2:
        raise ValueError(f"x must be 2-D [rows, dim], got shape {x32.shape}")
    amax = np.abs(x32).max(axis=1) if x32.shape[1] else np.zeros(x32.shape[0], np.float32)
    scales = (amax / FP8_MAX).astype(np.float32)
    scales[scales == 0] = np.float32(1.0)
    with np.errstate(invalid="ignore"):  # only a row holding a NaN or an Inf: its NaN codes
        q = np.clip(x32 / scales[:, None], -FP8_MAX, FP8_MAX)
    return q.astype(E4M3).view(np.uint8), scales


def _flush_subnormal(x: np.ndarray) -> np.ndarray:
    """Subnormal float32 values become a zero of the same sign."""
    return np.where(np.abs(x) < _F32_TINY, np.copysign(np.float32(0), x), x).astype(np.float32)


def dequantize_fp8_reference(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """``bf16(ftz(float32(e4m3(codes)) * ftz(scales)[:, None]))``, round to nearest even.

    ``ftz`` flushes subnormal float32 values to a signed zero: the H200's float32
    multiply in these kernels does so for subnormal operands and results, even when
    compiled with ``--ftz=false`` (``tests/kernels/test_gather.py`` checks the GPU kernels
    against this flush bit for bit). It matters only for scales or products below 1.2e-38.
    """
    vals = _E4M3_TO_F32[np.asarray(codes, dtype=np.uint8)]  # exact: a table of the 256 values
    prod = vals * _flush_subnormal(np.asarray(scales, dtype=np.float32))[:, None]
    return _flush_subnormal(prod).astype(BF16)


def bf16_scale_reference(scale: object) -> np.float32:
    """A table scale as the float32 the gathers multiply by: the bf16 value ``scale``
    holds (a bfloat16 scalar or 0-d array, or a float that is exactly a bfloat16 value),
    widened exactly. The launchers check ``scale`` (``rowcache.kernels.gather``)."""
    return np.float32(np.asarray(scale).astype(BF16).astype(np.float32))


def dequantize_fp8_table_scale_reference(codes: np.ndarray, scale: object) -> np.ndarray:
    """``bf16_rn(float32(e4m3(codes)) * float32(scale))``: E4M3 codes and ONE bf16 scale.

    The rule of checkpoints that ship E4M3 codes with one BF16 ``weight_scale`` per table
    (Qwen3.8-Flash-Next's FP8 release), as ``codes.to(bfloat16) * scale`` computes it: the
    code is exactly a bfloat16 value, the float32 product of two bfloat16 values is exact
    (subnormal products included: no flush here, none on the GPU either), and the one
    rounding is to bfloat16, nearest even. So the result is the exact product rounded once.

    Specials: a NaN code (0x7F, 0xFF) or a NaN scale gives NaN, as torch's does, written as
    the bfloat16 ``0x7FC0`` (positive quiet NaN) on every path: torch's own NaN bits differ
    between its paths (2.13 on the CPU writes ``0xFFFF``; a GPU conversion writes its
    canonical NaN), so rowcache fixes one, and the code's sign is not kept; an infinite scale gives +-Inf times a non-zero code and NaN
    (``0x7FC0``) times a zero code; a product beyond bfloat16's range rounds to +-Inf.
    The store and the resident table refuse a non-finite scale at their boundaries.
    """
    vals = _E4M3_TO_F32[np.asarray(codes, dtype=np.uint8)]  # exact: a table of the 256 values
    with np.errstate(invalid="ignore", over="ignore"):
        prod = vals * bf16_scale_reference(scale)
    out = prod.astype(BF16)
    nan = np.isnan(prod)
    if nan.any():
        out.view(np.uint16)[nan] = BF16_NAN_BITS
    return out


def dequantize_fp8_block_reference(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """``bf16_rn(float32(e4m3(code)) * 2**(e - 127))``: E4M3 codes, one UE8M0 byte a block.

    The rule of block-scaled FP8 checkpoints (DeepSeek-V4.1-Flash's Engram tables, OCP MX
    style): row ``r``'s values ``[k * B, (k + 1) * B)`` share the scale byte ``scales[r, k]``,
    ``B = d // nb`` (32 in V4.1).

    Parameters
    ----------
    codes : uint8[n, d]
        E4M3 (fn) bit patterns.
    scales : uint8[n, nb]
        UE8M0 bytes; ``nb`` divides ``d``.

    Returns
    -------
    bfloat16[n, d]

    The float32 product is exact for every code and every byte: an E4M3 value has at most 4
    significant bits and magnitude in ``[2**-9, 448]``, so its product with ``2**(e - 127)``
    lies in ``[2**-136, 1.75 * 2**135]`` and its last bit is at least ``2**-136``, above
    float32's subnormal step ``2**-149``; it overflows only past ``2**128`` (``e >= 247`` with
    codes of magnitude ``>= 2**(128 - (e - 127))``), to +-Inf, which bf16's rounding of the
    exact value gives too. The one rounding is the conversion to bf16, nearest even, which
    changes nothing where the product is a bf16 normal (it has at most 4 significant bits
    against bf16's 8); below ``2**-126`` it rounds to bf16's subnormal step ``2**-133``, which
    loses bits only for ``e <= 2`` (some products become +-0). Nothing is flushed.

    Specials: ``e = 0`` is ``2**-127`` (the OCP value; engines that build the float32 scale as
    ``e << 23`` read 0 there); ``e = 255`` is NaN (OCP MX: the UE8M0 NaN), so every value of its
    block is NaN, zero codes included (engines that shift read +Inf); a NaN code (0x7F, 0xFF)
    is NaN. Every NaN is written as the bf16 ``0x7FC0``, as the table-scaled gather writes it.
    Signed zeros are kept.
    """
    c = np.asarray(codes, dtype=np.uint8)
    e = np.asarray(scales, dtype=np.uint8)
    n, d = c.shape
    nb = e.shape[1]
    vals = _E4M3_TO_F32[c].reshape(n, nb, d // nb if nb else 0)
    with np.errstate(invalid="ignore", over="ignore"):
        prod = (vals * _E8M0_TO_F32[e][:, :, None]).reshape(n, d)
    out = prod.astype(BF16)
    nan = np.isnan(prod)
    if nan.any():
        out.view(np.uint16)[nan] = BF16_NAN_BITS
    return out


def _check_ids(ids: np.ndarray, rows: int) -> np.ndarray:
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise ValueError(f"ids must be a 1-D integer array, got {ids.dtype}{list(ids.shape)}")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= rows):
        bad = int(np.flatnonzero((ids < 0) | (ids >= rows))[0])
        raise IndexError(f"ids[{bad}] = {int(ids[bad])} is outside the table's {rows} rows")
    return ids


def batched_embed_reference(
    ids: np.ndarray, table: np.ndarray, out: np.ndarray | None = None
) -> np.ndarray:
    """``out[i] = table[ids[i]]`` for a bfloat16 table ``[rows, d]``; returns ``out``."""
    ids = _check_ids(ids, table.shape[0])
    if out is None:
        return table[ids]
    np.take(
        table, ids, axis=0, out=out, mode="clip"
    )  # ids were checked: clip avoids a buffered copy
    return out


def batched_embed_fp8_reference(
    ids: np.ndarray, codes: np.ndarray, scales: np.ndarray, out: np.ndarray | None = None
) -> np.ndarray:
    """``out[i] = bf16(e4m3(codes[ids[i]]) * scales[ids[i]])``; returns bf16 ``[n, d]``."""
    ids = _check_ids(ids, codes.shape[0])
    res = dequantize_fp8_reference(codes[ids], scales[ids])
    if out is None:
        return res
    out[...] = res
    return out


def batched_embed_fp8_table_scale_reference(
    ids: np.ndarray, codes: np.ndarray, scale: object, out: np.ndarray | None = None
) -> np.ndarray:
    """``out[i] = bf16_rn(e4m3(codes[ids[i]]) * scale)``, one bf16 ``scale`` for the table
    (:func:`dequantize_fp8_table_scale_reference`); returns bf16 ``[n, d]``."""
    ids = _check_ids(ids, codes.shape[0])
    res = dequantize_fp8_table_scale_reference(codes[ids], scale)
    if out is None:
        return res
    out[...] = res
    return out


def batched_embed_fp8_block_reference(
    ids: np.ndarray, codes: np.ndarray, scales: np.ndarray, out: np.ndarray | None = None
) -> np.ndarray:
    """``out[i] = bf16_rn(e4m3(codes[ids[i]]) * 2**(scales[ids[i], block] - 127))``, one
    UE8M0 byte a block of ``d // scales.shape[1]`` values
    (:func:`dequantize_fp8_block_reference`); returns bf16 ``[n, d]``."""
    ids = _check_ids(ids, codes.shape[0])
    res = dequantize_fp8_block_reference(codes[ids], scales[ids])
    if out is None:
        return res
    out[...] = res
    return out


def scatter_records_reference(
    records: np.ndarray,
    slots: np.ndarray,
    table: np.ndarray,
    scales: np.ndarray | None = None,
) -> None:
    """Write staged store records into arena slots, in place.

    Parameters
    ----------
    records : uint8[n, record_bytes]
        Rows as stored (see ``rowcache.format.codecs``): the arena row's bytes verbatim
        (bf16 values, or E4M3 codes of a table-scaled codec), or, with ``scales``, FP8
        codes followed by the row's float32 scale.
    slots : int[n]
        Destination slot of each record (distinct).
    table : bfloat16[slots, d] or uint8[slots, d]
        The arena. With ``scales`` (float32[slots]) it is uint8 FP8 codes and each
        record's scale goes to ``scales``; without, each row is the record's first
        ``d * itemsize`` bytes.
    """
    slots = np.asarray(slots, dtype=np.int64)
    d = table.shape[1]
    if scales is None:
        row = d * table.itemsize
        table[slots] = records[:, :row].view(table.dtype).reshape(len(slots), d)
    else:
        table[slots] = records[:, :d]
        scales[slots] = np.ascontiguousarray(records[:, d : d + 4]).view("<f4").reshape(-1)
