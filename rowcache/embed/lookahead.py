"""Lookahead for the n-gram embedding: the cached rows of a coming step, prefetched.

Owns :func:`prefetch_step`, behind ``NgramEmbedding.prefetch`` / ``prefetch_batch`` /
``prefetch_packed``: the step's cached rows hashed on the host and handed, one call per
cache, to ``rowcache.NgramRowCache.prefetch``, which reads them in the background; the
handles are merged into one ``rowcache.PrefetchHandle``. The semantics (rows arrive
unpinned and most recently used, nothing faults twice, a failed read raises at the step
that needs the row) are the cache's. Resident tables need nothing.
"""

from __future__ import annotations

from typing import Any

from rowcache.cache.prefetch import PrefetchHandle


def prefetch_step(emb: Any, batch: Any) -> PrefetchHandle:
    """Start the cached rows of ``batch`` (an ``NgramBatch``) reading; never blocks."""
    if not emb._groups or batch.n == 0:
        return PrefetchHandle([], 0, 0)
    if batch.on_device:
        batch = type(batch)(emb.dims, batch.tokens.get(), batch.ctx_lens, batch.seq_lens)
    handles = [cache.prefetch(gid.ravel()) for cache, _, gid, _ in emb._group_ids(batch, None)]
    return PrefetchHandle.merge(handles)
