"""rowcache: out-of-core embedding rows on NVMe, a bounded row arena with LRU and pinning.

Public API (see DESIGN.md): ``build_store``, ``RowStore``, ``TableInfo``,
``NgramRowCache``, ``CacheStats``, ``PrefetchHandle``, and the errors of ``rowcache.errors``.
"""

from __future__ import annotations

from .builder import build_store
from .cache import CacheStats, NgramRowCache
from .errors import (
    ArenaExhaustedError,
    ConfigError,
    CorruptDataError,
    FormatError,
    GpuUnavailableError,
    RowCacheError,
    RowRangeError,
)
from .format import TableInfo
from .prefetch import PrefetchHandle
from .store import RowStore, VerifyReport

__all__ = [
    "ArenaExhaustedError",
    "CacheStats",
    "ConfigError",
    "CorruptDataError",
    "FormatError",
    "GpuUnavailableError",
    "NgramRowCache",
    "PrefetchHandle",
    "RowCacheError",
    "RowRangeError",
    "RowStore",
    "TableInfo",
    "VerifyReport",
    "build_store",
]
