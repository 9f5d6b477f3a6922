"""The counters of ``NgramRowCache``: what its pieces count, and the snapshot it returns.

Owns :class:`CacheStats` (the frozen snapshot of ``NgramRowCache.stats()``) and
:class:`Counters`, the one writer of the running counts: the pieces report what they
observed through its ``count_*`` methods (integer ``+=`` on the hot path), the facade
snapshots and resets it. Also the per-part misses and
the demand fault's phase times (``NgramRowCache.fault_phases``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np


@dataclass(frozen=True)
class CacheStats:
    """Counters of a cache since creation or the last ``stats(reset=True)``.

    ``lookups``: ids passed to ``resolve``. ``hits`` / ``misses``: unique rows of a
    batch found resident / faulted in (a row resolved twice in one batch counts
    once). ``evictions``: mapped rows dropped for others. ``rows_read``,
    ``bytes_read``, ``read_ops``: what the fault path read from the store (bytes
    include page padding and coalesced neighbours; prefetches' reads included).
    ``fault_seconds``: wall time spent in the demand fault path. ``batches``:
    ``end_step`` calls. ``prefetched``: rows read by completed prefetches (a later
    ``resolve`` of such a row is a hit; rows a resolve took over from a piece not
    started count here too). ``prefetch_wait_seconds``: time resolves spent waiting
    for prefetches still in flight, or reading the rows they took over.
    ``rows_reread``: rows read twice, in ``rows_read`` twice: a resolve that needed rows
    of a prefetch piece being read read them itself rather than wait for the whole piece
    (the piece reads them too).
    """

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    rows_read: int = 0
    bytes_read: int = 0
    read_ops: int = 0
    fault_seconds: float = 0.0
    batches: int = 0
    prefetched: int = 0
    prefetch_wait_seconds: float = 0.0
    rows_reread: int = 0

    @property
    def hit_rate(self) -> float:
        """hits / (hits + misses), 0.0 before any lookup."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class Counters:
    """The running counts behind :class:`CacheStats` (attributes of the same names, read
    them), the misses per part (``part_misses``, int64[parts]) and the demand faults' phase
    times (:meth:`phases`: plan, read, commit, launch; summed, never reset; four floats, so
    that a fault adds to them without an array operation).

    The only writer of them all: the object that observed an event reports it through one
    of the ``count_*`` methods below (the LRU a resolve's lookups, hits, misses and each
    part's misses, which its C counts and returns; the faulter a read and a fault's times;
    the prefetcher its reads, evictions and waits; the facade a batch), and nobody else
    assigns or adds to these attributes (``tests/cache/test_writers.py`` checks it)."""

    def __init__(self, parts: int) -> None:
        self.part_misses = np.zeros(parts, dtype=np.int64)
        self.plan_s = self.read_s = self.commit_s = self.launch_s = 0.0
        self.reset()

    def reset(self) -> None:
        """Every count back to zero (the phase times are kept)."""
        self.lookups = self.hits = self.misses = self.evictions = 0
        self.rows_read = self.bytes_read = self.read_ops = 0
        self.batches = self.prefetched = self.rows_reread = 0
        self.fault_seconds = 0.0
        self.prefetch_wait_seconds = 0.0
        self.part_misses[:] = 0

    def phases(self) -> np.ndarray:
        """float64[4]: the phase times summed: plan, read, commit, launch."""
        return np.array([self.plan_s, self.read_s, self.commit_s, self.launch_s])

    # -- the writers ---------------------------------------------------------
    def count_fault(
        self, seconds: float, plan: float, read: float, commit: float, launch: float
    ) -> None:
        """A demand fault's host time (``fault_seconds``) and its phase times (seconds)."""
        self.fault_seconds += seconds
        self.plan_s += plan
        self.read_s += read
        self.commit_s += commit
        self.launch_s += launch

    def count_read(self, read: tuple[int, int, int]) -> None:
        """A read's (rows, bytes, ops)."""
        self.rows_read += read[0]
        self.bytes_read += read[1]
        self.read_ops += read[2]

    def count_hits(self, lookups: int, fresh: int) -> None:
        """An all-hits resolve's ``lookups`` ids, or its deferred touch's ``fresh`` slots
        newly pinned (hits)."""
        self.lookups += lookups
        self.hits += fresh

    def count_commit(
        self, lookups: int, fresh: int, misses: int, evictions: int, part_misses: np.ndarray
    ) -> None:
        """A resolve with misses, committed: ``fresh`` slots newly pinned (``misses`` of
        them faulted; ``part_misses[p]`` of those in part ``p``)."""
        self.lookups += lookups
        self.misses += misses
        self.hits += fresh - misses
        self.evictions += evictions
        if misses:  # (one part: a scalar add, ~0.1 us against an array add's ~0.7)
            if self.part_misses.size == 1:
                self.part_misses[0] += misses
            else:
                self.part_misses += part_misses

    def count_evictions(self, evictions: int) -> None:
        """Mapped rows a prefetch's reservation dropped for others."""
        self.evictions += evictions

    def count_prefetched(self, prefetched: int, reread: int = 0) -> None:
        """Rows of prefetches completed (or taken over), and rows read twice."""
        self.prefetched += prefetched
        self.rows_reread += reread

    def count_wait(self, seconds: float) -> None:
        """Time a resolve spent on prefetches in flight (waiting, or reading their rows)."""
        self.prefetch_wait_seconds += seconds

    def count_batch(self) -> None:
        """An ``end_step``."""
        self.batches += 1

    def snapshot(self) -> CacheStats:
        """The counts as a :class:`CacheStats`."""
        return CacheStats(**{f.name: getattr(self, f.name) for f in fields(CacheStats)})
