"""The error hierarchy (``RowCacheError`` and its subclasses), as users import it.

Defined in ``kernels.errors`` so the kernels package needs nothing from rowcache;
``StoreChangedError``, which only the store raises, is defined here.
"""

from __future__ import annotations

from kernels.errors import (
    ArenaExhaustedError,
    ConfigError,
    CorruptDataError,
    FormatError,
    GpuUnavailableError,
    RowCacheError,
    RowRangeError,
)


class StoreChangedError(CorruptDataError):
    """The store a handle opened was replaced or removed and a read could not be served
    from it; a handle never mixes two stores: open the path again."""


__all__ = [
    "ArenaExhaustedError",
    "ConfigError",
    "CorruptDataError",
    "FormatError",
    "GpuUnavailableError",
    "RowCacheError",
    "RowRangeError",
    "StoreChangedError",
]
