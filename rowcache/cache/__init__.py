"""The row cache: a bounded arena of row slots over one store table (or several).

:class:`NgramRowCache` (``row_cache``) is the public facade over objects that each own
their state: the slot table (``slots``), the LRU (``lru``; the miss plan it hands from
planning to committing: ``plan``), the arena and device map (``arena``), the reads of the
parts (``parts``), the faulter (``faulter``), the prefetcher (``prefetcher``; its pieces and
handles: ``prefetch``) and the counters (``stats``); the handle of a deferred resolve (``deferred``), the read-only
view of the books (``view``), and :class:`StepRows` (``step_rows``), the one owner of a step's
rows over its caches.
"""

from __future__ import annotations

from rowcache.cache.deferred import DeferredResolve
from rowcache.cache.prefetch import PrefetchHandle
from rowcache.cache.row_cache import CacheStats, NgramRowCache
from rowcache.cache.step_rows import StepRows
from rowcache.cache.view import CacheView

__all__ = [
    "CacheStats",
    "CacheView",
    "DeferredResolve",
    "NgramRowCache",
    "PrefetchHandle",
    "StepRows",
]
