"""The state that ``NgramRowCache``'s pieces share, declared once.

Owns :class:`CacheState`: annotations (no values, no code) of the slot arrays, log
bounds, batch counters and stats that ``rowcache.cache.row_cache`` creates and the mixins
``rowcache.cache.lru``, ``rowcache.cache.fault``, ``rowcache.cache.device_map`` and
``rowcache.cache.prefetch_book`` work on.
"""

from __future__ import annotations

from typing import Any

import numpy as np

BUSY_READING = 1
"""``_busy[slot]``: reserved by a prefetch piece in flight whose row is still being read
(a resolve of the row waits for it or reads it itself). 0: not reserved."""
BUSY_READ = 2
"""``_busy[slot]``: reserved by a prefetch piece in flight whose row a resolve has read
into the slot already (a hit; the piece writes the same bytes again when it lands). Like
``BUSY_READING`` no victim until the piece is reaped (``csrc/lru_miss.c``)."""


class CacheState:
    """Attributes of :class:`rowcache.cache.row_cache.NgramRowCache` its mixins read and write."""

    num_slots: int
    rows: int
    _row_slot: np.ndarray
    _slot_row: np.ndarray
    _last_used: np.ndarray
    _log: np.ndarray
    _log_pos: np.ndarray
    _head: int
    _tail: int
    _batch: int
    _pinned: int
    _n_busy: int
    _busy: np.ndarray  # uint8[slots]: 0, BUSY_READING or BUSY_READ
    _stats: dict[str, Any]
    name: str
    device: str
    _xp: Any
    _lock: Any
    _dev_map: Any
    _jobs: list[Any]
    _failed: list[tuple[np.ndarray, BaseException]]
    _last_faults: int
    _reaped_rows: int
    _touching: Any  # deferred touches in flight (rowcache.cache.lru.LruLog._finish_touch)
