"""The store's format: what the store (``rowcache.store``) writes and the readers
(``rowcache.io``) read, beneath both so that neither imports the other to agree on it.

``layout`` (records, page packing, shard files and keys, ``TableInfo``, ``ShardRecord``, the
meta record and its checks), ``rows`` (``check_row_ids``: a call's row ids against a
table's rows), ``reports`` (the JSON reports' format names, versions and table shape, and
the check each reader runs). No I/O here.
"""

from __future__ import annotations

from rowcache.format.layout import PAGE, ShardRecord, TableInfo, record_bytes
from rowcache.format.rows import check_row_ids

__all__ = ["PAGE", "ShardRecord", "TableInfo", "check_row_ids", "record_bytes"]
