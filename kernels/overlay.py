"""Token-overlay kernels: ``embed_rowdiff``, ``embed_overlay_routed``, ``lmhead_overlay_routed``.

Owns the three kernels' cupy launchers (CUDA source ``kernels/overlay.cu``) and their
NumPy references, which are the specification and the CPU path. Does not own adapters
or their lifetime: :class:`embed.overlay.TokenOverlay` builds the per-adapter tables
(override rows, slot maps, device pointer tables) that these functions read.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

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
)
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
    if getattr(logits, "ndim", None) != 2 or logits.dtype not in (np.dtype(np.float32), BF16):
        raise ConfigError(
            f"logits must be a 2-D float32 or bfloat16 array, got {_describe(logits)}"
        )
    if logits.shape[0] != n:
        raise ConfigError(
            f"logits must have {n} rows (one per hidden row), got {_describe(logits)}"
        )
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


# --------------------------------------------------------------------------- launchers
def compile_overlay_kernels() -> None:
    """Compile every overlay kernel now (NVRTC); raises GpuUnavailableError without a GPU."""
    for name in KERNEL_NAMES:
        get_kernel(SOURCE, name)


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
