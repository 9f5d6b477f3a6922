"""Token-overlay kernels: ``embed_rowdiff``, ``embed_overlay_routed``, ``lmhead_overlay_routed``.

Owns the kernels' cupy launchers (CUDA source ``kernels/overlay.cu``), their NumPy
references (the specification and the CPU path) and the LM head's two packed-table paths
(one cuBLAS GEMM against every adapter's rows packed together then a routed scatter, or
one tensor-core kernel reading each packed row once). Does not own adapters or their
lifetime: :class:`embed.overlay.TokenOverlay` builds the tables.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._cublas import capture_workspace, gemm_ex
from ._cuda import get_kernel, is_device_array, require_cupy
from .errors import ConfigError
from .reference import BF16

SOURCE = "overlay.cu"
# (overrides, rows) each LM-head warp works on at once; (1, 1) is one warp per (row, j).
LMHEAD_TILES = ((1, 1), (2, 2), (2, 4), (4, 4))
DEFAULT_LMHEAD_TILE = (4, 4)
KERNEL_NAMES = (
    "embed_rowdiff",
    "embed_overlay_routed_i32",
    "embed_overlay_routed_i64",
    *(f"lmhead_overlay_routed_{t}_j{j}r{r}" for t in ("f32", "bf16") for j, r in LMHEAD_TILES),
    "lmhead_overlay_scatter_f32",
    "lmhead_overlay_scatter_bf16",
)
# The tensor-core ("mma") path's kernels: (16-row tiles, warps, ring stages) per block.
# The warps split K; each lane streams its own operands through a ring of `stages`
# k-blocks of shared memory (2 * tiles + 4 chunks of 16 bytes each: 96 KiB per block for
# (1, 8, 4), two blocks per SM; 128 KiB for (2, 8, 4), one). Measured on the H200 and
# dropped (bench/overlay.py, 64 rows over 4 x 1,000 overrides, graph): 4 warps per
# block, (1, 4, 8) 0.031 ms and (2, 4, 6) 0.033 ms against 0.020-0.021 ms with 8, and a
# block-shared layout (a warp per tile, tiles and hidden rows staged together, a barrier
# per 128-column stage) 0.055-0.059 ms: the time follows the k-blocks each warp waits on
# in turn, not the bytes in flight.
MMA_TILE = 16  # rows of the packed table per tile; a tile holds one adapter's rows only
MMA_CONFIGS = ((1, 8, 4), (2, 8, 4))
DEFAULT_MMA_CONFIG = (2, 8, 4)  # 0.0200 vs 0.0206 ms (above); half the hidden-row reads
# Each adapter's block of the packed table starts at a multiple of this many rows, so a
# block of 2 tiles never mixes adapters (a block that does is handled in two runs).
MMA_ALIGN = 2 * MMA_TILE


def _mma_name(dtype: str, config: tuple[int, int, int]) -> str:
    t, w, st = config
    return f"lmhead_overlay_mma_{dtype}_t{t}w{w}d{st}"


def _mma_smem(config: tuple[int, int, int]) -> int:
    """Dynamic shared memory (bytes) of the mma kernel of ``config``."""
    t, w, st = config
    return st * (2 * t + 4) * w * 32 * 16


MMA_KERNEL_NAMES = tuple(_mma_name(d, c) for d in ("f32", "bf16") for c in MMA_CONFIGS)
KERNEL_NAMES = KERNEL_NAMES + MMA_KERNEL_NAMES
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
_SCATTER_BLOCK = 256
_BLOCK = 256  # threads per block of the rowdiff and embed kernels (8 warps)
_WARPS = _BLOCK // 32
ROW_TILE = 64  # LM-head rows per block along grid z (the kernel's LM_ROW_TILE: two ballots)
_MAX_GRID = 1 << 20  # grid-stride loops cover anything larger
_ROWDIFF_CHUNK = 4096  # rows per NumPy chunk in the reference (bounds its f32 temporaries)


# --------------------------------------------------------------------------- validation
def _describe(a: Any) -> str:
    if a is None:
        return "None"
    dtype = getattr(a, "dtype", None)
    shape = getattr(a, "shape", None)
    if dtype is None or shape is None:
        return type(a).__name__
    return f"{type(a).__module__.split('.')[0]} {dtype}{list(shape)}"


def check_bf16_2d(name: str, a: Any, *, rows: int | None = None, cols: int | None = None) -> None:
    """Raise ConfigError unless ``a`` is a C-contiguous bfloat16 ``[rows, cols]`` array."""
    if getattr(a, "ndim", None) != 2 or a.dtype != BF16:
        raise ConfigError(f"{name} must be a 2-D bfloat16 array, got {_describe(a)}")
    if rows is not None and a.shape[0] != rows:
        raise ConfigError(f"{name} must have {rows} rows, got {_describe(a)}")
    if cols is not None and a.shape[1] != cols:
        raise ConfigError(f"{name} must have {cols} columns, got {_describe(a)}")
    if not a.flags.c_contiguous:
        raise ConfigError(f"{name} must be C-contiguous (it is written or read by row)")


def check_int_1d(name: str, a: Any, *, length: int | None = None) -> None:
    """Raise ConfigError unless ``a`` is a 1-D integer array (of ``length`` when given)."""
    if getattr(a, "ndim", None) != 1 or a.dtype.kind not in "iu":
        raise ConfigError(f"{name} must be a 1-D integer array, got {_describe(a)}")
    if length is not None and a.shape[0] != length:
        raise ConfigError(f"{name} must have {length} entries (one per row), got {_describe(a)}")


def check_route(seq_slot: Any, active: Any, n: int) -> int:
    """Validate the routing arguments shared by both overlays; returns ``active`` as int."""
    if seq_slot is not None:
        check_int_1d("seq_slot", seq_slot, length=n)
    if isinstance(active, bool):
        raise ConfigError(f"active must be an int adapter slot (or -1 for none), got {active!r}")
    try:
        act = operator.index(active)
    except TypeError:
        raise ConfigError(
            f"active must be an int adapter slot (or -1 for none), got {active!r}"
        ) from None
    if not -(2**31) <= act < 2**31:
        raise ConfigError(f"active must fit in int32, got {act}")
    return act


def _check_thresh(thresh: Any) -> np.float32:
    t = np.float32(thresh)
    if not np.isfinite(t) or t < 0:
        raise ConfigError(f"thresh must be a finite float >= 0, got {thresh!r}")
    return t


def _check_pair(base: Any, served: Any) -> None:
    check_bf16_2d("base", base)
    check_bf16_2d("served", served)
    if base.shape != served.shape:
        raise ConfigError(
            f"base and served must have the same shape, got {_describe(base)} "
            f"and {_describe(served)}; compare the rows both have (slice them first)"
        )


def _check_logits(logits: Any, n: int) -> None:
    if getattr(logits, "ndim", None) != 2 or logits.dtype not in (np.dtype(np.float32), BF16):
        raise ConfigError(
            f"logits must be a 2-D float32 or bfloat16 array, got {_describe(logits)}"
        )
    if logits.shape[0] != n:
        raise ConfigError(
            f"logits must have {n} rows (one per hidden row), got {_describe(logits)}"
        )


def _adapters(name: str, tables: Sequence[Any]) -> list[Any]:
    if isinstance(tables, (str, bytes)) or not isinstance(tables, Sequence):
        raise ConfigError(f"{name} must be a sequence with one entry per adapter, got {tables!r}")
    return list(tables)


# --------------------------------------------------------------------------- references
def embed_rowdiff_reference(
    base: np.ndarray, served: np.ndarray, thresh: float = 0.0
) -> np.ndarray:
    """Flag the rows of ``base`` that differ from ``served`` (build time).

    Parameters (kernel argument order)
    ----------
    base : bfloat16[rows, hidden]
        The adapter's table (C-contiguous).
    served : bfloat16[rows, hidden]
        The served model's table, same shape.
    thresh : float, finite, >= 0

    Returns
    -------
    flags : bool[rows]
        ``flags[r] = max_i |base[r,i] - served[r,i]| > thresh``, the difference taken in
        float32 (round to nearest even). A NaN difference counts as "no larger", except
        that a NaN on exactly one side flags the row (both NaN: equal).
    """
    _check_pair(base, served)
    t = _check_thresh(thresh)
    rows = base.shape[0]
    flags = np.zeros(rows, dtype=bool)
    if base.shape[1] == 0:
        return flags
    for start in range(0, rows, _ROWDIFF_CHUNK):
        stop = min(rows, start + _ROWDIFF_CHUNK)
        b = base[start:stop].astype(np.float32)
        s = served[start:stop].astype(np.float32)
        with np.errstate(invalid="ignore"):
            hit = np.abs(b - s) > t
        hit |= np.isnan(b) != np.isnan(s)
        flags[start:stop] = hit.any(axis=1)
    return flags


def embed_overlay_routed_reference(
    ids: np.ndarray,
    seq_slot: np.ndarray | None,
    active: int,
    slot_maps: Sequence[np.ndarray | None],
    override_rows: Sequence[np.ndarray | None],
    out: np.ndarray,
) -> np.ndarray:
    """Overwrite gathered embedding rows with their adapter's override rows, in place.

    Parameters (kernel argument order)
    ----------
    ids : int[n]
        Token id of each gathered row.
    seq_slot : int[n] or None
        Adapter slot of each row; None routes every row to ``active``.
    active : int
        The slot of every row when ``seq_slot`` is None (-1: none).
    slot_maps : L entries of int32[vocab_s] or None
        Adapter s's map token id -> override index (-1: not overridden); its length
        ``vocab_s`` is the adapter's vocabulary snapshot. None: an empty adapter.
    override_rows : L entries of bfloat16[count_s, hidden] or None
        Adapter s's override rows.
    out : bfloat16[n, hidden]
        The gathered rows (before any embedding scale); modified in place and returned.

    Row r, with ``s = seq_slot[r]`` (or ``active``), is left untouched when ``s < 0`` or
    ``s >= L``, when ``ids[r] < 0`` or ``ids[r] >= vocab_s``, or when ``slot_maps[s][ids[r]]``
    is < 0 or >= ``count_s``; otherwise ``out[r] = override_rows[s][slot_maps[s][ids[r]]]``.
    """
    check_int_1d("ids", ids)
    n = ids.shape[0]
    check_bf16_2d("out", out, rows=n)
    act = check_route(seq_slot, active, n)
    maps = _adapters("slot_maps", slot_maps)
    rows_l = _adapters("override_rows", override_rows)
    if len(maps) != len(rows_l):
        raise ConfigError(
            f"slot_maps and override_rows must have one entry per adapter each, "
            f"got {len(maps)} and {len(rows_l)}"
        )
    slots = np.full(n, act, np.int64) if seq_slot is None else np.asarray(seq_slot, np.int64)
    ids64 = np.asarray(ids).astype(np.int64, copy=False)
    for s, (smap, srows) in enumerate(zip(maps, rows_l)):
        if smap is None or srows is None:
            continue
        check_int_1d(f"slot_maps[{s}]", smap)
        check_bf16_2d(f"override_rows[{s}]", srows, cols=out.shape[1])
        sel = np.flatnonzero(slots == s)
        if sel.size == 0:
            continue
        tok = ids64[sel]
        ok = (tok >= 0) & (tok < smap.shape[0])
        sel, tok = sel[ok], tok[ok]
        idx = smap[tok].astype(np.int64, copy=False)
        ok = (idx >= 0) & (idx < srows.shape[0])
        out[sel[ok]] = srows[idx[ok]]
    return out


def lmhead_overlay_routed_reference(
    hidden: np.ndarray,
    seq_slot: np.ndarray | None,
    active: int,
    override_ids: Sequence[np.ndarray | None],
    override_rows: Sequence[np.ndarray | None],
    logits: np.ndarray,
) -> np.ndarray:
    """Recompute the logits of each adapter's overridden tokens, in place.

    Parameters (kernel argument order)
    ----------
    hidden : bfloat16[n, hidden_size]
        Final hidden states.
    seq_slot : int[n] or None
        Adapter slot of each row; None routes every row to ``active``.
    active : int
        The slot of every row when ``seq_slot`` is None (-1: none).
    override_ids : L entries of int[count_s] or None
        Adapter s's overridden token ids (distinct).
    override_rows : L entries of bfloat16[count_s, hidden_size] or None
        Adapter s's LM-head rows for those ids.
    logits : float32 or bfloat16 [n, n_cols]
        Before softcap; modified in place and returned.

    For each row r routed to an adapter s in ``[0, L)`` and each j with
    ``0 <= override_ids[s][j] < n_cols``: ``logits[r, override_ids[s][j]] =
    round(dot(hidden[r], override_rows[s][j]))``, accumulated in float32 and rounded
    to nearest even into the logits' dtype. The GPU sums in another order, so it agrees
    with this to float32 rounding of the sum (then to one bf16 step for bf16 logits).
    """
    check_bf16_2d("hidden", hidden)
    n = hidden.shape[0]
    _check_logits(logits, n)
    act = check_route(seq_slot, active, n)
    ids_l = _adapters("override_ids", override_ids)
    rows_l = _adapters("override_rows", override_rows)
    if len(ids_l) != len(rows_l):
        raise ConfigError(
            f"override_ids and override_rows must have one entry per adapter each, "
            f"got {len(ids_l)} and {len(rows_l)}"
        )
    slots = np.full(n, act, np.int64) if seq_slot is None else np.asarray(seq_slot, np.int64)
    n_cols = logits.shape[1]
    for s, (sids, srows) in enumerate(zip(ids_l, rows_l)):
        if sids is None or srows is None:
            continue
        check_int_1d(f"override_ids[{s}]", sids)
        check_bf16_2d(f"override_rows[{s}]", srows, rows=sids.shape[0], cols=hidden.shape[1])
        sel = np.flatnonzero(slots == s)
        if sel.size == 0 or sids.shape[0] == 0:
            continue
        cols = sids.astype(np.int64, copy=False)
        ok = (cols >= 0) & (cols < n_cols)
        w = (srows if ok.all() else srows[ok]).astype(np.float32)
        vals = hidden[sel].astype(np.float32) @ w.T
        logits[np.ix_(sel, cols[ok])] = vals.astype(logits.dtype)
    return logits


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
    ids_l = _adapters("override_ids", override_ids)
    rows_l = _adapters("override_rows", override_rows)
    if len(ids_l) != len(rows_l):
        raise ConfigError(
            f"override_ids and override_rows must have one entry per adapter each, "
            f"got {len(ids_l)} and {len(rows_l)}"
        )
    if isinstance(align, bool) or not isinstance(align, int) or align < 1:
        raise ConfigError(f"align must be an int >= 1, got {align!r}")
    check_bf16_2d("rows_all", rows_all)
    cap, hidden_size = rows_all.shape
    check_int_1d("ids_all", ids_all, length=cap)
    if ids_all.dtype != np.int32:
        raise ConfigError(f"ids_all must be int32, got {_describe(ids_all)}")
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


def lmhead_overlay_mma_reference(
    hidden: np.ndarray,
    seq_slot: np.ndarray | None,
    active: int,
    rows_all: np.ndarray,
    ids_all: np.ndarray,
    tile_adapter: np.ndarray,
    num_adapters: int,
    logits: np.ndarray,
) -> np.ndarray:
    """The mma path's semantics: each tile's rows against the rows routed to its adapter.

    Parameters (kernel argument order)
    ----------
    hidden : bfloat16[n, hidden_size]
    seq_slot : int[n] or None
        Adapter slot of each row; None routes every row to ``active``.
    active : int
    rows_all : bfloat16[cap, hidden_size], cap a multiple of ``MMA_TILE``
        Every adapter's LM-head rows, packed (see :func:`pack_overrides`).
    ids_all : int32[cap]
        Token id of each row of ``rows_all`` (-1 for padding).
    tile_adapter : int32[cap // MMA_TILE]
        The adapter owning each tile (see :func:`mma_tile_adapters`; -1: none).
    num_adapters : int
        L: tiles of adapters outside ``[0, L)`` and rows routed outside it are skipped.
    logits : float32 or bfloat16 [n, n_cols]; modified in place and returned.

    For each row c of ``rows_all`` whose tile's adapter s is in ``[0, L)`` with
    ``0 <= ids_all[c] < n_cols``, and each row r routed to s: ``logits[r, ids_all[c]] =
    round(dot(hidden[r], rows_all[c]))``, summed in float32 and rounded to nearest even
    into the logits' dtype. Same results as :func:`lmhead_overlay_routed_reference` on
    the unpacked tables, to float32 rounding of the sums.
    """
    check_bf16_2d("hidden", hidden)
    n = hidden.shape[0]
    _check_logits(logits, n)
    act = check_route(seq_slot, active, n)
    check_bf16_2d("rows_all", rows_all, cols=hidden.shape[1])
    cap = rows_all.shape[0]
    if cap % MMA_TILE:
        raise ConfigError(f"rows_all must have a multiple of {MMA_TILE} rows, got {cap}")
    check_int_1d("ids_all", ids_all, length=cap)
    check_int_1d("tile_adapter", tile_adapter, length=cap // MMA_TILE)
    num = operator.index(num_adapters)
    slots = np.full(n, act, np.int64) if seq_slot is None else np.asarray(seq_slot, np.int64)
    row_adapter = np.repeat(np.asarray(tile_adapter, np.int64), MMA_TILE)
    ids64 = np.asarray(ids_all).astype(np.int64, copy=False)
    n_cols = logits.shape[1]
    for s in np.unique(row_adapter):
        if s < 0 or s >= num:
            continue
        sel = np.flatnonzero(slots == s)
        c = np.flatnonzero((row_adapter == s) & (ids64 >= 0) & (ids64 < n_cols))
        if sel.size == 0 or c.size == 0:
            continue
        vals = hidden[sel].astype(np.float32) @ rows_all[c].astype(np.float32).T
        logits[np.ix_(sel, ids64[c])] = vals.astype(logits.dtype)
    return logits


def lmhead_overlay_gemm_reference(
    hidden: np.ndarray,
    seq_slot: np.ndarray | None,
    active: int,
    rows_all: np.ndarray,
    ids_all: np.ndarray,
    bases: np.ndarray,
    counts: np.ndarray,
    logits: np.ndarray,
) -> np.ndarray:
    """The GEMM path's semantics: ``P = hidden @ rows_all^T``, then a routed scatter of P.

    Parameters (launcher argument order)
    ----------
    hidden : bfloat16[n, hidden_size]
    seq_slot : int[n] or None
        Adapter slot of each row; None routes every row to ``active``.
    active : int
    rows_all : bfloat16[cap, hidden_size]
        Every adapter's LM-head rows, packed (see :func:`pack_overrides`).
    ids_all : int[cap]
        Token id of each row of ``rows_all``.
    bases, counts : int[L]
        Adapter s owns rows ``bases[s] : bases[s] + counts[s]`` (clipped to ``cap``).
    logits : float32 or bfloat16 [n, n_cols]; modified in place and returned.

    For each row r routed to s in ``[0, L)`` and each such row c of ``rows_all`` with
    ``0 <= ids_all[c] < n_cols``: ``logits[r, ids_all[c]] = round(P[r, c])``, P summed in
    float32 and rounded to nearest even into the logits' dtype. Same results as
    :func:`lmhead_overlay_routed_reference` on the unpacked tables, to float32 rounding
    of the sums (both sum in float32, in different orders).
    """
    check_bf16_2d("hidden", hidden)
    n = hidden.shape[0]
    _check_logits(logits, n)
    act = check_route(seq_slot, active, n)
    check_bf16_2d("rows_all", rows_all, cols=hidden.shape[1])
    cap = rows_all.shape[0]
    check_int_1d("ids_all", ids_all, length=cap)
    check_int_1d("bases", bases)
    check_int_1d("counts", counts, length=bases.shape[0])
    slots = np.full(n, act, np.int64) if seq_slot is None else np.asarray(seq_slot, np.int64)
    n_cols = logits.shape[1]
    p = hidden.astype(np.float32) @ rows_all.astype(np.float32).T
    ids64 = np.asarray(ids_all).astype(np.int64, copy=False)
    for s in range(bases.shape[0]):
        base = int(bases[s])
        count = min(int(counts[s]), cap - base)
        sel = np.flatnonzero(slots == s)
        if base < 0 or count <= 0 or sel.size == 0:
            continue
        c = np.arange(base, base + count)
        ok = (ids64[c] >= 0) & (ids64[c] < n_cols)
        c = c[ok]
        logits[np.ix_(sel, ids64[c])] = p[np.ix_(sel, c)].astype(logits.dtype)
    return logits


# --------------------------------------------------------------------------- launchers
def compile_overlay_kernels() -> None:
    """Compile every overlay kernel now (NVRTC); raises GpuUnavailableError without a GPU."""
    for name in KERNEL_NAMES:
        get_kernel(SOURCE, name)
    for dtype in ("f32", "bf16"):  # and let the mma kernels use their shared memory
        for config in MMA_CONFIGS:
            _mma_kernel(dtype, config)


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
                f"got {_describe(a)}"
            )
        ptrs[i] = a.data.ptr
    return cp.asarray(ptrs)


def _u16(cp: Any, a: Any) -> Any:
    return a.view(cp.uint16)


def _aligned(*arrays: Any) -> bool:
    return all(a.data.ptr % 16 == 0 for a in arrays)


def _grid(n: int) -> int:
    return max(1, min(n, _MAX_GRID))


def _slot_arg(cp: Any, seq_slot: Any) -> Any:
    if seq_slot is None:
        return np.uint64(0)  # a null int32 pointer: every row takes `active`
    if not is_device_array(seq_slot):
        raise ConfigError(f"seq_slot must be a cupy array here, got {_describe(seq_slot)}")
    return cp.ascontiguousarray(seq_slot, dtype=cp.int32)


def _check_table(name: str, a: Any, dtype: Any, length: int) -> None:
    if not is_device_array(a) or a.ndim != 1 or a.dtype != dtype or a.shape[0] != length:
        want = "L" if length < 0 else str(length)
        raise ConfigError(
            f"{name} must be a cupy {np.dtype(dtype)}[{want}] array (one entry per adapter), "
            f"got {_describe(a)}"
        )


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
            f"base and served must both be numpy or both cupy, got {_describe(base)} "
            f"and {_describe(served)}"
        )
    _check_pair(base, served)
    t = _check_thresh(thresh)
    rows, hidden = base.shape
    flags = cp.zeros(rows, dtype=cp.uint8)
    if rows and hidden:
        vec = int(hidden % 8 == 0 and _aligned(base, served))
        kern = get_kernel(SOURCE, "embed_rowdiff")
        grid = _grid((rows + _WARPS - 1) // _WARPS)
        kern(
            (grid,),
            (_BLOCK,),
            (_u16(cp, base), _u16(cp, served), np.int64(rows), np.int32(hidden), t,
             np.int32(vec), flags),
        )  # fmt: skip
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
        raise ConfigError(f"ids must be a cupy array here, got {_describe(ids)}")
    check_int_1d("ids", ids)
    n = ids.shape[0]
    check_bf16_2d("out", out, rows=n)
    if not is_device_array(out):
        raise ConfigError(f"out must be a cupy array here, got {_describe(out)}")
    act = check_route(seq_slot, active, n)
    num = map_ptrs.shape[0] if getattr(map_ptrs, "ndim", None) == 1 else -1
    _check_table("map_ptrs", map_ptrs, np.uint64, num)
    _check_table("row_ptrs", row_ptrs, np.uint64, num)
    _check_table("counts", counts, np.int32, num)
    _check_table("vocabs", vocabs, np.int32, num)
    hidden = out.shape[1]
    if n == 0 or hidden == 0 or num == 0:
        return out
    if ids.dtype == np.int32:
        name, ids_arg = "embed_overlay_routed_i32", cp.ascontiguousarray(ids)
    else:
        name, ids_arg = "embed_overlay_routed_i64", cp.ascontiguousarray(ids, dtype=cp.int64)
    # Override rows start 16-byte aligned (see device_pointer_table), so only `out` can
    # break the 16-byte vector path.
    vec = int(hidden % 8 == 0 and _aligned(out))
    kern = get_kernel(SOURCE, name)
    kern(
        (_grid(n),),
        (_BLOCK,),
        (ids_arg, _slot_arg(cp, seq_slot), np.int32(act), np.int64(n), np.int32(hidden),
         map_ptrs, row_ptrs, counts, vocabs, np.int32(num), np.int32(vec), _u16(cp, out)),
    )  # fmt: skip
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
            f"hidden and logits must be cupy arrays here, got {_describe(hidden)} "
            f"and {_describe(logits)}"
        )
    if logits.ndim != 2 or logits.dtype not in (np.dtype(np.float32), BF16):
        raise ConfigError(
            f"logits must be a 2-D float32 or bfloat16 array, got {_describe(logits)}"
        )
    if logits.shape[0] != n or not logits.flags.c_contiguous:
        raise ConfigError(f"logits must be C-contiguous with {n} rows, got {_describe(logits)}")
    act = check_route(seq_slot, active, n)
    num = id_ptrs.shape[0] if getattr(id_ptrs, "ndim", None) == 1 else -1
    _check_table("id_ptrs", id_ptrs, np.uint64, num)
    _check_table("row_ptrs", row_ptrs, np.uint64, num)
    _check_table("counts", counts, np.int32, num)
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
    vec = int(hidden_size % 8 == 0 and _aligned(hidden))
    jb, rb = tile
    if logits.dtype == np.float32:
        name, logits_arg = f"lmhead_overlay_routed_f32_j{jb}r{rb}", logits
    else:
        name, logits_arg = f"lmhead_overlay_routed_bf16_j{jb}r{rb}", _u16(cp, logits)
    kern = get_kernel(SOURCE, name)
    per_block = (block // 32) * jb  # overrides one block covers per pass
    j_blocks = min((max_count + per_block - 1) // per_block, 65535)
    kern(
        (j_blocks, num, row_tiles),
        (block,),
        (_u16(cp, hidden), _slot_arg(cp, seq_slot), np.int32(act), np.int64(n),
         np.int32(hidden_size), id_ptrs, row_ptrs, counts, np.int32(num),
         np.int64(n_cols), np.int32(vec), logits_arg),
    )  # fmt: skip
    return logits


# --------------------------------------------------------------------------- GEMM path
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
        cp, op_t, op_n, cap, n, k, one.ctypes.data, rows_all.data.ptr, bf16_t, k,
        hidden.data.ptr, bf16_t, k, zero.ctypes.data, p.data.ptr, f32_t, cap, compute, algo,
    )  # fmt: skip


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
    check_bf16_2d("hidden", hidden)
    n, hidden_size = hidden.shape
    for name, a in (("hidden", hidden), ("rows_all", rows_all), ("logits", logits), ("p", p)):
        if not is_device_array(a):
            raise ConfigError(f"{name} must be a cupy array here, got {_describe(a)}")
    _check_logits(logits, n)
    if not logits.flags.c_contiguous:
        raise ConfigError(f"logits must be C-contiguous, got {_describe(logits)}")
    act = check_route(seq_slot, active, n)
    check_bf16_2d("rows_all", rows_all, cols=hidden_size)
    cap = rows_all.shape[0]
    _check_table("ids_all", ids_all, np.int32, cap)
    num = bases.shape[0] if getattr(bases, "ndim", None) == 1 else -1
    _check_table("bases", bases, np.int32, num)
    _check_table("counts", counts, np.int32, num)
    if (
        getattr(p, "ndim", None) != 2
        or p.dtype != np.float32
        or p.shape[0] < n
        or p.shape[1] != cap
        or not p.flags.c_contiguous
    ):
        raise ConfigError(
            f"p must be a C-contiguous cupy float32[>= {n}, {cap}] workspace, got {_describe(p)}"
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
    if logits.dtype == np.float32:
        name, logits_arg = "lmhead_overlay_scatter_f32", logits
    else:
        name, logits_arg = "lmhead_overlay_scatter_bf16", _u16(cp, logits)
    kern = get_kernel(SOURCE, name)
    j_blocks = min((max_count + _SCATTER_BLOCK - 1) // _SCATTER_BLOCK, _MAX_GRID)
    kern(
        (j_blocks, min(n, 65535)),
        (_SCATTER_BLOCK,),
        (p, np.int64(cap), _slot_arg(cp, seq_slot), np.int32(act), np.int64(n), ids_all,
         bases, counts, np.int32(num), np.int64(cap), np.int64(n_cols), logits_arg),
    )  # fmt: skip
    return logits


# --------------------------------------------------------------------------- mma path
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
    check_bf16_2d("hidden", hidden)
    n, hidden_size = hidden.shape
    for name, a in (("hidden", hidden), ("rows_all", rows_all), ("logits", logits)):
        if not is_device_array(a):
            raise ConfigError(f"{name} must be a cupy array here, got {_describe(a)}")
    _check_logits(logits, n)
    if not logits.flags.c_contiguous:
        raise ConfigError(f"logits must be C-contiguous, got {_describe(logits)}")
    act = check_route(seq_slot, active, n)
    check_bf16_2d("rows_all", rows_all, cols=hidden_size)
    cap = rows_all.shape[0]
    if cap % MMA_TILE:
        raise ConfigError(f"rows_all must have a multiple of {MMA_TILE} rows, got {cap}")
    _check_table("ids_all", ids_all, np.int32, cap)
    _check_table("tile_adapter", tile_adapter, np.int32, cap // MMA_TILE)
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
    vec = int(hidden_size % 8 == 0 and _aligned(hidden, rows_all))
    dtype = "f32" if logits.dtype == np.float32 else "bf16"
    logits_arg = logits if logits.dtype == np.float32 else _u16(cp, logits)
    kern, smem = _mma_kernel(dtype, config)
    kern(
        (-(-num_tiles // tiles),),
        (warps * 32,),
        (_u16(cp, hidden), _slot_arg(cp, seq_slot), np.int32(act), np.int64(n),
         np.int32(hidden_size), _u16(cp, rows_all), ids_all, tile_adapter,
         np.int64(num_tiles), np.int32(num), np.int64(n_cols), np.int32(vec), logits_arg),
        shared_mem=smem,
    )  # fmt: skip
    return logits


@functools.cache
def _mma_kernel_on(dtype: str, config: tuple[int, int, int], device_id: int) -> tuple[Any, int]:
    kern = get_kernel(SOURCE, _mma_name(dtype, config))  # a cupy.RawKernel
    smem = _mma_smem(config)
    # Above 48 KiB of dynamic shared memory a kernel must opt in, once per device (not a
    # stream operation: done at first use, before any capture).
    kern.max_dynamic_shared_size_bytes = smem
    # All of the SM's unified L1/shared memory as shared, so that two blocks fit.
    kern.preferred_shared_memory_carveout = 100
    return kern, smem


def _mma_kernel(dtype: str, config: tuple[int, int, int]) -> tuple[Any, int]:
    """The mma kernel of ``config`` ready to launch, and its dynamic shared memory."""
    cp = require_cupy("lmhead_overlay_mma")
    return _mma_kernel_on(dtype, config, cp.cuda.runtime.getDevice())
