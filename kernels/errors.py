"""The error hierarchy of rowcache, embed and kernels (defined here, in the lowest package).

Every error derives from :class:`RowCacheError`; where a builtin fits, the error
also inherits it (``ConfigError`` is a ``ValueError``, ``RowRangeError`` an
``IndexError``) so callers that catch builtins keep working. The classes live in
``kernels`` so that dependencies point one way (kernels <- rowcache <- embed);
users import them from ``rowcache.errors``. Messages say what was
asked, what exists, and what to do.
"""

from __future__ import annotations


class RowCacheError(Exception):
    """Base class of every rowcache error."""


class ConfigError(RowCacheError, ValueError):
    """A bad argument or configuration value (names the argument and the value)."""


class FormatError(RowCacheError):
    """A store whose meta record is missing, of an unknown version, or inconsistent."""


class CorruptDataError(RowCacheError):
    """A shard whose bytes are short, missing, or fail their checksum."""


class RowRangeError(RowCacheError, IndexError):
    """A row id outside ``[0, rows)`` of its table."""


class ArenaExhaustedError(RowCacheError, RuntimeError):
    """A batch needs more slots than the arena has free or unpinned."""


class GpuUnavailableError(RowCacheError, RuntimeError):
    """A GPU path was requested where cupy or a CUDA device is not usable."""


__all__ = [
    "ArenaExhaustedError",
    "ConfigError",
    "CorruptDataError",
    "FormatError",
    "GpuUnavailableError",
    "RowCacheError",
    "RowRangeError",
]
