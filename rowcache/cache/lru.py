"""The LRU of ``NgramRowCache``: recency, pins, victims; its C and its Python reference.

Owns :class:`Lru`, the only writer of the slots' recency (the batch of last use, which
also pins: a slot is pinned while its last use is the current batch), the LRU log and
its bounds, and the pin count. Each operation is here twice, side by side: the native
one (``rowcache.kernels._host``: the all-hits path, the scan and the deferred touch, the
miss plan and its commit, compaction; ``csrc/lru_*.c``) and the Python one, which is its
reference (tests compare the two). Reads the slot table (``rowcache.cache.slots``); writes
it only through the native commit, which maps a plan's misses into their victims.

Log rules. Recency is the batch in which a slot was last resolved. Each resolve appends
its slots to the log (an int32 array) in ascending row-id order; ``log_pos[slot]`` is the
position of the slot's live entry, so older entries of that slot are stale. Victims are
the first live entries from the head whose slots are neither pinned nor reserved by a
prefetch: least recently used first, and within one batch a smaller row id counts as
older (the tie rule that makes batch-LRU a stack algorithm, so that
``rowcache.tools.miss_ratio_curve(..., batch=...)`` predicts this cache's faults exactly).
The log has a slack of at least as many entries as slots and is compacted in place when
full: O(1) amortized per access.

Deferred touch. An all-hits resolve of at least ``defer_min`` ids (``DEFER_MIN``, where
the process may use 4 CPUs or more) returns once its scan has found every row resident
and a background C thread pins and logs its slots (``csrc/lru_touch.c``). Until
:meth:`Lru.finish_touches` has taken in its result the log bounds and pins are owed to it:
the facade finishes the touches before any call that reads them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from rowcache.cache.plan import LruStatus, MissPlan
from rowcache.cache.slots import READ, READING, SlotTable
from rowcache.cache.stats import Counters
from rowcache.errors import ConfigError
from rowcache.kernels.host import HOST_THREADS, TOUCH_THREADS, USABLE_CPUS

# An all-hits call of at least this many ids returns after its scan and leaves the
# touch (sort, pin, log: ~90 % of its C time) to a background thread, which the cache's
# next call waits for (csrc/lru_touch.c); where the process may use at least 4 CPUs only
# (on 2 CPUs the background touch competed with the caller: docs/benchmarks.md, "Figures the
# code cites").
DEFER_MIN = 2048 if USABLE_CPUS >= 4 else 1 << 62

# Rows (all parts) from which the native miss path splits a large call's plan and commit over
# HOST_THREADS: a row map of 64 MB or more outgrows the CPU's caches, its look-ups wait on
# memory, and parts on several cores overlap those waits. Below it a part's work is about a
# pool worker's wake-up, and the 2-CPU dev machine's serve run (6,000-row tables) planned and
# committed a prefill step's call slower in parts (docs/benchmarks.md, "Figures the code cites").
MISS_PARTS_MIN_ROWS = 1 << 24

HIT, MISS, ELSE = 0, 1, 2
# LruStatus' codes as plain ints for the hit paths' comparisons (an IntEnum member's is
# ~80 ns slower, several a step)
_OK = int(LruStatus.OK)
_MISS = int(LruStatus.MISS)
_BAD_ID = int(LruStatus.BAD_ID)
_LOG_FULL = int(LruStatus.LOG_FULL)
"""What :meth:`Lru.hits` found: every row resident (touched), a miss (nothing changed;
the ids are in range), or neither (the Python path must look: a bad id)."""


class Reservation(NamedTuple):
    """A prefetch's reservation (:meth:`Lru.reserve`): the ``victims`` its missing rows took
    (their slots, reserved ``READING`` in the slot table) and the rows those ``evicted``."""

    victims: np.ndarray
    evicted: np.ndarray


_NO_SLOTS = np.empty(0, dtype=np.int32)
_NO_SLOTS.flags.writeable = False


def sorted_unique(a: np.ndarray) -> np.ndarray:
    """The distinct values of ``a`` (int64 row ids < 2**31), ascending, as int32
    (``np.unique`` without its overheads; int32 sorts twice as fast as int64)."""
    u = np.sort(a.astype(np.int32))
    if u.size > 1:
        keep = np.empty(u.size, dtype=bool)
        keep[0] = True
        np.not_equal(u[1:], u[:-1], out=keep[1:])
        if not keep.all():
            u = u[keep]
    return u


def member(values: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """bool[len(values)]: which ``values`` are in ``sorted_set`` (sorted, unique): one
    binary search a value; ``np.isin`` sorts both sides on every call."""
    if not sorted_set.size:
        return np.zeros(values.shape, dtype=bool)
    i = sorted_set.searchsorted(values)
    i[i == sorted_set.size] = 0
    return sorted_set[i] == values


class Lru:
    """Recency and pins of a :class:`SlotTable`'s slots, in a log.

    Parameters
    ----------
    slots : the slot table (read here; written by the native commit only).
    counters : where the LRU reports what its calls counted (``Counters.count_hits``,
        ``count_commit``, ``count_evictions``: the lookups, hits, misses and each part's
        misses, which the native commit counts and returns in the LRU's ``part_counts``).
    native : the native host kernels (``rowcache.kernels.host.native``), or None for the
        Python reference everywhere. With them the LRU makes one ``LruState`` (C) over the
        slot table's and its own arrays, once: its calls pass ids and a plan.
    part_offsets : int64[parts + 1], the parts' first global rows and the total.
    defer_min : ids from which an all-hits call defers its touch (:data:`DEFER_MIN`).
    log_slack : log entries beyond the slots (default ``max(slots, 2**14)``; at least
        ``slots``): fewer compact more often.

    Attributes (read them; only this object writes them)
    ----------
    last_used : int64[slots], the batch of each slot's last use (-1: never).
    log : int32[slots + slack], slots in touch order; ``log[head:tail]`` the live window.
    log_pos : int32[slots], each slot's live entry.
    head, tail : the log's bounds. batch : the current batch. pinned : slots it pinned.
    """

    def __init__(
        self,
        slots: SlotTable,
        counters: Counters,
        native: Any,
        part_offsets: np.ndarray,
        *,
        defer_min: int = DEFER_MIN,
        log_slack: int | None = None,
    ) -> None:
        S = slots.num_slots
        self.slots = slots
        self.counters = counters
        self.native = native
        self.defer_min = defer_min
        self.last_used = np.full(S, -1, dtype=np.int64)
        # Slack of S entries: a compaction (O(S)) every S / k calls of k unique rows, i.e.
        # about one entry moved per row touched. (At least S: a call's entries fit after a
        # compaction.)
        slack = max(S, 1 << 14) if log_slack is None else log_slack
        if slack < S:
            raise ConfigError(f"log_slack={log_slack!r}: give at least the slots ({S})")
        self.log = np.empty(S + slack, dtype=np.int32)
        self.log[:S] = np.arange(S, dtype=np.int32)
        self.log_pos = np.arange(S, dtype=np.int32)
        self.head, self.tail = 0, S
        self.batch = 0
        self.pinned = 0
        self._scratch = np.empty(0, dtype=np.int32)  # the hit path's sort buffer
        self._scratch2 = np.empty(0, dtype=np.int32)  # a queued touch's
        # deferred touches, oldest first: (handle or result, its batch, the scratch it holds)
        self._touching: list[tuple[Any, int, np.ndarray]] = []
        self._miss_threads = HOST_THREADS if slots.rows >= MISS_PARTS_MIN_ROWS else 1
        self._offsets = np.ascontiguousarray(part_offsets, dtype=np.int64)
        # each commit's misses per part (C writes them; Counters.count_commit adds them)
        self._part_counts = np.zeros(self._offsets.size - 1, dtype=np.int64)
        self._c: Any = None  # the native state: these arrays, held by C (csrc/lru_state.h)
        if native is not None:
            self._c = native.LruState(
                slots.row_map.native_arg,
                slots.slot_row,
                slots.state,
                self.last_used,
                self.log,
                self.log_pos,
                self._offsets,
                self._part_counts,
            )

    def __del__(self) -> None:
        # a touch still in flight holds the arrays (and a slot of the C side): finish it
        if getattr(self, "_touching", None):
            try:
                self.finish_touches()
            except Exception:
                pass

    # -- batches and pins --------------------------------------------------
    def end_step(self) -> None:
        """The next batch begins: every slot of this one is unpinned at once."""
        self.pinned = 0
        self.batch += 1

    def pin_mask(self) -> np.ndarray:
        """bool[slots]: pinned by the current batch."""
        return self.last_used == self.batch

    def free_or_unpinned(self) -> int:
        """Slots neither pinned nor reserved by a prefetch."""
        return self.slots.num_slots - self.pinned - self.slots.reserved

    # -- the deferred touch ------------------------------------------------
    @property
    def touching(self) -> bool:
        """A deferred touch is pending: log bounds and pins are owed to it."""
        return bool(self._touching)

    def finish_touches(self, keep: int = 0) -> None:
        """Wait for the deferred touches, oldest first, all but the newest ``keep``, and
        take in their results: the log's bounds, the hits they counted, and their pins
        while their batch lasts."""
        while len(self._touching) > keep:
            handle, batch, _ = self._touching.pop(0)
            res = handle if type(handle) is tuple else self.native.lru_touch_wait(handle)
            status, fresh, self.head, self.tail = res
            if status != _OK:  # LOG_FULL
                raise AssertionError("the LRU log had no room for a touch after compaction")
            self.counters.count_hits(0, fresh)
            if batch == self.batch:
                self.pinned += fresh

    def _start_touch(self, scratch: np.ndarray, n: int, after: int = -1) -> None:
        """Hand the touch of an all-hits call (its keys in ``scratch``) to the toucher."""
        handle = self._c.touch_start(
            scratch, n, self.head, self.tail, self.batch, TOUCH_THREADS, after
        )
        self._touching.append((handle, self.batch, scratch))
        self.counters.count_hits(n, 0)

    def _scratch_for(self, n: int) -> np.ndarray:
        if self._scratch.size < 2 * n:
            self._scratch = np.empty(max(2 * n, 2 * self._scratch.size), dtype=np.int32)
        return self._scratch

    # -- the native hit path -----------------------------------------------
    def hits(self, ids: np.ndarray) -> tuple[int, np.ndarray | None]:
        """The all-hits path in one C call (``csrc/lru_hits.c``) for a contiguous int64
        vector ``ids`` (the native module present, no deferred touch pending). Returns
        ``(HIT, slots)`` with the call touched and counted (its touch deferred for a call
        of ``defer_min`` ids or more), ``(MISS, None)`` with nothing changed, or ``(ELSE,
        None)`` where the Python path must look (a bad id)."""
        c = self._c
        n = ids.size
        scratch = self._scratch_for(n)
        out = np.empty(n, dtype=np.int32)
        if n >= self.defer_min:
            status, _ = c.scan(ids, out, scratch, HOST_THREADS)
            if status == _OK:  # every row resident: the touch goes on in the background
                self._start_touch(scratch, n)
                return HIT, out
            return (MISS, None) if status == _MISS else (ELSE, None)
        status, fresh, tail = c.hits(ids, self.tail, self.batch, out, scratch, HOST_THREADS)
        if status == _LOG_FULL:  # compact, then once more
            self.compact()
            status, fresh, tail = c.hits(ids, self.tail, self.batch, out, scratch, HOST_THREADS)
        if status == _MISS:
            return MISS, None
        if status != _OK:
            return ELSE, None
        self.tail = tail
        self.counters.count_hits(n, fresh)
        self.pinned += fresh
        return HIT, out

    def hits_queued(self, ids: np.ndarray) -> tuple[int, np.ndarray | None]:
        """With a deferred touch pending: an all-hits call of at least ``defer_min`` ids
        scans the row map, which no touch writes, and queues its own touch behind the
        pending one instead of waiting for it (at most two are pending). ``(MISS, None)``:
        a row is missing, and the touches are finished (nothing may run ahead of the
        fault). ``(ELSE, None)``: the caller finishes the touches and takes the usual path
        (a small call, a bad id, a pending touch that ran in its caller)."""
        if ids.size < self.defer_min:
            return ELSE, None
        self.finish_touches(keep=1)
        prev, _, held = self._touching[0]
        if type(prev) is tuple:  # it ran in its caller: nothing to follow
            return ELSE, None
        n = ids.size
        scratch = self._scratch2 if held is self._scratch else self._scratch
        if scratch.size < 2 * n:
            scratch = np.empty(max(2 * n, 2 * scratch.size), dtype=np.int32)
            if held is self._scratch:
                self._scratch2 = scratch
            else:
                self._scratch = scratch
        out = np.empty(n, dtype=np.int32)
        status, _ = self._c.scan(ids, out, scratch, HOST_THREADS)
        if status == _MISS:
            self.finish_touches()
            return MISS, None
        if status != _OK:
            return ELSE, None
        self._start_touch(scratch, n, prev)
        return HIT, out

    def all_resident(self, ids: np.ndarray) -> bool | None:
        """One C scan of the row map, changing nothing: whether every row of ``ids`` (a
        contiguous int64 vector) is mapped; None for a bad id (the caller's check raises)."""
        n = ids.size
        scratch = np.empty(2 * n, dtype=np.int32)  # not the cache's: a touch may hold it
        status, _ = self._c.scan(ids, np.empty(n, dtype=np.int32), scratch, 1)
        return None if status == _BAD_ID else status == _OK

    # -- the miss path: a plan, then its commit --------------------------------
    def plan(self, ids: np.ndarray) -> MissPlan:
        """Plan a resolve of ``ids`` (a contiguous int64 vector), changing nothing: dedup,
        the missing rows, exhaustion (against the slots neither pinned nor reserved), the
        victims and the rows they evict. C ``LruState.plan``, or its Python reference
        (:meth:`_plan_python`) without the native module."""
        n = ids.size
        work = np.empty(5 * n, dtype=np.int32)  # [uniq | slots | missing | victims | evicted]
        t = self.slots
        avail = t.num_slots - self.pinned - t.reserved
        if self._c is None:
            return MissPlan.of(ids, work, self._plan_python(ids, work, avail), self.batch)
        planned = self._c.plan(
            ids,
            self.head,
            self.tail,
            self.batch,
            t.reserved > 0,
            avail,
            work,
            self._scratch_for(n),
            self._miss_threads,
        )
        return MissPlan.of(ids, work, planned, self.batch)

    def commit(self, plan: MissPlan, out: np.ndarray) -> int:
        """Commit a plan whose reads succeeded: unmap the evicted rows, map the missing ones
        into their victims (resident), pin the call's slots (while the plan's batch lasts)
        and log them, add each part's misses, write the slots of the ids to ``out``; count
        the call. Returns the slots newly pinned. C ``LruState.commit`` (which refuses
        arguments that do not fit, ``ValueError``, before any change), or its Python
        reference (:meth:`_commit_python`)."""
        if self._c is None:
            fresh = self._commit_python(plan, out)
        else:
            fresh, self.head, self.tail = self._c.commit(
                plan.ids,
                plan.work,
                plan.n_u,
                plan.n_miss,
                plan.n_ev,
                plan.head,
                self.tail,
                plan.batch,
                out,
                self._miss_threads,
            )
        self.counters.count_commit(plan.n, fresh, plan.n_miss, plan.n_ev, self._part_counts)
        if plan.batch == self.batch:  # (a deferred call's batch may have ended: no pins)
            self.pinned += fresh
        return int(fresh)

    def _plan_python(self, ids: np.ndarray, work: np.ndarray, avail: int) -> tuple:
        """The reference of C ``LruState.plan`` (``csrc/lru_miss.c``): the same status,
        counts, work, head, end and passed flag (tests compare the two)."""
        n, t, head = ids.size, self.slots, self.head
        bad = np.flatnonzero((ids < 0) | (ids >= t.rows))
        if bad.size:
            return LruStatus.BAD_ID, int(bad[0]), 0, 0, 0, head, head, 0
        uniq = sorted_unique(ids)
        n_u = uniq.size
        slots_u = t.slots_of(uniq)
        miss = slots_u < 0
        missing = uniq[miss]
        n_miss = missing.size
        hits = np.sort(slots_u[~miss])
        fresh = self.fresh(hits)
        work[:n_u] = uniq
        work[n : n + n_u] = slots_u
        work[2 * n : 2 * n + n_miss] = missing
        if t.reserved and bool((t.state[hits] == READING).any()):
            return LruStatus.IN_FLIGHT, n_u, n_miss, fresh, 0, head, head, 0
        if n_miss and n_miss > avail - fresh:
            return LruStatus.EXHAUSTED, n_u, n_miss, fresh, 0, head, head, 0
        if not n_miss:
            return LruStatus.OK, n_u, 0, fresh, 0, head, head, 0
        victims, new_head, end = self.choose_victims(n_miss, hits)  # the call's hits: none
        passed = self.passed_reserved(end, hits)
        old = t.slot_row[victims]
        evicted = old[old >= 0]
        work[3 * n : 3 * n + n_miss] = victims
        work[4 * n : 4 * n + evicted.size] = evicted
        return LruStatus.OK, n_u, n_miss, fresh, evicted.size, new_head, end, int(passed)

    def _commit_python(self, plan: MissPlan, out: np.ndarray) -> int:
        """The reference of C ``LruState.commit``: the slot table maps the misses into the
        victims, the log's head moves to the plan's, the call's slots are pinned for the
        plan's batch and logged (compacting first where the log is full)."""
        n = plan.n
        slots_u = plan.work[n : n + plan.n_u].copy()
        miss = slots_u < 0
        if int(np.count_nonzero(miss)) != plan.n_miss:
            raise ValueError("commit: the plan's slots do not match its missing rows")
        self.slots.map(plan.missing, plan.victims, plan.evicted)
        slots_u[miss] = plan.victims
        self.head = plan.head  # every entry before it is stale once the slots are re-logged
        fresh = int(np.count_nonzero(self.last_used[slots_u] != plan.batch))
        self.last_used[slots_u] = plan.batch
        self.log_slots(slots_u)
        # global rows ascending: each part's misses are one run
        self._part_counts[:] = np.diff(np.searchsorted(plan.missing, self._offsets))
        out[:n] = self.slots.slots_of(plan.ids)
        return fresh

    # -- victims and the log (the Python plan's, and the prefetcher's) ------
    def fresh(self, slots: np.ndarray) -> int:
        """Of ``slots`` (distinct), those not yet pinned in this batch."""
        return int(np.count_nonzero(self.last_used[slots] != self.batch))

    def choose_victims(
        self, need: int, spare: np.ndarray | None = None
    ) -> tuple[np.ndarray, int, int]:
        """The ``need`` least recently used slots neither pinned, nor reserved by a
        prefetch, nor in ``spare`` (sorted slots: a call's own hits). Returns the
        victims, the new log head (the first live entry passed over, else just past
        the last victim: entries before it are stale once the victims are re-logged)
        and the position just past the last victim. Changes nothing."""
        found: list[np.ndarray] = []
        got = 0
        pos = self.head
        window = 2 * need + 64
        last_taken = self.head - 1
        first_kept = -1
        state = self.slots.state
        while got < need:
            if pos >= self.tail:  # cannot happen: availability was checked
                raise AssertionError("LRU log exhausted before finding enough victims")
            stop = min(self.tail, pos + window)
            s = self.log[pos:stop]
            live = self.log_pos[s] == np.arange(pos, stop, dtype=np.int32)
            ok = live & (self.last_used[s] != self.batch)
            if self.slots.reserved:
                ok &= state[s] < READING
            if spare is not None:
                ok &= ~member(s, spare)
            cand = np.flatnonzero(ok)[: need - got]
            end = stop  # the part of this window the victims span
            if cand.size:
                found.append(s[cand])
                got += cand.size
                last_taken = pos + int(cand[-1])
                if got == need:
                    end = last_taken + 1
            if first_kept < 0:  # pinned or reserved entries stay in the log
                kept = np.flatnonzero(live[: end - pos] & ~ok[: end - pos])
                if kept.size:
                    first_kept = pos + int(kept[0])
            pos = stop
            window *= 2
        victims = np.concatenate(found) if len(found) > 1 else found[0]
        head = last_taken + 1 if first_kept < 0 else first_kept
        return victims, head, last_taken + 1

    def passed_reserved(self, end: int, spare: np.ndarray | None = None) -> bool:
        """True when victims taken up to log position ``end`` skipped a slot that a
        prefetch in flight holds (the LRU would have taken it had the read landed): a live
        log entry of a reserved slot before ``end``, but a READ slot pinned or in ``spare``
        (sorted: a call's hits; no victim in any order). Every entry before the head is
        stale, so the scan is the victims' window (``LruState.plan`` tells the same)."""
        if not self.slots.reserved or end <= self.head:
            return False
        s = self.log[self.head : end]
        live = self.log_pos[s] == np.arange(self.head, end, dtype=np.int32)
        b = self.slots.state[s]
        read = (b == READ) & (self.last_used[s] != self.batch)
        if spare is not None and spare.size:
            read &= ~member(s, spare)
        return bool((live & ((b == READING) | read)).any())

    def reserve(
        self, rows_u: np.ndarray, missing: np.ndarray, spare: np.ndarray
    ) -> Reservation | None:
        """A prefetch's reservation, in one call: victims for the ``missing`` rows (sorted
        unique, a subset of ``rows_u``) among the least recently used slots neither
        pinned, nor reserved, nor in ``spare`` (the call's resident slots, sorted); the
        head past them; the slot table's reservation (``SlotTable.reserve``: evicted rows
        unmapped, ``missing`` mapped into the victims, ``READING``); the evictions
        counted; then every mapped row of ``rows_u`` logged most recently used, in
        ascending row order (resolve's tie rule). Returns the victims and evicted rows
        (the prefetcher's pieces and the device map's update), or None, with nothing
        changed, where the victims' scan would pass a slot a piece in flight holds (the
        LRU would have taken it had its read landed): the caller waits for the pieces and
        asks again."""
        victims = evicted = _NO_SLOTS
        if missing.size:
            victims, head, end = self.choose_victims(int(missing.size), spare)
            if self.slots.reserved and self.passed_reserved(end):
                return None
            self.head = head  # every entry before it is stale once the victims are re-logged
            old = self.slots.slot_row[victims]
            evicted = old[old >= 0]
            self.slots.reserve(missing, victims, evicted)
            self.counters.count_evictions(int(evicted.size))
        order = self.slots.slots_of(rows_u)
        self.log_slots(order[order >= 0].astype(np.int32, copy=False))
        return Reservation(victims, evicted)

    def log_slots(self, slots_u: np.ndarray) -> None:
        """Move distinct slots to the tail of the LRU log, in the given order."""
        k = slots_u.size
        if self.tail + k > self.log.size:
            self.compact()  # first: the slots' old entries are still live, and kept
        t = self.tail
        self.log[t : t + k] = slots_u
        self.log_pos[slots_u] = np.arange(t, t + k, dtype=np.int32)  # old entries now stale
        self.tail = t + k

    def log_front(self, slots: np.ndarray) -> None:
        """Move distinct unpinned slots to the head of the LRU log (the next victims)."""
        k = slots.size
        if self.head < k:  # no room before the head: compact behind k free entries
            self.log_pos[slots] = -1  # their current entries become stale
            live = self.log[self.head : self.tail]
            keep = live[self.log_pos[live] == np.arange(self.head, self.tail, dtype=np.int32)]
            self.log[k : k + keep.size] = keep
            self.log_pos[keep] = np.arange(k, k + keep.size, dtype=np.int32)
            self.head, self.tail = k, k + keep.size
        h = self.head - k
        self.log[h : self.head] = slots
        self.log_pos[slots] = np.arange(h, self.head, dtype=np.int32)
        self.head = h

    def compact(self) -> None:
        """Move the log's live entries to its front (in C where built)."""
        if self._c is not None:
            self.tail = self._c.compact(self.head, self.tail, HOST_THREADS)
            self.head = 0
            return
        live = self.log[self.head : self.tail]
        keep = live[self.log_pos[live] == np.arange(self.head, self.tail, dtype=np.int32)]
        self.log[: keep.size] = keep
        self.log_pos[keep] = np.arange(keep.size, dtype=np.int32)
        self.head, self.tail = 0, keep.size

    # -- checks ------------------------------------------------------------
    def check(self) -> list[str]:
        """Every broken invariant of the LRU, one sentence each (empty when sound): the
        bounds in order, every slot exactly one live entry in ``log[head:tail]``, no use
        after the current batch, ``pinned`` the slots used in it. With a deferred touch
        pending only the touch-independent ones (the rest is owed to the touch)."""
        bad: list[str] = []
        S = self.slots.num_slots
        if not 0 <= self.head <= self.tail <= self.log.size:
            return [
                f"log bounds out of order: head {self.head}, tail {self.tail}, "
                f"capacity {self.log.size}"
            ]
        if int(self.last_used.max(initial=-1)) > self.batch:
            bad.append("a slot was used in a batch after the current one")
        if self._touching:
            return bad
        pos = self.log_pos
        if int(pos.min()) < self.head or int(pos.max()) >= self.tail:
            bad.append("a slot's live entry lies outside log[head:tail]")
        elif not np.array_equal(self.log[pos], np.arange(S, dtype=np.int32)):
            bad.append("a slot's log_pos does not point at an entry of that slot")
        window = self.log[self.head : self.tail]
        live = np.count_nonzero(pos[window] == np.arange(self.head, self.tail, dtype=np.int32))
        if live != S:
            bad.append(f"{live} live log entries for {S} slots")
        n_pinned = int(np.count_nonzero(self.last_used == self.batch))
        if n_pinned != self.pinned:
            bad.append(f"pinned is {self.pinned} but {n_pinned} slots were used in this batch")
        return bad
