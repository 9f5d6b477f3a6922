"""The row cache: a bounded arena of row slots over one store table (or several).

:class:`NgramRowCache` (``row_cache``) is the public class; the LRU log and pins (``lru``),
the demand fault path (``fault``, ``buffers``), deferred faults (``deferred``), the device
row map (``device_map``) and prefetch (``prefetch``, ``prefetch_book``, ``in_flight``) are
its parts, over the shared slot state declared in ``state``.
"""

from __future__ import annotations

from rowcache.cache.prefetch import PrefetchHandle
from rowcache.cache.row_cache import CacheStats, NgramRowCache

__all__ = ["CacheStats", "NgramRowCache", "PrefetchHandle"]
