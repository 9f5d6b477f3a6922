"""Token overlay: per-sequence adapters that override vocab rows of the embedding and LM head.

Owns :class:`TokenOverlay`'s API (adapter slots set, cleared and described; the
embedding and LM-head applications), checking its inputs and routing the adapters per row.
It composes two objects and calls them: the override tables (which vocab rows changed, their
values, the token -> override maps and, on the GPU, the device pointer tables) are owned by
``rowcache.embed.overlay.tables.OverlayTables``; the GPU LM-head path choice, its knobs and the
packed table by ``rowcache.embed.overlay.lmhead_paths.LmHeadPaths``. Does not own the kernels (``rowcache.kernels.overlay.routed``) nor the embedding gather or the LM-head
GEMM: callers apply the overlay to rows and logits they computed with the served model.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import numpy as np

from rowcache.embed.overlay.lmhead_paths import LmHeadPaths
from rowcache.embed.overlay.tables import OverlayTables, describe_array, to_host
from rowcache.errors import ConfigError, GpuUnavailableError
from rowcache.kernels.loader import is_device_array, require_cupy
from rowcache.kernels.overlay.routed import (
    check_bf16_2d,
    check_int_1d,
    check_route,
    compile_overlay_kernels,
    embed_overlay_routed,
    embed_overlay_routed_reference,
    lmhead_overlay_routed_reference,
)
from rowcache.kernels.reference import BF16

_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True, eq=False)
class OverlayAdapterInfo:
    """What one adapter slot overrides (host arrays; a snapshot).

    Attributes
    ----------
    slot : int
    embed_ids : int32[k]
        Sorted token ids whose input-embedding row the adapter overrides.
    lm_head_ids : int32[m]
        Sorted token ids whose LM-head row (hence logit) the adapter overrides.
    embed_vocab, lm_head_vocab : int
        Rows of the adapter's embedding / LM head (0: that part not given). Ids at or
        beyond them are never overridden.
    """

    slot: int
    embed_ids: np.ndarray
    lm_head_ids: np.ndarray
    embed_vocab: int
    lm_head_vocab: int

    @property
    def empty(self) -> bool:
        return self.embed_ids.size == 0 and self.lm_head_ids.size == 0


class TokenOverlay:
    """Up to ``max_adapters`` adapters overriding vocab rows, routed per row by slot.

    An adapter is a fine-tune of the served model that changed some rows of the input
    embedding and/or of the LM head (retrained or new tokens). :meth:`set_adapter` finds
    the changed rows with ``embed_rowdiff`` and stores only those. On each step,
    :meth:`apply_embed` overwrites the gathered embedding rows of tokens the row's
    adapter overrides (before any embedding scale), and :meth:`apply_lmhead` recomputes
    the logits of the adapter's overridden tokens (before softcap). Rows whose slot is
    negative keep the served model's values.

    Parameters
    ----------
    vocab_size : int
        The served token-id space (logit columns). An adapter may have fewer rows (ids
        beyond them are untouched) or more than the served table (rows beyond the served
        table are new tokens, always overridden), but never more than ``vocab_size``.
    hidden_size : int
    max_adapters : int
        Slots ``0 .. max_adapters - 1`` (at most 65,535).
    device : "cpu" or "cuda"
        "cpu": NumPy tables, the NumPy references run (always available). "cuda": cupy
        tables and the CUDA kernels; rows, logits and hidden states must be cupy arrays.

    Raises
    ------
    GpuUnavailableError
        ``device="cuda"`` where cupy, a CUDA device or NVRTC is unusable. The kernels are
        compiled here, eagerly, so this is the only place the GPU path can fail to load.
        rowcache raises instead of doing what the seed does (silently skipping the
        overlay when its kernels are missing): a skipped overlay does not crash, it
        serves every adapter's sequences with the base model's embeddings and logits,
        i.e. wrong tokens with no signal. An explicit error at construction, before any
        request is served, lets the caller choose (fix the install, use
        ``device="cpu"``, or refuse adapter requests) and guarantees no step fails midway.

    Notes
    -----
    On the GPU every per-adapter table is reached through device pointer tables
    (``uint64[max_adapters]``) plus ``int32`` counts and vocab sizes, allocated here
    once and updated in place by :meth:`set_adapter` / :meth:`clear_adapter`. A decode
    step's only per-step input is ``seq_slot`` and both apply methods always launch
    their kernel, so a CUDA graph captured around them stays valid when adapters change
    (set adapters between replays, not during one).

    The LM head has three GPU paths (:attr:`lmhead_path`). "warp": the warp-per-(row, j)
    kernels over the per-adapter tables. The other two use every adapter's LM-head rows
    packed into one bf16 table R ``[capacity, hidden_size]`` (a second copy of those
    rows, rebuilt by every set/clear; each adapter's block starts at a multiple of
    ``MMA_ALIGN`` = 32 rows, the gaps are zero rows of id -1). "gemm": one cuBLAS GEMM
    ``P = hidden @ R^T`` (f32 accumulate and out) then a routed scatter of each row's
    adapter's columns of P into the logits. "mma": one tensor-core kernel, a block per
    16-row tile of R, that computes only the routed rows' dot products and reads each
    routed adapter's rows once from memory (nothing for adapters no row is routed to);
    on the H200 it measured 0.020 ms against the GEMM path's 0.015 ms at 64 rows, so
    "auto" does not pick it (see ``rowcache.kernels.overlay.routed.GEMM_MIN_ROWS``).
    A graph captured on the GEMM or mma path holds R's (and P's) addresses and R's row
    count: it stays valid while they do not move, i.e. while the adapters' padded
    LM-head overrides fit the capacity and (GEMM) the batch fits P. They grow on demand
    (to a multiple of 256 rows, resp. 16 rows), and :attr:`lmhead_generation` counts
    the moves: re-capture when it changed, or call :meth:`reserve_lmhead` before
    capturing.

    The overlay composes an :class:`~rowcache.embed.overlay.tables.OverlayTables` (the
    adapters' tables and device pointer tables) and an
    :class:`~rowcache.embed.overlay.lmhead_paths.LmHeadPaths` (the GPU LM-head path
    choice, knobs and packed table), each the one owner of its state.
    """

    def __init__(
        self, vocab_size: int, hidden_size: int, max_adapters: int, *, device: str = "cpu"
    ) -> None:
        self.vocab_size = _positive("vocab_size", vocab_size, 2**31 - 1)
        self.hidden_size = _positive("hidden_size", hidden_size, 2**31 - 1)
        self.max_adapters = _positive("max_adapters", max_adapters, 65535)
        if device not in _DEVICES:
            raise ConfigError(f"device must be one of {_DEVICES}, got {device!r}")
        self.device = device
        xp: Any = np
        if device == "cuda":
            cp = require_cupy("TokenOverlay(device='cuda')")
            try:
                compile_overlay_kernels()
            except GpuUnavailableError:
                raise
            except Exception as exc:
                raise GpuUnavailableError(
                    f"TokenOverlay(device='cuda') could not load its kernels "
                    f"(rowcache/kernels/overlay/overlay.cu): {exc}; use device='cpu' or fix the CUDA/NVRTC install"
                ) from exc
            xp = cp
        self._xp = xp
        self._tables = OverlayTables(self.vocab_size, self.hidden_size, self.max_adapters, xp)
        self._paths = LmHeadPaths(self._tables, self.hidden_size, self.max_adapters, xp)

    # ------------------------------------------------------------------ adapters
    def set_adapter(
        self,
        slot: int,
        *,
        embed_weight: Any = None,
        lm_head_weight: Any = None,
        served_embed: Any = None,
        served_lm_head: Any = None,
        thresh: float = 0.0,
    ) -> OverlayAdapterInfo:
        """Install an adapter in ``slot`` (replacing what was there).

        Parameters
        ----------
        slot : int in [0, max_adapters)
        embed_weight, lm_head_weight : bfloat16[V_a, hidden_size] or None
            The adapter's input embedding / LM head (numpy or cupy). At least one is
            given; a part left None is not overridden. ``V_a <= vocab_size``.
        served_embed, served_lm_head : bfloat16[V_s, hidden_size]
            The served model's tables, required for the parts given (ignored otherwise).
        thresh : float >= 0
            A row is overridden when ``max_i |adapter - served| > thresh`` (see
            ``rowcache.kernels.overlay.routed.embed_rowdiff_reference``). Rows ``V_s <= r < V_a`` do not
            exist in the served table and are always overridden; rows ``r >= V_a`` never.

        Returns
        -------
        OverlayAdapterInfo
            The overridden ids. On failure the slot is left as it was.
        """
        s = self._check_slot(slot)
        if embed_weight is None and lm_head_weight is None:
            raise ConfigError(
                "set_adapter needs embed_weight and/or lm_head_weight (the adapter's tables); "
                "to empty a slot use clear_adapter"
            )
        try:
            t = np.float32(float(thresh)) if not isinstance(thresh, bool) else np.float32(-1)
        except (TypeError, ValueError):
            t = np.float32(-1)
        if not np.isfinite(t) or t < 0:
            raise ConfigError(f"thresh must be a finite float >= 0, got {thresh!r}")
        emb = None
        if embed_weight is not None:
            emb = self._tables.build(
                "embed_weight", embed_weight, "served_embed", served_embed, t, True
            )
        lm = None
        if lm_head_weight is not None:
            lm = self._tables.build(
                "lm_head_weight", lm_head_weight, "served_lm_head", served_lm_head, t, False
            )
        self._tables.set(s, emb, lm)
        self._paths.refit()
        return self.adapter_info(s)

    def clear_adapter(self, slot: int) -> None:
        """Empty ``slot``: rows routed to it keep the served values from now on."""
        s = self._check_slot(slot)
        self._tables.set(s, None, None)
        self._paths.refit()

    def adapter_info(self, slot: int) -> OverlayAdapterInfo:
        """What ``slot`` overrides now (empty arrays for an empty slot)."""
        s = self._check_slot(slot)
        emb, lm = self._tables.embed_parts[s], self._tables.lm_parts[s]
        none = np.zeros(0, np.int32)
        return OverlayAdapterInfo(
            slot=s,
            embed_ids=none if emb is None else emb.ids_host.copy(),
            lm_head_ids=none if lm is None else lm.ids_host.copy(),
            embed_vocab=0 if emb is None else emb.vocab,
            lm_head_vocab=0 if lm is None else lm.vocab,
        )

    @property
    def num_adapters(self) -> int:
        """Slots holding an adapter (a set adapter with zero changed rows counts)."""
        return self._tables.num_adapters

    # ------------------------------------------------------------------ LM-head paths
    @property
    def lmhead_tile(self) -> tuple[int, int]:
        """GPU tuning knob: (overrides, rows) per warp of the LM-head kernel (same results).

        One of ``rowcache.kernels.overlay.routed.LMHEAD_TILES``; change it between steps, not inside a
        captured CUDA graph (the graph keeps the kernel it captured).
        """
        return self._paths.tile

    @lmhead_tile.setter
    def lmhead_tile(self, tile: tuple[int, int]) -> None:
        self._paths.set_tile(tile)

    @property
    def lmhead_path(self) -> str:
        """GPU knob: which LM-head path :meth:`apply_lmhead` runs; one of ``LMHEAD_PATHS``.

        "warp": the warp kernels over the per-adapter tables (tuned by
        :attr:`lmhead_tile`). "gemm": one cuBLAS GEMM against the packed table of every
        adapter's rows, then a routed scatter. "mma": one tensor-core kernel over the
        packed table (tuned by :attr:`lmhead_mma_config`). "gemm" and "mma" have nothing
        to do while no adapter has an LM-head override and nothing is reserved. "auto"
        (default): ``rowcache.kernels.overlay.routed.AUTO_PACKED_PATH`` for batches of at least
        ``rowcache.kernels.overlay.routed.GEMM_MIN_ROWS`` rows once the packed table exists, else "warp"
        (so a graph captured before any adapter is set still applies adapters set
        later); the rule comes from the H200 measurements of bench/overlay.py. All agree
        to float32 rounding of the dot products. Set it between steps, not inside a
        capture. The CPU path ignores it.
        """
        return self._paths.path

    @lmhead_path.setter
    def lmhead_path(self, path: str) -> None:
        self._paths.set_path(path)

    @property
    def lmhead_mma_config(self) -> tuple[int, int, int]:
        """GPU tuning knob of the mma path: (16-row tiles, warps, ring stages) per block.

        One of ``rowcache.kernels.overlay.routed.MMA_CONFIGS``; results agree to float32 rounding. Change
        it between steps, not inside a captured CUDA graph.
        """
        return self._paths.mma_config

    @lmhead_mma_config.setter
    def lmhead_mma_config(self, config: tuple[int, int, int]) -> None:
        self._paths.set_mma_config(config)

    @property
    def lmhead_generation(self) -> int:
        """Times the packed-table paths' buffers (table R, workspace P) have moved.

        A CUDA graph that captured the GEMM or mma path is valid only while this is
        unchanged.
        """
        return self._paths.generation

    @property
    def lmhead_capacity(self) -> tuple[int, int]:
        """(rows of the packed LM-head table, batch rows of the P workspace); GPU only."""
        return self._paths.capacity

    def reserve_lmhead(self, rows: int = 0, batch: int = 0) -> None:
        """Size the packed-table paths' buffers now, so later adapters and steps do not
        move them.

        Parameters
        ----------
        rows : int >= 0
            Total LM-head override rows, over all adapters, that must fit without
            growing the packed table (it is never shrunk). The table gets room for the
            alignment padding too (up to 31 rows per adapter, for at most ``rows``
            adapters). Each step's GEMM covers the whole capacity, so reserve what will
            be used, not more.
        batch : int >= 0
            Largest batch (rows of hidden/logits) a step will pass.

        Call it before capturing a CUDA graph with the GEMM or mma path. A no-op on the
        CPU.
        """
        self._paths.reserve(rows, batch)

    # ------------------------------------------------------------------ per step
    def apply_embed(self, ids: Any, rows: Any, seq_slot: Any = None, active: int = -1) -> Any:
        """Overwrite gathered base embedding rows with their adapter's rows, in place.

        Parameters
        ----------
        ids : int[n] (numpy or cupy)
            Token id of each row. Ids < 0 or beyond the row's adapter vocabulary are
            left untouched (never read out of bounds).
        rows : bfloat16[n, hidden_size], C-contiguous
            The gathered served rows, before any embedding scale. numpy for
            ``device="cpu"``, cupy for ``device="cuda"``.
        seq_slot : int[n], int, or None
            Adapter slot of each row (negative: none); a scalar routes every row to it
            (like ``active``). A host (numpy) array is checked to hold no slot >=
            ``max_adapters``; a device array is not (that would synchronize), and the
            kernel leaves such rows untouched. Pass a cupy int32 array on the GPU: other
            dtypes are converted each call (an allocation, not allowed in a CUDA graph).
        active : int
            The slot of every row when ``seq_slot`` is None (-1: none).

        Returns
        -------
        rows
        """
        self._check_out("rows", rows, None)
        n = rows.shape[0]
        check_int_1d("ids", ids, length=n)
        act, seq = self._route(seq_slot, active, n)
        if self.device == "cpu":
            embed_overlay_routed_reference(
                to_host(ids),
                seq,
                act,
                [None if p is None else p.slot_map for p in self._tables.embed_parts],
                [None if p is None else p.rows for p in self._tables.embed_parts],
                rows,
            )
            return rows
        cp = self._xp
        t = self._tables.device
        embed_overlay_routed(
            cp.asarray(ids),
            seq,
            act,
            t.emb_map_ptrs,
            t.emb_row_ptrs,
            t.emb_counts,
            t.emb_vocabs,
            rows,
        )
        return rows

    def apply_lmhead(self, hidden: Any, logits: Any, seq_slot: Any = None, active: int = -1) -> Any:
        """Recompute the logits of each row's adapter's overridden tokens, in place.

        Parameters
        ----------
        hidden : bfloat16[n, hidden_size], C-contiguous
            Final hidden states (numpy for "cpu", cupy for "cuda").
        logits : float32 or bfloat16 [n, n_cols], C-contiguous
            The served LM head's logits, before softcap. Overridden ids at or beyond
            ``n_cols`` are skipped.
        seq_slot, active
            As in :meth:`apply_embed`.

        Returns
        -------
        logits
            ``logits[r, id] = dot(hidden[r], adapter_row[id])`` (float32 accumulation,
            rounded to the logits' dtype) for the overridden ids of row r's adapter.

        On the GPU, :attr:`lmhead_path` picks the warp kernels, the GEMM path (one
        cuBLAS GEMM against every adapter's packed rows, then a routed scatter) or the
        mma path (one tensor-core kernel over the packed rows); all are CUDA-graph
        capturable with ``seq_slot``'s contents as the only per-step input.
        """
        self._check_out("hidden", hidden, self.hidden_size)
        n = hidden.shape[0]
        if getattr(logits, "ndim", None) != 2 or logits.dtype not in (np.float32, BF16):
            raise ConfigError(
                f"logits must be a 2-D float32 or bfloat16 array, got {describe_array(logits)}"
            )
        if logits.shape[0] != n or not logits.flags.c_contiguous:
            raise ConfigError(
                f"logits must be C-contiguous with {n} rows (one per hidden row), "
                f"got {describe_array(logits)}"
            )
        if is_device_array(logits) != (self.device == "cuda"):
            raise ConfigError(
                f"logits must be a {'cupy' if self.device == 'cuda' else 'numpy'} array for "
                f"device={self.device!r}, got {describe_array(logits)}"
            )
        act, seq = self._route(seq_slot, active, n)
        if self.device == "cpu":
            lmhead_overlay_routed_reference(
                hidden,
                seq,
                act,
                [None if p is None else p.ids for p in self._tables.lm_parts],
                [None if p is None else p.rows for p in self._tables.lm_parts],
                logits,
            )
            return logits
        self._paths.run(hidden, seq, act, logits)
        return logits

    # ------------------------------------------------------------------ internals
    def _check_slot(self, slot: Any) -> int:
        try:
            s = operator.index(slot)
        except TypeError:
            raise ConfigError(f"slot must be an int, got {slot!r}") from None
        if isinstance(slot, bool) or not 0 <= s < self.max_adapters:
            raise ConfigError(f"slot must be in [0, {self.max_adapters}), got {slot!r}")
        return s

    def _check_out(self, name: str, a: Any, cols: int | None) -> None:
        check_bf16_2d(name, a, cols=self.hidden_size if cols is None else cols)
        if is_device_array(a) != (self.device == "cuda"):
            want = "cupy" if self.device == "cuda" else "numpy"
            raise ConfigError(
                f"{name} must be a {want} array for device={self.device!r}, got {describe_array(a)}"
            )

    def _route(self, seq_slot: Any, active: Any, n: int) -> tuple[int, Any]:
        if seq_slot is not None and np.ndim(seq_slot) == 0:
            # One slot for every row (what a caller embedding one sequence passes).
            seq_slot, active = None, _scalar_slot(seq_slot)
        act = check_route(seq_slot, active, n)
        if act >= self.max_adapters:
            raise ConfigError(
                f"active must be -1 (none) or a slot in [0, {self.max_adapters}), got {act}"
            )
        if seq_slot is None:
            return act, None
        if not is_device_array(seq_slot) or self.device == "cpu":
            seq = to_host(seq_slot)
            if seq.size and int(seq.max()) >= self.max_adapters:
                bad = int(np.flatnonzero(seq >= self.max_adapters)[0])
                raise ConfigError(
                    f"seq_slot[{bad}] = {int(seq[bad])} is not an adapter slot: allowed are "
                    f"negative values (none) and 0..{self.max_adapters - 1}"
                )
            if self.device == "cpu":
                return act, seq
        xp = self._xp
        seq = xp.asarray(seq_slot)
        if seq.dtype != xp.int32:
            # Checked on the device, without a host sync (the step stays capturable): a
            # slot outside [0, max_adapters) is no adapter, as the kernels treat it, and
            # never wraps into range (an unchecked int64 -> int32 cast sends 2**32 + 2 to 2).
            outside = (seq < 0) | (seq >= self.max_adapters)
            seq = xp.where(outside, -1, seq).astype(xp.int32)
        return act, seq


def _positive(name: str, value: Any, limit: int) -> int:
    try:
        v = operator.index(value)
    except TypeError:
        raise ConfigError(f"{name} must be an int, got {value!r}") from None
    if isinstance(value, bool) or not 1 <= v <= limit:
        raise ConfigError(f"{name} must be in [1, {limit}], got {value!r}")
    return v


def _scalar_slot(v: Any) -> Any:
    if is_device_array(v) or isinstance(v, np.ndarray):
        v = v.item()
    return v
