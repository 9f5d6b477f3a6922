"""Row ids as every layer takes them: checked once, at the boundary, against a table's rows.

Owns :func:`check_row_ids`, the one check of a call's row ids (the store's ``read_rows``,
the row cache's ``resolve``, ``prefetch`` and ``holds_all``): integer type, one dimension,
every id inside ``[0, rows)``. Changes nothing; raises before anything reads or moves.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rowcache.errors import ConfigError, RowRangeError


def check_row_ids(row_ids: Any, rows: int, name: str = "row_ids") -> np.ndarray:
    """``row_ids`` as int64 [n]; ConfigError/ValueError for bad types, RowRangeError for range."""
    if type(row_ids).__module__.startswith("cupy"):
        row_ids = row_ids.get()
    raw = np.asarray(row_ids)
    if raw.dtype.kind not in "iu" or raw.dtype == np.bool_:
        if raw.size == 0 and raw.dtype.kind == "f":
            raw = raw.astype(np.int64)
        else:
            raise ConfigError(f"{name} must be an integer array, got dtype {raw.dtype}")
    if raw.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(raw.shape)}")
    ids = raw.astype(np.int64, copy=False)
    # One pass: as unsigned, a negative id is huge, so a single compare catches both ends
    # (a uint64 id >= 2**63 wraps negative here and is caught the same way).
    if ids.size and int(ids.view(np.uint64).max()) >= rows:
        bad = int(np.flatnonzero((ids < 0) | (ids >= rows))[0])
        raise RowRangeError(
            f"{name}[{bad}] = {int(raw[bad])} is outside the table's rows [0, {rows})"
        )
    return ids


__all__ = ["check_row_ids"]
