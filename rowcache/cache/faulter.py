"""The faulter of ``NgramRowCache``: a resolve with misses, read and committed, now or later.

Owns :class:`Faulter`: a resolve's path through the LRU's plan and commit around the read
(``rowcache.cache.lru``: in C, or their Python reference), the read into the arena's staging
buffer, the scatter (CPU) or the one GPU launch, and the rows claimed from prefetch pieces
in flight; and :class:`PendingFault`, a fault whose read outlives its call
(``resolve_deferred``: :meth:`Faulter.start` starts the read and returns the value,
:meth:`Faulter.finish` joins it and commits). Owns no maps, log or buffers (``slots``,
``lru``, ``arena``); reports its reads and times to ``Counters``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from rowcache.cache.arena import Arena
from rowcache.cache.lru import Lru
from rowcache.cache.parts import PartReader
from rowcache.cache.plan import LruStatus, MissPlan
from rowcache.cache.prefetcher import InFlightClaim, Prefetcher
from rowcache.cache.slots import SlotTable
from rowcache.cache.stats import Counters
from rowcache.errors import ArenaExhaustedError
from rowcache.format.rows import check_row_ids
from rowcache.io.reader import RowReader

DEFERRED = np.empty(0, dtype=np.int32)
"""What a resolve whose read was deferred returns (its slots are known at the commit)."""
DEFERRED.flags.writeable = False

FAULT_ROUNDS = 7
"""Plans a fault makes at most. A plan that must wait for, claim or settle prefetches in
flight plans again (as may one whose claimed read failed), and each such round leaves
fewer pieces to act on: a wait for them all leaves none, so a row in flight is settled
once, and at most one wait for the pieces the call mostly needs
(``Prefetcher.wait_mostly_needed``), one wait for them all and one failed claimed read
precede the plan that commits."""


@dataclass(frozen=True)
class PendingFault:
    """A native fault whose read runs on a reader's own thread while the caller goes on
    (:meth:`Faulter.start`), as a value its :class:`Faulter` finishes
    (:meth:`Faulter.finish`): the ``plan`` to commit once the read is joined, the rows
    ``claim``-ed from prefetch pieces, the ``reader`` to join, the arrays the read holds
    (``held``: its rows, bounds and slots; its buffers hold them until the join) and its
    ``times`` (plan start, read start, launched)."""

    plan: MissPlan
    claim: InFlightClaim | None
    reader: RowReader
    held: tuple[np.ndarray, np.ndarray, np.ndarray]
    times: tuple[float, float, float]


class Faulter:
    """Resolves with misses over a cache's pieces.

    ``last_faults``: rows whose device-map entries the latest resolve changed.
    ``pending``: a :class:`PendingFault` not yet finished, or None.
    """

    def __init__(
        self,
        slots: SlotTable,
        lru: Lru,
        arena: Arena,
        parts: PartReader,
        counters: Counters,
        prefetcher: Prefetcher,
        name: str,
    ) -> None:
        self.slots = slots
        self.lru = lru
        self.arena = arena
        self.parts = parts
        self.counters = counters
        self.prefetcher = prefetcher
        self.name = name
        self.last_faults = 0
        self.pending: PendingFault | None = None
        self._seq = 0

    def hit(self) -> None:
        """The latest resolve found every row resident and mapped."""
        self.last_faults = 0

    def finish_pending(self) -> None:
        """Finish the pending fault (join its read, commit; raises its read's error)."""
        p, self.pending = self.pending, None
        if p is not None:
            self.finish(p)

    def finish(self, p: PendingFault) -> None:
        """Join a deferred fault's read and commit its plan (maps, pins, log, stats, the
        rows claimed from prefetches) as a fault that read in its call commits; a failed
        read commits nothing (its launch wrote nothing) and raises its ``CorruptDataError``."""
        t0, t1, t2 = p.times
        t3 = time.perf_counter()
        try:
            read = p.reader.read_batch_join()
        except BaseException:
            if p.claim is not None:
                self.prefetcher.unclaim(p.claim)
            self.last_faults = 0
            raise
        t4 = time.perf_counter()
        self.counters.count_read(read)
        rows, _, slots = p.held
        if not self.arena.gpu:  # (the GPU's launch has written them, in stream order)
            self.arena.scatter(self.arena.staged(rows.size), slots)
        self.commit(p.plan, p.claim, np.empty(p.plan.n, dtype=np.int32))
        t5 = time.perf_counter()
        # the host's time: plan, launch, join, commit
        self.counters.count_fault((t2 - t0) + (t5 - t3), t1 - t0, t4 - t3, t5 - t4, t2 - t1)

    def _exhausted(self, n_miss: int, free_or_unpinned: int) -> ArenaExhaustedError:
        return ArenaExhaustedError(
            f"table {self.name!r}: this step needs {n_miss} more slots but only "
            f"{max(0, free_or_unpinned)} of {self.slots.num_slots} are free or unpinned "
            f"({self.lru.pinned} pinned by the step, {self.slots.reserved} reserved by "
            "prefetches in flight); end the step (end_step()) sooner, split the step, prefetch "
            "less ahead, or give the cache more slots"
        )

    # -- a resolve ---------------------------------------------------------
    def resolve(self, ids: np.ndarray, device_out: bool = False, defer: bool = False) -> Any:
        """Resolve checked ``ids``; returns their slots (int32, input order). ``device_out``
        (GPU): a call that faulted may return its slots as a cupy array, written by its
        launch. ``defer``: a native fault's read may outlive the call (returns
        :data:`DEFERRED`, the fault in :attr:`pending`)."""
        self.last_faults = 0
        if ids.size == 0:
            return np.empty(0, dtype=np.int32)
        ids = np.ascontiguousarray(ids)  # (checked ids may be a strided view; C needs a vector)
        self._settle_first(ids)
        return self.fault(ids, device_out, defer)  # (it settles a row in flight: IN_FLIGHT)

    def _settle_first(self, ids: np.ndarray) -> None:
        """Before a plan: reap finished pieces, and settle the prefetches of ``ids`` (wait
        for, reap, raise their errors) where a failed one is pending or the Python path
        plans (it has no claims)."""
        pf = self.prefetcher
        if pf.jobs:
            pf.reap()
        if pf.failed or (pf.jobs and self.lru.native is None):
            pf.settle(ids)

    def fault(self, ids: np.ndarray, device_out: bool = False, defer: bool = False) -> Any:
        """The path of :meth:`resolve` in two LRU calls around the read: the LRU's plan
        (dedup, victims, exhaustion; changes nothing: a :class:`MissPlan`), the read, the
        LRU's commit (maps, pins, log, part misses), then on the GPU the fault's one launch
        (the plan and commit in C, or their Python reference: the same victims, log, maps,
        stats and errors). A failed call changes nothing (but for a failed launch, after
        the commit: a device that refuses a launch is unusable anyway). With prefetches in
        flight (finished ones reaped by the caller) the plan tells whether a row of the
        call is in flight and whether its victims' scan passed a reserved slot. Rows in
        flight are claimed and read in the call's own read, beside its misses, into the
        slots their pieces reserved; where that read fails, or the plan must wait for
        pieces, the claim is undone and the call settles those prefetches as the Python
        path does and plans again: a loop of at most :data:`FAULT_ROUNDS` plans. ``ids``: a
        contiguous int64 vector in range (the caller's check)."""
        pf = self.prefetcher
        settled = False  # the call's rows in flight were claimed or settled once
        waited = False  # the pieces being read that the call mostly needs were waited for
        claim: InFlightClaim | None = None
        for _ in range(FAULT_ROUNDS):
            self.last_faults = 0
            t0 = time.perf_counter()
            plan = self.lru.plan(ids)
            status = plan.status
            if claim is not None and (status or (plan.n_miss and plan.passed_reserved)):
                pf.unclaim(claim)  # (a wait or an error below: nothing claimed)
                claim = None
            if status == LruStatus.IN_FLIGHT:  # read with the misses (a claim), or settled
                if settled:
                    raise AssertionError("a row of the call is still in flight after settling")
                # pieces mostly the call's are waited for, not read twice (a deferred call
                # never blocks on I/O: it claims them)
                if not waited and not defer:
                    waited = True
                    if pf.wait_mostly_needed(ids):
                        continue
                claim = pf.claim(ids)
                if claim is None:
                    pf.settle(ids)
                settled = True
                continue
            if status == LruStatus.EXHAUSTED and not self.slots.reserved:
                raise self._exhausted(plan.n_miss, self.lru.free_or_unpinned() - plan.fresh_hits)
            if status == LruStatus.EXHAUSTED or (
                plan.n_miss and self.slots.reserved and plan.passed_reserved
            ):
                # reserved slots count as free once their reads land; and an LRU order that
                # reaches a slot still in flight waits, as if it had landed
                pf.wait_all()
                self._settle_first(ids)
                settled = False
                continue
            if status:
                check_row_ids(ids, self.slots.rows)  # BAD_ID: raises RowRangeError
                raise AssertionError("LRU log exhausted before finding enough victims")
            rows, slots = self._reads(plan, claim)
            m = rows.size
            t1 = t2 = time.perf_counter()
            if m and defer and not device_out and self.lru.native is not None:
                pending = self.start(plan, claim, t0)
                if pending is not None:
                    self.pending = pending
                    return DEFERRED
            if m:  # raises before any change
                try:
                    records = self._read(rows)
                except Exception:
                    if claim is None:
                        raise
                    pf.unclaim(claim)  # read apart, or waited for, as the Python path does
                    claim = None
                    pf.settle(ids)
                    settled = True
                    continue
                t2 = time.perf_counter()
                if not self.arena.gpu:
                    self.arena.scatter(records, slots)
            return self._commit_call(plan, claim, rows, slots, device_out, (t0, t1, t2))
        raise AssertionError(
            f"a fault of {ids.size} ids planned {FAULT_ROUNDS} times without committing"
        )

    def _commit_call(
        self,
        plan: MissPlan,
        claim: InFlightClaim | None,
        rows: np.ndarray,
        slots: np.ndarray,
        device_out: bool,
        times: tuple[float, float, float],
    ) -> Any:
        """A planned call whose ``rows`` were read into ``slots`` (CPU: scattered): its
        commit, then on the GPU its launch; counted. Returns the call's slots."""
        n, m = plan.n, rows.size
        gpu = bool(m) and self.arena.gpu
        if gpu:  # the launch's side buffer: [slots | rows | evicted (| out)]
            side_out = self.arena.fill_side(slots, rows, plan.evicted, n if device_out else 0)
        out = side_out if gpu and device_out else np.empty(n, dtype=np.int32)
        self.commit(plan, claim, out)
        self.last_faults = plan.n_miss + self.prefetcher.shown
        t3 = time.perf_counter()
        if gpu:  # after the commit, so that the launch can carry the slots (out) too
            dev = self.arena.xp.empty(n, dtype=np.int32) if device_out else None
            self.arena.launch(m, plan.n_ev, dev)
            out = out if dev is None else dev
        if m:
            t0, t1, t2 = times
            t4 = time.perf_counter()
            self.counters.count_fault(t4 - t0, t1 - t0, t2 - t1, t3 - t2, t4 - t3)
        return out

    @staticmethod
    def _reads(plan: MissPlan, claim: InFlightClaim | None) -> tuple[np.ndarray, np.ndarray]:
        """The rows a plan reads and their slots: the misses (into their victims) and the
        claimed rows in flight (into their reserved slots), ascending as one read plan."""
        rows, slots = plan.missing, plan.victims
        if claim is not None:
            rows = np.concatenate((rows, claim.rows.astype(np.int32, copy=False)))
            order = np.argsort(rows, kind="stable")
            rows, slots = rows[order], np.concatenate((slots, claim.slots))[order]
        return rows, slots

    def commit(self, plan: MissPlan, claim: InFlightClaim | None, out: np.ndarray) -> None:
        """Commit a plan whose reads succeeded (the LRU's commit: maps, pins, log, part
        misses, ``out``; counted) and complete the rows it claimed from prefetches in
        flight. A refused commit (arguments that do not fit: nothing changed) undoes the
        claim."""
        try:  # (it checks its arguments before any change)
            self.lru.commit(plan, out)
        except BaseException:
            if claim is not None:
                self.prefetcher.unclaim(claim)
            raise
        if claim is not None:
            self.prefetcher.claimed(claim)

    def _read(self, rows: np.ndarray) -> np.ndarray:
        """Read ``rows`` (sorted, unique) into the staging buffer; returns their records.
        Raises before any change (a failed read maps nothing)."""
        staging = self.arena.staging_rows(rows.size)
        self.counters.count_read(self.parts.read(rows, staging))
        return staging[: rows.size]

    # -- a deferred fault --------------------------------------------------
    def start(self, plan: MissPlan, claim: InFlightClaim | None, t0: float) -> PendingFault | None:
        """Start a planned fault's read on a reader's own thread; on the GPU, queue its
        launch behind ``fault_wait`` on the cache's stream: the stream holds until the read
        ends, and the launch writes the records and the device map's update only if the
        read was clean (on the CPU the records are written when the read is joined). The
        maps, pins, log and stats change only at :meth:`finish`. None where the reader
        cannot read apart (nothing started)."""
        rows, slots = self._reads(plan, claim)
        m = rows.size
        arena = self.arena
        staging = arena.staging_rows(m)
        ctl = arena.ctl() if arena.gpu else None
        self._seq = self._seq % (1 << 30) + 1
        t1 = time.perf_counter()
        started = self.parts.start(rows, staging, ctl, self._seq)
        if started is None:
            return None
        reader, (rows64, bounds) = started
        try:
            if arena.gpu:  # (on the CPU the records are written at the join)
                assert ctl is not None
                arena.fill_side(slots, rows, plan.evicted)
                arena.launch(m, plan.n_ev, None, ctl.ctypes.data, self._seq)
        except BaseException:
            try:
                reader.read_batch_join()
            finally:
                if claim is not None:
                    self.prefetcher.unclaim(claim)
            raise
        times = (t0, t1, time.perf_counter())
        self.last_faults = (
            plan.n_miss + self.prefetcher.shown + (0 if claim is None else claim.rows.size)
        )
        return PendingFault(plan, claim, reader, (rows64, bounds, slots), times)
