"""NumPy references of the token-overlay kernels: the specification and the CPU path.

Owns ``embed_rowdiff_reference``, ``embed_overlay_routed_reference``,
``lmhead_overlay_routed_reference`` and the LM head's packed-table references
(``lmhead_overlay_gemm_reference``, ``lmhead_overlay_mma_reference``). The launchers
(``rowcache.kernels.overlay.routed``, ``rowcache.kernels.overlay.lmhead``) are compared with these in tests.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np

from rowcache.errors import ConfigError
from rowcache.kernels.overlay.checks import (
    check_bf16_2d,
    check_int_1d,
    check_logits,
    check_pair,
    check_route,
    check_thresh,
    paired_adapters,
    route_slots,
)
from rowcache.kernels.overlay.pack import MMA_TILE

_ROWDIFF_CHUNK = 4096  # rows per NumPy chunk in the reference (bounds its f32 temporaries)


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
    check_pair(base, served)
    t = check_thresh(thresh)
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
    maps, rows_l = paired_adapters(("slot_maps", "override_rows"), slot_maps, override_rows)
    slots = route_slots(seq_slot, act, n)
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
    check_logits(logits, n)
    act = check_route(seq_slot, active, n)
    ids_l, rows_l = paired_adapters(("override_ids", "override_rows"), override_ids, override_rows)
    slots = route_slots(seq_slot, act, n)
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
    check_logits(logits, n)
    act = check_route(seq_slot, active, n)
    check_bf16_2d("rows_all", rows_all, cols=hidden.shape[1])
    cap = rows_all.shape[0]
    if cap % MMA_TILE:
        raise ConfigError(f"rows_all must have a multiple of {MMA_TILE} rows, got {cap}")
    check_int_1d("ids_all", ids_all, length=cap)
    check_int_1d("tile_adapter", tile_adapter, length=cap // MMA_TILE)
    num = operator.index(num_adapters)
    slots = route_slots(seq_slot, act, n)
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
    check_logits(logits, n)
    act = check_route(seq_slot, active, n)
    check_bf16_2d("rows_all", rows_all, cols=hidden.shape[1])
    cap = rows_all.shape[0]
    check_int_1d("ids_all", ids_all, length=cap)
    check_int_1d("bases", bases)
    check_int_1d("counts", counts, length=bases.shape[0])
    slots = route_slots(seq_slot, act, n)
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
