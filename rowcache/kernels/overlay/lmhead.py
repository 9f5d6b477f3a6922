"""The token overlay's packed-table LM-head launchers: the GEMM path and the mma path.

Owns ``lmhead_overlay_gemm`` (one cuBLAS GEMM of the rows against every adapter's
packed rows, then a routed scatter: ``gemm_rows_t``, ``prepare_gemm_capture``) and
``lmhead_overlay_mma`` (one tensor-core kernel reading each packed row once). Their
references are ``rowcache.kernels.overlay.reference``; the packing is ``rowcache.kernels.overlay.pack``.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from rowcache.errors import ConfigError
from rowcache.kernels.cublas import capture_workspace, gemm_ex
from rowcache.kernels.loader import get_kernel, require_cupy
from rowcache.kernels.overlay.checks import check_packed_call, check_table, describe_array
from rowcache.kernels.overlay.launch import (
    DEFAULT_MMA_CONFIG,
    MAX_GRID,
    MMA_CONFIGS,
    SCATTER_BLOCK,
    SOURCE,
    aligned,
    as_u16,
    logits_launch_arg,
    mma_kernel,
    slot_arg,
)
from rowcache.kernels.overlay.pack import MMA_TILE


def prepare_gemm_capture() -> None:
    """Allocate the current device's cuBLAS capture workspace now (outside any capture)."""
    cp = require_cupy("prepare_gemm_capture")
    capture_workspace(cp.cuda.runtime.getDevice())


def gemm_rows_t(cp: Any, hidden: Any, rows_all: Any, p: Any) -> None:
    """``p[:n, :cap] = float32(hidden @ rows_all^T)`` on cupy's current stream.

    hidden bfloat16[n, k], rows_all bfloat16[cap, k] (both C-contiguous), p float32
    [>= n, cap] C-contiguous. One ``cublasGemmEx`` (bf16 in, ``CUBLAS_COMPUTE_32F``,
    f32 out, tensor cores): column-major ``P^T[cap, n] = R[cap, k] . H^T[k, n]``, i.e.
    transa = T on R's column-major view, transb = N on hidden's. Capturable in a graph
    once one call ran eagerly (that call allocates the capture workspace and lets cuBLAS
    load its kernels outside the capture).
    """
    from cupy.cuda import cublas, runtime

    n, k = hidden.shape
    cap = rows_all.shape[0]
    op_t, op_n = getattr(cublas, "CUBLAS_OP_T", 1), getattr(cublas, "CUBLAS_OP_N", 0)
    bf16_t = getattr(runtime, "CUDA_R_16BF", 14)
    f32_t = getattr(runtime, "CUDA_R_32F", 0)
    compute = getattr(cublas, "CUBLAS_COMPUTE_32F", 68)
    algo = getattr(cublas, "CUBLAS_GEMM_DEFAULT", -1)
    one = np.array(1.0, dtype=np.float32)
    zero = np.array(0.0, dtype=np.float32)
    gemm_ex(
        cp,
        op_t,
        op_n,
        cap,
        n,
        k,
        one.ctypes.data,
        rows_all.data.ptr,
        bf16_t,
        k,
        hidden.data.ptr,
        bf16_t,
        k,
        zero.ctypes.data,
        p.data.ptr,
        f32_t,
        cap,
        compute,
        algo,
    )


def lmhead_overlay_gemm(
    hidden: Any,
    seq_slot: Any,
    active: int,
    rows_all: Any,
    ids_all: Any,
    bases: Any,
    counts: Any,
    logits: Any,
    *,
    p: Any,
    max_count: int | None = None,
) -> Any:
    """GPU launcher of the LM-head overlay's GEMM path; semantics of the references.

    Parameters (launcher argument order)
    ----------
    hidden : cupy bfloat16[n, hidden_size], C-contiguous
    seq_slot : cupy int[n] or None (None: every row takes ``active``)
    active : int
    rows_all : cupy bfloat16[cap, hidden_size], C-contiguous
        Every adapter's LM-head rows packed by :func:`pack_overrides` (cap >= 1).
    ids_all : cupy int32[cap]
        Token id of each row of ``rows_all`` (-1 for padding).
    bases, counts : cupy int32[L]
        Adapter s owns rows ``bases[s] : bases[s] + counts[s]`` of ``rows_all``.
    logits : cupy float32 or bfloat16 [n, n_cols], C-contiguous; modified in place.
    p : cupy float32[>= n, cap], C-contiguous, keyword-only
        Workspace for ``P = hidden @ rows_all^T`` (preallocate it for the largest batch:
        allocating is not allowed inside a CUDA graph capture).
    max_count : int, keyword-only
        Largest ``counts[s]`` (sizes the scatter's grid; a smaller value only loops).
        None reads it from ``counts`` (a device-to-host copy: not for graphs).

    One cuBLAS GEMM (bf16 in, f32 accumulate and out; every row against every
    adapter's rows, all read once), then ``lmhead_overlay_scatter``: row r routed to s
    writes ``logits[r, ids_all[bases[s] + j]] = round(P[r, bases[s] + j])`` for
    ``j < counts[s]``, skipping ids < 0 or >= n_cols. Rows routed to no adapter are
    computed and never read back. Every argument stays fixed between steps except
    ``seq_slot``'s contents, and both launches can be captured in a CUDA graph.
    """
    cp = require_cupy("lmhead_overlay_gemm")
    n, hidden_size, act = check_packed_call(
        hidden, seq_slot, active, rows_all, logits, extra=(("p", p),)
    )
    cap = rows_all.shape[0]
    check_table("ids_all", ids_all, np.int32, cap)
    num = bases.shape[0] if getattr(bases, "ndim", None) == 1 else -1
    check_table("bases", bases, np.int32, num)
    check_table("counts", counts, np.int32, num)
    if (
        getattr(p, "ndim", None) != 2
        or p.dtype != np.float32
        or p.shape[0] < n
        or p.shape[1] != cap
        or not p.flags.c_contiguous
    ):
        raise ConfigError(
            f"p must be a C-contiguous cupy float32[>= {n}, {cap}] workspace, got {describe_array(p)}"
        )
    if max_count is None:
        max_count = int(counts.max()) if num > 0 else 0
    n_cols = logits.shape[1]
    if n == 0 or n_cols == 0 or num == 0 or cap == 0 or max_count <= 0:
        return logits
    if hidden_size == 0:
        p[:n].fill(0)
    else:
        gemm_rows_t(cp, hidden, rows_all, p)  # both C-contiguous (checked above)
    tag, logits_arg = logits_launch_arg(cp, logits)
    kern = get_kernel(SOURCE, f"lmhead_overlay_scatter_{tag}")
    j_blocks = min((max_count + SCATTER_BLOCK - 1) // SCATTER_BLOCK, MAX_GRID)
    kern(
        (j_blocks, min(n, 65535)),
        (SCATTER_BLOCK,),
        (
            p,
            np.int64(cap),
            slot_arg(cp, seq_slot),
            np.int32(act),
            np.int64(n),
            ids_all,
            bases,
            counts,
            np.int32(num),
            np.int64(cap),
            np.int64(n_cols),
            logits_arg,
        ),
    )
    return logits


def lmhead_overlay_mma(
    hidden: Any,
    seq_slot: Any,
    active: int,
    rows_all: Any,
    ids_all: Any,
    tile_adapter: Any,
    num_adapters: int,
    logits: Any,
    *,
    config: tuple[int, int, int] = DEFAULT_MMA_CONFIG,
) -> Any:
    """GPU launcher of the LM-head overlay's tensor-core path; semantics of the reference.

    Parameters (kernel argument order)
    ----------
    hidden : cupy bfloat16[n, hidden_size], C-contiguous
    seq_slot : cupy int[n] or None (None: every row takes ``active``)
    active : int
    rows_all : cupy bfloat16[cap, hidden_size], C-contiguous, cap a multiple of 16
        Every adapter's LM-head rows packed by :func:`pack_overrides` with ``align`` a
        multiple of ``MMA_ALIGN`` (``MMA_TILE`` is enough for the 1-tile shapes).
    ids_all : cupy int32[cap]
        Token id of each row of ``rows_all`` (-1 for padding).
    tile_adapter : cupy int32[cap // 16]
        The adapter of each 16-row tile (:func:`mma_tile_adapters`; -1: padding only).
    num_adapters : int
        L; rows routed outside ``[0, L)`` are untouched.
    logits : cupy float32 or bfloat16 [n, n_cols], C-contiguous; modified in place.
    config : (tiles, warps, stages), keyword-only, one of ``MMA_CONFIGS``
        Tuning knob: 16-row tiles and warps per block, and the depth of each lane's ring
        of k-blocks in flight. Results depend on ``warps`` only (how K is split, hence
        the order of float32 sums).

    One kernel, one block per ``tiles`` tiles (grid fixed by ``cap``): the block finds
    the rows routed to its tiles' adapter and computes their dot products with the
    tiles' rows on tensor cores (``mma.sync`` m16n8k16, bf16 in, float32 accumulate),
    the operands streamed into shared memory by ``cp.async`` several k-blocks ahead.
    Each tile is read from memory once per 32 rows routed to its adapter, and not at
    all when none is. Every argument stays fixed between steps except ``seq_slot``'s
    contents, so the launch can be captured in a CUDA graph.
    """
    cp = require_cupy("lmhead_overlay_mma")
    n, hidden_size, act = check_packed_call(hidden, seq_slot, active, rows_all, logits)
    cap = rows_all.shape[0]
    if cap % MMA_TILE:
        raise ConfigError(f"rows_all must have a multiple of {MMA_TILE} rows, got {cap}")
    check_table("ids_all", ids_all, np.int32, cap)
    check_table("tile_adapter", tile_adapter, np.int32, cap // MMA_TILE)
    if isinstance(num_adapters, bool):
        raise ConfigError(f"num_adapters must be an int in [0, 65535], got {num_adapters!r}")
    try:
        num = operator.index(num_adapters)
    except TypeError:
        raise ConfigError(
            f"num_adapters must be an int in [0, 65535], got {num_adapters!r}"
        ) from None
    if not 0 <= num <= 65535:
        raise ConfigError(f"num_adapters must be an int in [0, 65535], got {num_adapters!r}")
    if not isinstance(config, tuple) or config not in MMA_CONFIGS:
        raise ConfigError(f"config must be one of {MMA_CONFIGS}, got {config!r}")
    n_cols = logits.shape[1]
    num_tiles = cap // MMA_TILE
    if n == 0 or n_cols == 0 or num == 0 or num_tiles == 0:
        return logits
    tiles, warps, _ = config
    vec = int(hidden_size % 8 == 0 and aligned(hidden, rows_all))
    tag, logits_arg = logits_launch_arg(cp, logits)
    kern, smem = mma_kernel(tag, config)
    kern(
        (-(-num_tiles // tiles),),
        (warps * 32,),
        (
            as_u16(cp, hidden),
            slot_arg(cp, seq_slot),
            np.int32(act),
            np.int64(n),
            np.int32(hidden_size),
            as_u16(cp, rows_all),
            ids_all,
            tile_adapter,
            np.int64(num_tiles),
            np.int32(num),
            np.int64(n_cols),
            np.int32(vec),
            logits_arg,
        ),
        shared_mem=smem,
    )
    return logits
