"""The demand fault path of ``NgramRowCache``: readers, staging, scatter, commit.

Owns the mixin :class:`FaultPath`: the cache's readers (its own, and the prefetch
jobs'), a resolve with misses (victims, reads into a staging buffer, the scatter
into the arena, the maps committed only after the reads succeeded: natively, one C
call before the read and one after, ``csrc/lru_miss.c``; the Python path is their
reference). Its buffers, the GPU arena's set-up and the fault launch are
``rowcache.cache.buffers``; the LRU log is ``rowcache.cache.lru``.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from rowcache.cache.buffers import FaultBuffers
from rowcache.cache.deferred import DEFERRED
from rowcache.cache.lru import sorted_unique
from rowcache.errors import ArenaExhaustedError
from rowcache.io.reader import RowReader
from rowcache.kernels.host import HOST_THREADS
from rowcache.kernels.reference import scatter_records_reference
from rowcache.store.handle import check_row_ids

# Rows (all parts) from which the native miss path splits a large call's plan and commit over
# HOST_THREADS: a row map of 64 MB or more outgrows the CPU's caches, its look-ups wait on
# memory, and parts on several cores overlap those waits. Below it a part's work is about a
# pool worker's wake-up, and the 2-CPU dev machine's serve run (6,000-row tables) planned and
# committed a prefill step's call slower in parts (docs/results/2026-12-03-sixteenth-session.md).
MISS_PARTS_MIN_ROWS = 1 << 24


class FaultPath(FaultBuffers):
    """Faults of :class:`rowcache.cache.row_cache.NgramRowCache` (a mixin over its arrays,
    reader and arena)."""

    store: Any
    row_offsets: np.ndarray
    _reader: RowReader
    _part_array: np.ndarray
    _part_bases: np.ndarray
    _part_misses: np.ndarray
    _scratch: np.ndarray
    # seconds of the native demand faults' phases, summed: plan (lru_plan), read, commit
    # (the CPU path's scatter or the GPU launch's side buffer, and lru_commit), launch;
    # where fault_seconds goes (bench/serve reports them); never reset. A deferred
    # fault's read is the time its join waited.
    _fault_phases: np.ndarray
    _defer: bool  # resolve_deferred's call: a fault's read may outlive the call
    _start_deferred: Any  # rowcache.cache.deferred.DeferredFaults

    def _miss_threads(self) -> int:
        """Threads of the native miss path's plan and commit (MISS_PARTS_MIN_ROWS)."""
        return HOST_THREADS if self.rows >= MISS_PARTS_MIN_ROWS else 1

    def _make_reader(
        self, reader: str, queue_depth: int | None, direct: bool | None
    ) -> tuple[RowReader, str]:
        base = self.store.reader
        qd = base.queue_depth if queue_depth is None else queue_depth
        use_direct = base.direct if direct is None else direct
        if reader == "auto":
            from rowcache.io.kvikio_reader import gds_available

            reader = "kvikio" if self.device == "cuda" and gds_available() else "posix"
        # siblings of the store's reader: the same pinned files and page checks
        if reader == "kvikio":
            from rowcache.io.kvikio_reader import KvikioRowReader

            opts = base.options(queue_depth=qd, direct=False)
            return self.store.new_reader(KvikioRowReader, **opts), "kvikio"
        if qd == base.queue_depth and use_direct == base.direct:
            return base, "posix"
        return self.store.new_reader(**base.options(queue_depth=qd, direct=use_direct)), "posix"

    def _host_lib(self) -> Any:
        raise NotImplementedError

    def _exhausted(self, n_miss: int, free_or_unpinned: int) -> ArenaExhaustedError:
        return ArenaExhaustedError(
            f"table {self.name!r}: this batch needs {n_miss} more slots but only "
            f"{free_or_unpinned} of {self.num_slots} are free or unpinned "
            f"({self._pinned} pinned by the batch); call end_batch() more often, split the "
            "batch, or give the cache more slots"
        )

    def _resolve_unique(self, ids: np.ndarray) -> np.ndarray:
        """Resolve a checked batch; returns its slots (int32, input order)."""
        self._last_faults = 0
        if ids.size == 0:
            return np.empty(0, dtype=np.int32)
        native = self._host_lib()
        if self._jobs:
            self._reap()
        if self._failed or (self._jobs and native is None):
            self._settle(ids)  # prefetches this call needs: waited for, reaped, errors raised
        if native is not None:  # (it settles a row in flight itself: lru_plan's status 4)
            return self._resolve_native(native, ids)
        # The Python path: the reference of _resolve_native (tests compare them).
        s = self._row_slot[ids]
        if int(s.min()) >= 0:  # every row resident: the hot path (no fault, no eviction)
            rows_u = sorted_unique(ids)
            self._count(ids.size, self._row_slot[rows_u], 0)
            self._last_faults = self._reaped_rows
            return s
        rows_u = sorted_unique(ids)  # the call's rows, ascending: the touch order
        slots_u = self._row_slot[rows_u]
        miss = slots_u < 0
        missing_rows = rows_u[miss]
        uhit = slots_u[~miss]
        n_miss = int(missing_rows.size)
        hit_last = self._last_used[uhit]
        fresh_hits = int(np.count_nonzero(hit_last != self._batch))
        free_or_unpinned = self.num_slots - self._pinned - fresh_hits - self._n_busy
        if n_miss > free_or_unpinned and self._n_busy:
            self._wait_jobs(self._jobs)  # reserved slots count as free once their reads land
            return self._resolve_unique(ids)
        if n_miss > free_or_unpinned:
            raise self._exhausted(n_miss, free_or_unpinned)
        t0 = time.perf_counter()
        self._last_used[uhit] = self._batch  # pinned: the call's hits are no victims
        try:
            victims, new_head, end = self._choose_victims(n_miss)
            if self._n_busy and self._passed_busy(end):
                # LRU order reaches a slot still in flight: as if it had landed, wait
                self._last_used[uhit] = hit_last
                self._wait_jobs(self._jobs)
                return self._resolve_unique(ids)
            old = self._slot_row[victims]
            evicted = old[old >= 0]
            self._fault(missing_rows, victims, evicted)  # raises before any other change
        except BaseException:
            self._last_used[uhit] = hit_last  # a failed call changes nothing
            raise
        # Commit: unmap victims, map the new rows. Every log entry before new_head is
        # now stale (a victim's, or a hit's that _touch re-logs), so the head skips them.
        self._head = new_head
        self._row_slot[evicted] = -1
        self._row_slot[missing_rows] = victims
        self._slot_row[victims] = missing_rows
        # (the device mirror was updated by _fault's launch, in stream order)
        self._last_faults = n_miss + self._reaped_rows
        if len(self.parts) > 1:  # global rows ascending: each part's misses are one run
            self._part_misses += np.diff(np.searchsorted(missing_rows, self.row_offsets))
        else:
            self._part_misses[0] += n_miss
        st = self._stats
        st["evictions"] += int(evicted.size)
        st["fault_seconds"] += time.perf_counter() - t0
        slots_u[miss] = victims
        self._last_used[uhit] = hit_last  # _count tells fresh hits by their last use
        self._count(ids.size, slots_u, n_miss)
        return self._row_slot[ids]

    def _resolve_native(
        self,
        native: Any,
        ids: np.ndarray,
        device_out: bool = False,
        settled: bool = False,
        claim: Any = None,
    ) -> Any:
        """The path of :meth:`_resolve_unique` in two C calls around the read
        (``csrc/lru_miss.c``): ``lru_plan`` (dedup, victims, exhaustion; changes
        nothing), :meth:`_fault_read`, ``lru_commit`` (maps, pins, log, part misses),
        then on the GPU the fault's one launch. Same victims, log, maps, stats and errors
        as the Python path; a failed call changes nothing (but for a failed launch, after
        the commit: a device that refuses a launch is unusable anyway). With
        ``device_out`` (GPU) a call that faulted returns its slots as a cupy array,
        written by that launch. With prefetches in flight (finished ones reaped by the
        caller), ``lru_plan`` tells whether a row of the call is in flight and whether
        its victims' scan passed a slot in flight (``_passed_busy``). Rows in flight are
        claimed (``_claim_in_flight``) and read in the call's own read, beside its
        misses, into the slots their pieces reserved; where that read fails, or the
        plan must wait for pieces, the claim is undone and the call settles those
        prefetches as the Python path does (``_settle``: the rows read apart, or
        waited for) and plans again."""
        self._last_faults = 0
        ids = np.ascontiguousarray(ids)
        n = ids.size
        if self._scratch.size < 2 * n:
            self._scratch = np.empty(max(2 * n, 2 * self._scratch.size), dtype=np.int32)
        work = np.empty(5 * n, dtype=np.int32)  # [uniq | slots | missing | victims | evicted]
        t0 = time.perf_counter()
        status, n_u, n_miss, fresh_hits, n_ev, head, _end, passed_busy = native.lru_plan(
            ids, self.rows, self._row_slot, self._slot_row, self._last_used, self._log,
            self._log_pos, self._head, self._tail, self._batch,
            self._busy if self._n_busy else None,
            self.num_slots - self._pinned - self._n_busy, work, self._scratch,
            self._miss_threads(),
        )  # fmt: skip
        if claim is not None and (status or (n_miss and passed_busy)):
            self._unclaim(claim)  # (a wait or an error below: nothing claimed)
        if status == 4:  # a row of the call is in flight: read with the misses, or settled
            if settled:
                raise AssertionError("a row of the call is still in flight after settling")
            claim = self._claim_in_flight(ids) if self._merge_in_flight else None
            if claim is None:
                self._settle(ids)
            return self._resolve_native(native, ids, device_out, True, claim)
        if status == 1 and not self._n_busy:
            raise self._exhausted(n_miss, self.num_slots - self._pinned - fresh_hits)
        if status == 1 or (n_miss and self._n_busy and passed_busy):
            # reserved slots count as free once their reads land; and an LRU order that
            # reaches a slot still in flight waits, as if it had landed
            self._wait_jobs(self._jobs)
            return self._resolve_unique(ids)
        if status:
            check_row_ids(ids, self.rows)  # status 2: raises RowRangeError
            raise AssertionError("LRU log exhausted before finding enough victims")
        # the rows read: the misses (into their victims) and the claimed rows in flight
        # (into their reserved slots), ascending as one read plan
        rows, slots = work[2 * n : 2 * n + n_miss], work[3 * n : 3 * n + n_miss]
        if claim is not None:
            rows = np.concatenate((rows, claim.rows.astype(np.int32, copy=False)))
            order = np.argsort(rows, kind="stable")
            rows, slots = rows[order], np.concatenate((slots, claim.slots))[order]
        m = rows.size
        gpu = bool(m) and self.device == "cuda"
        t1 = t2 = time.perf_counter()
        if m and self._defer and not device_out:
            if self._start_deferred(ids, work, n_u, n_miss, n_ev, head, claim, rows, slots, t0):
                return DEFERRED
        if m:  # raises before any change
            try:
                records = self._fault_read(rows)
            except Exception:
                if claim is None:
                    raise
                self._unclaim(claim)  # read apart, or waited for, as the Python path does
                self._settle(ids)
                return self._resolve_native(native, ids, device_out, settled=True)
            t2 = time.perf_counter()
            if self.device == "cpu":
                scatter_records_reference(records, slots, self.table, self.scales)
        if gpu:  # the launch's side buffer: [slots | rows | evicted (| out)]
            e0 = 2 * m + n_ev
            side = self._side_ints(e0 + (n if device_out else 0))
            side[:m] = slots
            side[m : 2 * m] = rows
            side[2 * m : e0] = work[4 * n : 4 * n + n_ev]
        out = side[e0 : e0 + n] if gpu and device_out else np.empty(n, dtype=np.int32)
        self._commit_plan(native, ids, work, n_u, n_miss, n_ev, head, claim, out, self._batch)
        self._last_faults = n_miss + self._reaped_rows
        t3 = time.perf_counter()
        if gpu:  # after the commit, so that the launch can carry the slots (out) too
            dev = self._xp.empty(n, dtype=np.int32) if device_out else None
            self._fault_launch(m, n_ev, dev)
            out = out if dev is None else dev
        if m:
            t4 = time.perf_counter()
            self._stats["fault_seconds"] += t4 - t0
            self._fault_phases += (t1 - t0, t2 - t1, t3 - t2, t4 - t3)
        return out

    def _commit_plan(
        self, native: Any, ids: np.ndarray, work: np.ndarray, n_u: int, n_miss: int, n_ev: int,
        head: int, claim: Any, out: np.ndarray, batch: int,
    ) -> None:  # fmt: skip
        """Commit a plan whose reads succeeded (``lru_commit``: maps, pins, log, part
        misses, ``out``), count it, pin its slots while ``batch`` (the batch of its call)
        lasts, and settle the rows it claimed from prefetches in flight. A refused commit
        (arguments that do not fit: nothing changed) undoes the claim."""
        try:  # (it checks its arguments before any change)
            fresh, self._head, self._tail = native.lru_commit(
                ids, work, n_u, n_miss, n_ev, self._row_slot, self._slot_row, self._last_used,
                self._log, self._log_pos, head, self._tail, batch, self.row_offsets,
                self._part_misses, out, self._miss_threads(),
            )  # fmt: skip
        except BaseException:
            if claim is not None:
                self._unclaim(claim)
            raise
        st = self._stats
        st["lookups"] += ids.size
        st["misses"] += n_miss
        st["hits"] += fresh - n_miss
        st["evictions"] += n_ev
        if batch == self._batch:  # (a deferred call's batch may have ended: no pins)
            self._pinned += fresh
        if claim is not None:
            self._claimed(claim)

    def _read_parts(
        self, rows: np.ndarray, staging: np.ndarray, reader: RowReader | None = None
    ) -> tuple[int, int, int]:
        """Records of global ``rows`` (sorted, unique) into ``staging[:n]``; returns
        (rows, bytes, read ops) read. Touches no cache state (prefetch threads call it)."""
        reader = reader or self._reader
        # Global rows are sorted, so each part's rows are one contiguous run of them, and
        # the parts in order are the staging order: one read plan and one dispatch for all.
        rows = rows if rows.dtype == np.int64 else rows.astype(np.int64)  # the plan's int32
        bounds = rows.searchsorted(self.row_offsets)  # (the method: no NumPy wrapper)
        return reader.read_batch(rows, bounds, self._part_array, self._part_bases,
                                 staging[: rows.size])  # fmt: skip

    def _prefetch_reader(self) -> RowReader:
        """The reader prefetch jobs use: a POSIX reader of their own (its own ring and
        buffers: a native batch runs one at a time per reader, so a demand fault never
        waits for a prefetch's batch; ``background``: it submits no read while a demand
        fault reads, so the fault's reads do not queue behind it on the disk either; it
        sleeps on its reads, ``spin_us=0``); kvikio's reader is shared (thread-safe)."""
        r = self._reader
        if type(r) is RowReader:  # it sleeps on its reads: no core spent polling for them
            return self.store.new_reader(**r.options(spin_us=0, background=True))
        return r

    def _fault(self, rows: np.ndarray, victims: np.ndarray, evicted: np.ndarray) -> None:
        """Read ``rows`` (sorted, unique) and write them into ``victims``' arena rows; on
        the GPU the device map's update (``evicted`` rows unmapped, ``rows`` mapped) goes
        in the same launch, after the reads succeeded (the Python path's order)."""
        records = self._fault_read(rows)
        if self.device == "cpu":
            scatter_records_reference(records, victims, self.table, self.scales)
            return
        n, e = rows.size, evicted.size
        side = self._side_ints(2 * n + e)
        side[:n] = victims
        side[n : 2 * n] = rows
        side[2 * n : 2 * n + e] = evicted
        self._fault_launch(n, e, None)

    def _fault_read(self, rows: np.ndarray) -> np.ndarray:
        """Read ``rows`` (sorted, unique) into the staging buffer; returns their records.
        Raises before any change (a failed read maps nothing)."""
        n = rows.size
        st = self._stats
        if self.device == "cuda" and self._copy_done is not None:
            self._copy_done.synchronize()  # the staging and side buffers' last launch ran
        staging = self._staging_rows(n)
        rows_read, nbytes, ops = self._read_parts(rows, staging)
        st["rows_read"] += rows_read
        st["bytes_read"] += nbytes
        st["read_ops"] += ops
        return staging[:n]
