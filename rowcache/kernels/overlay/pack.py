"""Packing of the token overlay's LM-head rows for the packed-table paths.

Owns :data:`MMA_TILE` / :data:`MMA_ALIGN` (the tensor-core path's tile and adapter
alignment), ``pack_overrides`` (every adapter's rows into one table), the tiles'
adapters (``mma_tile_adapters``) and ``device_pointer_table`` (the per-adapter
address tables of the routed kernels). Launches nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rowcache.errors import ConfigError
from rowcache.kernels.loader import is_device_array, require_cupy
from rowcache.kernels.overlay.checks import (
    check_bf16_2d,
    check_int_1d,
    describe_array,
    paired_adapters,
)

MMA_TILE = 16  # rows of the packed table per tile; a tile holds one adapter's rows only
# Each adapter's block of the packed table starts at a multiple of this many rows, so a
# block of 2 tiles never mixes adapters (a block that does is handled in two runs).
MMA_ALIGN = 2 * MMA_TILE


def pack_overrides(
    override_ids: Sequence[Any],
    override_rows: Sequence[Any],
    rows_all: Any,
    ids_all: Any,
    *,
    align: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """Pack every adapter's LM-head overrides into one table, in place (the table R of the
    GEMM and mma paths).

    Parameters
    ----------
    override_ids : L entries of int[count_s] or None
        Adapter s's overridden token ids (None: an empty adapter).
    override_rows : L entries of bfloat16[count_s, hidden_size] or None
        Adapter s's LM-head rows for those ids.
    rows_all : bfloat16[cap, hidden_size], C-contiguous (numpy or cupy)
        Receives the rows, adapter after adapter in slot order; every other row (the
        padding after each adapter's block, and past the last one) is zeroed.
    ids_all : int32[cap] (same array module)
        Receives the token id of each row of ``rows_all``; -1 on every other row.
    align : int >= 1, keyword-only
        Each adapter's block starts at a multiple of ``align`` rows (the mma path packs
        with ``MMA_ALIGN`` so that no 16-row tile mixes adapters).

    Returns
    -------
    bases, counts : int32[L] (numpy)
        Adapter s owns rows ``bases[s] : bases[s] + counts[s]`` of ``rows_all``.
    """
    ids_l, rows_l = paired_adapters(("override_ids", "override_rows"), override_ids, override_rows)
    if isinstance(align, bool) or not isinstance(align, int) or align < 1:
        raise ConfigError(f"align must be an int >= 1, got {align!r}")
    check_bf16_2d("rows_all", rows_all)
    cap, hidden_size = rows_all.shape
    check_int_1d("ids_all", ids_all, length=cap)
    if ids_all.dtype != np.int32:
        raise ConfigError(f"ids_all must be int32, got {describe_array(ids_all)}")
    counts = np.array(
        [0 if i is None or r is None else i.shape[0] for i, r in zip(ids_l, rows_l)], np.int32
    )
    sizes = -(-counts.astype(np.int64) // align) * align
    need = int(sizes.sum())
    if need > cap:
        raise ConfigError(
            f"rows_all has {cap} rows but the adapters override {int(counts.sum())} in all "
            f"({need} with each adapter's block aligned to {align} rows)"
        )
    bases = np.zeros(len(ids_l), np.int32)
    if len(ids_l):
        bases[1:] = np.cumsum(sizes)[:-1]
    dev = is_device_array(rows_all)
    if is_device_array(ids_all) != dev or any(
        a is not None and is_device_array(a) != dev for a in (*ids_l, *rows_l)
    ):
        raise ConfigError(
            "rows_all, ids_all and every adapter's ids and rows must all be numpy or all cupy"
        )
    dst = rows_all.view(np.uint16)  # bit copies, whatever xp thinks of bfloat16
    for s, (sids, srows) in enumerate(zip(ids_l, rows_l)):
        b, c, size = int(bases[s]), int(counts[s]), int(sizes[s])
        if c:
            check_int_1d(f"override_ids[{s}]", sids)
            check_bf16_2d(f"override_rows[{s}]", srows, rows=sids.shape[0], cols=hidden_size)
            dst[b : b + c] = srows.view(dst.dtype)
            ids_all[b : b + c] = sids
        if size > c:  # the alignment padding after the block
            dst[b + c : b + size] = 0
            ids_all[b + c : b + size] = -1
    dst[need:] = 0
    ids_all[need:] = -1
    return bases, counts


def mma_tile_adapters(bases: Any, counts: Any, cap: int) -> np.ndarray:
    """The mma path's tile table: the adapter owning each 16-row tile of the packed table.

    Parameters
    ----------
    bases, counts : int[L]
        As returned by :func:`pack_overrides` (every ``bases[s]`` with ``counts[s] > 0``
        a multiple of ``MMA_TILE``: pack with ``align`` a multiple of it).
    cap : int
        Rows of the packed table, a multiple of ``MMA_TILE``.

    Returns
    -------
    tile_adapter : int32[cap // MMA_TILE]
        ``s`` for the tiles holding adapter s's rows (its last tile may end in padding
        rows, whose id is -1), -1 for tiles of padding only.
    """
    bases = np.asarray(bases)
    counts = np.asarray(counts)
    check_int_1d("bases", bases)
    check_int_1d("counts", counts, length=bases.shape[0])
    if isinstance(cap, bool) or not isinstance(cap, (int, np.integer)) or cap % MMA_TILE:
        raise ConfigError(f"cap must be an int multiple of {MMA_TILE}, got {cap!r}")
    out = np.full(int(cap) // MMA_TILE, -1, np.int32)
    for s in np.flatnonzero(counts > 0):
        b, c = int(bases[s]), int(counts[s])
        if b % MMA_TILE or b < 0 or b + c > cap:
            raise ConfigError(
                f"adapter {s}'s rows {b}:{b + c} must start at a multiple of {MMA_TILE} and "
                f"fit the {cap} rows (pack with align={MMA_ALIGN})"
            )
        out[b // MMA_TILE : -(-(b + c) // MMA_TILE)] = s
    return out


def device_pointer_table(arrays: Sequence[Any]) -> Any:
    """uint64[L] cupy array of the device addresses of ``arrays`` (0 for None or empty).

    Each array must be C-contiguous and start 16-byte aligned (the kernels read rows in
    16-byte vectors; whole cupy allocations are). The caller keeps ``arrays`` alive as
    long as the table is used.
    """
    cp = require_cupy("device_pointer_table")
    ptrs = np.zeros(len(arrays), dtype=np.uint64)
    for i, a in enumerate(arrays):
        if a is None or a.size == 0:
            continue
        if not is_device_array(a) or not a.flags.c_contiguous or a.data.ptr % 16:
            raise ConfigError(
                f"arrays[{i}] must be a C-contiguous, 16-byte aligned cupy array, "
                f"got {describe_array(a)}"
            )
        ptrs[i] = a.data.ptr
    return cp.asarray(ptrs)
