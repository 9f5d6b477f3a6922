"""Rows of prefetch pieces in flight that a resolve needs now: read by the resolve itself.

Owns the mixin :class:`InFlightRows` of ``NgramRowCache`` (through
``rowcache.cache.prefetch_book.PrefetchBook``): a resolve takes over the rows of pieces not
started (``_take_over``), reads the rows of pieces being read into their reserved slots
(``_read_in_flight``), or, on the native miss path, claims both kinds for its own demand
read (``_claim_in_flight``, ``_claimed``, ``_unclaim``): one read a step. Does not own
the pieces, their queue or their reaping (``rowcache.cache.prefetch_book``) nor the read of a
job (``rowcache.cache.prefetch``).
"""

from __future__ import annotations

import collections
import threading
from typing import Any, NamedTuple

import numpy as np

from rowcache.cache.prefetch import PrefetchBuffers, PrefetchJob
from rowcache.cache.state import BUSY_READ, BUSY_READING, CacheState


def _member(values: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """bool[len(values)]: which ``values`` are in ``sorted_set`` (sorted, unique, not
    empty): one binary search a value; ``np.isin`` sorts both sides on every call."""
    i = sorted_set.searchsorted(values)
    i[i == sorted_set.size] = 0
    return sorted_set[i] == values


def _job_of(rows: list[np.ndarray], slots: list[np.ndarray]) -> PrefetchJob:
    """One job of the rows (and their reserved slots) taken from several pieces, in
    ascending row order (a read plan's order)."""
    r, sl = np.concatenate(rows), np.concatenate(slots)
    order = np.argsort(r, kind="stable")
    return PrefetchJob(r[order], sl[order])


class InFlightClaim(NamedTuple):
    """Rows of prefetch pieces in flight that a resolve reads in its own demand read
    (:meth:`PrefetchBook._claim_in_flight`): ``rows`` ascending, their reserved
    ``slots``, and per piece holding some of them ``(piece, mask over its slots)``."""

    rows: np.ndarray
    slots: np.ndarray
    parts: list[tuple[PrefetchJob, np.ndarray]]


class InFlightRows(CacheState):
    """A resolve's use of rows still in prefetch pieces (a mixin of
    :class:`rowcache.cache.prefetch_book.PrefetchBook`)."""

    _jobs: list[PrefetchJob]
    _steal_buffers: PrefetchBuffers | None  # a resolve's own, for rows it takes over
    _pf_queue: collections.deque[PrefetchJob]  # pieces not started, in call order
    _pf_qlock: threading.Lock
    _rows_taken: int  # rows resolves took over from pieces not started (benchmarks)
    _reader: Any

    def _take_over(self, needed: np.ndarray) -> list[PrefetchJob]:
        """The rows of queued pieces whose reserved slots are in ``needed`` (sorted,
        unique), read now by the calling resolve with the demand reader (not after every
        piece queued before them), as one job; returns the started pieces holding others
        of ``needed`` (:meth:`_read_in_flight`). Under the cache lock."""
        rows, slots, origin = [], [], []
        own = None
        with self._pf_qlock:
            for job in self._pf_queue:
                m = _member(job.slots, needed)
                if m.any():
                    rows.append(job.rows[m])
                    slots.append(job.slots[m])
                    origin.append(job)
                    job.rows, job.slots = job.rows[~m], job.slots[~m]
            if rows:
                own = _job_of(rows, slots)
                for job in origin:  # their handles wait for it too (before any is done)
                    job.taken.append(own)
                    if not job.rows.size:  # nothing left to read: done
                        self._pf_queue.remove(job)
                        job.event.set()
        if own is not None:
            self._rows_taken += int(own.rows.size)
            self._jobs.append(own)
            self._read_now(own)
        return [j for j in self._jobs if j.started and _member(j.slots, needed).any()]

    def _read_in_flight(self, started: list[PrefetchJob], needed: np.ndarray) -> list[PrefetchJob]:
        """The rows of pieces being read (``started``) whose reserved slots are in
        ``needed`` (sorted, unique), read now by the calling resolve with the demand reader
        into those slots, as one job: the resolve does not wait for the whole piece (a
        1,024-row piece reads for ~11 ms on the H200's disk). The slots become
        ``BUSY_READ``: hits, and still no victims until their piece lands and is reaped
        (it writes the same bytes again). Their rows count as prefetched by their piece,
        as before; the reads count in ``rows_read`` and ``rows_reread``. A failed read
        changes nothing: the pieces are waited for instead. Returns the pieces the caller
        still waits for (finished ones, to reap; all of them after a failed read). Under
        the cache lock."""
        rows, slots = [], []
        for job in started:
            if not job.event.is_set():
                m = _member(job.slots, needed)
                rows.append(job.rows[m])
                slots.append(job.slots[m])
        if not rows:
            return started
        own = _job_of(rows, slots)
        self._read_now(own)
        if own.error is not None:
            return started  # their pieces' own reads may still succeed
        st = self._stats
        n_rows, nbytes, ops = own.read
        st["rows_read"] += n_rows
        st["bytes_read"] += nbytes
        st["read_ops"] += ops
        st["rows_reread"] += int(own.rows.size)
        self._busy[own.slots] = BUSY_READ
        self._reaped_rows += int(own.rows.size)  # shown in the device map by this call
        if self._dev_map is not None:  # after the arena writes, in stream order
            self._sync_device_map(own.rows[:0], own.rows, own.slots)
        return [j for j in started if j.event.is_set()]

    def _claim_in_flight(self, ids: np.ndarray) -> InFlightClaim | None:
        """For a native resolve of ``ids`` whose plan found rows in flight: those rows
        of every piece in flight (queued or being read) and their reserved slots, which
        the resolve reads in its own demand read (one read a step, not one more before
        it). Their slots are ``BUSY_READ`` meanwhile (hits of the plan); undo with
        :meth:`_unclaim`, or after a successful read commit with :meth:`_claimed`. None
        where :meth:`_settle` must run instead (a failed prefetch to raise). Under the
        cache lock."""
        if self._failed:
            return None
        needed = self._needed_in_flight(ids)
        if not needed.size:
            return None
        parts, rows, slots = [], [], []
        for job in self._jobs:
            m = _member(job.slots, needed)
            if m.any():
                parts.append((job, m))
                rows.append(job.rows[m])
                slots.append(job.slots[m])
        claim = _job_of(rows, slots)
        self._busy[claim.slots] = BUSY_READ
        return InFlightClaim(claim.rows, claim.slots, parts)

    def _needed_in_flight(self, ids: np.ndarray) -> np.ndarray:
        """The slots (sorted, unique) of the rows of ``ids`` still being read by pieces."""
        s = self._row_slot[ids]
        s = s[s >= 0]
        return np.unique(s[self._busy[s] == BUSY_READING])

    def _unclaim(self, claim: InFlightClaim) -> None:
        """A claim whose read did not happen: its slots are being read again."""
        self._busy[claim.slots] = BUSY_READING

    def _claimed(self, claim: InFlightClaim) -> None:
        """The claim's rows were read into their slots by the resolve (and shown in the
        device map by its launch): rows of pieces not started leave them (taken over:
        their slots free of the piece, counted as prefetched); rows of pieces that have
        started stay ``BUSY_READ`` until their piece is reaped (read twice,
        ``rows_reread``), exactly as :meth:`_take_over` and :meth:`_read_in_flight`
        leave them. Under the cache lock."""
        taken = []
        with self._pf_qlock:  # a piece starts under it: started or not, for certain
            for job, m in claim.parts:
                if job.started:
                    continue
                taken.append(job.slots[m])
                job.rows, job.slots = job.rows[~m], job.slots[~m]
                if not job.rows.size:  # nothing left to read: done
                    self._pf_queue.remove(job)
                    job.event.set()
        n_taken = 0
        if taken:
            t = np.concatenate(taken)
            n_taken = int(t.size)
            self._busy[t] = 0
            self._n_busy -= n_taken
        st = self._stats
        st["prefetched"] += n_taken
        st["rows_reread"] += int(claim.rows.size) - n_taken
        self._rows_taken += n_taken
        self._reaped_rows += int(claim.rows.size)  # shown in the device map by this call

    def _read_now(self, job: PrefetchJob) -> None:
        """Run ``job`` in the calling resolve: the demand reader, the resolve's own
        buffers, the arena writes on the cache's stream (its gathers read them next)."""
        if self._steal_buffers is None:
            self._steal_buffers = PrefetchBuffers(self._reader)
        job.run(self, self._steal_buffers)
