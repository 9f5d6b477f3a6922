"""The LM-head paths of ``rowcache.embed.TokenOverlay``: their choice, knobs and the packed table.

Owns :class:`LmHeadPaths`, the one owner of the GPU LM-head path choice (``lmhead_path``, its
"auto" rule), the tuning knobs (``lmhead_tile``, ``lmhead_mma_config``) and the packed table R
and GEMM workspace P of the "gemm" and "mma" paths (growth, ``reserve``, ``generation``,
repacking), and the one place the GPU LM-head kernels are launched from. Reads the adapters'
LM-head parts and device tables from ``rowcache.embed.overlay.tables.OverlayTables``, never
writes them. Does not own the adapters' tables nor the routing
(``rowcache.embed.overlay.overlay``) nor the kernels (``rowcache.kernels.overlay.routed``).
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from rowcache.embed.overlay.tables import OverlayTables
from rowcache.errors import ConfigError
from rowcache.kernels.overlay.routed import (
    AUTO_PACKED_PATH,
    DEFAULT_LMHEAD_TILE,
    DEFAULT_MMA_CONFIG,
    GEMM_MIN_ROWS,
    LMHEAD_PATHS,
    LMHEAD_TILES,
    MMA_ALIGN,
    MMA_CONFIGS,
    MMA_TILE,
    lmhead_overlay_gemm,
    lmhead_overlay_mma,
    lmhead_overlay_routed,
    mma_tile_adapters,
    pack_overrides,
    prepare_gemm_capture,
)
from rowcache.kernels.reference import BF16

_CAP_ROUND = 256  # rows: the packed LM-head table grows in these steps
_BATCH_ROUND = 16  # rows of the GEMM path's P workspace


class LmHeadPaths:
    """The GPU LM-head paths of :class:`rowcache.embed.TokenOverlay` over its tables.

    Parameters
    ----------
    tables : OverlayTables
        The adapters' tables (read here: the LM-head parts, counts and device tables).
    hidden_size, max_adapters : int
        Validated by the caller.
    xp : module
        ``numpy`` (the CPU: knobs only, nothing is allocated or launched) or ``cupy``.
    """

    def __init__(self, tables: OverlayTables, hidden_size: int, max_adapters: int, xp: Any) -> None:
        self._tables = tables
        self._hidden_size = hidden_size
        self._max_adapters = max_adapters
        self._xp = xp
        self._on_host = xp is np
        self._tile = DEFAULT_LMHEAD_TILE
        self._mma_config = DEFAULT_MMA_CONFIG
        self._path = "auto"
        self._bases = np.zeros(max_adapters, np.int32)  # each adapter's first row in R
        self._cap = 0  # rows of the packed table R (0: none yet)
        self._batch = 0  # rows of the P workspace
        self._generation = 0
        # Device buffers: the bases now, R (with its ids and tile -> adapter map) and P
        # when the first LM-head override or a reserve sizes them.
        self._bases_dev: Any = None
        self._rows_all: Any = None
        self._ids_all: Any = None
        self._tile_adapter: Any = None
        self._p: Any = None
        if not self._on_host:
            self._bases_dev = xp.zeros(max_adapters, dtype=xp.int32)

    # ------------------------------------------------------------------ knobs
    @property
    def tile(self) -> tuple[int, int]:
        """(overrides, rows) per warp of the warp kernel; see ``TokenOverlay.lmhead_tile``."""
        return self._tile

    def set_tile(self, tile: tuple[int, int]) -> None:
        """Choose the warp kernel's tile (one of ``LMHEAD_TILES``)."""
        try:
            t = tuple(int(v) for v in tile)
        except (TypeError, ValueError):
            t = ()
        if t not in LMHEAD_TILES:
            raise ConfigError(f"lmhead_tile must be one of {LMHEAD_TILES}, got {tile!r}")
        self._tile = (t[0], t[1])

    @property
    def path(self) -> str:
        """The path asked for, or "auto"; see ``TokenOverlay.lmhead_path``."""
        return self._path

    def set_path(self, path: str) -> None:
        """Choose the LM-head path (one of ``LMHEAD_PATHS``)."""
        if path not in LMHEAD_PATHS:
            raise ConfigError(f"lmhead_path must be one of {LMHEAD_PATHS}, got {path!r}")
        self._path = path

    @property
    def mma_config(self) -> tuple[int, int, int]:
        """(16-row tiles, warps, ring stages) of the mma path; see
        ``TokenOverlay.lmhead_mma_config``."""
        return self._mma_config

    def set_mma_config(self, config: tuple[int, int, int]) -> None:
        """Choose the mma path's configuration (one of ``MMA_CONFIGS``)."""
        try:
            c = tuple(config)
        except TypeError:
            c = ()
        if len(c) != 3 or c not in MMA_CONFIGS or any(isinstance(v, float) for v in c):
            raise ConfigError(f"lmhead_mma_config must be one of {MMA_CONFIGS}, got {config!r}")
        self._mma_config = (int(c[0]), int(c[1]), int(c[2]))

    @property
    def generation(self) -> int:
        """Times the packed-table paths' buffers (table R, workspace P) have moved."""
        return self._generation

    @property
    def capacity(self) -> tuple[int, int]:
        """(rows of the packed table R, batch rows of the P workspace)."""
        return self._cap, self._batch

    # ------------------------------------------------------------------ sizing
    def reserve(self, rows: Any, batch: Any) -> None:
        """Size R for ``rows`` override rows (plus alignment padding) and P for ``batch``
        rows, then prepare cuBLAS for a capture; see ``TokenOverlay.reserve_lmhead``."""
        r = _nonnegative("rows", rows)
        b = _nonnegative("batch", batch)
        if not self._on_host:
            pad = (MMA_ALIGN - 1) * min(self._max_adapters, r)
            self._grow(r + pad, b)
            prepare_gemm_capture()

    def refit(self) -> None:
        """Follow the tables after an adapter slot changed: grow R when the overrides
        (each adapter's block padded to MMA_ALIGN rows) outgrow it (the first LM-head
        override creates it), else repack it in place (addresses kept)."""
        if self._on_host:
            return
        counts = self._tables.lm_counts
        total = int((-(-counts.astype(np.int64) // MMA_ALIGN) * MMA_ALIGN).sum())
        if total > self._cap:
            self._grow(total, 0)  # repacks
        elif self._cap:
            self._pack()

    # ------------------------------------------------------------------ per step
    def run(self, hidden: Any, seq: Any, act: int, logits: Any) -> None:
        """Apply the LM-head overrides on the GPU by the chosen path (inputs checked and
        routed by the caller)."""
        n = hidden.shape[0]
        t = self._tables.device
        # At least 1 so the kernel is always launched (a CUDA graph captured with no
        # adapter set still applies adapters set later; its loop covers any count).
        max_count = max(1, self._tables.max_lm_count)
        path = self._pick(n)
        if path == "mma":
            if self._cap == 0:
                return  # forced "mma" with no override anywhere: nothing to do
            lmhead_overlay_mma(
                hidden,
                seq,
                act,
                self._rows_all,
                self._ids_all,
                self._tile_adapter,
                self._max_adapters,
                logits,
                config=self._mma_config,
            )
            return
        if path == "gemm":
            if self._cap == 0:
                return  # forced "gemm" with no override anywhere: nothing to do
            if n > self._batch:
                self._check_not_capturing(n)
                self._grow(0, n)
            lmhead_overlay_gemm(
                hidden,
                seq,
                act,
                self._rows_all,
                self._ids_all,
                self._bases_dev,
                t.lm_counts,
                logits,
                p=self._p,
                max_count=max_count,
            )
            return
        lmhead_overlay_routed(
            hidden,
            seq,
            act,
            t.lm_id_ptrs,
            t.lm_row_ptrs,
            t.lm_counts,
            logits,
            max_count=max_count,
            tile=self._tile,
        )

    # ------------------------------------------------------------------ internals
    def _pick(self, n: int) -> str:
        if self._path != "auto":
            return self._path
        return AUTO_PACKED_PATH if self._cap > 0 and n >= GEMM_MIN_ROWS else "warp"

    def _check_not_capturing(self, n: int) -> None:
        stream = self._xp.cuda.get_current_stream()
        try:
            capturing = bool(stream.is_capturing())
        except Exception:
            capturing = False
        if capturing:
            raise ConfigError(
                f"apply_lmhead's GEMM path needs a larger P workspace for {n} rows (it holds "
                f"{self._batch}), and allocating inside a CUDA graph capture is not "
                f"allowed: call reserve_lmhead(batch={n}) or run one step before capturing"
            )

    def _grow(self, rows: int, batch: int) -> None:
        """Grow R (and P with it) to hold ``rows`` override rows and P to ``batch`` rows."""
        cp = self._xp
        cap, nb = self._cap, self._batch
        if rows > cap:
            cap = -(-rows // _CAP_ROUND) * _CAP_ROUND
        if batch > nb:
            nb = -(-batch // _BATCH_ROUND) * _BATCH_ROUND
        if cap == self._cap and nb == self._batch:
            return
        if cap != self._cap:
            self._rows_all = cp.zeros((cap, self._hidden_size), dtype=cp.uint16).view(BF16)
            self._ids_all = cp.full(cap, -1, dtype=cp.int32)
            self._tile_adapter = cp.full(cap // MMA_TILE, -1, dtype=cp.int32)
        self._p = cp.zeros((max(nb, 1), cap), dtype=cp.float32)
        repack = cap != self._cap
        self._cap, self._batch = cap, max(nb, 1)
        self._generation += 1  # graphs that captured the GEMM path hold the old buffers
        if repack:
            self._pack()

    def _pack(self) -> None:
        lm = self._tables.lm_parts
        bases, counts = pack_overrides(
            [None if p is None else p.ids for p in lm],
            [None if p is None else p.rows for p in lm],
            self._rows_all,
            self._ids_all,
            align=MMA_ALIGN,
        )
        self._bases[:] = bases
        self._bases_dev.set(self._bases)
        self._tile_adapter.set(mma_tile_adapters(bases, counts, self._cap))


def _nonnegative(name: str, value: Any) -> int:
    try:
        v = operator.index(value)
    except TypeError:
        raise ConfigError(f"{name} must be an int >= 0, got {value!r}") from None
    if isinstance(value, bool) or v < 0:
        raise ConfigError(f"{name} must be an int >= 0, got {value!r}")
    return v
