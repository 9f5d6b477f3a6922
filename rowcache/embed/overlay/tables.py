"""The adapters' override tables of ``rowcache.embed.TokenOverlay``: built, and pointed to.

Owns :class:`OverlayPart` (one side, embedding or LM head, of one adapter: its changed token ids,
their rows and the token -> override map) and the mixin :class:`OverlayTables`: checking
and placing an adapter's tables (``_prepare``), finding its changed rows (``_build``, with
``rowcache.kernels.overlay.routed.embed_rowdiff``) and refreshing a slot's counts and, on the GPU, the
device pointer tables in place (``_refresh_tables``). Does not own routing nor the public
API (``rowcache.embed.overlay.overlay``) nor the LM-head paths' packed table (``rowcache.embed.overlay.lmhead_paths``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from rowcache.errors import ConfigError
from rowcache.kernels.loader import is_device_array
from rowcache.kernels.overlay.routed import MMA_ALIGN, embed_rowdiff
from rowcache.kernels.reference import BF16


@dataclass
class OverlayPart:
    """One side (embedding or LM head) of one adapter, in the overlay's array module."""

    ids: Any  # int32[count], sorted token ids
    rows: Any  # bfloat16[count, hidden]
    slot_map: Any  # int32[vocab] token -> override index or -1 (embedding side only)
    ids_host: np.ndarray
    vocab: int


class OverlayTables:
    """The adapters' tables of :class:`rowcache.embed.overlay.overlay.TokenOverlay` (a mixin over its
    per-slot parts ``_embed`` / ``_lm``, host counts and pointer tables, device tables
    ``_dev``, array module ``_xp``, and the LM-head paths' ``_grow_gemm`` / ``_pack_lm``)."""

    device: str
    hidden_size: int
    vocab_size: int
    _xp: Any
    _dev: dict[str, Any]
    _embed: list[OverlayPart | None]
    _lm: list[OverlayPart | None]
    _emb_counts: np.ndarray
    _emb_vocabs: np.ndarray
    _lm_counts: np.ndarray
    _emb_map_ptrs: np.ndarray
    _emb_row_ptrs: np.ndarray
    _lm_id_ptrs: np.ndarray
    _lm_row_ptrs: np.ndarray
    _gemm_cap: int
    _grow_gemm: Any  # LmHeadPaths' (a method: not defined here, so that the MRO finds it)
    _pack_lm: Any

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
        if self.device == "cpu":
            return np.ascontiguousarray(to_host(a))
        return self._xp.ascontiguousarray(self._xp.asarray(a))

    def _build(
        self,
        name: str,
        weight: Any,
        served_name: str,
        served: Any,
        thresh: np.float32,
        with_map: bool,
    ) -> OverlayPart:
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

    def _refresh_tables(self, s: int) -> None:
        emb, lm = self._embed[s], self._lm[s]
        self._emb_counts[s] = 0 if emb is None else emb.ids.shape[0]
        self._emb_vocabs[s] = 0 if emb is None else emb.vocab
        self._lm_counts[s] = 0 if lm is None else lm.ids.shape[0]
        if self.device != "cuda":
            return
        self._emb_map_ptrs[s] = _ptr(None if emb is None else emb.slot_map)
        self._emb_row_ptrs[s] = _ptr(None if emb is None else emb.rows)
        self._lm_id_ptrs[s] = _ptr(None if lm is None else lm.ids)
        self._lm_row_ptrs[s] = _ptr(None if lm is None else lm.rows)
        # In-place copies: the device tables keep their addresses (CUDA-graph safe).
        d = self._dev
        d["emb_map_ptrs"].set(self._emb_map_ptrs)
        d["emb_row_ptrs"].set(self._emb_row_ptrs)
        d["lm_id_ptrs"].set(self._lm_id_ptrs)
        d["lm_row_ptrs"].set(self._lm_row_ptrs)
        d["emb_counts"].set(self._emb_counts)
        d["emb_vocabs"].set(self._emb_vocabs)
        d["lm_counts"].set(self._lm_counts)
        # The packed table: grown when the overrides (each adapter's block padded to
        # MMA_ALIGN rows) outgrow it (the first LM-head override creates it), else
        # repacked in place (addresses kept).
        total = int((-(-self._lm_counts.astype(np.int64) // MMA_ALIGN) * MMA_ALIGN).sum())
        if total > self._gemm_cap:
            self._grow_gemm(total, 0)  # repacks
        elif self._gemm_cap:
            self._pack_lm()


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
