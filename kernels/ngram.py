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

from ._cublas import gemm_ex, gemm_strided_batched_ex
from ._cuda import get_kernel, is_device_array, launch_1d, require_cupy
from .errors import ConfigError
from .reference import BF16, batched_embed_fp8_reference, batched_embed_reference

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


def _bad_token(tokens: np.ndarray, vocab: int) -> None:
    bad = (tokens < 0) | (tokens >= vocab)
    if tokens.size and bool(bad.any()):
        first = int(np.flatnonzero(bad)[0])
        raise TokenRangeError(first, int(tokens[first]), vocab)


class TokenRangeError(ConfigError):
    """A token id outside ``[0, vocab)``; ``position`` is the first bad one."""

    def __init__(self, position: int, value: int, vocab: int) -> None:
        super().__init__(f"tokens[{position}] = {value} is outside the vocabulary [0, {vocab})")
        self.position, self.value, self.vocab = position, value, vocab


def ngram_hash(
    tokens: Any,
    multipliers: Any,
    rows: Any,
    eos: int,
    starts: Any = None,
    *,
    vocab: int | None = None,
) -> Any:
    """:func:`ngram_hash_reference` on NumPy input, the CUDA kernel on cupy input.

    ``tokens`` decides the device; the result (int64[T, L]) lives on the same device
    and is bit-identical. With ``vocab``, tokens outside ``[0, vocab)`` raise
    :class:`TokenRangeError` (a ConfigError, so a ValueError) naming the first bad
    position; on the GPU the check is fused into the hash kernel (one 8-byte read
    back instead of a separate reduction).
    """
    if not is_device_array(tokens):
        if vocab is not None:
            _bad_token(np.asarray(tokens), vocab)
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
    bad = cp.full(1, length, dtype=cp.int64) if vocab is not None else mod
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
            np.int64(vocab or 0),
            bad,
        ),
    )
    if vocab is not None:
        first = int(bad.get()[0])
        if first < length:
            raise TokenRangeError(first, int(tok[first].get()), vocab)
    return out


# --- the stacked gather -------------------------------------------------------
class StackedTables:
    """The T tables of one embedding, described once for :func:`gather_stacked`.

    Parameters
    ----------
    tables : list of ``(data, scales)``
        ``data`` bfloat16[rows, d] with ``scales`` None, or uint8[rows, d] FP8 codes
        with ``scales`` float32[rows]; all numpy or all cupy (a cupy array may wrap
        mapped pinned host memory). Rows contiguous; the row stride may be anything.
        The arrays are referenced, never copied: a row-cache arena can be described
        once and its contents change under it.
    maps : list of ``(map, offset)`` or None per table, optional (GPU)
        For :func:`hash_gather`: a row cache's device row -> slot map (cupy int32,
        ``NgramRowCache.device_map()``) and the table's row offset in it; the table's
        ``data`` is then the cache's arena. Ignored by :func:`gather_stacked`, which
        takes slots.
    """

    def __init__(
        self, tables: list[tuple[Any, Any]], maps: list[tuple[Any, int] | None] | None = None
    ) -> None:
        if not tables:
            raise ConfigError("StackedTables needs at least one table")
        dims = {int(a.shape[1]) for a, _ in tables}
        if len(dims) != 1:
            raise ConfigError(f"StackedTables: every table needs one width, got {sorted(dims)}")
        self.tables = list(tables)
        self.dim = dims.pop()
        self.device = is_device_array(tables[0][0])
        for i, (a, s) in enumerate(tables):
            kind_ok = (a.dtype == BF16 and s is None) or (
                a.dtype == np.uint8 and s is not None and s.dtype == np.float32
            )
            if a.ndim != 2 or not kind_ok or a.strides[1] != a.itemsize:
                raise ConfigError(
                    f"StackedTables: table {i} must be bfloat16 rows (scales None) or uint8 "
                    f"codes with float32 scales, rows contiguous; got {a.dtype}{list(a.shape)}"
                )
            if is_device_array(a) != self.device or (
                s is not None and is_device_array(s) != self.device
            ):
                raise ConfigError("StackedTables: tables must all be numpy or all cupy")
        if not self.device:
            return
        cp = require_cupy("StackedTables on the GPU")
        ptrs = np.array([a.data.ptr for a, _ in tables], dtype=np.uint64)
        scl = np.array([0 if s is None else s.data.ptr for _, s in tables], dtype=np.uint64)
        strides = np.array([a.strides[0] // a.itemsize for a, _ in tables], dtype=np.int64)
        d = self.dim
        # 16-byte words for bf16 rows, 8-code words for FP8 rows, when everything aligns
        self.vec = d % 8 == 0 and all(
            (a.data.ptr % 16 == 0 and a.strides[0] % 16 == 0)
            if s is None
            else (a.data.ptr % 8 == 0 and a.strides[0] % 8 == 0)
            for a, s in tables
        )
        self._ptrs = cp.asarray(ptrs)
        self._scales = cp.asarray(scl)
        self._strides = cp.asarray(strides)
        mp = [None] * len(tables) if maps is None else list(maps)
        if len(mp) != len(tables):
            raise ConfigError(f"StackedTables: {len(mp)} maps for {len(tables)} tables")
        self.mapped = any(m is not None for m in mp)
        self._maps = cp.asarray(
            np.array([0 if m is None else m[0].data.ptr for m in mp], dtype=np.uint64)
        )
        self._map_offsets = cp.asarray(
            np.array([0 if m is None else int(m[1]) for m in mp], dtype=np.int64)
        )
        self._map_refs = [m[0] for m in mp if m is not None]  # keep the maps alive


def _item_launch(items: int) -> tuple[tuple[int], tuple[int, int]]:
    """Grid and block of the stacked kernels: one work item (a row, or a chunk of one)
    per threadIdx.y row of a (32, 8) block; the kernels stride past the grid cap."""
    return (min(max(1, -(-items // 8)), 65535 * 8),), (32, 8)


def gather_stacked_reference(ids: np.ndarray, tables: StackedTables, out: np.ndarray) -> np.ndarray:
    """``out[:, i*d:(i+1)*d] = gather of table i at ids[i]``: ids int[T, n], out bfloat16[n, T*d]."""
    d = tables.dim
    for i, (a, s) in enumerate(tables.tables):  # loop over tables (T), vectorized over rows
        block = out[:, i * d : (i + 1) * d]
        if s is None:
            batched_embed_reference(np.asarray(ids[i]), a, block)
        else:
            block[...] = batched_embed_fp8_reference(np.asarray(ids[i]), a, s)
    return out


def gather_stacked(ids: Any, tables: StackedTables, out: Any) -> Any:
    """Every table's rows into one stacked buffer, one kernel launch on the GPU.

    Parameters
    ----------
    ids : int64[T, n]
        Row of table ``i`` for output row ``r`` (a hashed id, or an arena slot).
        On the GPU the ids are trusted to be in range (no sync); the columns must be
        contiguous (a column slice ``ids[:, a:b]`` of a contiguous array is fine).
    tables : StackedTables
    out : bfloat16[n, T*d], C-contiguous, same device.

    Bit-identical to ``kernels.batched_embed`` / ``batched_embed_fp8`` per table.
    """
    if not tables.device:
        return gather_stacked_reference(ids, tables, out)
    cp = require_cupy("gather_stacked")
    T, d = len(tables.tables), tables.dim
    n = int(ids.shape[1])
    if ids.dtype != cp.int64 or ids.shape[0] != T or (n > 1 and ids.strides[1] != 8):
        raise ConfigError(f"gather_stacked: ids must be int64[{T}, n] with contiguous columns")
    if out.dtype != BF16 or out.shape != (n, T * d) or not out.flags.c_contiguous:
        raise ConfigError(f"gather_stacked: out must be C-contiguous bfloat16[{n}, {T * d}]")
    if n == 0:
        return out
    ld = ids.strides[0] // 8 if T > 1 else n
    vec = bool(tables.vec and out.data.ptr % 16 == 0)
    get_kernel(_SOURCE, "ngram_gather_stacked")(
        *_item_launch(n * T),
        (
            ids,
            np.int64(ld),
            np.int64(0),
            tables._ptrs,
            tables._scales,
            tables._strides,
            out,
            np.int64(n),
            np.int32(T),
            np.int32(d),
            np.int32(vec),
        ),
    )
    return out


def hash_gather_reference(
    tokens: np.ndarray,
    starts: np.ndarray | None,
    positions: np.ndarray,
    multipliers: np.ndarray,
    rows: np.ndarray,
    eos: int,
    tables: StackedTables,
    out: np.ndarray,
    word: StackedTables,
    words: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """What :func:`hash_gather` computes: the hash of every position, the embedded
    ``positions`` selected, their T rows stacked into ``out`` and their word rows
    (``tokens[positions]`` of the single table ``word``) into ``words``."""
    ids = ngram_hash_reference(tokens, multipliers, rows, eos, starts)[:, positions]
    gather_stacked_reference(ids, tables, out)
    gather_stacked_reference(np.asarray(tokens)[positions][None, :], word, words)
    return out, words


def hash_gather(
    tokens: Any,
    starts: Any,
    positions: Any,
    multipliers: Any,
    rows: Any,
    eos: int,
    tables: StackedTables,
    out: Any,
    word: StackedTables,
    words: Any,
) -> tuple[Any, Any]:
    """Hash, select, stacked gather and word gather of a step in ONE launch on the GPU.

    Parameters (launcher argument order)
    ----------
    tokens : int64[L], C-contiguous, trusted to lie in ``[0, V)`` (checked by the caller)
    starts : int64[L] or None
        First position of each position's sequence (several sequences packed); None:
        one sequence.
    positions : int64[n] or None
        The embedded positions (with ``starts``); None: the last ``n`` positions.
    multipliers, rows : int64[T, N], int64[T] (``NgramDims.multipliers``, table rows)
    eos : int
    tables : StackedTables of the T tables (width d); out : bfloat16[n, T*d]
    word : StackedTables of the word table alone (width D); words : bfloat16[n, D]

    Bit-identical to :func:`ngram_hash`, the selection, :func:`gather_stacked` and the
    word gather (:func:`hash_gather_reference`); no allocation, no sync: capturable.
    """
    n = int(out.shape[0])
    L = int(tokens.shape[0])
    T = len(tables.tables)
    if positions is None:
        positions_arr = np.arange(L - n, L, dtype=np.int64)
    else:
        positions_arr = positions
    if not tables.device:
        return hash_gather_reference(
            tokens, starts, positions_arr, multipliers, rows, eos, tables, out, word, words
        )
    require_cupy("hash_gather")
    d, D = tables.dim, word.dim
    if len(word.tables) != 1 or not word.device:
        raise ConfigError("hash_gather: word must be a StackedTables of one GPU table")
    if out.dtype != BF16 or out.shape != (n, T * d) or not out.flags.c_contiguous:
        raise ConfigError(f"hash_gather: out must be C-contiguous bfloat16[{n}, {T * d}]")
    if words.dtype != BF16 or words.shape != (n, D) or not words.flags.c_contiguous:
        raise ConfigError(f"hash_gather: words must be C-contiguous bfloat16[{n}, {D}]")
    if (starts is None) != (positions is None):
        raise ConfigError("hash_gather: give starts and positions together, or neither")
    if n > L:
        raise ConfigError(f"hash_gather: {n} output rows but only {L} tokens")
    if n == 0:
        return out, words
    multi = starts is not None
    # the word row in chunks as wide as a table row (a multiple of 8, at least 256)
    wchunk = max(256, -(-d // 8) * 8)
    W = -(-D // wchunk)
    get_kernel(_SOURCE, "ngram_hash_gather")(
        *_item_launch(n * (T + W)),
        (
            tokens,
            starts if multi else tokens,
            positions if multi else tokens,
            np.int64(L - n),
            np.int32(multi),
            multipliers,
            rows,
            np.int32(multipliers.shape[1]),
            np.int64(eos),
            tables._ptrs,
            tables._scales,
            tables._strides,
            out,
            np.int64(n),
            np.int32(T),
            np.int32(d),
            np.int32(bool(tables.vec and out.data.ptr % 16 == 0)),
            word._ptrs,
            word._scales,
            word._strides,
            words,
            np.int32(D),
            np.int32(bool(word.vec and words.data.ptr % 16 == 0)),
            np.int32(W),
            np.int32(wchunk),
            tables._maps,
            tables._map_offsets,
            word._maps,
            word._map_offsets,
        ),
    )
    return out, words


def copy_from_mapped(src_ptr: int, dst: Any, n: int) -> None:
    """``dst[:n] = src[:n]`` (int64 words) on the GPU by a kernel reading host memory.

    ``src_ptr`` is the address of pinned host memory (``cudaHostAlloc``, e.g.
    ``cupyx.empty_pinned``: with unified addressing, as on every 64-bit CUDA platform,
    the device reads it at its host address), ``dst`` a cupy int64 array. Capturable (no allocation, no sync). For uploads of a few kilobytes a
    kernel that reads over PCIe finishes in one round trip, where a DMA copy node of a
    graph costs ~10 us; the caller must not rewrite ``src`` until the kernel ran.
    """
    if n <= 0:
        return
    block = 256
    grid = (min(-(-n // block), 1024),)
    get_kernel(_SOURCE, "ngram_copy_words")(grid, (block,), (np.uint64(src_ptr), dst, np.int64(n)))


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
        capturable in a CUDA graph once the shape ran eagerly, ``kernels._cublas``);
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


__all__ = [
    "StackedTables",
    "TokenRangeError",
    "copy_from_mapped",
    "gather_stacked",
    "gather_stacked_reference",
    "gemm_bf16_f32",
    "gemm_bf16_f32_parts",
    "gemm_bf16_f32_parts_reference",
    "gemm_bf16_f32_reference",
    "hash_gather",
    "hash_gather_reference",
    "ngram_hash",
    "ngram_hash_reference",
    "scale_sum",
    "scale_sum_reference",
    "split_k",
]
