"""The error hierarchy (``RowCacheError`` and its subclasses), as users import it.

Defined in ``kernels.errors`` so the kernels package needs nothing from rowcache.
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

__all__ = [
    "ArenaExhaustedError",
    "ConfigError",
    "CorruptDataError",
    "FormatError",
    "GpuUnavailableError",
    "RowCacheError",
    "RowRangeError",
]
