"""rowcache: out-of-core embedding rows on NVMe, a bounded row arena with LRU and pinning.

Public API: ``build_store`` (with ``ConcatRows`` and ``Fp8TableScaleSource`` sources),
``RowStore``, ``TableInfo``, ``NgramRowCache``,
``CacheStats``, ``PrefetchHandle``, and the errors of ``rowcache.errors``
(``StoreChangedError`` among them).
"""

from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _dist_version

from rowcache.cache.prefetch import PrefetchHandle
from rowcache.cache.row_cache import CacheStats, NgramRowCache
from rowcache.cache.step_rows import StepRows
from rowcache.errors import (
    ArenaExhaustedError,
    ConfigError,
    CorruptDataError,
    FormatError,
    GpuUnavailableError,
    PendingResolveError,
    RowCacheError,
    RowRangeError,
    StoreChangedError,
)
from rowcache.format.layout import TableInfo
from rowcache.store.builder import build_store
from rowcache.store.handle import RowStore, VerifyReport
from rowcache.store.sources import ConcatRows, Fp8TableScaleSource

# The library logs through ``logging.getLogger("rowcache")`` (and its children, one a module:
# ``rowcache.store.builder``, ...) and prints nothing itself; without a handler of the
# application's, nothing shows (``rowcache -v`` shows INFO on stderr, ``-vv`` DEBUG).
logging.getLogger("rowcache").addHandler(logging.NullHandler())

try:
    __version__ = _dist_version("rowcache")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "ArenaExhaustedError",
    "CacheStats",
    "ConcatRows",
    "ConfigError",
    "CorruptDataError",
    "FormatError",
    "Fp8TableScaleSource",
    "GpuUnavailableError",
    "NgramRowCache",
    "PendingResolveError",
    "PrefetchHandle",
    "RowCacheError",
    "RowRangeError",
    "RowStore",
    "StepRows",
    "StoreChangedError",
    "TableInfo",
    "VerifyReport",
    "__version__",
    "build_store",
]
