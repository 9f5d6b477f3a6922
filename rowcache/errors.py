"""The error hierarchy of rowcache: ``RowCacheError`` and its subclasses.

Defined once, in the lowest layer: every package (kernels, store, io, cache, embed, tools,
cli) raises these. Where a builtin fits, the error also inherits it (``ConfigError`` is a
``ValueError``, ``RowRangeError`` an ``IndexError``) so callers that catch builtins keep
working. Messages say what was asked, what exists, and what to do.
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
    """A step needs more slots than the arena has free or unpinned (a step ends at
    ``end_step()``: its rows are pinned until then)."""


class GpuUnavailableError(RowCacheError, RuntimeError):
    """A GPU path was requested where cupy or a CUDA device is not usable."""


class StoreChangedError(CorruptDataError):
    """The store a handle opened was replaced or removed and a read could not be served
    from it; a handle never mixes two stores: open the path again."""


class RankFailedError(RowCacheError):
    """A rank of a ``torch.distributed`` group failed a step of
    ``rowcache.embed.ShardedNgramEmbedding`` (that rank raised its own error); the step's
    output is invalid on every rank."""


class PendingResolveError(RowCacheError, RuntimeError):
    """A call on a row cache found a deferred resolve (``resolve(ids, defer=True)``) whose
    handle was not waited for: the cache never commits it implicitly, its owner calls the
    handle's ``wait()`` first."""


__all__ = [
    "ArenaExhaustedError",
    "ConfigError",
    "CorruptDataError",
    "FormatError",
    "GpuUnavailableError",
    "PendingResolveError",
    "RankFailedError",
    "RowCacheError",
    "RowRangeError",
    "StoreChangedError",
]
