"""The prefetch bookkeeping of ``NgramRowCache``: slots reserved, jobs reaped, errors.

Owns the mixin :class:`PrefetchBook`: ``prefetch`` (rows touched, victims reserved,
a job started), ``poll``, reaping finished jobs into the maps and stats, waiting for
the jobs a resolve needs (``_settle``, ``_passed_busy``) and raising a failed
prefetch's error once. The job itself (reads into its own buffers, the scatter) is
``rowcache.cache.prefetch``; a resolve's use of rows still in pieces (taken over, read
itself, claimed for its demand read) is ``rowcache.cache.in_flight``.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from rowcache.cache.in_flight import InFlightRows
from rowcache.cache.lru import sorted_unique
from rowcache.cache.prefetch import PrefetchBuffers, PrefetchHandle, PrefetchJob
from rowcache.cache.state import BUSY_READ, BUSY_READING
from rowcache.errors import CorruptDataError
from rowcache.store.handle import check_row_ids

PIECE_ROWS = 1024
"""A prefetch's rows are read in pieces of this many (one native batch each, in call
order), so a resolve that needs a row still in flight waits for one piece, and the rows of
pieces still queued it reads itself. The H200 disk read 1,024 fresh random pages a batch
at 95-107k reads/s at queue depth 64, 4,096 at 85-111k (the retired bench/queue_depth.py,
docs/results/2026-12-01-tenth-session.md)."""


class PrefetchBook(InFlightRows):
    """Prefetch bookkeeping of :class:`rowcache.cache.row_cache.NgramRowCache` (a mixin; its
    :class:`rowcache.cache.in_flight.InFlightRows` part serves resolves that need rows in flight)."""

    _pf_pool: ThreadPoolExecutor | None
    _pf_buffers: PrefetchBuffers | None
    _batch_done: Any  # GPU: the cache stream's event at the last end_batch (see PrefetchJob)
    _piece_rows: int  # 0: PIECE_ROWS; else a benchmark's ablation
    _deferred: Any  # rowcache.cache.deferred.DeferredFault | None
    _merge_in_flight: bool  # a native resolve reads rows in flight in its demand read
    _stream: Any  # GPU: the cache's stream (rowcache.cache.fault)
    _device_id: int

    def poll(self) -> int:
        """Commit the prefetches whose reads have finished (their rows appear in
        :meth:`device_map`, in stream order after their arena writes); returns the
        rows still in flight. Every other method does this too; a caller that reads
        the device map before resolving calls it first. With a :meth:`resolve_deferred`
        call not yet settled it does nothing (that call's rows are in the device map
        in stream order already)."""
        with self._lock.raw:  # a deferred touch may go on, unless prefetches need reaping
            if self._jobs and self._deferred is None:  # (a deferred fault may claim rows of
                # pieces that have landed: they are reaped after its commit)
                if self._touching:
                    self._finish_touch()
                self._reap()
            return self._n_busy

    def prefetch(self, row_ids: Any) -> PrefetchHandle:
        """Start reading the rows of a coming step; never blocks on I/O.

        Parameters
        ----------
        row_ids : int[n] (numpy or cupy), any order, duplicates ok; as :meth:`resolve`.

        Returns
        -------
        PrefetchHandle with ``wait()`` and ``done()``.

        Semantics, next to :meth:`resolve`'s: at this call the rows are touched most
        recently used and left unpinned (pins of the current batch are kept); missing
        rows take the least recently used unpinned slots, never a slot the current
        batch holds, and missing rows beyond the free or unpinned slots are dropped
        (``handle.dropped``), so a prefetch never raises ``ArenaExhaustedError``. Rows
        already resident or in flight are not read again. Their reads run in the
        cache's prefetch thread meanwhile, in pieces of :data:`PIECE_ROWS` rows, in
        call order. A later :meth:`resolve` that needs rows of a piece not started yet
        reads those rows itself (once: they leave the piece); rows of a piece being read
        it reads itself too, into the slots the piece reserved (the piece writes the
        same bytes again, and its slots are no victims until it lands: those rows are
        read twice, ``CacheStats.rows_reread``). It reads them in the same read as its
        own faults (one read plan), and apart only where that read fails. It waits for pieces in flight only when
        it needs their slots as victims or to avoid exhaustion (or when its own read of
        their rows failed), so the LRU order, the exhaustion rule and every fault count
        are exactly those of a prefetch that completed at its call. A failed read maps
        nothing (its slots are left free), and the :meth:`resolve` that next needs one
        of its rows raises that read's error once (a later call faults the row
        normally); rows a resolve read itself stay mapped. The prefetch thread's reader
        yields the disk: it submits no new read while a demand read of the process runs
        (``RowReader(background=True)``), so a step's faults do not queue behind a
        prefetch's thousands of reads. On ``device="cuda"`` the arena writes go on the
        prefetch thread's own stream (the class's "Streams" section); the device map
        shows the rows from the first call after their read completed.
        """
        ids = check_row_ids(row_ids, self.rows)
        with self._lock:
            self._reap()
            if ids.size == 0:
                return PrefetchHandle([], 0, 0)
            return self._prefetch(sorted_unique(ids))

    def _prefetch(self, rows_u: np.ndarray) -> PrefetchHandle:
        """The prefetch of sorted unique rows, under the lock."""
        slots_u = self._row_slot[rows_u]
        miss = slots_u < 0
        hit = slots_u[~miss]
        busy = self._busy_mask()
        # resident rows (in flight or not) move to the tail, pins unchanged; not victims
        was_busy = busy[hit].copy()
        busy[hit] = BUSY_READING
        unpinned_hits = int(
            np.count_nonzero((was_busy == 0) & (self._last_used[hit] != self._batch))
        )
        avail = self.num_slots - self._pinned - self._n_busy - unpinned_hits
        missing = rows_u[miss]
        dropped = max(0, missing.size - max(avail, 0))
        if dropped and self._n_busy:  # an earlier prefetch's slots would be free once landed
            busy[hit] = was_busy
            self._wait_jobs(self._jobs)
            return self._prefetch(rows_u)
        if dropped:
            missing = missing[: missing.size - dropped]
        victims = np.empty(0, dtype=np.int32)
        if missing.size:
            # masked: the call's resident rows are marked busy for the choice
            victims, new_head, end = self._choose_victims(int(missing.size), masked=True)
            busy[hit] = was_busy  # (before the check: the call's own hits are not in flight)
            if self._n_busy and self._passed_busy(end):  # LRU reaches a slot in flight
                self._wait_jobs(self._jobs)
                return self._prefetch(rows_u)
            self._head = new_head
        busy[hit] = was_busy
        if missing.size:
            old = self._slot_row[victims]
            evicted = old[old >= 0]
            self._row_slot[evicted] = -1
            self._row_slot[missing] = victims
            self._slot_row[victims] = missing
            busy[victims] = BUSY_READING
            self._n_busy += int(victims.size)
            self._stats["evictions"] += int(evicted.size)
            if self._dev_map is not None and evicted.size:
                self._sync_device_map(evicted, missing[:0], victims[:0])
        # the touch order of the call: ascending rows, as resolve's tie rule
        order = self._row_slot[rows_u]
        order = order[order >= 0]
        self._log_slots(order.astype(np.int32, copy=False))
        if not missing.size:
            return PrefetchHandle([], 0, dropped)
        if self._pf_pool is None:
            self._pf_pool = ThreadPoolExecutor(1, thread_name_prefix="rowcache-prefetch")
            self._pf_buffers = PrefetchBuffers(self._prefetch_reader(), own_stream=True)
            if self.device == "cuda":  # until the next end_batch: everything queued so far
                self._record_batch_done()
        after = self._batch_done
        piece = self._piece_rows or PIECE_ROWS
        jobs = [
            PrefetchJob(missing[i : i + piece], victims[i : i + piece], after)
            for i in range(0, missing.size, piece)
        ]
        self._jobs.extend(jobs)
        with self._pf_qlock:
            self._pf_queue.extend(jobs)
        for _ in jobs:
            self._pf_pool.submit(self._run_next_piece)
        return PrefetchHandle(jobs, int(missing.size), dropped)

    def _run_next_piece(self) -> None:
        """The prefetch thread: read the queue's first piece (none left when resolves
        took every row of the pieces still queued)."""
        with self._pf_qlock:
            if not self._pf_queue:
                return
            job = self._pf_queue.popleft()
            job.started = True
        assert self._pf_buffers is not None
        job.run(self, self._pf_buffers)

    def _record_batch_done(self) -> None:
        """GPU: the event after which a prefetch may overwrite victims (an unpinned
        slot's gathers were all issued before the last ``end_batch``, on this stream)."""
        cp = self._xp
        with cp.cuda.Device(self._device_id):  # the event on the stream's device
            ev = cp.cuda.Event(block=False, disable_timing=True)
            ev.record(self._stream)
        self._batch_done = ev

    def _busy_mask(self) -> np.ndarray:
        """uint8[slots]: 0, or the slot is reserved by a prefetch piece in flight
        (``BUSY_READING`` / ``BUSY_READ``, ``rowcache.cache.state``; made on first
        prefetch)."""
        if self._busy.size != self.num_slots:
            self._busy = np.zeros(self.num_slots, dtype=np.uint8)
        return self._busy

    def _reap(self) -> None:
        """Commit every finished prefetch: release its slots, count its reads, show its
        rows in the device map; a failed one unmaps its rows and leaves their slots free."""
        keep: list[PrefetchJob] = []
        landed: list[PrefetchJob] = []
        for job in self._jobs:
            if not job.event.is_set():
                keep.append(job)
                continue
            read = self._busy[job.slots] == BUSY_READ  # rows a resolve read itself
            self._busy[job.slots] = 0
            self._n_busy -= int(job.slots.size)
            if job.error is not None:  # (the rows a resolve read itself stay mapped)
                rows, slots = job.rows[~read], job.slots[~read]
                self._row_slot[rows] = -1
                self._slot_row[slots] = -1
                self._log_front(slots)  # free slots are taken first, as at the start
                if rows.size:
                    self._failed.append((rows, job.error))
                continue
            if job.landed is not None:  # its arena writes, on the prefetch stream, first
                self._stream.wait_event(job.landed)
            rows, nbytes, ops = job.read
            st = self._stats
            st["rows_read"] += rows
            st["bytes_read"] += nbytes
            st["read_ops"] += ops
            st["prefetched"] += int(job.rows.size)
            self._reaped_rows += int(job.rows.size) - int(np.count_nonzero(read))
            landed.append(job)
        self._jobs = keep
        if self._dev_map is not None and landed:  # after the jobs' arena writes (waited
            rows = landed[0].rows  # for above, in stream order): one upload, one scatter
            if len(landed) > 1:
                rows = np.concatenate([j.rows for j in landed])
                slots = np.concatenate([j.slots for j in landed])
            else:
                slots = landed[0].slots
            self._sync_device_map(rows[:0], rows, slots)

    def _wait_jobs(self, jobs: list[PrefetchJob]) -> None:
        t0 = time.perf_counter()
        for job in list(jobs):
            job.event.wait()
        self._stats["prefetch_wait_seconds"] += time.perf_counter() - t0
        self._reap()

    def _settle(self, ids: np.ndarray) -> None:
        """Before a resolve of ``ids``: reap finished prefetches, read the rows of
        ``ids`` that pieces in flight hold (:meth:`_take_over`, :meth:`_read_in_flight`;
        waits for a piece only where that read failed), and raise the error of a failed
        prefetch of one of them (once; nothing else changes)."""
        if self._jobs:
            self._reap()
        if self._jobs:
            needed = self._needed_in_flight(ids)
            if needed.size:  # the rows of queued pieces and of pieces being read, read now
                t0 = time.perf_counter()
                started = self._read_in_flight(self._take_over(needed), needed)
                self._stats["prefetch_wait_seconds"] += time.perf_counter() - t0
                self._wait_jobs(started)
        first: tuple[int, BaseException] | None = None
        left: list[tuple[np.ndarray, BaseException]] = []
        for rows, err in self._failed:
            hit = np.isin(ids, rows)
            if hit.any():
                if first is None:
                    first = (int(ids[np.flatnonzero(hit)[0]]), err)
                rows = rows[~np.isin(rows, ids)]
            if rows.size:
                left.append((rows, err))
        if first is not None:
            self._failed = left  # raised once: a later call faults these rows normally
            row, err = first
            raise CorruptDataError(
                f"table {self.name!r}: the prefetch of row {row} failed, so it was not "
                f"mapped: {err}"
            ) from err

    def _passed_busy(self, end: int) -> bool:
        """True when victims taken up to log position ``end`` skipped a slot that a
        prefetch in flight holds (the LRU would have taken it had the read landed): a live
        log entry of a busy slot before ``end``. Every entry before the head is stale, so
        the scan is the victims' window, not every job's slots (``lru_plan`` tells the
        native path the same)."""
        if not self._n_busy or end <= self._head:
            return False
        s = self._log[self._head : end]
        live = self._log_pos[s] == np.arange(self._head, end, dtype=np.int32)
        b = self._busy[s]
        # (a BUSY_READ slot pinned in this batch: a hit of it, no victim in any order)
        passed = (b == BUSY_READING) | ((b == BUSY_READ) & (self._last_used[s] != self._batch))
        return bool((live & passed).any())
