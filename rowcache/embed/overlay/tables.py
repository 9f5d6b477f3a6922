"""The adapters' override tables of ``rowcache.embed.TokenOverlay``: built, and pointed to.

Owns :class:`OverlayPart` (one side, embedding or LM head, of one adapter: its changed token
ids, their rows and the token -> override map) and :class:`OverlayTables`, the one owner of
every adapter slot's parts, their host counts and, on the GPU, the device pointer tables the
kernels read (:class:`DeviceTables`, allocated once and updated in place). It checks and
places an adapter's tables and finds its changed rows (``build``, with
``rowcache.kernels.overlay.routed.embed_rowdiff``). Does not own routing nor the public API
(``rowcache.embed.overlay.overlay``) nor the LM-head paths' packed table
(``rowcache.embed.overlay.lmhead_paths``, which reads the LM-head parts from here).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rowcache.errors import ConfigError
from rowcache.kernels.loader import is_device_array
from rowcache.kernels.overlay.routed import embed_rowdiff
from rowcache.kernels.reference import BF16


@dataclass
class OverlayPart:
    """One side (embedding or LM head) of one adapter, in the overlay's array module."""

    ids: Any  # int32[count], sorted token ids
    rows: Any  # bfloat16[count, hidden]
    slot_map: Any  # int32[vocab] token -> override index or -1 (embedding side only)
    ids_host: np.ndarray
    vocab: int


@dataclass(frozen=True, eq=False)
class DeviceTables:
    """The kernels' per-slot tables on the device (cupy, ``[max_adapters]`` each).

    Allocated once; :class:`OverlayTables` copies into them in place, so their addresses
    never change (a captured CUDA graph keeps reading the current adapters).
    """

    emb_map_ptrs: Any  # uint64: each slot's token -> override map (0: none)
    emb_row_ptrs: Any  # uint64: each slot's embedding override rows
    emb_counts: Any  # int32
    emb_vocabs: Any  # int32
    lm_id_ptrs: Any  # uint64: each slot's LM-head override ids
    lm_row_ptrs: Any  # uint64: each slot's LM-head override rows
    lm_counts: Any  # int32


class OverlayTables:
    """Every adapter slot's override tables: the parts, their counts and pointer tables.

    Parameters
    ----------
    vocab_size, hidden_size, max_adapters : int
        Validated by the caller (:class:`rowcache.embed.TokenOverlay`).
    xp : module
        ``numpy`` (the CPU: no device tables) or ``cupy`` (the GPU, kernels loaded).
    """

    def __init__(self, vocab_size: int, hidden_size: int, max_adapters: int, xp: Any) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self._xp = xp
        self._on_host = xp is np
        n = max_adapters
        self._embed: list[OverlayPart | None] = [None] * n
        self._lm: list[OverlayPart | None] = [None] * n
        # Host mirrors of the kernel tables (counts also size the LM-head grid).
        self._emb_counts = np.zeros(n, np.int32)
        self._emb_vocabs = np.zeros(n, np.int32)
        self._lm_counts = np.zeros(n, np.int32)
        self._lm_counts_view = self._lm_counts.view()
        self._lm_counts_view.setflags(write=False)
        self._max_lm_count = 0
        self._emb_map_ptrs = np.zeros(n, np.uint64)
        self._emb_row_ptrs = np.zeros(n, np.uint64)
        self._lm_id_ptrs = np.zeros(n, np.uint64)
        self._lm_row_ptrs = np.zeros(n, np.uint64)
        self._device: DeviceTables | None = None
        if not self._on_host:
            # Allocated in the order the kernels' tables always were: pointers, then counts.
            self._device = DeviceTables(
                emb_map_ptrs=xp.zeros(n, dtype=xp.uint64),
                emb_row_ptrs=xp.zeros(n, dtype=xp.uint64),
                lm_id_ptrs=xp.zeros(n, dtype=xp.uint64),
                lm_row_ptrs=xp.zeros(n, dtype=xp.uint64),
                emb_counts=xp.zeros(n, dtype=xp.int32),
                emb_vocabs=xp.zeros(n, dtype=xp.int32),
                lm_counts=xp.zeros(n, dtype=xp.int32),
            )

    # ------------------------------------------------------------------ reading
    @property
    def embed_parts(self) -> Sequence[OverlayPart | None]:
        """Each slot's embedding part (None: not overridden); read, never written."""
        return self._embed

    @property
    def lm_parts(self) -> Sequence[OverlayPart | None]:
        """Each slot's LM-head part (None: not overridden); read, never written."""
        return self._lm

    @property
    def lm_counts(self) -> np.ndarray:
        """int32[max_adapters], read-only: each slot's LM-head override rows."""
        return self._lm_counts_view

    @property
    def max_lm_count(self) -> int:
        """The most LM-head override rows of any slot (0: none)."""
        return self._max_lm_count

    @property
    def device(self) -> DeviceTables:
        """The device tables; only on the GPU."""
        assert self._device is not None, "OverlayTables.device: the tables live on the host"
        return self._device

    @property
    def num_adapters(self) -> int:
        """Slots holding an adapter (a set adapter with zero changed rows counts)."""
        return sum(e is not None or m is not None for e, m in zip(self._embed, self._lm))

    # ------------------------------------------------------------------ writing
    def build(
        self,
        name: str,
        weight: Any,
        served_name: str,
        served: Any,
        thresh: np.float32,
        with_map: bool,
    ) -> OverlayPart:
        """One side of an adapter: the rows of ``weight`` that differ from ``served``.

        Checks both tables (``ConfigError`` naming ``name`` / ``served_name``); changes
        nothing here (:meth:`set` installs the parts).
        """
        if served is None:
            raise ConfigError(f"{name} needs {served_name} (the served table) to find changed rows")
        w = self._prepare(name, weight)
        sv = self._prepare(served_name, served)
        va, vs = w.shape[0], sv.shape[0]
        if va > self.vocab_size:
            raise ConfigError(
                f"{name} has {va} rows but the overlay's vocab_size is {self.vocab_size}; "
                f"build the TokenOverlay with vocab_size >= the largest adapter vocabulary"
            )
        xp = self._xp
        m = min(va, vs)
        flags = embed_rowdiff(w[:m], sv[:m], float(thresh))
        ids = xp.flatnonzero(flags)
        if va > vs:  # rows the served table lacks: new tokens
            ids = xp.concatenate([ids, xp.arange(vs, va)])
        ids = ids.astype(xp.int32)
        # Gather through a uint16 view: bit copies, independent of bf16 support in xp.
        rows = xp.ascontiguousarray(w.view(xp.uint16)[ids]).view(w.dtype)
        slot_map = None
        if with_map:
            slot_map = xp.full(va, -1, dtype=xp.int32)
            slot_map[ids] = xp.arange(ids.shape[0], dtype=xp.int32)
        return OverlayPart(ids=ids, rows=rows, slot_map=slot_map, ids_host=to_host(ids), vocab=va)

    def set(self, s: int, embed: OverlayPart | None, lm: OverlayPart | None) -> None:
        """Install slot ``s``'s parts (None: that side not overridden) and refresh its
        counts and, on the GPU, the device tables in place."""
        self._embed[s], self._lm[s] = embed, lm
        self._emb_counts[s] = 0 if embed is None else embed.ids.shape[0]
        self._emb_vocabs[s] = 0 if embed is None else embed.vocab
        self._lm_counts[s] = 0 if lm is None else lm.ids.shape[0]
        self._max_lm_count = int(self._lm_counts.max())
        if self._device is None:
            return
        self._emb_map_ptrs[s] = _ptr(None if embed is None else embed.slot_map)
        self._emb_row_ptrs[s] = _ptr(None if embed is None else embed.rows)
        self._lm_id_ptrs[s] = _ptr(None if lm is None else lm.ids)
        self._lm_row_ptrs[s] = _ptr(None if lm is None else lm.rows)
        # In-place copies: the device tables keep their addresses (CUDA-graph safe).
        d = self._device
        d.emb_map_ptrs.set(self._emb_map_ptrs)
        d.emb_row_ptrs.set(self._emb_row_ptrs)
        d.lm_id_ptrs.set(self._lm_id_ptrs)
        d.lm_row_ptrs.set(self._lm_row_ptrs)
        d.emb_counts.set(self._emb_counts)
        d.emb_vocabs.set(self._emb_vocabs)
        d.lm_counts.set(self._lm_counts)

    # ------------------------------------------------------------------ internals
    def _prepare(self, name: str, a: Any) -> Any:
        if getattr(a, "ndim", None) != 2 or a.dtype != BF16:
            raise ConfigError(
                f"{name} must be a 2-D bfloat16 array [vocab, {self.hidden_size}], got "
                f"{describe_array(a)}; convert float tables with .astype(ml_dtypes.bfloat16)"
            )
        if a.shape[1] != self.hidden_size:
            raise ConfigError(
                f"{name} must have hidden_size = {self.hidden_size} columns, got {describe_array(a)}"
            )
        if self._on_host:
            return np.ascontiguousarray(to_host(a))
        return self._xp.ascontiguousarray(self._xp.asarray(a))


def to_host(a: Any) -> np.ndarray:
    return a.get() if is_device_array(a) else np.asarray(a)


def _ptr(a: Any) -> int:
    return 0 if a is None or a.size == 0 else int(a.data.ptr)


def describe_array(a: Any) -> str:
    dtype = getattr(a, "dtype", None)
    shape = getattr(a, "shape", None)
    if dtype is None or shape is None:
        return type(a).__name__
    return f"{type(a).__module__.split('.')[0]} {dtype}{list(shape)}"
