"""rowcache: out-of-core embedding rows on NVMe, a bounded row arena with LRU and pinning.

Public API (see DESIGN.md): ``build_store``, ``RowStore``, ``TableInfo``,
``NgramRowCache``, ``CacheStats``, and the errors of ``rowcache.errors``.
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
from .store import RowStore, VerifyReport

__all__ = [
    "ArenaExhaustedError",
    "CacheStats",
    "ConfigError",
    "CorruptDataError",
    "FormatError",
    "GpuUnavailableError",
    "NgramRowCache",
    "RowCacheError",
    "RowRangeError",
    "RowStore",
    "TableInfo",
    "VerifyReport",
    "build_store",
]
