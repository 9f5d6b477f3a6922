"""Kernels of the n-gram embedding: hashed ids, the fp32-accumulated projection, the scaled sum.

Owns the launchers of ``kernels/ngram.cu`` and their NumPy references (the
specification, and the CPU path): ``ngram_hash`` (the LongCat id of every table and
position, ``docs/ngram-spec.md``), ``gemm_bf16_f32`` (bf16 x bf16 -> float32 through
cuBLAS with fp32 accumulation) and ``scale_sum`` (``bf16((word + proj) / denom)``).
Does not know about ``embed``'s objects: it takes plain arrays and multipliers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._cuda import get_kernel, is_device_array, launch_1d, require_cupy
from .reference import BF16

_SOURCE = "ngram.cu"


# --- the hash -----------------------------------------------------------------
def ngram_hash_reference(
    tokens: np.ndarray,
    multipliers: np.ndarray,
    rows: np.ndarray,
    eos: int,
    starts: np.ndarray | None = None,
) -> np.ndarray:
    """LongCat n-gram ids of every table at every position, vectorized.

    Parameters
    ----------
    tokens : int[L]
        Token ids, already checked to lie in ``[0, V)``.
    multipliers : int64[T, N]
        ``V**j mod rows[i]`` for ``j < order(i)``, 0 beyond (``NgramDims.multipliers``).
    rows : int64[T]
        Row count ``M_i`` of every table.
    eos : int
        The EOS token: the look-back of position ``t`` stops at an EOS strictly before ``t``.
    starts : int64[L], optional
        First position of the sequence of each position, when several sequences are
        concatenated: the look-back never reaches before ``starts[t]``. Default 0.

    Returns
    -------
    int64[T, L]
        ``(sum_j xt(t - j) * multipliers[i, j]) mod rows[i]``.
    """
    x = np.asarray(tokens).astype(np.int64, copy=False)
    mult = np.asarray(multipliers, dtype=np.int64)
    mod = np.asarray(rows, dtype=np.int64)
    max_n = mult.shape[1]
    length = x.shape[0]
    pos = np.arange(length, dtype=np.int64)
    # start[t] = first position of t's segment: one past the last EOS before t.
    last_eos = np.maximum.accumulate(np.where(x == eos, pos, -1))
    start = np.zeros(length, dtype=np.int64)
    start[1:] = last_eos[:-1] + 1
    if starts is not None:
        np.maximum(start, np.asarray(starts, dtype=np.int64), out=start)
    acc = mult[:, :1] * x[None, :]
    shifted = np.empty(length, dtype=np.int64)
    for j in range(1, max_n):  # loop over orders (<= N), vectorized over positions
        shifted[:j] = 0
        shifted[j:] = x[:-j] if j < length else x[:0]
        shifted[pos - j < start] = 0
        acc += mult[:, j : j + 1] * shifted[None, :]
    acc %= mod[:, None]
    return acc


def ngram_hash(tokens: Any, multipliers: Any, rows: Any, eos: int, starts: Any = None) -> Any:
    """:func:`ngram_hash_reference` on NumPy input, the CUDA kernel on cupy input.

    ``tokens`` decides the device; the result (int64[T, L]) lives on the same device
    and is bit-identical.
    """
    if not is_device_array(tokens):
        return ngram_hash_reference(tokens, multipliers, rows, eos, starts)
    cp = require_cupy("ngram_hash")
    tok = cp.ascontiguousarray(tokens, dtype=cp.int64)
    mult = cp.ascontiguousarray(cp.asarray(multipliers), dtype=cp.int64)
    mod = cp.ascontiguousarray(cp.asarray(rows), dtype=cp.int64)
    n_tables, max_n = mult.shape
    length = tok.shape[0]
    first = tok if starts is None else cp.ascontiguousarray(cp.asarray(starts), dtype=cp.int64)
    if first.shape != tok.shape:
        raise ValueError(f"starts must have the shape of tokens {tok.shape}, got {first.shape}")
    out = cp.empty((n_tables, length), dtype=cp.int64)
    total = n_tables * length
    if total == 0:
        return out
    kern = get_kernel(_SOURCE, "ngram_hash")
    grid, block = launch_1d(total)
    kern(
        grid,
        block,
        (
            tok,
            first,
            mult,
            mod,
            out,
            np.int64(length),
            np.int32(n_tables),
            np.int32(max_n),
            np.int64(eos),
            np.int32(starts is not None),
        ),
    )
    return out


# --- the projection GEMM ------------------------------------------------------
def gemm_bf16_f32_reference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``float32(a) @ float32(b)``: a bfloat16[n, k], b bfloat16 or float32[k, m] -> float32[n, m]."""
    return np.asarray(a).astype(np.float32) @ np.asarray(b).astype(np.float32, copy=False)


def gemm_bf16_f32(a: Any, b: Any, out: Any = None) -> Any:
    """``a @ b`` with bf16 inputs, fp32 accumulation and a float32 result.

    Parameters
    ----------
    a : bfloat16[n, k]
    b : bfloat16[k, m] (on the GPU), or bfloat16/float32 (on the CPU)
    out : float32[n, m], optional
        Written in place (C-contiguous) on the GPU.

    Returns
    -------
    float32[n, m]
        On the GPU through ``cublasGemmEx`` (``CUBLAS_COMPUTE_32F``, tensor cores);
        on the CPU :func:`gemm_bf16_f32_reference`. Both accumulate in fp32 but in
        different orders, so they agree to rounding, not bit for bit.
    """
    if not is_device_array(a):
        res = gemm_bf16_f32_reference(a, b)
        if out is None:
            return res
        out[...] = res
        return out
    cp = require_cupy("gemm_bf16_f32")
    from cupy.cuda import cublas, device, runtime

    if a.dtype != BF16 or b.dtype != BF16 or a.ndim != 2 or b.ndim != 2:
        raise ValueError(
            f"gemm_bf16_f32 takes bfloat16 2-D arrays, got a {a.dtype}{list(a.shape)} "
            f"and b {b.dtype}{list(b.shape)}"
        )
    n, k = a.shape
    k2, m = b.shape
    if k != k2:
        raise ValueError(f"gemm_bf16_f32: a is [{n}, {k}] but b is [{k2}, {m}]")
    a = cp.ascontiguousarray(a)
    b = cp.ascontiguousarray(b)
    if out is None:
        out = cp.empty((n, m), dtype=cp.float32)
    elif out.dtype != cp.float32 or out.shape != (n, m) or not out.flags.c_contiguous:
        raise ValueError(
            f"gemm_bf16_f32: out must be C-contiguous float32[{n}, {m}], "
            f"got {out.dtype}{list(out.shape)}"
        )
    if n == 0 or m == 0:
        return out
    if k == 0:
        out.fill(0)
        return out
    one = np.array(1.0, dtype=np.float32)
    zero = np.array(0.0, dtype=np.float32)
    # Row-major C[n, m] = A[n, k] B[k, m] is column-major C^T = B^T A^T: pass B first.
    cublas.gemmEx(
        device.get_cublas_handle(),
        getattr(cublas, "CUBLAS_OP_N", 0),
        getattr(cublas, "CUBLAS_OP_N", 0),
        m,
        n,
        k,
        one.ctypes.data,
        b.data.ptr,
        getattr(runtime, "CUDA_R_16BF", 14),
        m,
        a.data.ptr,
        getattr(runtime, "CUDA_R_16BF", 14),
        k,
        zero.ctypes.data,
        out.data.ptr,
        getattr(runtime, "CUDA_R_32F", 0),
        m,
        getattr(cublas, "CUBLAS_COMPUTE_32F", 68),
        getattr(cublas, "CUBLAS_GEMM_DEFAULT", -1),
    )
    return out


# --- the scaled sum -------------------------------------------------------------
def scale_sum_reference(
    word: np.ndarray, proj: np.ndarray, denom: float, out: np.ndarray | None = None
) -> np.ndarray:
    """``bf16((float32(word) + proj) / float32(denom))``, round to nearest even.

    word : bfloat16[n, D]; proj : float32[n, D]; returns bfloat16[n, D].
    """
    res = ((np.asarray(word).astype(np.float32) + proj) / np.float32(denom)).astype(BF16)
    if out is None:
        return res
    out[...] = res
    return out


def scale_sum(word: Any, proj: Any, denom: float, out: Any = None) -> Any:
    """:func:`scale_sum_reference` on NumPy input, the CUDA kernel on cupy; bit-identical."""
    if not is_device_array(proj):
        return scale_sum_reference(word, proj, denom, out)
    cp = require_cupy("scale_sum")
    if word.shape != proj.shape or word.dtype != BF16 or proj.dtype != cp.float32:
        raise ValueError(
            f"scale_sum takes word bfloat16 and proj float32 of one shape, got "
            f"{word.dtype}{list(word.shape)} and {proj.dtype}{list(proj.shape)}"
        )
    word = cp.ascontiguousarray(word)
    proj = cp.ascontiguousarray(proj)
    if out is None:
        out = cp.empty(word.shape, dtype=BF16)
    n = int(word.size)
    if n:
        grid, block = launch_1d(n)
        get_kernel(_SOURCE, "ngram_scale_sum")(
            grid, block, (word, proj, out, np.int64(n), np.float32(denom))
        )
    return out


__all__ = [
    "gemm_bf16_f32",
    "gemm_bf16_f32_reference",
    "ngram_hash",
    "ngram_hash_reference",
    "scale_sum",
    "scale_sum_reference",
]
