"""The fused eager GPU step: one upload, one hash + gather launch, GEMM, scaled sum.

Owns the mixin :class:`FusedStep`: an ``NgramEmbedding`` step from host tokens on the
GPU when every table is resident or read through its cache's device map
(``_fused_ids``): the upload read from pinned memory, the hash and every gather in one
``rowcache.kernels.ngram.hash.hash_gather`` launch, the overlay, GEMM and sum; cached rows resolved
on the host meanwhile; a small step that would fault resolves first
(``CachedGroups._verified`` says when, and what a larger step does). Does not own the
buffers (``rowcache.embed.step.device``) nor graph replay (``rowcache.embed.step.graph``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rowcache.embed.ngram.batch import NgramBatch
from rowcache.embed.step.device import DeviceStep, StepShape, pack_upload, upload_words
from rowcache.kernels.gemm import project_and_sum
from rowcache.kernels.ngram.hash import hash_gather
from rowcache.kernels.ngram.stacked import copy_from_mapped


class FusedStep:
    """The fused eager step of :class:`rowcache.embed.layer.NgramEmbedding` (a mixin)."""

    dims: Any
    device_lookup: bool
    _xp: Any
    _mult: Any
    _rows: Any
    _wcat: Any
    _stacked: Any
    _word_stacked: Any
    _groups: list[Any]

    def _step_fused(
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
        """One step into ``out``: upload, then the hash and every gather in one launch
        (cached tables through their caches' device maps), the overlay, GEMM and sum;
        then the cached rows are resolved on the host (pinned, LRU) while the device
        works; or, for a step that would fault, the resolve first and the device part
        once (``CachedGroups._verified``)."""
        xp = self._xp
        n = batch.n
        try:
            buf = self._tok_buffers(batch)
            host = buf.host()
            pack_upload(host, batch)

            def device_part() -> None:
                w = self._upload_gather(buf, host, StepShape.of(batch), stack, words)
                rows = self._overlay_rows(overlay, w, words, seq_slots, active, batch, n)
                project_and_sum(
                    stack,
                    self._wcat,
                    rows,
                    proj=proj,
                    out=out,
                    denom=float(1 + self.dims.num_tables),
                )

            try:
                self._verified(batch, device_part, check=True)
            finally:  # the pinned upload is free once the last part that reads it ran
                buf.uploaded(xp.cuda.get_current_stream())
        finally:
            self._end_batches()
        return out

    @property
    def _fused_ids(self) -> bool:
        """GPU, fused, every table resident or read through its cache's device map: a
        step's id work is one ``hash_gather`` launch."""
        return (
            self._word_stacked is not None
            and self._stacked is not None
            and (self.device_lookup or not self._groups)
        )

    def _upload_gather(
        self, buf: DeviceStep, host: np.ndarray, batch: Any, stack: Any, words: Any
    ) -> Any:
        """Pack ``batch``'s host tokens into the pinned ``host``, copy them up into
        ``buf.dev`` and hash + gather them into ``stack`` and ``words`` (one copy,
        one launch; no allocation, no sync: capturable). Returns the word ids
        (int64[n], device). ``batch`` may be a :class:`StepShape` when ``host`` is
        already packed."""
        L, n, multi = batch.length, batch.n, batch.num_seqs > 1
        k = pack_upload(host, batch) if isinstance(batch, NgramBatch) else upload_words(L, n, multi)
        copy_from_mapped(host.ctypes.data, buf.dev, k)
        assert self._stacked is not None and self._word_stacked is not None
        tok = buf.dev[:L]
        hash_gather(
            tok,
            buf.dev[L + n : 2 * L + n] if multi else None,
            buf.dev[2 * L + n : 2 * L + 2 * n] if multi else None,
            self._mult,
            self._rows,
            self.dims.eos_token_id,
            self._stacked,
            stack,
            self._word_stacked,
            words,
        )
        return buf.dev[L : L + n] if multi else tok[L - n :]
