"""The row cache: a bounded arena of row slots over one store table (or several).

:class:`NgramRowCache` (``row_cache``) is the public facade over objects that each own
their state: the slot table (``slots``), the LRU (``lru``; the miss plan it hands from
planning to committing: ``plan``), the arena and device map (``arena``), the reads of the
parts (``parts``), the faulter (``faulter``), the prefetcher (``prefetcher``; its pieces and
handles: ``prefetch``) and the counters (``stats``).
"""

from __future__ import annotations

from rowcache.cache.prefetch import PrefetchHandle
from rowcache.cache.row_cache import CacheStats, NgramRowCache

__all__ = ["CacheStats", "NgramRowCache", "PrefetchHandle"]
