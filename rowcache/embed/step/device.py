"""The fixed buffers of a GPU embedding step from host tokens, and its upload layout.

Owns :class:`DeviceStep` (pinned upload ring, device tokens and ids, and for graph
steps the stack / projection / word-row / output buffers a captured graph points at),
:class:`StepShape` and the packing of an ``NgramBatch`` into one upload (``pack_upload``).
Does not launch kernels (``rowcache.embed.step.stages``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rowcache.embed.ngram.batch import NgramBatch
from rowcache.kernels.reference import BF16


class StepShape:
    """A step's shape (what a captured graph depends on): ``length`` tokens, ``n``
    embedded rows, several sequences or one."""

    __slots__ = ("length", "n", "num_seqs")

    def __init__(self, length: int, n: int, multi: bool) -> None:
        self.length, self.n, self.num_seqs = length, n, 2 if multi else 1

    @classmethod
    def of(cls, batch: NgramBatch) -> StepShape:
        return cls(batch.length, batch.n, batch.num_seqs > 1)


def upload_words(L: int, n: int, multi: bool) -> int:
    """int64 words of an upload: ``[tokens L | word ids n | starts L | positions n]``,
    or the tokens alone for one sequence."""
    return 2 * L + 2 * n if multi else L


def pack_upload(host: np.ndarray, batch: NgramBatch) -> int:
    """Pack ``batch`` into the pinned upload buffer ``host``; returns the words used."""
    L, n = batch.length, batch.n
    host[:L] = batch.tokens
    if batch.num_seqs > 1:
        host[L : L + n] = batch.word_ids
        host[L + n : 2 * L + n] = batch.starts
        host[2 * L + n : 2 * L + 2 * n] = batch.positions
    return upload_words(L, n, batch.num_seqs > 1)


class DeviceStep:
    """Fixed device buffers of a GPU step from host tokens (capacity ``cap_len``
    tokens, ``cap_rows`` rows), and a pinned upload buffer ring.

    Layout of an upload: ``[tokens L | word ids n | starts L | positions n]`` (one
    sequence: the tokens only). Before a pinned buffer is rewritten, the copy that
    last read it must have run (its event is waited on: normally long done). With
    ``staging`` (graph steps) it also owns the step's stack, projection, word-row
    and output buffers, so a captured graph's pointers stay valid.
    """

    def __init__(
        self,
        cp: Any,
        cap_len: int,
        cap_rows: int,
        staging: tuple[tuple[int, int], int, int] | None = None,
        out: bool = False,
    ) -> None:
        import cupyx

        self.cap_len, self.cap_rows = cap_len, cap_rows
        words = 2 * cap_len + 2 * cap_rows  # [tokens | word ids | starts | positions]
        ring = 1 if staging is not None else 2  # a graph reads one fixed buffer
        # pinned buffers (cudaHostAlloc: with unified addressing the device reads them at
        # their host address): a step's first kernel reads its upload straight from them
        self.hosts = [cupyx.empty_pinned(max(words, 1), dtype=np.int64) for _ in range(ring)]
        # one event per buffer, re-recorded (a fresh event per step is one more CUDA call)
        self._event_pool = [cp.cuda.Event(disable_timing=True) for _ in range(ring)]
        self._events: list[Any] = [None] * ring  # the buffer's event while a copy reads it
        self._next = 0
        self.dev = cp.empty(max(words, 1), dtype=cp.int64)
        self.stack = self.proj = self.words = self.out = None
        if staging is not None:
            (n, td), D, S = staging
            self.stack = cp.empty((n, td), dtype=BF16)
            self.proj = cp.empty((S, n, D), dtype=cp.float32)
            self.words = cp.empty((n, D), dtype=BF16)
            if out:
                self.out = cp.empty((n, D), dtype=BF16)

    @property
    def nbytes(self) -> int:
        arrays = [self.dev, self.stack, self.proj, self.words, self.out]
        return sum(int(a.nbytes) for a in arrays if a is not None)

    def host(self) -> np.ndarray:
        """The next pinned buffer to fill, once its previous copy has read it."""
        k = self._next
        if self._events[k] is not None:
            self._events[k].synchronize()
            self._events[k] = None
        return self.hosts[k]

    def uploaded(self, stream: Any) -> None:
        """Mark the buffer just handed out as being read by work queued on ``stream``."""
        ev = self._event_pool[self._next]
        ev.record(stream)
        self._events[self._next] = ev
        self._next = (self._next + 1) % len(self.hosts)

    def wait(self) -> None:
        for e in self._events:
            if e is not None:
                e.synchronize()
