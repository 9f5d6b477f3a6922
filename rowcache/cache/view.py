"""A read-only view of a row cache's books, for checks, tests, benchmarks and timelines.

Owns :class:`CacheView`, what ``NgramRowCache.inspect()`` returns: the slot table and the
LRU (read them, never write them), copies of the maps and pins, the invariant checks, the
prefetch pieces, the per-part misses and the fault phases. It writes nothing: every member
reads under the cache's lock, after the cache's deferred touches finished; a deferred
resolve not yet waited for is never committed here (its members raise
``PendingResolveError``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from rowcache.cache.deferred import refuse_pending
from rowcache.cache.faulter import Faulter
from rowcache.cache.lru import Lru
from rowcache.cache.prefetch import PrefetchJob
from rowcache.cache.prefetcher import Prefetcher
from rowcache.cache.slots import SlotTable
from rowcache.cache.stats import Counters
from rowcache.format.rows import check_row_ids


class CacheView:
    """The books of one ``NgramRowCache`` (``cache.inspect()``), read-only.

    Parameters: the cache's name, lock and pieces (a view never writes them; it holds no
    reference to the cache, so a dropped cache is freed at once).
    """

    def __init__(
        self,
        name: str,
        lock: threading.RLock,
        slots: SlotTable,
        lru: Lru,
        prefetcher: Prefetcher,
        counters: Counters,
        faulter: Faulter,
    ) -> None:
        self._name = name
        self._lock = lock
        self._slots = slots
        self._lru = lru
        self._prefetcher = prefetcher
        self._counters = counters
        self._faulter = faulter

    @contextmanager
    def _settled(self) -> Iterator[None]:
        """The cache's lock held, its deferred touches finished; ``PendingResolveError``
        where a deferred resolve's handle was not waited for."""
        with self._lock:
            refuse_pending(self._name, self._faulter.pending is not None)
            if self._lru.touching:
                self._lru.finish_touches()
            yield

    @property
    def slot_table(self) -> SlotTable:
        """The slot table (row -> slot, slot -> row, states; ``check()``): read it only."""
        return self._slots

    @property
    def lru(self) -> Lru:
        """The LRU (recency, pins, the log; ``check()``): read it only."""
        return self._lru

    @property
    def pending(self) -> bool:
        """A deferred resolve's handle has not been waited for."""
        return self._faulter.pending is not None

    def check(self) -> list[str]:
        """Every broken invariant of the slot table and the LRU, one sentence each; empty
        when sound."""
        with self._settled():
            return self._slots.check() + self._lru.check()

    def slot_map(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of ``(row -> slot [rows], slot_row [slots])`` (-1 = unmapped; dense: 4
        bytes a row whatever the map's kind), with finished prefetches committed."""
        with self._settled():
            if self._prefetcher.jobs:
                self._prefetcher.reap()
            return self._slots.row_map.to_dense().copy(), self._slots.slot_row.copy()

    def pin_counts(self) -> np.ndarray:
        """int32[slots]: 1 for each slot pinned by the current step, else 0."""
        with self._settled():
            return self._lru.pin_mask().astype(np.int32)

    def is_resident(self, row_ids: Any) -> np.ndarray:
        """bool[n]: which of the global ``row_ids`` are mapped now (being read or not);
        raises ``RowRangeError`` for an id outside the cache's rows."""
        ids = check_row_ids(row_ids, self._slots.rows)
        with self._settled():
            return self._slots.slots_of(ids) >= 0

    def prefetch_pieces(self) -> list[PrefetchJob]:
        """The prefetch pieces in flight or not yet reaped (for timelines: their ``rows``,
        ``started``, ``times``)."""
        with self._settled():
            return self._prefetcher.pieces()

    def part_misses(self) -> np.ndarray:
        """int64[parts]: ``stats().misses`` split by the listed table they fell in (since
        creation or the last ``stats(reset=True)``)."""
        with self._settled():
            return self._counters.part_misses.copy()

    @property
    def fault_phases(self) -> np.ndarray:
        """float64[4]: seconds of the demand faults' phases since creation, summed: plan,
        read, commit (with the CPU's scatter), launch (a deferred fault's read: the time its
        join waited)."""
        return self._counters.phases()

    @property
    def rows_taken(self) -> int:
        """Rows resolves took over from prefetch pieces not started, since creation."""
        return int(self._prefetcher.rows_taken)

    @property
    def pinned(self) -> int:
        """Slots pinned by the current step."""
        with self._settled():
            return int(self._lru.pinned)

    def overhead_bytes(self) -> dict[str, int]:
        """Host bookkeeping bytes: per-slot arrays and the row map (dense: 4 bytes a row; a
        hash: 16-32 bytes a slot)."""
        t, lru = self._slots, self._lru
        per_slot = sum(a.nbytes for a in (t.slot_row, t.state, lru.last_used, lru.log, lru.log_pos))
        return {"per_slot_arrays": int(per_slot), "row_map": int(t.row_map.nbytes)}

    def __repr__(self) -> str:
        s: Any = self._slots
        return f"CacheView(slots={s.num_slots}, resident={s.resident}, pending={self.pending})"


__all__ = ["CacheView"]
