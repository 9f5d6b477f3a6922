"""Deferred faults of ``NgramRowCache``: a resolve whose read outlives the call.

Owns the mixin :class:`DeferredFaults`: ``resolve_deferred`` (a planned fault's read
started on the reader's own thread, ``RowReader.read_batch_start``; on the GPU
its launch queued behind ``fault_wait``, which holds the cache's stream until the read
ends, and writes nothing unless it was clean: ``rowcache/kernels/scatter.cu``) and ``settle`` (the
read joined and the plan committed, as ``FaultPath._resolve_native`` commits after its
read; a failed read commits nothing and raises). Every locked call of the cache settles
first (``rowcache.cache.lru.SettlingLock``); ``poll`` and ``end_batch`` leave it pending.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import numpy as np

from rowcache.cache.state import CacheState
from rowcache.io.reader import RowReader
from rowcache.kernels.reference import scatter_records_reference

DEFERRED = np.empty(0, dtype=np.int32)
"""What a resolve whose read was deferred returns (its slots are known at the commit);
``NgramRowCache.resolve_deferred`` drops it."""
DEFERRED.flags.writeable = False


class DeferredFault(NamedTuple):
    """A native fault whose read runs on the reader's own thread while the caller goes on
    (``NgramRowCache.resolve_deferred``): the plan to commit once the read is joined
    (``DeferredFaults._finish_deferred``), the arrays the read holds, and its times."""

    ids: np.ndarray
    work: np.ndarray
    n_u: int
    n_miss: int
    n_ev: int
    head: int
    claim: Any
    held: tuple[np.ndarray, np.ndarray, np.ndarray]  # the read's rows, bounds, slots
    reader: RowReader
    times: tuple[float, float, float]  # plan start, read start, launched
    batch: int  # the batch of the call: its commit pins only while that batch lasts


class DeferredFaults(CacheState):
    """Deferred faults of :class:`rowcache.cache.row_cache.NgramRowCache` (a mixin over its
    arrays, reader, staging and fault launch: ``rowcache.cache.fault``,
    ``rowcache.cache.buffers``)."""

    store: Any
    table: Any
    scales: Any
    row_offsets: np.ndarray
    _reader: RowReader
    _part_array: np.ndarray
    _part_bases: np.ndarray
    _part_misses: np.ndarray
    _staging: np.ndarray
    _copy_done: Any
    _fault_phases: np.ndarray
    _defer: bool  # resolve_deferred's call: a fault's read may outlive the call
    _deferred: DeferredFault | None  # such a fault, not yet committed
    _ctl: Any  # pinned int32[2]: a deferred read's end, polled by the GPU (fault_wait)
    _apart_reader: RowReader | None  # where another cache reads apart on the shared reader
    _seq: int
    resolve_host: Any
    _staging_rows: Any
    _side_ints: Any
    _fault_launch: Any
    _pinned_host: Any
    _host_lib: Any
    _unclaim: Any
    _commit_plan: Any

    def resolve_deferred(self, row_ids: Any) -> int:
        """:meth:`resolve` for a caller that reads the arena only through
        :meth:`device_map`, in stream order on the cache's stream (``NgramEmbedding``'s
        device-map steps): on ``device="cuda"`` a call that must read rows returns while
        they are being read, instead of after. The read runs on the reader's own
        thread; the cache's stream holds until it ends, then one launch writes the rows
        and updates the device map, so the caller's launches queued after this call see
        them. The host's side of the call (pins, LRU order, maps, stats) is committed by
        the next call on the cache (:meth:`settle`, or any other but :meth:`poll` and
        :meth:`end_batch`, which leave it pending: the commit then pins nothing, its
        batch having ended), which first waits for the read; if the read failed, that
        call raises its ``CorruptDataError`` and the cache is exactly as before this
        call: the launch wrote nothing, so what the caller computed from these rows in
        the meantime is invalid and must be dropped.
        Returns :attr:`last_faults` (rows whose device-map entries the call changes).
        On ``device="cpu"`` the rows are written into the arena by that next call, so a
        caller reads them after it. Where the reader cannot read apart (the Python or
        kvikio engine), and for a call without reads, it is :meth:`resolve_host`,
        finished before it returns. Row ids and errors as :meth:`resolve`'s
        (out-of-range ids and exhaustion raise at this call)."""
        self._defer = True
        try:
            self.resolve_host(row_ids)
        finally:
            self._defer = False
        return self._last_faults

    def settle(self) -> None:
        """Commit a :meth:`resolve_deferred` call whose read may still run: wait for the
        read, then pin, log and map as :meth:`resolve` does; raises the read's error
        (the cache as before that call). Every other method does this first too."""
        with self._lock:
            pass

    def _start_deferred(
        self, ids: np.ndarray, work: np.ndarray, n_u: int, n_miss: int, n_ev: int, head: int,
        claim: Any, rows: np.ndarray, slots: np.ndarray, t0: float,
    ) -> bool:  # fmt: skip
        """Start a planned fault's read (``rows`` into ``slots``) on the reader's own
        thread; on the GPU, queue its launch behind ``fault_wait`` on the cache's stream:
        the stream holds until the read ends, and the launch writes the records and the
        device map's update only if the read was clean (on the CPU the records are
        written when the read is joined). The host maps, pins, log and stats change only
        when :meth:`_finish_deferred` joins the read (the next locked call). False where
        the reader cannot read apart (nothing started)."""
        reader = self._reader
        if reader.reading_apart:  # another cache's read apart on the store's reader
            if self._apart_reader is None:  # a sibling of its own (same files and checks)
                self._apart_reader = self.store.new_reader(**reader.options())
            reader = self._apart_reader
        m = rows.size
        gpu = self.device == "cuda"
        if gpu and self._copy_done is not None:
            self._copy_done.synchronize()  # the staging and side buffers' last launch ran
        staging = self._staging_rows(m)
        if gpu and self._ctl is None:
            self._ctl = self._pinned_host((2,), np.int32)
            self._ctl[:] = 0
        self._seq = self._seq % (1 << 30) + 1
        rows64 = rows.astype(np.int64)
        bounds = rows64.searchsorted(self.row_offsets)
        t1 = time.perf_counter()
        if not reader.read_batch_start(rows64, bounds, self._part_array, self._part_bases,
                                       staging[:m], self._ctl if gpu else None, self._seq):  # fmt: skip
            return False
        try:
            if gpu:  # (on the CPU the records are written at the join)
                e0 = 2 * m + n_ev
                side = self._side_ints(e0)
                side[:m] = slots
                side[m : 2 * m] = rows
                side[2 * m : e0] = work[4 * len(ids) : 4 * len(ids) + n_ev]
                self._fault_launch(m, n_ev, None, self._ctl.ctypes.data, self._seq)
        except BaseException:
            try:
                reader.read_batch_join()
            finally:
                if claim is not None:
                    self._unclaim(claim)
            raise
        held = (rows64, bounds, slots)
        times = (t0, t1, time.perf_counter())
        self._deferred = DeferredFault(ids, work, n_u, n_miss, n_ev, head, claim, held,
                                       reader, times, self._batch)  # fmt: skip
        self._last_faults = n_miss + self._reaped_rows + (0 if claim is None else claim.rows.size)
        return True

    def _finish_deferred(self) -> None:
        """Join a deferred fault's read and commit its plan (maps, pins, log, stats, the
        rows it claimed from prefetches), as :meth:`_resolve_native` commits after its
        read; a failed read commits nothing (its launch wrote nothing) and raises."""
        d = self._deferred
        assert d is not None  # called only with a deferred fault pending
        self._deferred = None
        t0, t1, t2 = d.times
        t3 = time.perf_counter()
        try:
            n_rows, nbytes, ops = d.reader.read_batch_join()
        except BaseException:
            if d.claim is not None:
                self._unclaim(d.claim)
            self._last_faults = 0
            raise
        t4 = time.perf_counter()
        st = self._stats
        st["rows_read"] += n_rows
        st["bytes_read"] += nbytes
        st["read_ops"] += ops
        if self.device == "cpu":  # (the GPU's launch has written them, in stream order)
            m = d.held[0].size
            scatter_records_reference(self._staging[:m], d.held[2], self.table, self.scales)
        self._commit_plan(self._host_lib(), d.ids, d.work, d.n_u, d.n_miss, d.n_ev, d.head,
                          d.claim, np.empty(d.ids.size, dtype=np.int32), d.batch)  # fmt: skip
        t5 = time.perf_counter()
        st["fault_seconds"] += (t2 - t0) + (t5 - t3)  # the host's: plan, launch, join, commit
        self._fault_phases += (t1 - t0, t4 - t3, t5 - t4, t2 - t1)
