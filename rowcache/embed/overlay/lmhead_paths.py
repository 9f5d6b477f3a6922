"""The LM-head paths of ``rowcache.embed.TokenOverlay``: their knobs and the packed table's buffers.

Owns the mixin :class:`LmHeadPaths`: the GPU LM-head path choice (``lmhead_path``, its
"auto" rule) and tuning knobs (``lmhead_tile``, ``lmhead_mma_config``), and the packed
table R and GEMM workspace P of the "gemm" and "mma" paths (growth, ``reserve_lmhead``,
``lmhead_generation``, repacking). Does not own the adapters' tables nor the routing
(``rowcache.embed.overlay.overlay``) nor the kernels (``rowcache.kernels.overlay.routed``).
"""

from __future__ import annotations

import operator
from typing import Any

from rowcache.errors import ConfigError
from rowcache.kernels.overlay.routed import (
    AUTO_PACKED_PATH,
    GEMM_MIN_ROWS,
    LMHEAD_PATHS,
    LMHEAD_TILES,
    MMA_ALIGN,
    MMA_CONFIGS,
    MMA_TILE,
    mma_tile_adapters,
    pack_overrides,
    prepare_gemm_capture,
)
from rowcache.kernels.reference import BF16

_CAP_ROUND = 256  # rows: the packed LM-head table grows in these steps
_BATCH_ROUND = 16  # rows of the GEMM path's P workspace


class LmHeadPaths:
    """The LM-head paths of :class:`rowcache.embed.overlay.overlay.TokenOverlay` (a mixin over its
    adapters' LM-head parts ``_lm``, device tables ``_dev`` and array module ``_xp``)."""

    device: str
    hidden_size: int
    max_adapters: int
    _xp: Any
    _dev: dict[str, Any]
    _lm: list[Any]
    _lm_bases: Any
    _lmhead_tile: tuple[int, int]
    _lmhead_path: str
    _lmhead_mma_config: tuple[int, int, int]
    _gemm_cap: int
    _gemm_batch: int
    _generation: int

    @property
    def lmhead_tile(self) -> tuple[int, int]:
        """GPU tuning knob: (overrides, rows) per warp of the LM-head kernel (same results).

        One of ``rowcache.kernels.overlay.routed.LMHEAD_TILES``; change it between steps, not inside a
        captured CUDA graph (the graph keeps the kernel it captured).
        """
        return self._lmhead_tile

    @lmhead_tile.setter
    def lmhead_tile(self, tile: tuple[int, int]) -> None:
        try:
            t = tuple(int(v) for v in tile)
        except (TypeError, ValueError):
            t = ()
        if t not in LMHEAD_TILES:
            raise ConfigError(f"lmhead_tile must be one of {LMHEAD_TILES}, got {tile!r}")
        self._lmhead_tile = (t[0], t[1])

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
        return self._lmhead_path

    @lmhead_path.setter
    def lmhead_path(self, path: str) -> None:
        if path not in LMHEAD_PATHS:
            raise ConfigError(f"lmhead_path must be one of {LMHEAD_PATHS}, got {path!r}")
        self._lmhead_path = path

    @property
    def lmhead_mma_config(self) -> tuple[int, int, int]:
        """GPU tuning knob of the mma path: (16-row tiles, warps, ring stages) per block.

        One of ``rowcache.kernels.overlay.routed.MMA_CONFIGS``; results agree to float32 rounding. Change
        it between steps, not inside a captured CUDA graph.
        """
        return self._lmhead_mma_config

    @lmhead_mma_config.setter
    def lmhead_mma_config(self, config: tuple[int, int, int]) -> None:
        try:
            c = tuple(config)
        except TypeError:
            c = ()
        if len(c) != 3 or c not in MMA_CONFIGS or any(isinstance(v, float) for v in c):
            raise ConfigError(f"lmhead_mma_config must be one of {MMA_CONFIGS}, got {config!r}")
        self._lmhead_mma_config = (int(c[0]), int(c[1]), int(c[2]))

    @property
    def lmhead_generation(self) -> int:
        """Times the packed-table paths' buffers (table R, workspace P) have moved.

        A CUDA graph that captured the GEMM or mma path is valid only while this is
        unchanged.
        """
        return self._generation

    @property
    def lmhead_capacity(self) -> tuple[int, int]:
        """(rows of the packed LM-head table, batch rows of the P workspace); GPU only."""
        return self._gemm_cap, self._gemm_batch

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
        r = _nonnegative("rows", rows)
        b = _nonnegative("batch", batch)
        if self.device == "cuda":
            pad = (MMA_ALIGN - 1) * min(self.max_adapters, r)
            self._grow_gemm(r + pad, b)
            prepare_gemm_capture()

    def _pick_path(self, n: int) -> str:
        if self._lmhead_path != "auto":
            return self._lmhead_path
        return AUTO_PACKED_PATH if self._gemm_cap > 0 and n >= GEMM_MIN_ROWS else "warp"

    def _check_not_capturing(self, n: int) -> None:
        stream = self._xp.cuda.get_current_stream()
        try:
            capturing = bool(stream.is_capturing())
        except Exception:
            capturing = False
        if capturing:
            raise ConfigError(
                f"apply_lmhead's GEMM path needs a larger P workspace for {n} rows (it holds "
                f"{self._gemm_batch}), and allocating inside a CUDA graph capture is not "
                f"allowed: call reserve_lmhead(batch={n}) or run one step before capturing"
            )

    def _grow_gemm(self, rows: int, batch: int) -> None:
        """Grow R (and P with it) to hold ``rows`` override rows and P to ``batch`` rows."""
        cp = self._xp
        d = self._dev
        cap, nb = self._gemm_cap, self._gemm_batch
        if rows > cap:
            cap = -(-rows // _CAP_ROUND) * _CAP_ROUND
        if batch > nb:
            nb = -(-batch // _BATCH_ROUND) * _BATCH_ROUND
        if cap == self._gemm_cap and nb == self._gemm_batch:
            return
        if cap != self._gemm_cap:
            d["lm_rows_all"] = cp.zeros((cap, self.hidden_size), dtype=cp.uint16).view(BF16)
            d["lm_ids_all"] = cp.full(cap, -1, dtype=cp.int32)
            d["lm_tile_adapter"] = cp.full(cap // MMA_TILE, -1, dtype=cp.int32)
        d["lm_p"] = cp.zeros((max(nb, 1), cap), dtype=cp.float32)
        repack = cap != self._gemm_cap
        self._gemm_cap, self._gemm_batch = cap, max(nb, 1)
        self._generation += 1  # graphs that captured the GEMM path hold the old buffers
        if repack:
            self._pack_lm()

    def _pack_lm(self) -> None:
        d = self._dev
        bases, counts = pack_overrides(
            [None if p is None else p.ids for p in self._lm],
            [None if p is None else p.rows for p in self._lm],
            d["lm_rows_all"],
            d["lm_ids_all"],
            align=MMA_ALIGN,
        )
        self._lm_bases[:] = bases
        d["lm_bases"].set(self._lm_bases)
        d["lm_tile_adapter"].set(mma_tile_adapters(bases, counts, self._gemm_cap))


def _nonnegative(name: str, value: Any) -> int:
    try:
        v = operator.index(value)
    except TypeError:
        raise ConfigError(f"{name} must be an int >= 0, got {value!r}") from None
    if isinstance(value, bool) or v < 0:
        raise ConfigError(f"{name} must be an int >= 0, got {value!r}")
    return v
