"""The composed embedding step: ids, resolve, per-part gathers, GEMM, scaled sum.

Owns the mixin :class:`ComposedStep`: the step of an ``NgramEmbedding`` on the CPU
(NumPy references: the specification the GPU paths are compared with), from device
tokens, and on the GPU when the ids are resolved on the host before the gathers
(``fused=False`` or ``device_lookup=False``). Does not own the fused eager step
(``rowcache.embed.step.fused``) nor graph replay (``rowcache.embed.step.graph``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rowcache.embed.ngram.batch import NgramBatch
from rowcache.embed.step.device import DeviceStep, pack_upload
from rowcache.embed.tables import CachedTable
from rowcache.kernels.gemm import project_and_sum
from rowcache.kernels.ngram.hash import ngram_hash
from rowcache.kernels.ngram.stacked import gather_stacked


class ComposedStep:
    """The composed step of :class:`rowcache.embed.layer.NgramEmbedding` (a mixin: the step's
    buffers, cached groups and overlay come from the other parts of the class)."""

    dims: Any
    tables: list[Any]
    word: Any
    _xp: Any
    _mult: Any
    _rows: Any
    _wcat: Any
    _stacked: Any
    _groups: list[Any]
    _cached_rows: np.ndarray

    def _step_composed(
        self,
        batch: NgramBatch,
        stack: Any,
        words: Any,
        proj: Any,
        out: Any,
        overlay: Any,
        seq_slots: Any,
        active: int,
    ) -> Any:
        """One step into ``out``: the ids hashed (host or device), the cached tables'
        rows resolved on the host (their slots replace the ids), the gathers (one
        stacked launch when fused, else per table), the overlay, GEMM and sum."""
        xp = self._xp
        n = batch.n
        try:
            if xp is np:
                ids: Any = batch.host_ids()  # int64[T, n]: only the embedded positions
                word_ids: Any = batch.word_ids
                host_ids = ids[self._cached_rows] if self._groups else None
            elif batch.on_device:
                ids = self._hash_all(batch)
                sel = batch.selection
                ids = ids[:, xp.asarray(sel) if isinstance(sel, np.ndarray) else sel]
                word_ids = batch.word_ids
                host_ids = ids[self._cached_rows].get() if self._groups else None
            else:
                # every n-gram table cached: their slots replace all ids, skip the hash
                hashed = self._cached_rows.size < self.dims.num_tables
                ids, word_ids = self._device_ids(self._tok_buffers(batch), batch, hashed)
                host_ids = batch.host_ids(self._cached_rows) if self._groups else None
            word_slots = None
            if self._groups:
                word_slots = self._resolve(batch, ids, host_ids)
                if xp is not np:
                    self._after_caches()
            if self._stacked is not None:
                gather_stacked(ids, self._stacked, stack)
            else:
                d = self.dims.table_dim
                for i, table in enumerate(self.tables):
                    block = stack[:, i * d : (i + 1) * d]
                    if isinstance(table, CachedTable):
                        table.gather_slots(ids[i], out=block)
                    else:
                        table.gather(ids[i], out=block)
            if word_slots is not None:
                self.word.gather_slots(word_slots, out=words)
            else:
                self.word.gather(word_ids, out=words)
            rows = self._overlay_rows(overlay, word_ids, words, seq_slots, active, batch, n)
            project_and_sum(
                stack, self._wcat, rows, proj=proj, out=out, denom=float(1 + self.dims.num_tables)
            )
        finally:
            self._end_batches()
        return out

    def _device_ids(
        self, buf: DeviceStep, batch: NgramBatch, hashed: bool = True
    ) -> tuple[Any, Any]:
        """Upload the packed tokens (one H2D copy from a pinned buffer), hash them,
        select the embedded positions: ``(ids int64[T, n], word ids int64[n])`` on the
        device, all in ``buf``'s fixed buffers (no allocation, no sync). With
        ``hashed=False`` only the word ids go up and ``ids`` is left for the caller
        to fill (every n-gram table is cached)."""
        cp = self._xp
        L, n = batch.length, batch.n
        T = self.dims.num_tables
        multi = batch.num_seqs > 1
        host = buf.host()
        if not hashed:
            host[:n] = batch.word_ids
            stream = cp.cuda.get_current_stream()
            buf.dev[:n].set(host[:n], stream=stream)
            buf.uploaded(stream)
            return buf.ids_sel[: T * n].reshape(T, n), buf.dev[:n]
        k = pack_upload(host, batch)
        stream = cp.cuda.get_current_stream()
        dev = buf.dev
        dev[:k].set(host[:k], stream=stream)
        buf.uploaded(stream)
        ids_all = buf.ids_all[: T * L].reshape(T, L)
        tok = dev[:L]
        # host tokens were checked once in NgramBatch: no range check here
        ngram_hash(
            tok,
            self._mult,
            self._rows,
            self.dims.eos_token_id,
            dev[L + n : 2 * L + n] if multi else None,
            out=ids_all,
        )
        if not multi:
            return ids_all[:, L - n :], tok[L - n :]
        ids = buf.ids_sel[: T * n].reshape(T, n)
        cp.take(ids_all, dev[2 * L + n : 2 * L + 2 * n], axis=1, out=ids)
        return ids, dev[L : L + n]
