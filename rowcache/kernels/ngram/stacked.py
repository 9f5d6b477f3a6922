"""The T tables of an n-gram embedding gathered as one: ``StackedTables``, its gather.

Owns :class:`StackedTables` (every table's rows, FP8 scales and, for cached tables, the
device row -> slot maps, described once for the kernels), ``gather_stacked`` (every
table's rows into one stacked buffer in one launch of ``rowcache/kernels/ngram/ngram.cu``) and its
NumPy reference, the argument tail the hash + gather kernels share (``gather_args``:
``rowcache.kernels.ngram.hash.hash_gather``, ``rowcache.kernels.ngram.rows``) and ``copy_from_mapped`` (a
kernel that uploads a few words from pinned host memory). Takes plain arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rowcache.errors import ConfigError
from rowcache.kernels.loader import get_kernel, is_device_array, require_cupy
from rowcache.kernels.reference import BF16, batched_embed_fp8_reference, batched_embed_reference

_SOURCE = "ngram/ngram.cu"


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
            if a.dtype == np.uint8 and s is None:
                raise ConfigError(
                    f"StackedTables: table {i} is uint8 codes without per-row scales (a "
                    "table- or block-scaled FP8 codec: fp8_table_scale, fp8_block_e8m0); the "
                    "fused n-gram step "
                    "reads bfloat16 rows or FP8 codes with a float32 scale a row only: hold "
                    "such a table as bf16 (or fp8) for NgramEmbedding, or gather it "
                    "through its own gather() (EngramMemory does)"
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


def item_launch(items: int) -> tuple[tuple[int], tuple[int, int]]:
    """Grid and block of the stacked kernels: one work item (a row, or a chunk of one)
    per threadIdx.y row of a (32, 8) block; the kernels stride past the grid cap."""
    return (min(max(1, -(-items // 8)), 65535 * 8),), (32, 8)


def gather_stacked_reference(
    ids: np.ndarray, tables: StackedTables, out: np.ndarray | None = None
) -> np.ndarray:
    """``out[:, i*d:(i+1)*d] = gather of table i at ids[i]``: ids int[T, n], out bfloat16[n, T*d]
    (allocated when None)."""
    d = tables.dim
    if out is None:
        out = np.empty((np.shape(ids)[1], len(tables.tables) * d), dtype=BF16)
    for i, (a, s) in enumerate(tables.tables):  # loop over tables (T), vectorized over rows
        block = out[:, i * d : (i + 1) * d]
        if s is None:
            batched_embed_reference(np.asarray(ids[i]), a, block)
        else:
            block[...] = batched_embed_fp8_reference(np.asarray(ids[i]), a, s)
    return out


def gather_stacked(ids: Any, tables: StackedTables, out: Any = None) -> Any:
    """Every table's rows into one stacked buffer, one kernel launch on the GPU.

    Parameters
    ----------
    ids : int64[T, n]
        Row of table ``i`` for output row ``r`` (a hashed id, or an arena slot).
        On the GPU the ids are trusted to be in range (no sync); the columns must be
        contiguous (a column slice ``ids[:, a:b]`` of a contiguous array is fine).
    tables : StackedTables
    out : bfloat16[n, T*d], C-contiguous, same device; allocated when None.

    Bit-identical to ``rowcache.kernels.batched_embed`` / ``batched_embed_fp8`` per table.
    """
    if not tables.device:
        return gather_stacked_reference(ids, tables, out)
    cp = require_cupy("gather_stacked")
    T, d = len(tables.tables), tables.dim
    n = int(ids.shape[1])
    if out is None:
        out = cp.empty((n, T * d), dtype=BF16)
    if ids.dtype != cp.int64 or ids.shape[0] != T or (n > 1 and ids.strides[1] != 8):
        raise ConfigError(f"gather_stacked: ids must be int64[{T}, n] with contiguous columns")
    if out.dtype != BF16 or out.shape != (n, T * d) or not out.flags.c_contiguous:
        raise ConfigError(f"gather_stacked: out must be C-contiguous bfloat16[{n}, {T * d}]")
    if n == 0:
        return out
    ld = ids.strides[0] // 8 if T > 1 else n
    get_kernel(_SOURCE, "ngram_gather_stacked")(
        *item_launch(n * T), (ids, np.int64(ld), np.int64(0), *_stacked_args(tables, out))
    )
    return out


def _stacked_args(tables: StackedTables, out: Any) -> tuple[Any, ...]:
    """The launch arguments of ``tables`` and their stacked output ``out`` (n rows), as
    the stacked gather and the hash + gather kernels take them: the tables' pointers,
    scales and row strides, ``out``, n, T, d, and whether 16-byte words align."""
    vec = bool(tables.vec and out.data.ptr % 16 == 0)
    n, T = int(out.shape[0]), len(tables.tables)
    return (
        tables._ptrs,
        tables._scales,
        tables._strides,
        out,
        np.int64(n),
        np.int32(T),
        np.int32(tables.dim),
        np.int32(vec),
    )


def gather_args(
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
    kernels (``rowcache/kernels/ngram/ngram.cu``'s ``NGRAM_HASH_GATHER_TAIL``), ``out``/``words``
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
        *_stacked_args(tables, out),
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


__all__ = ["StackedTables", "copy_from_mapped", "gather_stacked", "gather_stacked_reference"]
