"""Kernels of the n-gram embedding: hashed ids, the stacked gather, hash + gather.

Owns the launchers of ``kernels/ngram.cu`` and their NumPy references (the
specification, and the CPU path): ``ngram_hash`` (the LongCat id of every table and
position, ``docs/ngram-spec.md``), ``gather_stacked``, ``hash_gather`` and
``copy_from_mapped``. The projection GEMM and the scaled sum are ``kernels.gemm``
(re-exported here). Does not know about ``embed``'s objects: it takes plain arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._cuda import get_kernel, is_device_array, launch_1d, require_cupy
from .errors import ConfigError
from .gemm import (  # re-exported: imported from here before the GEMM helpers moved
    gemm_bf16_f32,
    gemm_bf16_f32_parts,
    gemm_bf16_f32_parts_reference,
    gemm_bf16_f32_reference,
    scale_sum,
    scale_sum_reference,
    split_k,
)
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
    if positions is None:
        positions_arr = np.arange(L - n, L, dtype=np.int64)
    else:
        positions_arr = positions
    if not tables.device:
        return hash_gather_reference(
            tokens, starts, positions_arr, multipliers, rows, eos, tables, out, word, words
        )
    require_cupy("hash_gather")
    if (starts is None) != (positions is None):
        raise ConfigError("hash_gather: give starts and positions together, or neither")
    if n > L:
        raise ConfigError(f"hash_gather: {n} output rows but only {L} tokens")
    items, tail = _gather_args("hash_gather", multipliers, rows, eos, tables, out, word, words)
    if n == 0:
        return out, words
    multi = starts is not None
    get_kernel(_SOURCE, "ngram_hash_gather")(
        *_item_launch(items),
        (
            tokens,
            starts if multi else tokens,
            positions if multi else tokens,
            np.int64(L - n),
            np.int32(multi),
            *tail,
        ),
    )
    return out, words


def _gather_args(
    name: str,
    multipliers: Any,
    rows: Any,
    eos: int,
    tables: StackedTables,
    out: Any,
    word: StackedTables,
    words: Any,
) -> tuple[int, tuple[Any, ...]]:
    """The work items and the launch arguments after the tokens' of the hash + gather
    kernels (``kernels/ngram.cu``'s ``NGRAM_HASH_GATHER_TAIL``), ``out``/``words``
    checked: bfloat16[n, T*d] and bfloat16[n, D], C-contiguous, on the GPU."""
    n, T = int(out.shape[0]), len(tables.tables)
    d, D = tables.dim, word.dim
    if len(word.tables) != 1 or not word.device:
        raise ConfigError(f"{name}: word must be a StackedTables of one GPU table")
    if out.dtype != BF16 or out.shape != (n, T * d) or not out.flags.c_contiguous:
        raise ConfigError(f"{name}: out must be C-contiguous bfloat16[{n}, {T * d}]")
    if words.dtype != BF16 or words.shape != (n, D) or not words.flags.c_contiguous:
        raise ConfigError(f"{name}: words must be C-contiguous bfloat16[{n}, {D}]")
    # the word row in chunks as wide as a table row (a multiple of 8, at least 256)
    wchunk = max(256, -(-d // 8) * 8)
    W = -(-D // wchunk)
    tail = (
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
    )
    return n * (T + W), tail


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
