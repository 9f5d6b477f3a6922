"""The projection GEMM of the n-gram embedding and its scaled sum (not n-gram specific).

Owns ``gemm_bf16_f32`` (bf16 x bf16 -> float32 through cuBLAS with fp32
accumulation), ``gemm_bf16_f32_parts`` (the same split along K: ``split_k``), and
``scale_sum`` (``bf16((word + proj) / denom)``, the kernel of ``rowcache/kernels/gemm.cu``),
each with its NumPy reference (the specification, and the CPU path).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rowcache.kernels.cublas import gemm_ex, gemm_strided_batched_ex
from rowcache.kernels.loader import get_kernel, is_device_array, launch_1d, require_cupy
from rowcache.kernels.reference import BF16

_SOURCE = "gemm.cu"


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
        On the GPU through ``cublasGemmEx`` (``CUBLAS_COMPUTE_32F``, tensor cores;
        capturable in a CUDA graph once the shape ran eagerly, ``rowcache.kernels.cublas``);
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
    from cupy.cuda import cublas, runtime

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
    gemm_ex(
        cp,
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


def split_k(k: int, splits: int) -> bool:
    """Whether ``k`` splits into ``splits`` chunks usable by :func:`gemm_bf16_f32_parts`
    (equal, a multiple of 8 elements: 16-byte aligned bf16 rows)."""
    return splits >= 1 and k % splits == 0 and (k // splits) % 8 == 0


def gemm_bf16_f32_parts_reference(a: np.ndarray, b: np.ndarray, splits: int) -> np.ndarray:
    """float32[splits, n, m]: part j = ``float32(a[:, K_j]) @ float32(b[K_j, :])`` for the
    j-th of ``splits`` equal chunks ``K_j`` of the inner dimension."""
    k = a.shape[1]
    ks = k // splits
    return np.stack(
        [
            gemm_bf16_f32_reference(a[:, j * ks : (j + 1) * ks], b[j * ks : (j + 1) * ks])
            for j in range(splits)
        ]
    )


def gemm_bf16_f32_parts(a: Any, b: Any, out: Any) -> Any:
    """The projection GEMM split along its inner dimension: ``out[j] = a[:, K_j] @
    b[K_j, :]`` (bf16 in, fp32 accumulation, float32 out) for ``S = out.shape[0]``
    equal chunks, summed later by :func:`scale_sum` in a fixed order.

    A decode step's GEMM has few rows: one cuBLAS GEMM over all of K runs on few
    thread blocks and reads the weights slowly; S chunks run S times as many
    (``cublasGemmStridedBatchedEx``, capturable). ``S = 1`` is :func:`gemm_bf16_f32`.

    Parameters
    ----------
    a : bfloat16[n, k], C-contiguous
    b : bfloat16[k, m], C-contiguous
    out : float32[S, n, m], C-contiguous, with ``split_k(k, S)``
    """
    S = int(out.shape[0])
    if S == 1:
        gemm_bf16_f32(a, b, out=out[0])
        return out
    if not is_device_array(a):
        out[...] = gemm_bf16_f32_parts_reference(a, b, S)
        return out
    cp = require_cupy("gemm_bf16_f32_parts")
    from cupy.cuda import cublas, runtime

    n, k = a.shape
    m = b.shape[1]
    if (
        a.dtype != BF16
        or b.dtype != BF16
        or b.shape[0] != k
        or not (a.flags.c_contiguous and b.flags.c_contiguous and out.flags.c_contiguous)
        or out.dtype != cp.float32
        or out.shape != (S, n, m)
        or not split_k(k, S)
    ):
        raise ValueError(
            f"gemm_bf16_f32_parts: a bfloat16[n, k], b bfloat16[k, m] and out float32[S, n, m] "
            f"C-contiguous with k split in S chunks of a multiple of 8; got a {a.dtype}"
            f"{list(a.shape)}, b {b.dtype}{list(b.shape)}, out {out.dtype}{list(out.shape)}"
        )
    if n == 0 or m == 0:
        return out
    ks = k // S
    one = np.array(1.0, dtype=np.float32)
    zero = np.array(0.0, dtype=np.float32)
    bf16 = getattr(runtime, "CUDA_R_16BF", 14)
    # column-major: part_j^T [m, n] = b[K_j]^T [m, ks] . a[:, K_j]^T [ks, n]
    gemm_strided_batched_ex(
        cp,
        getattr(cublas, "CUBLAS_OP_N", 0),
        getattr(cublas, "CUBLAS_OP_N", 0),
        m,
        n,
        ks,
        one.ctypes.data,
        b.data.ptr,
        bf16,
        m,
        ks * m,  # the next chunk of b: ks rows further
        a.data.ptr,
        bf16,
        k,
        ks,  # the next chunk of a: ks columns further
        zero.ctypes.data,
        out.data.ptr,
        getattr(runtime, "CUDA_R_32F", 0),
        m,
        n * m,
        S,
        getattr(cublas, "CUBLAS_COMPUTE_32F", 68),
        getattr(cublas, "CUBLAS_GEMM_DEFAULT", -1),
    )
    return out


# --- the scaled sum -------------------------------------------------------------
def scale_sum_reference(
    word: np.ndarray, proj: np.ndarray, denom: float, out: np.ndarray | None = None
) -> np.ndarray:
    """``bf16((float32(word) + proj) / float32(denom))``, round to nearest even.

    word : bfloat16[n, D]; proj : float32[n, D], or float32[S, n, D] parts
    (:func:`gemm_bf16_f32_parts`) summed first in order ``((p0 + p1) + p2) + ...``;
    returns bfloat16[n, D].
    """
    proj = np.asarray(proj)
    if proj.ndim == 3:  # loop over parts (S <= a few), vectorized over elements
        total = proj[0].copy()
        for j in range(1, proj.shape[0]):
            total += proj[j]
        proj = total
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
    parts = 1 if proj.ndim == 2 else int(proj.shape[0])
    if word.shape != proj.shape[-2:] or word.dtype != BF16 or proj.dtype != cp.float32:
        raise ValueError(
            f"scale_sum takes word bfloat16[n, D] and proj float32[n, D] or [S, n, D], got "
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
            grid, block, (word, proj, out, np.int64(n), np.float32(denom), np.int32(parts))
        )
    return out


# --- the embedding's tail ----------------------------------------------------------
def project_and_sum(
    stack: Any, weights: Any, words: Any, *, proj: Any, out: Any, denom: float
) -> Any:
    """The n-gram embedding's tail, written once for every step: the projection GEMM of
    the gathered rows and the scaled sum with the word rows.

    ``out = bf16((float32(words) + stack @ weights) / denom)`` with the GEMM in
    ``proj.shape[0]`` K-parts when ``proj`` is float32[S, n, D] (:func:`gemm_bf16_f32_parts`).
    stack : bfloat16[n, T*d]; weights : bfloat16[T*d, D]; words : bfloat16[n, D];
    proj : float32[n, D] or [S, n, D] (scratch); out : bfloat16[n, D], returned. NumPy or
    cupy arrays alike (the references or the kernels), on the current stream, capturable.
    """
    gemm_bf16_f32_parts(stack, weights, out=proj)
    return scale_sum(words, proj, denom, out=out)


__all__ = [
    "gemm_bf16_f32",
    "gemm_bf16_f32_parts",
    "gemm_bf16_f32_parts_reference",
    "gemm_bf16_f32_reference",
    "project_and_sum",
    "scale_sum",
    "scale_sum_reference",
    "split_k",
]
