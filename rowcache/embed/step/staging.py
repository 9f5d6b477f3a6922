"""The eager step's buffers and the parts of its GEMM.

Owns :data:`GEMM_SPLITS` (how many K-parts the projection GEMM runs in, by rows per
step), :func:`gemm_parts` (that rule) and :class:`Staging`: the eager runners' stack /
projection / word-row buffers (grown, never shrunk) and, on the GPU, the device token
buffers of a step from host tokens (``rowcache.embed.step.device.DeviceStep``), handed
out as a :class:`StepBuffers` per planned step. Launches nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rowcache.embed.ngram.dims import NgramDims
from rowcache.embed.step.device import DeviceStep, StepShape
from rowcache.kernels.gemm import split_k
from rowcache.kernels.reference import BF16

# Parts of the projection GEMM by rows per step: (at most this many rows, parts).
# Measured on an H200 at LongCat's shape ([n, 3072] x [3072, 3072], bench/embed_step.py's
# GEMM sweep): 1 row 10.8 -> 8.8 us with 4 parts; 64 and 2,048 rows are fastest
# whole; 256 rows gain 1 us, less than the wider scaled sum costs.
GEMM_SPLITS = ((16, 4),)
GEMM_SPLITS_MAX = max(s for _, s in GEMM_SPLITS)


def gemm_parts(dims: NgramDims, gemm_splits: int | None, n: int, on_device: bool) -> int:
    """Parts of the projection GEMM of an ``n``-row step: 1 on the CPU, ``gemm_splits``
    when given, else by :data:`GEMM_SPLITS`. Every GPU runner of one embedding uses this
    rule, so their results are bit-identical."""
    if not on_device:
        return 1
    if gemm_splits is not None:
        return gemm_splits
    K = dims.num_tables * dims.table_dim
    for rows, splits in GEMM_SPLITS:
        if n <= rows:
            return splits if split_k(K, splits) else 1
    return 1


class StepBuffers:
    """The buffers of one planned step: ``out`` bfloat16[n, D], ``stack``
    bfloat16[n, T*d], ``words`` bfloat16[n, D], ``proj`` float32[S, n, D] and, for a GPU
    step from host tokens, ``tok`` (its upload ring and device tokens), else None."""

    __slots__ = ("out", "proj", "stack", "tok", "words")

    def __init__(self, out: Any, stack: Any, words: Any, proj: Any, tok: Any) -> None:
        self.out, self.stack, self.words, self.proj, self.tok = out, stack, words, proj, tok


class Staging:
    """The eager steps' buffers of one embedding, grown to the largest step (never shrunk).

    Parameters
    ----------
    dims : NgramDims; xp : numpy or cupy; gemm_splits : the embedding's ``gemm_splits``.
    """

    def __init__(self, dims: NgramDims, xp: Any, gemm_splits: int | None) -> None:
        self.dims, self._xp, self.gemm_splits = dims, xp, gemm_splits
        self._cap = 0
        self.stack: Any = None
        self._proj: Any = None
        self._words: Any = None
        self._tok: DeviceStep | None = None

    @property
    def nbytes(self) -> int:
        arrays = (self.stack, self._proj, self._words)
        tok = 0 if self._tok is None else self._tok.nbytes
        return sum(int(a.nbytes) for a in arrays if a is not None) + tok

    def parts(self, n: int) -> int:
        """Parts of the projection GEMM of an ``n``-row step (:func:`gemm_parts`)."""
        return gemm_parts(self.dims, self.gemm_splits, n, self._xp is not np)

    def _reserve(self, n: int) -> None:
        """Grow the staging buffers to at least ``n`` rows."""
        if n <= self._cap:
            return
        cap = max(n, 2 * self._cap)
        xp, D = self._xp, self.dims.hidden_size
        self.stack = xp.empty((cap, self.dims.num_tables * self.dims.table_dim), dtype=BF16)
        self._proj = xp.empty(max(GEMM_SPLITS_MAX, self.gemm_splits or 1) * cap * D, np.float32)
        self._words = xp.empty((cap, D), dtype=BF16)
        self._cap = cap

    def buffers(self, shape: StepShape, out: Any, tokens: bool) -> StepBuffers:
        """The buffers of an ``shape.n``-row step: ``out`` as given or fresh, the rest
        views of the staging buffers; with ``tokens`` (a GPU step from host tokens) the
        device token buffers, grown to ``shape.length`` tokens."""
        n = shape.n
        self._reserve(n)
        D = self.dims.hidden_size
        if out is None:
            out = self._xp.empty((n, D), dtype=BF16)
        S = self.parts(n)
        proj = self._proj[: S * n * D].reshape(S, n, D)
        tok = self._tokens(shape) if tokens else None
        return StepBuffers(out, self.stack[:n], self._words[:n], proj, tok)

    def _tokens(self, shape: StepShape) -> DeviceStep:
        L, n = shape.length, shape.n
        buf = self._tok
        if buf is None or buf.cap_len < L or buf.cap_rows < n:
            cap_len = max(L, 2 * buf.cap_len) if buf is not None else L
            cap_rows = max(n, 2 * buf.cap_rows) if buf is not None else n
            if buf is not None:
                buf.wait()
            buf = self._tok = DeviceStep(self._xp, cap_len, cap_rows)
        return buf
