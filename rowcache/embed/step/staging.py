"""The staging buffers of an ``NgramEmbedding`` step and the parts of its GEMM.

Owns :data:`GEMM_SPLITS` (how many K-parts the projection GEMM runs in, by rows per
step) and the mixin :class:`Staging`: the eager step's stack / projection / word-row
buffers (grown, never shrunk), the graph steps' staging shapes and the device token
buffers of a GPU step from host tokens (``rowcache.embed.step.device``). Launches nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rowcache.embed.ngram.batch import NgramBatch
from rowcache.embed.ngram.dims import NgramDims
from rowcache.embed.step.device import DeviceStep
from rowcache.kernels.gemm import split_k
from rowcache.kernels.reference import BF16

# Parts of the projection GEMM by rows per step: (at most this many rows, parts).
# Measured on an H200 at LongCat's shape ([n, 3072] x [3072, 3072], bench/embed_step.py's
# GEMM sweep): 1 row 10.8 -> 8.8 us with 4 parts; 64 and 2,048 rows are fastest
# whole; 256 rows gain 1 us, less than the wider scaled sum costs.
GEMM_SPLITS = ((16, 4),)
GEMM_SPLITS_MAX = max(s for _, s in GEMM_SPLITS)


class Staging:
    """Buffers of :class:`rowcache.embed.layer.NgramEmbedding`'s step (a mixin over its
    ``dims``, ``gemm_splits`` and array module ``_xp``)."""

    dims: NgramDims
    gemm_splits: int | None
    _xp: Any
    _cap: int
    _stack: Any
    _proj: Any
    upload_words: Any
    _tok: DeviceStep | None

    def _staging_shapes(self, n: int) -> tuple[tuple[int, int], int, int]:
        return (
            (n, self.dims.num_tables * self.dims.table_dim),
            self.dims.hidden_size,
            self._splits(n),
        )

    def _splits(self, n: int) -> int:
        """Parts of the projection GEMM of an ``n``-row step (1 on the CPU)."""
        if self._xp is np:
            return 1
        if self.gemm_splits is not None:
            return self.gemm_splits
        K = self.dims.num_tables * self.dims.table_dim
        for rows, splits in GEMM_SPLITS:
            if n <= rows:
                return splits if split_k(K, splits) else 1
        return 1

    def _reserve(self, n: int) -> None:
        """Grow the staging buffers to at least ``n`` rows (they never shrink)."""
        if n <= self._cap:
            return
        cap = max(n, 2 * self._cap)
        xp, D = self._xp, self.dims.hidden_size
        self._stack = xp.empty((cap, self.dims.num_tables * self.dims.table_dim), dtype=BF16)
        self._proj = xp.empty(max(GEMM_SPLITS_MAX, self.gemm_splits or 1) * cap * D, np.float32)
        self.upload_words = xp.empty((cap, D), dtype=BF16)
        self._cap = cap

    def _step_buffers(self, n: int, out: Any) -> tuple[Any, Any, Any, Any]:
        """An ``n``-row eager step's ``(out, stack, words, proj)``: ``out`` as given or
        fresh, the rest views of the staging buffers (grown to ``n`` rows)."""
        self._reserve(n)
        D = self.dims.hidden_size
        if out is None:
            out = self._xp.empty((n, D), dtype=BF16)
        S = self._splits(n)
        return out, self._stack[:n], self.upload_words[:n], self._proj[: S * n * D].reshape(S, n, D)

    def _tok_buffers(self, batch: NgramBatch) -> DeviceStep:
        L, n = batch.length, batch.n
        buf = self._tok
        if buf is None or buf.cap_len < L or buf.cap_rows < n:
            cap_len = max(L, 2 * buf.cap_len) if buf is not None else L
            cap_rows = max(n, 2 * buf.cap_rows) if buf is not None else n
            if buf is not None:
                buf.wait()
            buf = self._tok = DeviceStep(self._xp, self.dims.num_tables, cap_len, cap_rows)
        return buf
