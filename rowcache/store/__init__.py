"""The store: shard files of fixed-stride rows and their LMDB index.

``format`` (record and page arithmetic, the meta record), ``index`` (reading and checking
the LMDB index before LMDB maps it), ``handle`` (:class:`RowStore`, a read-only view),
``builder`` (``build_store``), ``pages`` (rows into pages), ``sources`` (arrays, ``.npy``,
``.safetensors``), ``replace`` (the atomic switch), ``checksum`` (page CRC32C).
"""

from __future__ import annotations

from rowcache.store.builder import build_store
from rowcache.store.format import TableInfo
from rowcache.store.handle import RowStore, VerifyReport

__all__ = ["RowStore", "TableInfo", "VerifyReport", "build_store"]
