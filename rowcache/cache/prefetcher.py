"""The prefetcher of ``NgramRowCache``: pieces in flight, their thread, take-over and claims.

Owns :class:`Prefetcher`: a prefetch (its reservation asked of the LRU, ``Lru.reserve``:
its rows touched, victims chosen, evicted and reserved in the slot table), its pieces (``rowcache.cache.prefetch.PrefetchJob``)
and their queue, the thread that reads them, reaping finished pieces into the slot table,
the counters and the device map, the failed pieces' rows and their error (raised once),
and what a resolve does with rows still in flight: takes over rows of pieces not started
(:meth:`Prefetcher.settle`), reads rows of pieces being read itself, or claims both for
its own demand read (:meth:`Prefetcher.claim`). Every method runs under the cache's lock
but the thread's own and :meth:`Prefetcher.pause` / :meth:`Prefetcher.resume` (a flag: while
it is set no piece starts on the thread, whose tasks return at once, so that nothing ever
blocks on the pause: neither the cache's own calls, which read the pieces they wait for
themselves, nor the interpreter's exit).
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from rowcache.cache.arena import Arena
from rowcache.cache.lru import Lru, member
from rowcache.cache.parts import PartReader
from rowcache.cache.prefetch import PrefetchBuffers, PrefetchHandle, PrefetchJob
from rowcache.cache.slots import READ, READING, SlotTable
from rowcache.cache.stats import Counters
from rowcache.errors import ConfigError, CorruptDataError

PIECE_ROWS = 1024
"""A prefetch's rows are read in pieces of this many (one native batch each, in call
order), so a resolve that needs a row still in flight waits for one piece, and the rows of
pieces still queued it reads itself. The H200 disk read 1,024 fresh random pages a batch
at 95-107k reads/s at queue depth 64, 4,096 at 85-111k (docs/benchmarks.md, "Figures the
code cites")."""


WAIT_SHARE = 0.5
"""A resolve that needs at least this share of the rows of a prefetch piece in flight waits
for the piece rather than reading those rows itself (beside the piece, ``rows_reread``, or
taken over while the thread reads the piece before it): the piece is then mostly the
resolve's own rows (a prefill chunk prefetched a step ahead), and the thread reads them at
the disk's pace with nothing read twice. Below it, the resolve reads its few rows itself
rather than wait for the whole piece (a decode step's rows in a piece of 1,024). Qwen4's judge
on the dev VM (2M rows, 1/8 of the table, prefill 512): re-reading, 18 % of the prefetched
rows were read twice and a step's lookup waited 45.9–47.4 ms (0.73–0.82 of the disk's
bound); waiting, none and 39.8 ms (0.954); docs/results/2026-12-06-full-size-judges.md. A
deferred resolve (``defer=True``) never waits here: it reads them in its own read."""


def _job_of(rows: list[np.ndarray], slots: list[np.ndarray]) -> PrefetchJob:
    """One job of the rows (and their reserved slots) taken from several pieces, in
    ascending row order (a read plan's order)."""
    r, sl = np.concatenate(rows), np.concatenate(slots)
    order = np.argsort(r, kind="stable")
    return PrefetchJob(r[order], sl[order])


class InFlightClaim(NamedTuple):
    """Rows of prefetch pieces in flight that a resolve reads in its own demand read
    (:meth:`Prefetcher.claim`): ``rows`` ascending, their reserved ``slots``, and per
    piece holding some of them ``(piece, mask over its slots)``."""

    rows: np.ndarray
    slots: np.ndarray
    parts: list[tuple[PrefetchJob, np.ndarray]]


class Prefetcher:
    """Prefetches of one cache.

    Parameters
    ----------
    slots, lru, arena, parts, counters : the cache's pieces (see ``NgramRowCache``).
    name : the cache's, for errors.
    piece_rows : rows a piece (:data:`PIECE_ROWS`).
    merge : a native resolve reads rows in flight in its own demand read (claims) rather
        than apart before it (False: a benchmark's ablation).
    """

    def __init__(
        self,
        slots: SlotTable,
        lru: Lru,
        arena: Arena,
        parts: PartReader,
        counters: Counters,
        name: str,
        *,
        piece_rows: int = PIECE_ROWS,
        merge: bool = True,
    ) -> None:
        if isinstance(piece_rows, bool) or not isinstance(piece_rows, int) or piece_rows < 1:
            raise ConfigError(f"piece_rows={piece_rows!r}: give an int >= 1")
        self.slots = slots
        self.lru = lru
        self.arena = arena
        self.parts = parts
        self.counters = counters
        self.name = name
        self.piece_rows = piece_rows
        self.merge = merge
        self.jobs: list[PrefetchJob] = []  # in flight, or done and not yet reaped
        self.failed: list[tuple[np.ndarray, BaseException]] = []  # rows awaiting their raise
        self.rows_taken = 0  # rows resolves took over from pieces not started
        self.shown = 0  # rows shown in the device map since start_call (last_faults)
        self._queue: collections.deque[PrefetchJob] = collections.deque()  # not started
        self._qlock = threading.Lock()  # a piece starts under it
        self._paused = False  # (under _qlock) no piece starts on the thread
        self._parked = 0  # (under _qlock) the thread's tasks that returned while paused
        self._pool: ThreadPoolExecutor | None = None
        self._buffers: PrefetchBuffers | None = None
        self._own_buffers: PrefetchBuffers | None = None  # a resolve's, for rows it reads
        self._batch_done: Any = None  # GPU: the cache stream's event at the last end_step

    @property
    def idle(self) -> bool:
        """No piece in flight or unreaped and no failed rows to raise."""
        return not self.jobs and not self.failed

    def start_call(self) -> None:
        """A resolve begins: count the rows it shows in the device map from zero."""
        self.shown = 0

    def pieces(self) -> list[PrefetchJob]:
        """The pieces in flight or not yet reaped (a copy of the list)."""
        return list(self.jobs)

    # -- a prefetch ----------------------------------------------------------
    def prefetch(self, rows_u: np.ndarray) -> PrefetchHandle:
        """The prefetch of sorted unique rows (``NgramRowCache.prefetch``): its missing
        rows reserved by the LRU (:meth:`Lru.reserve`), read in pieces. Where the pieces in
        flight hold slots it would take (too few slots without them, or the LRU order
        reaches one), it waits for them all first, once: after that wait none is reserved."""
        slots, lru = self.slots, self.lru
        for _ in range(2):  # at most one wait for every piece, then no slot is reserved
            slots_u = slots.slots_of(rows_u)
            miss = slots_u < 0
            hit = slots_u[~miss]
            spare = np.sort(hit)  # the call's resident rows: touched, no victims
            reserved = slots.state[hit] >= READING
            unpinned_hits = int(np.count_nonzero(~reserved & (lru.last_used[hit] != lru.batch)))
            avail = lru.free_or_unpinned() - unpinned_hits
            missing = rows_u[miss]
            dropped = max(0, missing.size - max(avail, 0))
            if dropped and slots.reserved:  # an earlier prefetch's slots, free once landed
                self.wait_all()
                continue
            if dropped:
                missing = missing[: missing.size - dropped]
            got = lru.reserve(rows_u, missing, spare)
            if got is None:  # the LRU order reaches a slot in flight
                self.wait_all()
                continue
            break
        else:
            raise AssertionError(
                f"a prefetch of {rows_u.size} rows still waits for pieces in flight after "
                f"waiting for them all ({slots.reserved} slots reserved)"
            )
        victims = got.victims
        if missing.size:
            self.arena.sync_device_map(got.evicted, missing[:0], victims[:0])
        if not missing.size:
            return PrefetchHandle([], 0, dropped)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="rowcache-prefetch")
            self._buffers = PrefetchBuffers(self.parts.prefetch_reader(), own_stream=True)
            if self.arena.gpu:  # until the next end_step: everything queued so far
                self._batch_done = self.arena.stream_event()
        after = self._batch_done
        piece = self.piece_rows
        jobs = [
            PrefetchJob(missing[i : i + piece], victims[i : i + piece], after)
            for i in range(0, missing.size, piece)
        ]
        self.jobs.extend(jobs)
        with self._qlock:
            self._queue.extend(jobs)
        for _ in jobs:
            self._pool.submit(self._run_next_piece)
        return PrefetchHandle(jobs, int(missing.size), dropped)

    def _run_next_piece(self) -> None:
        """The prefetch thread: read the queue's first piece (none left when resolves
        took every row of the pieces still queued)."""
        with self._qlock:
            if self._paused:  # its piece stays queued; resume() submits the task again
                self._parked += 1
                return
            job = self._start_queued()
        if job is not None:
            self._run(job)

    def _start_queued(self) -> PrefetchJob | None:
        """The queue's first piece, taken off it and marked started (the caller holds the
        queue's lock); None where the queue is empty."""
        if not self._queue:
            return None
        job = self._queue.popleft()
        job.start()
        return job

    def _run(self, job: PrefetchJob) -> None:
        """Read a started piece with the prefetch buffers (one reader of them at a time:
        the prefetch thread, or a caller while paused)."""
        assert self._buffers is not None
        job.run(self.arena, self.parts, self._buffers)

    def end_step(self) -> None:
        """GPU: later pieces may overwrite this batch's slots once the cache's stream has
        run what was queued so far (every gather of the batch)."""
        if self._pool is not None and self.arena.gpu:
            self._batch_done = self.arena.stream_event()

    def close(self) -> None:
        """Wait for the pieces in flight (read here where paused), stop the prefetch thread
        and close the readers made for prefetching (their descriptors); a later prefetch
        starts them again, not paused."""
        if self.jobs:
            self.wait_all()
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        with self._qlock:
            self._paused, self._parked = False, 0
        for bufs in (self._buffers, self._own_buffers):
            if bufs is not None and bufs.reader is not self.parts.reader:
                bufs.reader.close()
        self._buffers = self._own_buffers = None
        self._batch_done = None

    def pause(self) -> None:
        """No piece starts on the prefetch thread until :meth:`resume`; returns once the
        pieces being read have finished. A wait of the cache's own for pieces not started
        (:meth:`wait`) reads them on its calling thread meanwhile."""
        with self._qlock:
            self._paused = True
        for job in list(self.jobs):
            if job.started:
                job.event.wait()

    def resume(self) -> None:
        """Undo :meth:`pause` (nothing where not paused): the queued pieces start."""
        with self._qlock:
            if not self._paused:
                return
            self._paused = False
            parked, self._parked = self._parked, 0
        for _ in range(parked):
            assert self._pool is not None
            self._pool.submit(self._run_next_piece)

    @property
    def paused(self) -> bool:
        """Between :meth:`pause` and :meth:`resume`."""
        return self._paused

    def _read_paused(self, jobs: list[PrefetchJob]) -> None:
        """While paused: the queue's pieces up to the last of ``jobs`` not started, read
        on the calling thread in queue order, once the thread's last piece has finished
        (the thread's buffers are then this caller's)."""
        for job in list(self.jobs):
            if job.started:
                job.event.wait()
        while self._paused and any(not j.started for j in jobs):
            with self._qlock:
                nxt = self._start_queued()
            if nxt is None:
                return
            self._run(nxt)

    # -- reaping -------------------------------------------------------------
    def reap(self) -> None:
        """Commit every finished piece: release its slots, count its reads, show its rows
        in the device map; a failed one unmaps its rows and leaves their slots free (the
        rows a resolve read itself stay mapped)."""
        keep: list[PrefetchJob] = []
        landed: list[PrefetchJob] = []
        slots = self.slots
        for job in self.jobs:
            if not job.event.is_set():
                keep.append(job)
                continue
            read = slots.state[job.slots] == READ  # rows a resolve read itself
            if job.error is not None:
                unread = job.slots[~read]
                slots.free(job.rows[~read], unread, job.slots[read])
                self.lru.log_front(unread)  # free slots are taken first, as at the start
                if unread.size:
                    self.failed.append((job.rows[~read], job.error))
                continue
            slots.release(job.slots)
            if job.landed is not None:  # its arena writes, on the prefetch stream, first
                self.arena.stream.wait_event(job.landed)
            self.counters.count_read(job.read)
            self.counters.count_prefetched(int(job.rows.size))
            self.shown += int(job.rows.size) - int(np.count_nonzero(read))
            landed.append(job)
        self.jobs = keep
        if landed:  # after the pieces' arena writes (waited for above, in stream order)
            rows = np.concatenate([j.rows for j in landed])
            self.arena.sync_device_map(rows[:0], rows, np.concatenate([j.slots for j in landed]))

    def wait(self, jobs: list[PrefetchJob]) -> None:
        """Wait for ``jobs`` (counted as prefetch wait time; paused: read here), then
        reap."""
        t0 = time.perf_counter()
        if self._paused:
            self._read_paused(jobs)
        for job in list(jobs):
            job.event.wait()
        self.counters.count_wait(time.perf_counter() - t0)
        self.reap()

    def wait_all(self) -> None:
        """Wait for every piece in flight, then reap."""
        self.wait(self.jobs)

    # -- a resolve's rows in flight --------------------------------------------
    def settle(self, ids: np.ndarray) -> None:
        """Before a resolve of ``ids``: reap finished pieces, read the rows of ``ids`` that
        pieces in flight hold (taken over from pieces not started, read beside pieces
        being read; waits for a piece only where that read failed), and raise the error of
        a failed prefetch of one of them (once; nothing else changes)."""
        if self.jobs:
            self.reap()
        if self.jobs:
            self.wait_mostly_needed(ids)  # (reaped: their rows are resident now)
        if self.jobs:
            needed = self.slots.reading_slots(ids)
            if needed.size:
                t0 = time.perf_counter()
                started = self._read_in_flight(self._take_over(needed), needed)
                self.counters.count_wait(time.perf_counter() - t0)
                self.wait(started)
        first: tuple[int, BaseException] | None = None
        left: list[tuple[np.ndarray, BaseException]] = []
        for rows, err in self.failed:
            hit = np.isin(ids, rows)
            if hit.any():
                if first is None:
                    first = (int(ids[np.flatnonzero(hit)[0]]), err)
                rows = rows[~np.isin(rows, ids)]
            if rows.size:
                left.append((rows, err))
        if first is not None:
            self.failed = left  # raised once: a later call faults these rows normally
            row, err = first
            raise CorruptDataError(
                f"table {self.name!r}: the prefetch of row {row} failed, so it was not "
                f"mapped: {err}"
            ) from err

    def wait_mostly_needed(self, ids: np.ndarray) -> bool:
        """Wait for (and reap) the pieces in flight, being read or queued, of whose rows
        ``ids`` needs at least :data:`WAIT_SHARE`; returns whether there were any (the
        caller plans again). Queued ones too: a resolve that took them over would read
        beside the thread, which starts the next queued piece as soon as the one being read
        lands, so the resolve's read of its rows would be a second one."""
        needed = self.slots.reading_slots(ids)
        if not needed.size:
            return False
        own = [
            j
            for j in self.jobs
            if not j.event.is_set()
            and np.count_nonzero(member(j.slots, needed)) >= WAIT_SHARE * j.slots.size
        ]
        if own:
            self.wait(own)
        return bool(own)

    def _take_over(self, needed: np.ndarray) -> list[PrefetchJob]:
        """The rows of queued pieces whose reserved slots are in ``needed`` (sorted,
        unique), read now by the calling resolve with the demand reader (not after every
        piece queued before them), as one job; returns the started pieces holding others
        of ``needed``."""
        rows, slots, origin = [], [], []
        own = None
        with self._qlock:
            for job in self._queue:
                m = member(job.slots, needed)
                if m.any():
                    rows.append(job.rows[m])
                    slots.append(job.slots[m])
                    origin.append((job, m))
            if rows:
                own = _job_of(rows, slots)
                for job, m in origin:  # their handles wait for it too (before any is done)
                    if job.give_up(m, own):  # nothing left to read: done
                        self._queue.remove(job)
        if own is not None:
            self.rows_taken += int(own.rows.size)
            self.jobs.append(own)
            self._read_now(own)
        return [j for j in self.jobs if j.started and member(j.slots, needed).any()]

    def _read_in_flight(self, started: list[PrefetchJob], needed: np.ndarray) -> list[PrefetchJob]:
        """The rows of pieces being read (``started``) whose reserved slots are in
        ``needed``, read now by the calling resolve into those slots, as one job: it does
        not wait for the whole piece. The slots become ``READ``: hits, and still no victims
        until their piece lands and is reaped (it writes the same bytes again). A failed
        read changes nothing: the pieces are waited for instead. Returns the pieces the
        caller still waits for (finished ones, to reap; all of them after a failed read)."""
        rows, slots = [], []
        for job in started:
            if not job.event.is_set():
                m = member(job.slots, needed)
                rows.append(job.rows[m])
                slots.append(job.slots[m])
        if not rows:
            return started
        own = _job_of(rows, slots)
        self._read_now(own)
        if own.error is not None:
            return started  # their pieces' own reads may still succeed
        self.counters.count_read(own.read)
        self.counters.count_prefetched(0, int(own.rows.size))
        self.slots.mark_read(own.slots)
        self.shown += int(own.rows.size)  # shown in the device map by this call
        self.arena.sync_device_map(own.rows[:0], own.rows, own.slots)
        return [j for j in started if j.event.is_set()]

    def _read_now(self, job: PrefetchJob) -> None:
        """Run ``job`` in the calling resolve: the demand reader, the resolve's own
        buffers, the arena writes on the cache's stream (its gathers read them next)."""
        if self._own_buffers is None:
            self._own_buffers = PrefetchBuffers(self.parts.reader)
        job.run(self.arena, self.parts, self._own_buffers)

    def claim(self, ids: np.ndarray) -> InFlightClaim | None:
        """For a native resolve of ``ids`` whose plan found rows in flight: those rows of
        every piece in flight (queued or being read) and their reserved slots, which the
        resolve reads in its own demand read (one read a step). Their slots are ``READ``
        meanwhile (hits of the plan); undo with :meth:`unclaim`, or after a successful
        read's commit complete with :meth:`claimed`. None where :meth:`settle` must run
        instead (merging off, or a failed prefetch to raise)."""
        if not self.merge or self.failed:
            return None
        needed = self.slots.reading_slots(ids)
        if not needed.size:
            return None
        parts, rows, slots = [], [], []
        for job in self.jobs:
            m = member(job.slots, needed)
            if m.any():
                parts.append((job, m))
                rows.append(job.rows[m])
                slots.append(job.slots[m])
        claim = _job_of(rows, slots)
        self.slots.mark_read(claim.slots)
        return InFlightClaim(claim.rows, claim.slots, parts)

    def unclaim(self, claim: InFlightClaim) -> None:
        """A claim whose read did not happen: its slots are being read again."""
        self.slots.mark_reading(claim.slots)

    def claimed(self, claim: InFlightClaim) -> None:
        """The claim's rows were read into their slots by the resolve (and shown in the
        device map by its launch): rows of pieces not started leave them (taken over: their
        slots released, counted as prefetched); rows of pieces that have started stay
        ``READ`` until their piece is reaped (read twice, ``rows_reread``)."""
        taken = []
        with self._qlock:  # a piece starts under it: started or not, for certain
            for job, m in claim.parts:
                if job.started:
                    continue
                taken.append(job.slots[m])
                if job.give_up(m):  # nothing left to read: done
                    self._queue.remove(job)
        n_taken = 0
        if taken:
            t = np.concatenate(taken)
            n_taken = int(t.size)
            self.slots.release(t)
        self.counters.count_prefetched(n_taken, int(claim.rows.size) - n_taken)
        self.rows_taken += n_taken
        self.shown += int(claim.rows.size)  # shown in the device map by this call
