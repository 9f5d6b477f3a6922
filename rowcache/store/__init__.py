"""The store: shard files of fixed-stride rows and their LMDB index.

``index`` (reading and checking the LMDB index before LMDB maps it), ``handle``
(:class:`RowStore`, a read-only view, reading through ``rowcache.io``'s ``RowReader``),
``builder`` (``build_store``), ``pages`` (rows into pages), ``sources`` (arrays, ``.npy``,
``.safetensors``), ``replace`` (the atomic switch), ``marker``, ``safeopen``. The layout the
store writes and its readers read is ``rowcache.format`` (``format`` here keeps its earlier
import path). The store imports its readers, never the other way round.

The public names are also ``rowcache.RowStore``, ``rowcache.TableInfo``, ``rowcache.build_store``,
``rowcache.ConcatRows``, ``rowcache.Fp8TableScaleSource``.
"""

from __future__ import annotations

from rowcache.format.layout import TableInfo
from rowcache.store.builder import build_store
from rowcache.store.handle import RowStore, VerifyReport
from rowcache.store.replace import Leftover, find_leftovers, remove_leftovers
from rowcache.store.sources import ConcatRows, Fp8TableScaleSource

__all__ = [
    "ConcatRows",
    "Fp8TableScaleSource",
    "Leftover",
    "RowStore",
    "TableInfo",
    "VerifyReport",
    "build_store",
    "find_leftovers",
    "remove_leftovers",
]
