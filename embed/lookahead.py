"""Lookahead for the n-gram embedding: the cached rows of a coming step, prefetched.

Owns :class:`StepPrefetch`, the handle of ``NgramEmbedding.prefetch`` /
``prefetch_batch`` / ``prefetch_packed``: the step's cached rows hashed on the host
and handed, one call per cache, to ``rowcache.NgramRowCache.prefetch``, which reads
them in the background. The semantics (rows arrive unpinned and most recently used,
nothing faults twice, a failed read raises at the step that needs the row) are the
cache's; see ``NgramRowCache.prefetch``. Resident tables need nothing.
"""

from __future__ import annotations

import time
from typing import Any


class StepPrefetch:
    """The prefetches of one coming step, one per cache.

    Attributes
    ----------
    rows : int
        Rows being read (rows already resident or in flight are not counted).
    dropped : int
        Rows left out because their cache had no unpinned slot for them.
    """

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles
        self.rows = sum(h.rows for h in handles)
        self.dropped = sum(h.dropped for h in handles)

    def done(self) -> bool:
        """True once every read has finished (or failed)."""
        return all(h.done() for h in self.handles)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every read has finished; False if ``timeout`` (s) passed first.
        Read errors are raised by the step that needs the rows, not here."""
        end = None if timeout is None else time.monotonic() + timeout
        for h in self.handles:
            left = None if end is None else max(0.0, end - time.monotonic())
            if not h.wait(left):
                return False
        return True

    def exception(self) -> BaseException | None:
        """The first read error once done, else None."""
        for h in self.handles:
            e = h.exception()
            if e is not None:
                return e
        return None

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"StepPrefetch(rows={self.rows}, dropped={self.dropped}, {state})"


def prefetch_step(emb: Any, batch: Any) -> StepPrefetch:
    """Start the cached rows of ``batch`` (an ``NgramBatch``) reading; never blocks."""
    if not emb._groups or batch.n == 0:
        return StepPrefetch([])
    if batch.on_device:
        batch = type(batch)(emb.dims, batch.tokens.get(), batch.ctx_lens, batch.seq_lens)
    return StepPrefetch(
        [cache.prefetch(gid.ravel()) for cache, _, gid, _ in emb._group_ids(batch, None)]
    )
