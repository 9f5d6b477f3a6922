"""Lookahead for the row cache: faults of a coming step started without blocking.

Owns the in-flight side of ``NgramRowCache.prefetch``: the job (a piece) that reads a
prefetch's rows in a background thread into its own staging buffer and writes
them into their (reserved) arena slots, and the handle a caller waits on. The
cache's bookkeeping (which slots a job reserved, the LRU log, the maps) is the
prefetcher's (``rowcache.cache.prefetcher``), under the cache's lock; a job touches only its
own slots' arena rows and its own buffers, so it never needs that lock.

Semantics (also in ``NgramRowCache.prefetch``): at the call, the rows are logged
most recently used and unpinned, their victims evicted and their slots reserved;
the read runs meanwhile, in pieces (``rowcache.cache.prefetcher.PIECE_ROWS``); a
``resolve`` that needs at least half of a piece's rows waits for the piece
(``rowcache.cache.prefetcher.WAIT_SHARE``); one that needs a few rows of a piece not
started, or of a piece being read, reads those rows itself (into the slots the piece
reserved, in the same read as its own faults), and one that would pass over a
reserved slot while choosing victims, or finds too few free slots without them, waits
for the pieces in flight, so LRU order, exhaustion and fault counts are exactly as
if the prefetch had completed at its call. A failed read maps nothing; the
``resolve`` that next needs one of its rows raises the read's error.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from rowcache.cache.arena import Arena
    from rowcache.cache.parts import PartReader


class PrefetchHandle:
    """A started prefetch (see ``NgramRowCache.prefetch``).

    Attributes
    ----------
    rows : int
        Rows this prefetch reads (those not already resident or in flight).
    dropped : int
        Missing rows left out because no unpinned slot was free for them (the
        prefetch never takes a slot the current batch holds).
    """

    def __init__(self, jobs: list[PrefetchJob], rows: int, dropped: int) -> None:
        self._jobs = jobs
        self.rows = rows
        self.dropped = dropped

    @classmethod
    def merge(cls, handles: list[PrefetchHandle]) -> PrefetchHandle:
        """One handle over several (a step's prefetches, one per cache)."""
        jobs = [j for h in handles for j in h._jobs]
        return cls(jobs, sum(h.rows for h in handles), sum(h.dropped for h in handles))

    def pieces(self, taken: bool = True) -> list[PrefetchJob]:
        """The pieces of this prefetch (their ``rows``, ``started``, ``times``: read them)
        and, with ``taken``, the jobs of resolves that took rows over from them."""
        return [k for j in self._jobs for k in ((j, *j.taken) if taken else (j,))]

    def done(self) -> bool:
        """True once every read of this prefetch has finished (or failed)."""
        return all(j.event.is_set() for j in self.pieces())

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the reads have finished; False if ``timeout`` (s) passed first.

        Never raises the reads' errors: those are raised by the ``resolve`` that
        needs a failed row (see :meth:`exception`)."""
        end = None if timeout is None else time.monotonic() + timeout
        for j in self.pieces():
            left = None if end is None else max(0.0, end - time.monotonic())
            if not j.event.wait(left):
                return False
        return True

    def exception(self) -> BaseException | None:
        """The first read error of this prefetch once done, else None."""
        for j in self.pieces():
            if j.event.is_set() and j.error is not None:
                return j.error
        return None

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"PrefetchHandle(rows={self.rows}, dropped={self.dropped}, {state})"


class PrefetchJob:
    """One piece of a prefetch's reads: ``rows`` (global ids, ascending) into ``slots``.

    ``run`` executes in the cache's prefetch thread; ``event`` is set when it has
    finished, with ``error`` set on failure and ``read`` holding ``(rows, bytes,
    ops)`` read. On the GPU, the arena writes are enqueued on the cache's stream
    before ``event`` is set, so work issued on that stream after a wait sees them.
    ``started``: the prefetch thread has taken it from the queue. Until then a resolve
    that needs some of its rows takes them over (``rowcache.cache.prefetcher``): they leave
    ``rows`` and ``slots`` for a job of their own, run at once and listed in ``taken``.
    On the GPU, ``after`` is the event of the cache's stream that the job's arena writes
    wait for (recorded at the last ``end_step``: every gather of an earlier batch, which
    may read the victims, was issued before it), and ``landed`` the event of the
    prefetch stream after them, which the cache's stream waits for when the job is reaped.
    ``times``: ``time.perf_counter()`` at its creation, start, end of its read and end (a
    timeline for benchmarks; 0 until reached).
    """

    def __init__(self, rows: np.ndarray, slots: np.ndarray, after: Any = None) -> None:
        self.rows = rows
        self.slots = slots
        self.after = after
        self.landed: Any = None
        self.event = threading.Event()
        self.error: BaseException | None = None
        self.read = (0, 0, 0)
        self.times = [time.perf_counter(), 0.0, 0.0, 0.0]
        self.started = False
        self.taken: list[PrefetchJob] = []

    def start(self) -> None:
        """The prefetch thread takes the job from the queue (under the prefetcher's queue
        lock): from now on its rows are read by it, and none is taken over."""
        self.started = True

    def give_up(self, mask: np.ndarray, taker: PrefetchJob | None = None) -> bool:
        """The rows under ``mask`` (over :attr:`rows`) leave this job not yet started: a
        resolve reads them (``taker``: the job it reads them in, which this job's handle
        then waits for too). Returns True when no row is left: the job is done (its event
        set), and leaves the queue."""
        if taker is not None:
            self.taken.append(taker)
        keep = ~mask
        self.rows, self.slots = self.rows[keep], self.slots[keep]
        if self.rows.size:
            return False
        self.event.set()
        return True

    def run(self, arena: Arena, parts: PartReader, buffers: PrefetchBuffers) -> None:
        """Read the job's rows and write them into its slots (``buffers``' staging);
        records an error instead of raising, and sets ``event`` at the end."""
        self.times[1] = time.perf_counter()
        try:
            self.read, self.times[2], self.landed = buffers.fill(arena, parts, self)
        except BaseException as e:
            self.error = e
        finally:
            self.times[3] = time.perf_counter()
            self.event.set()


class PrefetchBuffers:
    """A prefetch thread's (or a resolve's) own staging (host, pinned on the GPU) and reader.

    Used by one thread at a time (the cache's prefetch executor has one worker; a
    resolve holds the cache's lock), so a job never waits for the demand path's buffers.
    ``own_stream`` (GPU): the copies and arena writes go on a stream of their own, not
    the cache's, so they do not queue behind the work that the caller put on the cache's
    stream after the step's gathers (the rest of the model, a step ahead): they wait only
    for ``job.after``. Otherwise they go on the cache's stream (a resolve's take-over,
    whose rows the resolve's own gathers read next).
    """

    def __init__(self, reader: Any, own_stream: bool = False) -> None:
        self.reader = reader
        self.own_stream = own_stream
        self.stream: Any = None
        self.staging = np.empty((0, 0), dtype=np.uint8)
        self.dev_staging: Any = None
        self.copy_done: Any = None

    def fill(
        self, arena: Arena, parts: PartReader, job: PrefetchJob
    ) -> tuple[tuple[int, int, int], float, Any]:
        """Read the job's rows and write them into its arena slots; returns what the job
        records: its read's (rows, bytes, ops), when the read ended, and (GPU, own stream)
        the event after its arena writes (else None)."""
        rows, slots = job.rows, job.slots
        n = rows.size
        if arena.gpu:
            return self._fill_gpu(arena, parts, job, n)
        staging = self._host(arena, n)
        read = parts.read(rows, staging, self.reader)
        read_end = time.perf_counter()
        arena.scatter(staging[:n], slots)
        return read, read_end, None

    def _host(self, arena: Arena, n: int, pinned: bool = False) -> np.ndarray:
        rec = arena.record_bytes
        if self.staging.shape[0] < n or self.staging.shape[1] != rec:
            cap = max(n, 2 * self.staging.shape[0], 256)
            if pinned:
                import cupyx

                self.staging = cupyx.empty_pinned((cap, rec), dtype=np.uint8)
                self.dev_staging = arena.xp.empty((cap, rec), dtype=np.uint8)
            else:
                self.staging = np.empty((cap, rec), dtype=np.uint8)
        return self.staging

    def _fill_gpu(
        self, arena: Arena, parts: PartReader, job: PrefetchJob, n: int
    ) -> tuple[tuple[int, int, int], float, Any]:
        cp = arena.xp
        import rowcache.kernels.scatter

        with cp.cuda.Device(arena.device_id):
            if self.copy_done is not None:
                self.copy_done.synchronize()  # the staging buffer's last copy has left it
            staging = self._host(arena, n, pinned=True)
            read = parts.read(job.rows, staging, self.reader)
            read_end = time.perf_counter()
            if self.own_stream and self.stream is None:
                self.stream = cp.cuda.Stream(non_blocking=True)
            stream = self.stream if self.own_stream else arena.stream
            dev = self.dev_staging[:n]
            with stream:
                dev.set(staging[:n], stream=stream)
                self.copy_done = stream.record()
                slots = cp.asarray(job.slots)
                if self.own_stream and job.after is not None:
                    stream.wait_event(job.after)  # earlier batches' gathers of the victims
                rowcache.kernels.scatter.scatter_records(dev, slots, arena.table, arena.scales)
                landed = stream.record() if self.own_stream else None
        return read, read_end, landed
