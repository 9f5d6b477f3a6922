"""The state that ``NgramRowCache``'s pieces share, declared once.

Owns :class:`CacheState`: annotations (no values, no code) of the slot arrays, log
bounds, batch counters and stats that ``rowcache.cache`` creates and the mixins
``rowcache.lru``, ``rowcache.fault``, ``rowcache.device_map`` and
``rowcache.prefetch_book`` work on.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class CacheState:
    """Attributes of :class:`rowcache.cache.NgramRowCache` its mixins read and write."""

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
    _busy: np.ndarray
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
    _touching: Any  # deferred touches in flight (rowcache.lru.LruLog._finish_touch)
