"""Token-overlay kernels: ``embed_rowdiff``, ``embed_overlay_routed``, ``lmhead_overlay_routed``.

Owns the routed kernels' cupy launchers (CUDA source ``rowcache/kernels/overlay/overlay.cu``) and the
choice between the LM head's paths (:data:`LMHEAD_PATHS`, :data:`GEMM_MIN_ROWS`), and
is the one place the overlay's kernels are imported from: the checks
(``rowcache.kernels.overlay.checks``), the NumPy references (``rowcache.kernels.overlay.reference``),
the packing (``rowcache.kernels.overlay.pack``), the launch plumbing (``rowcache.kernels.overlay.launch``)
and the packed-table LM-head paths (``rowcache.kernels.overlay.lmhead``) are re-exported here.
Does not own adapters or their lifetime: :class:`rowcache.embed.overlay.overlay.TokenOverlay` builds the
tables.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rowcache.errors import ConfigError
from rowcache.kernels.loader import get_kernel, is_device_array, require_cupy
from rowcache.kernels.overlay.checks import (
    check_bf16_2d,
    check_int_1d,
    check_pair,
    check_route,
    check_table,
    check_thresh,
    describe_array,
)
from rowcache.kernels.overlay.launch import (
    BLOCK,
    DEFAULT_LMHEAD_TILE,
    DEFAULT_MMA_CONFIG,
    KERNEL_NAMES,
    LMHEAD_TILES,
    MMA_CONFIGS,
    MMA_KERNEL_NAMES,
    ROW_TILE,
    SOURCE,
    WARPS,
    aligned,
    as_u16,
    compile_overlay_kernels,
    grid_size,
    logits_launch_arg,
    slot_arg,
)
from rowcache.kernels.overlay.lmhead import (
    gemm_rows_t,
    lmhead_overlay_gemm,
    lmhead_overlay_mma,
    prepare_gemm_capture,
)
from rowcache.kernels.overlay.pack import (
    MMA_ALIGN,
    MMA_TILE,
    device_pointer_table,
    mma_tile_adapters,
    pack_overrides,
)
from rowcache.kernels.overlay.reference import (
    embed_overlay_routed_reference,
    embed_rowdiff_reference,
    lmhead_overlay_gemm_reference,
    lmhead_overlay_mma_reference,
    lmhead_overlay_routed_reference,
)
from rowcache.kernels.reference import BF16

LMHEAD_PATHS = ("auto", "gemm", "mma", "warp")
# "auto" takes AUTO_PACKED_PATH from GEMM_MIN_ROWS rows up, the warp kernels below. The
# packed paths read every routed adapter's rows once whatever the batch; the warp kernels
# read them once per few routed rows, so small batches favour the warps. Measured on the
# H200 (bench/overlay.py, 4 adapters x 1,000 rows, hidden 3,072, apply_lmhead alone in
# a CUDA graph, L2 flushed by a read; ms, warp | GEMM | mma): 1 row 0.013 | 0.017 |
# 0.018, 16 rows 0.015 | 0.017 | 0.019, 32 rows 0.022 | 0.017 | 0.019, 64 rows 0.038 |
# 0.015 | 0.020. The mma path never wins there, so "auto" does not take it.
GEMM_MIN_ROWS = 32
AUTO_PACKED_PATH = "gemm"


def embed_rowdiff(base: Any, served: Any, thresh: float = 0.0) -> Any:
    """``flags[r] = max_i |base[r,i] - served[r,i]| > thresh``; see the reference.

    NumPy inputs run :func:`embed_rowdiff_reference`; cupy inputs run the kernel (one
    warp per row) and return a cupy bool array. Results are bit-identical.
    """
    if not (is_device_array(base) or is_device_array(served)):
        return embed_rowdiff_reference(base, served, thresh)
    cp = require_cupy("embed_rowdiff")
    if not (is_device_array(base) and is_device_array(served)):
        raise ConfigError(
            f"base and served must both be numpy or both cupy, got {describe_array(base)} "
            f"and {describe_array(served)}"
        )
    check_pair(base, served)
    t = check_thresh(thresh)
    rows, hidden = base.shape
    flags = cp.zeros(rows, dtype=cp.uint8)
    if rows and hidden:
        vec = int(hidden % 8 == 0 and aligned(base, served))
        kern = get_kernel(SOURCE, "embed_rowdiff")
        grid = grid_size((rows + WARPS - 1) // WARPS)
        kern(
            (grid,),
            (BLOCK,),
            (
                as_u16(cp, base),
                as_u16(cp, served),
                np.int64(rows),
                np.int32(hidden),
                t,
                np.int32(vec),
                flags,
            ),
        )
    return flags.view(cp.bool_)


def embed_overlay_routed(
    ids: Any,
    seq_slot: Any,
    active: int,
    map_ptrs: Any,
    row_ptrs: Any,
    counts: Any,
    vocabs: Any,
    out: Any,
) -> Any:
    """GPU launcher of the routed embedding overlay; semantics of the reference.

    Parameters (kernel argument order)
    ----------
    ids : cupy int32[n] or int64[n] (other integer types are converted)
    seq_slot : cupy int[n] or None (None: every row takes ``active``)
    active : int
    map_ptrs : cupy uint64[L]
        Device addresses of the adapters' slot maps int32[vocabs[s]] (0: empty adapter).
    row_ptrs : cupy uint64[L]
        Device addresses of the adapters' override rows bfloat16[counts[s], hidden].
    counts, vocabs : cupy int32[L]
    out : cupy bfloat16[n, hidden], C-contiguous; modified in place and returned.

    The tables stay fixed between steps, so a captured CUDA graph replays with only
    ``seq_slot``'s contents changed. Bit-identical to :func:`embed_overlay_routed_reference`.
    """
    cp = require_cupy("embed_overlay_routed")
    if not is_device_array(ids):
        raise ConfigError(f"ids must be a cupy array here, got {describe_array(ids)}")
    check_int_1d("ids", ids)
    n = ids.shape[0]
    check_bf16_2d("out", out, rows=n)
    if not is_device_array(out):
        raise ConfigError(f"out must be a cupy array here, got {describe_array(out)}")
    act = check_route(seq_slot, active, n)
    num = map_ptrs.shape[0] if getattr(map_ptrs, "ndim", None) == 1 else -1
    check_table("map_ptrs", map_ptrs, np.uint64, num)
    check_table("row_ptrs", row_ptrs, np.uint64, num)
    check_table("counts", counts, np.int32, num)
    check_table("vocabs", vocabs, np.int32, num)
    hidden = out.shape[1]
    if n == 0 or hidden == 0 or num == 0:
        return out
    if ids.dtype == np.int32:
        name, ids_arg = "embed_overlay_routed_i32", cp.ascontiguousarray(ids)
    else:
        name, ids_arg = "embed_overlay_routed_i64", cp.ascontiguousarray(ids, dtype=cp.int64)
    # Override rows start 16-byte aligned (see device_pointer_table), so only `out` can
    # break the 16-byte vector path.
    vec = int(hidden % 8 == 0 and aligned(out))
    kern = get_kernel(SOURCE, name)
    kern(
        (grid_size(n),),
        (BLOCK,),
        (
            ids_arg,
            slot_arg(cp, seq_slot),
            np.int32(act),
            np.int64(n),
            np.int32(hidden),
            map_ptrs,
            row_ptrs,
            counts,
            vocabs,
            np.int32(num),
            np.int32(vec),
            as_u16(cp, out),
        ),
    )
    return out


def lmhead_overlay_routed(
    hidden: Any,
    seq_slot: Any,
    active: int,
    id_ptrs: Any,
    row_ptrs: Any,
    counts: Any,
    logits: Any,
    *,
    max_count: int | None = None,
    tile: tuple[int, int] = DEFAULT_LMHEAD_TILE,
    block: int = 128,
) -> Any:
    """GPU launcher of the routed LM-head overlay; semantics of the reference.

    Parameters (kernel argument order)
    ----------
    hidden : cupy bfloat16[n, hidden_size], C-contiguous
    seq_slot : cupy int[n] or None (None: every row takes ``active``)
    active : int
    id_ptrs : cupy uint64[L]
        Device addresses of the adapters' override ids int32[counts[s]] (distinct).
    row_ptrs : cupy uint64[L]
        Device addresses of the adapters' LM-head rows bfloat16[counts[s], hidden_size].
    counts : cupy int32[L]
    logits : cupy float32 or bfloat16 [n, n_cols], C-contiguous; modified in place.
    max_count : int, keyword-only
        Largest ``counts[s]``, known on the host when the tables were built; sizes the
        grid. None reads it from ``counts`` (a device-to-host copy: not for graphs). A
        smaller value stays correct (the kernel loops), only slower.
    tile : (overrides, rows), keyword-only, one of ``LMHEAD_TILES``
        Tuning knob: how many overrides x routed rows one warp computes at once (each
        loaded chunk of an override row then serves ``rows`` dot products). Same results.
    block : int, keyword-only
        Threads per block, a multiple of 32 in [32, 1024] (tuning knob).

    One warp computes each (row, j) dot product in float32 with a shuffle reduction.
    """
    cp = require_cupy("lmhead_overlay_routed")
    check_bf16_2d("hidden", hidden)
    n, hidden_size = hidden.shape
    if not (is_device_array(hidden) and is_device_array(logits)):
        raise ConfigError(
            f"hidden and logits must be cupy arrays here, got {describe_array(hidden)} "
            f"and {describe_array(logits)}"
        )
    if logits.ndim != 2 or logits.dtype not in (np.dtype(np.float32), BF16):
        raise ConfigError(
            f"logits must be a 2-D float32 or bfloat16 array, got {describe_array(logits)}"
        )
    if logits.shape[0] != n or not logits.flags.c_contiguous:
        raise ConfigError(
            f"logits must be C-contiguous with {n} rows, got {describe_array(logits)}"
        )
    act = check_route(seq_slot, active, n)
    num = id_ptrs.shape[0] if getattr(id_ptrs, "ndim", None) == 1 else -1
    check_table("id_ptrs", id_ptrs, np.uint64, num)
    check_table("row_ptrs", row_ptrs, np.uint64, num)
    check_table("counts", counts, np.int32, num)
    if not isinstance(tile, tuple) or tile not in LMHEAD_TILES:
        raise ConfigError(f"tile must be one of {LMHEAD_TILES}, got {tile!r}")
    if (
        isinstance(block, bool)
        or not isinstance(block, int)
        or not (32 <= block <= 1024)
        or block % 32
    ):
        raise ConfigError(f"block must be a multiple of 32 in [32, 1024], got {block!r}")
    if max_count is None:
        max_count = int(counts.max()) if num else 0
    n_cols = logits.shape[1]
    if n == 0 or n_cols == 0 or num == 0 or max_count <= 0:
        return logits
    if num > 65535:
        raise ConfigError(f"at most 65535 adapters fit the grid's y dimension, got {num}")
    row_tiles = (n + ROW_TILE - 1) // ROW_TILE
    if row_tiles > 65535:
        raise ConfigError(f"at most {65535 * ROW_TILE} rows per call, got {n}")
    vec = int(hidden_size % 8 == 0 and aligned(hidden))
    jb, rb = tile
    tag, logits_arg = logits_launch_arg(cp, logits)
    kern = get_kernel(SOURCE, f"lmhead_overlay_routed_{tag}_j{jb}r{rb}")
    per_block = (block // 32) * jb  # overrides one block covers per pass
    j_blocks = min((max_count + per_block - 1) // per_block, 65535)
    kern(
        (j_blocks, num, row_tiles),
        (block,),
        (
            as_u16(cp, hidden),
            slot_arg(cp, seq_slot),
            np.int32(act),
            np.int64(n),
            np.int32(hidden_size),
            id_ptrs,
            row_ptrs,
            counts,
            np.int32(num),
            np.int64(n_cols),
            np.int32(vec),
            logits_arg,
        ),
    )
    return logits


__all__ = [
    "AUTO_PACKED_PATH",
    "DEFAULT_LMHEAD_TILE",
    "DEFAULT_MMA_CONFIG",
    "GEMM_MIN_ROWS",
    "KERNEL_NAMES",
    "LMHEAD_PATHS",
    "LMHEAD_TILES",
    "MMA_ALIGN",
    "MMA_CONFIGS",
    "MMA_KERNEL_NAMES",
    "MMA_TILE",
    "ROW_TILE",
    "SOURCE",
    "check_bf16_2d",
    "check_int_1d",
    "check_route",
    "compile_overlay_kernels",
    "device_pointer_table",
    "embed_overlay_routed",
    "embed_overlay_routed_reference",
    "embed_rowdiff",
    "embed_rowdiff_reference",
    "gemm_rows_t",
    "lmhead_overlay_gemm",
    "lmhead_overlay_gemm_reference",
    "lmhead_overlay_mma",
    "lmhead_overlay_mma_reference",
    "lmhead_overlay_routed",
    "lmhead_overlay_routed_reference",
    "mma_tile_adapters",
    "pack_overrides",
    "prepare_gemm_capture",
]
