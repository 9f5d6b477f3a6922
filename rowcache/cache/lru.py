"""The LRU log and pins of ``NgramRowCache``: victims, touch, compaction, the hit path.

Owns the mixin :class:`LruLog` over the cache's slot arrays (``_row_slot``,
``_slot_row``, ``_last_used``, ``_log``, ``_log_pos``, head and tail): the all-hits
path in one C call (``csrc/lru_hits.c``), counting and pinning a call's slots, the
choice of victims, moving slots to the log's tail or head, compaction. Reads and
writes no rows (``rowcache.cache.fault``, also the native miss path: its C victim choice
mirrors ``_choose_victims``); the log's rules are in ``rowcache.cache.row_cache``.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np

from rowcache.cache.state import CacheState
from rowcache.kernels.host import HOST_THREADS, TOUCH_THREADS, USABLE_CPUS
from rowcache.store.handle import check_row_ids

# An all-hits call of at least this many ids returns after its scan and leaves the
# touch (sort, pin, log: ~90 % of its C time) to a background thread, which the cache's
# next locked call waits for (csrc/lru_touch.c); where the process may use at least 4
# CPUs only (on 2, the touch competed with the caller: the retired bench/host_threads.py, docs/results/).
DEFER_MIN = 2048 if USABLE_CPUS >= 4 else 1 << 62


class SettlingLock:
    """The cache's lock (re-entrant): entering it first finishes a deferred fault
    (``DeferredFaults._finish_deferred``: may raise its read's error) and a deferred touch, so
    no method sees the LRU state before the commit and touch it is owed. ``raw`` is the
    bare lock, for the methods that do not read that state (``end_batch`` needs only the
    batch, and finishes a deferred fault itself)."""

    __slots__ = ("_cache", "raw")

    def __init__(self, cache: Any) -> None:
        self.raw = threading.RLock()
        self._cache = weakref.ref(cache)  # no cycle: the cache's arrays go with it

    def __enter__(self) -> SettlingLock:
        self.raw.acquire()
        c = self._cache()
        if c is not None and (c._touching or c._deferred is not None):
            try:
                if c._deferred is not None:  # a deferred fault's read: joined, committed
                    c._finish_deferred()
                if c._touching:
                    c._finish_touch()
            except BaseException:
                self.raw.release()
                raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.raw.release()


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


class LruLog(CacheState):
    """LRU bookkeeping of :class:`rowcache.cache.row_cache.NgramRowCache` (a mixin over its
    arrays). ``_host_lib()`` gives the native host kernels (``rowcache.kernels.host.native``,
    or None), looked up where tests swap them."""

    _scratch: np.ndarray
    _scratch2: np.ndarray  # the keys of a touch queued behind one that holds _scratch
    # deferred touches, oldest first: (handle or result, its batch, the scratch it holds)
    _touching: list[tuple[Any, int, np.ndarray]]
    _deferred: Any  # rowcache.cache.deferred.DeferredFault | None
    _defer_min: int  # ids from which an all-hits call defers its touch (DEFER_MIN)

    def _host_lib(self) -> Any:
        raise NotImplementedError

    def __del__(self) -> None:
        # a touch still in flight holds the arrays (and a slot of the C side): finish it
        if getattr(self, "_touching", None):
            try:
                self._finish_touch()
            except Exception:
                pass

    def _finish_touch(self, keep: int = 0) -> None:
        """Wait for the deferred touches (``csrc/lru_touch.c``), oldest first, all but the
        newest ``keep``, and take in their results: the log's bounds, the hits they
        counted, and their pins while their batch lasts."""
        while len(self._touching) > keep:
            handle, batch, _ = self._touching.pop(0)
            res = handle if type(handle) is tuple else self._host_lib().lru_touch_wait(handle)
            status, fresh, self._head, self._tail = res
            if status:
                raise AssertionError("the LRU log had no room for a touch after compaction")
            self._stats["hits"] += fresh
            if batch == self._batch:
                self._pinned += fresh

    def _native_for(self, row_ids: Any) -> Any:
        """The native host kernels, where a call may use them: ``row_ids`` a contiguous
        int64 NumPy vector and no prefetch to settle; else None."""
        native = self._host_lib()
        if (
            native is None
            or type(row_ids) is not np.ndarray
            or row_ids.dtype != np.int64
            or row_ids.ndim != 1
            or not row_ids.flags.c_contiguous
            or self._jobs
            or self._failed
        ):
            return None
        return native

    def _hits_queued(self, row_ids: Any, device_out: bool = False) -> Any:
        """With a deferred touch pending (under the bare lock): an all-hits call of at
        least ``_defer_min`` ids scans the row map, which no touch writes, and queues its
        own touch behind the pending one, instead of waiting for it (a step's host
        resolve then overlaps the previous step's touch; at most two are pending, so a
        call waits for the touch of two calls ago). A miss settles the touches and goes
        to the native miss path with the ids scanned once (``device_out`` as for
        ``_hits_native``). None where the caller must settle and take the usual path: a
        bad id, prefetches, a small call."""
        native = self._native_for(row_ids)
        if native is None or row_ids.size < self._defer_min:
            return None
        self._finish_touch(keep=1)
        prev, _, held = self._touching[0]
        if type(prev) is tuple:  # it ran in its caller: nothing to follow
            return None
        n = row_ids.size
        scratch = self._scratch2 if held is self._scratch else self._scratch
        if scratch.size < 2 * n:
            scratch = np.empty(max(2 * n, 2 * scratch.size), dtype=np.int32)
            if held is self._scratch:
                self._scratch2 = scratch
            else:
                self._scratch = scratch
        out = np.empty(n, dtype=np.int32)
        status, _ = native.lru_scan(row_ids, self.rows, self._row_slot, out, scratch,
                                    HOST_THREADS)  # fmt: skip
        if status == 1:  # a miss: nothing may run ahead of the fault
            self._finish_touch()
            self._reaped_rows = 0
            return self._resolve_native(native, row_ids, device_out)
        if status:
            return None
        self._start_touch(native, scratch, n, prev)
        return out

    def _start_touch(self, native: Any, scratch: np.ndarray, n: int, after: int = -1) -> None:
        """Hand the touch of an all-hits call (its keys in ``scratch``) to the toucher."""
        handle = native.lru_touch_start(
            self._row_slot, self._last_used, self._log, self._log_pos, scratch, n,
            self._head, self._tail, self._batch, TOUCH_THREADS, after,
        )  # fmt: skip
        self._touching.append((handle, self._batch, scratch))
        self._stats["lookups"] += n
        self._last_faults = 0

    def holds_all(self, row_ids: Any) -> bool:
        """True when a :meth:`resolve` of ``row_ids`` would neither fault, wait nor commit
        a prefetch (its ``last_faults`` would be 0): every row is resident and shown in
        the device map, none belongs to a prefetch not yet committed (in flight, or
        landed and not yet reaped by a call such as :meth:`poll`; so none whose failed
        read a resolve would raise). Changes nothing (no touch, pin, count or commit).

        For callers that pick an order by it: ``NgramEmbedding`` resolves a small step
        first when this is False, rather than gathering through the device map and
        running its device part again after the fault. Raises as :meth:`resolve` does
        for ids outside the table."""
        native = self._host_lib()
        if self._deferred is not None:  # a deferred fault's commit first (it may raise)
            with self._lock:
                pass
        if (
            native is not None
            and type(row_ids) is np.ndarray
            and row_ids.dtype == np.int64
            and row_ids.ndim == 1
            and row_ids.flags.c_contiguous
        ):  # one C scan of the row map (~1 µs for a decode step's ids; numpy's ~10)
            n = row_ids.size
            scratch = np.empty(2 * n, dtype=np.int32)  # not the cache's: a touch may hold it
            with self._lock.raw:
                if not self._n_busy:  # else the rows' busy flags matter: numpy below
                    status, _ = native.lru_scan(row_ids, self.rows, self._row_slot,
                                                np.empty(n, dtype=np.int32), scratch, 1)  # fmt: skip
                    if status < 2:  # 2: a bad id, raised below
                        return status == 0
        ids = check_row_ids(row_ids, self.rows)
        with self._lock.raw:  # a deferred touch changes no mapping: no need to wait for it
            s = self._row_slot[ids]  # a failed prefetch's rows: busy, then unmapped
            if s.size and int(s.min()) < 0:
                return False
            return not (self._n_busy and bool(self._busy[s].any()))

    def _hits_native(self, row_ids: Any, device_out: bool = False) -> Any:
        """The all-hits path in one C call (``csrc/lru_hits.c``); on a miss, the native
        miss path (``FaultPath._resolve_native``); or None where the Python path must
        run: a bad id, prefetches to settle, no native module, input that is not a
        contiguous int64 NumPy vector. Same state, same stats. ``device_out``: a call
        that faulted may return its slots as a cupy array (``_resolve_native``)."""
        native = self._native_for(row_ids)
        if native is None or row_ids.size == 0:
            return None
        n = row_ids.size
        if self._scratch.size < 2 * n:
            self._scratch = np.empty(max(2 * n, 2 * self._scratch.size), dtype=np.int32)
        out = np.empty(n, dtype=np.int32)
        if n >= self._defer_min:
            status, _ = native.lru_scan(row_ids, self.rows, self._row_slot, out, self._scratch,
                                        HOST_THREADS)  # fmt: skip
            if status == 0:  # every row resident: the touch goes on in the background
                self._start_touch(native, self._scratch, n)
                return out
            if status == 1:
                self._reaped_rows = 0
                return self._resolve_native(native, row_ids, device_out)
            return None
        status, fresh, tail = native.lru_hits(
            row_ids,
            self.rows,
            self._row_slot,
            self._last_used,
            self._log,
            self._log_pos,
            self._tail,
            self._batch,
            out,
            self._scratch,
            HOST_THREADS,
        )
        if status == 3:  # the log is full: compact (as _touch would), then once more
            self._compact()
            status, fresh, tail = native.lru_hits(
                row_ids, self.rows, self._row_slot, self._last_used, self._log,
                self._log_pos, self._tail, self._batch, out, self._scratch, HOST_THREADS,
            )  # fmt: skip
        if status == 1:  # a miss: the native miss path (the ids are checked and in range)
            self._reaped_rows = 0
            return self._resolve_native(native, row_ids, device_out)
        if status != 0:
            return None
        self._tail = tail
        st = self._stats
        st["lookups"] += n
        st["hits"] += fresh
        self._pinned += fresh
        self._last_faults = 0
        return out

    def _count(self, lookups: int, slots_u: np.ndarray, n_miss: int) -> None:
        """Stats of a call, then pin and touch its unique slots (ascending row order)."""
        st = self._stats
        # not yet used in this batch: newly pinned (a faulted row's victim slot was unpinned)
        fresh = int(np.count_nonzero(self._last_used[slots_u] != self._batch))
        st["lookups"] += lookups
        st["misses"] += n_miss
        st["hits"] += fresh - n_miss
        self._pinned += fresh
        self._touch(slots_u)

    def _choose_victims(self, need: int, masked: bool = False) -> tuple[np.ndarray, int, int]:
        """The ``need`` least recently used unpinned slots, none reserved by a prefetch
        (the call's hits are pinned for the duration by the caller). Returns the
        victims, the new log head (the first live entry passed over, else just past
        the last victim: entries before it are stale once the victims are re-logged)
        and the position just past the last victim. Changes no state."""
        found: list[np.ndarray] = []
        got = 0
        pos = self._head
        window = 2 * need + 64
        last_taken = self._head - 1
        first_kept = -1
        while got < need:
            if pos >= self._tail:  # cannot happen: availability was checked
                raise AssertionError("LRU log exhausted before finding enough victims")
            stop = min(self._tail, pos + window)
            s = self._log[pos:stop]
            live = self._log_pos[s] == np.arange(pos, stop, dtype=np.int32)
            ok = live & (self._last_used[s] != self._batch)
            if masked or self._n_busy:  # slots reserved by prefetches (or by the caller)
                ok &= self._busy[s] == 0
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

    def _touch(self, slots_u: np.ndarray) -> None:
        """Pin the call's unique slots (last use = this batch) and move them to the
        tail of the LRU log."""
        self._last_used[slots_u] = self._batch
        self._log_slots(slots_u)

    def _log_slots(self, slots_u: np.ndarray) -> None:
        """Move distinct slots to the tail of the LRU log, in the given order."""
        k = slots_u.size
        if self._tail + k > self._log.size:
            self._compact()  # first: the slots' old entries are still live, and kept
        t = self._tail
        self._log[t : t + k] = slots_u
        self._log_pos[slots_u] = np.arange(t, t + k, dtype=np.int32)  # old entries now stale
        self._tail = t + k

    def _log_front(self, slots: np.ndarray) -> None:
        """Move distinct unpinned slots to the head of the LRU log (the next victims)."""
        k = slots.size
        if self._head < k:  # no room before the head: compact behind k free entries
            self._log_pos[slots] = -1  # their current entries become stale
            live = self._log[self._head : self._tail]
            keep = live[self._log_pos[live] == np.arange(self._head, self._tail, dtype=np.int32)]
            self._log[k : k + keep.size] = keep
            self._log_pos[keep] = np.arange(k, k + keep.size, dtype=np.int32)
            self._head, self._tail = k, k + keep.size
        h = self._head - k
        self._log[h : self._head] = slots
        self._log_pos[slots] = np.arange(h, self._head, dtype=np.int32)
        self._head = h

    def _compact(self) -> None:
        native = self._host_lib()
        if native is not None:
            self._tail = native.lru_compact(self._log, self._log_pos, self._head, self._tail,
                                            HOST_THREADS)  # fmt: skip
            self._head = 0
            return
        live = self._log[self._head : self._tail]
        keep = live[self._log_pos[live] == np.arange(self._head, self._tail, dtype=np.int32)]
        self._log[: keep.size] = keep
        self._log_pos[keep] = np.arange(keep.size, dtype=np.int32)
        self._head, self._tail = 0, keep.size
