"""``NgramRowCache``: a bounded arena of row slots over one store table (or several).

Owns the facade: validation at the boundary, one lock, and the public calls in a visible
order over the cache's pieces, each the only writer of its state: the slot table
(``rowcache.cache.slots``), the LRU (``rowcache.cache.lru``), the arena and device map
(``rowcache.cache.arena``), the reads of the parts (``rowcache.cache.parts``), the faulter
(``rowcache.cache.faulter``), the prefetcher (``rowcache.cache.prefetcher``) and the counters
(``rowcache.cache.stats``). Rows are gathered from ``cache.table`` by the same kernels that
gather from a resident table. docs/cache.md has the picture, the rules and a glossary.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rowcache.cache.arena import Arena
from rowcache.cache.config import CacheLayout, Tuning
from rowcache.cache.deferred import DeferredResolve, refuse_pending
from rowcache.cache.faulter import Faulter
from rowcache.cache.lru import HIT, MISS, Lru, sorted_unique
from rowcache.cache.parts import PartReader
from rowcache.cache.prefetch import PrefetchHandle
from rowcache.cache.prefetcher import Prefetcher
from rowcache.cache.row_map import make_row_map
from rowcache.cache.slots import SlotTable
from rowcache.cache.stats import CacheStats, Counters
from rowcache.cache.view import CacheView
from rowcache.errors import ConfigError
from rowcache.format.layout import TableInfo
from rowcache.format.rows import check_row_ids
from rowcache.kernels import extensions
from rowcache.kernels.host import native as _native
from rowcache.kernels.loader import require_cupy
from rowcache.store.handle import RowStore

__all__ = ["CacheStats", "NgramRowCache", "Tuning"]


class NgramRowCache:
    """A row-slot arena with LRU eviction and per-step pinning over one table (or several).

    Parameters
    ----------
    store : RowStore
    table : name or index of a table in ``store``; or a list of them (same width)
        that share one arena and one LRU. Rows of a shared cache are addressed by
        global ids ``row_offsets[k] + row_id`` for the ``k``-th listed table
        (``global_ids(k, row_ids)``), so one ``resolve`` serves all of them.
    slots : number of row slots in the arena (1 .. rows of the listed tables).
    device : ``"cpu"`` (NumPy arena) or ``"cuda"`` (cupy arena).
    policy : ``"lru"`` (the only policy; others are compared offline in ``rowcache.tools``).
    reader : ``"posix"`` (the store's reader, or a sibling with other options),
        ``"kvikio"`` (``CuFile.pread`` into the pinned staging buffer; GPU machines), or
        ``"auto"``: kvikio only where GPUDirect Storage is available, POSIX otherwise.
    arena : with ``device="cuda"``, ``"device"`` (HBM) or ``"host"`` (pinned host
        memory mapped into the device: the unified-memory layout).
    queue_depth : reads in flight on a fault.
    direct : read with ``O_DIRECT`` (POSIX reader).

    Attributes
    ----------
    table : bfloat16[slots, dim] or uint8[slots, dim] (FP8 codes), or uint8[slots, dim +
        dim / block] (whole records of a block-scaled ``fp8_block_e8m0`` store); numpy or cupy.
    scales : float32[slots] for ``fp8`` stores, else None.

    Thread safety: every method takes the cache's lock, so calls from several threads
    never corrupt the maps, pins or stats, and every slot returned to any caller holds its
    row until :meth:`end_step`. A step is shared: one owner decides when it ends (after
    every gather that uses its slots has been issued): ``rowcache.cache.StepRows`` for the
    tables a step reads.

    Streams (``device="cuda"``): the cache writes the arena on the CUDA stream current
    when it was built. Gathers wait for :meth:`ready_event` (None where that stream is
    their own); :meth:`end_step` takes the event after the step's gathers, which the
    cache's later writes wait for. Prefetches write on a stream of their own that waits
    for the cache's stream as it was at the last :meth:`end_step`; the cache's stream
    waits for those writes before the rows are used (:meth:`ready_event`, or the
    :meth:`resolve` that needs them).

    Resources: :meth:`close` (or a ``with`` block, or garbage collection) stops the
    prefetch thread and closes the readers the cache made.

    Names of the previous release: ``resolve_host`` and ``end_batch`` are aliases for one
    release; ``resolve_deferred``, ``settle``, ``poll`` and the inspection members
    (``slot_table``, ``lru``, ``slot_map``, ``pin_counts``, ``check``, ...) raise a
    ``TypeError`` (also an ``AttributeError``) that names the call replacing them.
    """

    def __init__(
        self,
        store: RowStore,
        table: str | int | Sequence[str | int],
        *,
        slots: int,
        device: str = "cpu",
        policy: str = "lru",
        reader: str = "auto",
        arena: str = "device",
        queue_depth: int | None = None,
        direct: bool | None = None,
    ) -> None:
        self._build(
            store, table, slots, device, policy, reader, arena, queue_depth, direct, Tuning(), None
        )

    @classmethod
    def assemble(
        cls,
        store: RowStore,
        table: str | int | Sequence[str | int],
        *,
        slots: int,
        tuning: Tuning | None = None,
        part_reader: Callable[[PartReader], PartReader] | None = None,
        device: str = "cpu",
        reader: str = "auto",
        arena: str = "device",
        queue_depth: int | None = None,
        direct: bool | None = None,
    ) -> NgramRowCache:
        """A cache whose pieces take ``tuning``, reading through ``part_reader(reads)``
        (e.g. a :class:`PartReader` that delays or fails) where given: for tests and
        benchmarks. Other arguments as the constructor's."""
        cache = cls.__new__(cls)
        cache._build(
            store,
            table,
            slots,
            device,
            "lru",
            reader,
            arena,
            queue_depth,
            direct,
            tuning or Tuning(),
            part_reader,
        )
        return cache

    def _build(
        self,
        store: Any,
        table: Any,
        slots: Any,
        device: str,
        policy: str,
        reader: str,
        arena: str,
        queue_depth: int | None,
        direct: bool | None,
        tuning: Tuning,
        part_reader: Callable[[PartReader], PartReader] | None,
    ) -> None:
        lay = CacheLayout.of(store, table, slots, device, policy, reader, arena)
        self.store, self.part_tables, self.parts = store, lay.part_tables, lay.parts
        self.row_offsets, self.rows, self.name = lay.row_offsets, lay.rows, lay.name
        self.dim, self.record_bytes, self.dtype = lay.dim, lay.record_bytes, lay.dtype
        self.num_slots, self.device, self.policy = lay.num_slots, device, policy
        self.arena_kind = lay.arena_kind
        xp: Any = require_cupy("NgramRowCache(device='cuda')") if device == "cuda" else np
        demand, self.reader_kind = PartReader.demand_reader(
            store, device, reader, queue_depth, direct
        )
        reads = PartReader(store, self.part_tables, self.row_offsets, demand)
        reads = part_reader(reads) if part_reader is not None else reads
        self._lock = threading.RLock()
        self._counters = Counters(len(self.parts))
        native = _native if tuning.native else None
        if tuning.native and _native is None:
            extensions.fallback("rowcache.kernels._host")
        row_map = make_row_map(
            self.rows, self.num_slots, self.record_bytes, _native, tuning.row_map
        )
        self._slots = SlotTable(self.rows, self.num_slots, row_map)
        self._lru = Lru(
            self._slots,
            self._counters,
            native,
            self.row_offsets,
            defer_min=tuning.defer_min,
            log_slack=tuning.log_slack,
        )
        self._arena = Arena(
            self.num_slots,
            self.dim,
            self.record_bytes,
            self.dtype,
            device,
            self.arena_kind,
            xp,
            self.parts[0].params,
        )
        self._reads = reads
        self._prefetcher = Prefetcher(
            self._slots,
            self._lru,
            self._arena,
            reads,
            self._counters,
            self.name,
            piece_rows=tuning.piece_rows,
            merge=tuning.merge_in_flight,
        )
        self._faulter = Faulter(
            self._slots, self._lru, self._arena, reads, self._counters, self._prefetcher, self.name
        )
        self.table, self.scales = self._arena.table, self._arena.scales
        # (the view holds the pieces, not the cache: no cycle keeps a dropped cache alive)
        self._view = CacheView(
            self.name,
            self._lock,
            self._slots,
            self._lru,
            self._prefetcher,
            self._counters,
            self._faulter,
        )
        # a dropped cache releases its readers' descriptors (the finalizer holds no self)
        self._finalizer = weakref.finalize(self, _release, self._prefetcher, reads)

    # -- the order of every call -----------------------------------------------
    def _settle_books(self) -> None:
        """Before a call that reads or changes the books: refuse a deferred resolve not yet
        waited for (never committed implicitly), finish the deferred touches."""
        if self._faulter.pending is not None:
            refuse_pending(self.name, True)
        if self._lru.touching:
            self._lru.finish_touches()

    def _native_ids(self, row_ids: Any, prefetch_idle: bool | None = None) -> bool:
        """``row_ids`` may take the native hit path: a contiguous int64 NumPy vector, the
        native module built, no prefetch to settle (``prefetch_idle``, default: the
        prefetcher's)."""
        return (
            self._lru.native is not None
            and type(row_ids) is np.ndarray
            and row_ids.dtype == np.int64
            and row_ids.ndim == 1
            and row_ids.flags.c_contiguous
            and (self._prefetcher.idle if prefetch_idle is None else prefetch_idle)
        )

    def _resolve(self, row_ids: Any, device_out: bool, defer: bool) -> Any:
        """The resolve under the lock (the caller holds it)."""
        native = self._native_ids(row_ids)
        if native and self._lru.touching and self._faulter.pending is None:
            found, out = self._lru.hits_queued(row_ids)  # behind the pending touch
            if found == HIT:
                self._faulter.hit()
                return out
            if found == MISS:  # (the touches are finished)
                self._prefetcher.start_call()
                return self._faulter.fault(row_ids, device_out, defer)
        self._settle_books()
        if native and row_ids.size:
            found, out = self._lru.hits(row_ids)
            if found == HIT:
                self._faulter.hit()
                return out
            if found == MISS:  # (the ids are in range)
                self._prefetcher.start_call()
                return self._faulter.fault(row_ids, device_out, defer)
        ids = check_row_ids(row_ids, self.rows)
        self._prefetcher.start_call()
        return self._faulter.resolve(ids, device_out, defer)

    def _commit_deferred(self, ids: np.ndarray) -> np.ndarray:
        """A :class:`DeferredResolve`'s ``wait``: join the pending read, commit it; the
        slots of ``ids`` (still mapped: no call changes the books while it is pending)."""
        with self._lock:
            self._faulter.finish_pending()
            return self._slots.slots_of(ids).astype(np.int32, copy=False)

    # -- serving ---------------------------------------------------------------
    def resolve(self, row_ids: Any, *, host: bool = False, defer: bool = False) -> Any:
        """Slots holding ``row_ids``, faulting missing rows in; pins them until :meth:`end_step`.

        Parameters
        ----------
        row_ids : int[n] (numpy, or cupy: copied to the host), any order, duplicates ok.
        host : on ``device="cuda"``, leave the slots on the host (int32 numpy) for a caller
            that packs them into its own upload; the faulted rows are written on the cache's
            stream, so gathers of these slots must wait for :meth:`ready_event`.
        defer : return at once with a :class:`DeferredResolve` handle while the rows are
            read on a reader's own thread; on ``device="cuda"`` the cache's stream holds
            until the read ends, then one launch writes the rows and the device map, so a
            caller that gathers through :meth:`device_map` in stream order after
            :meth:`ready_event` reads them. The host's side (pins, LRU order, maps, stats)
            is committed by the handle's ``wait()``, never by a later call: until then every
            call but :meth:`end_step`, :meth:`ready_event`, :meth:`stats` and the prefetch
            pause raises ``PendingResolveError``. A call without reads (or a reader that
            cannot read apart: the Python and kvikio engines) returns a handle already
            committed.

        Returns
        -------
        int32[n] slots in input order (numpy on the CPU or with ``host``, else cupy), or a
        :class:`DeferredResolve` with ``defer``.

        Raises
        ------
        RowRangeError : an id outside the table (nothing changes).
        ArenaExhaustedError : the step needs more slots than are free or unpinned
            (nothing changes: maps, pins and stats are as before the call).
        CorruptDataError : a read failed (nothing is mapped; the cache stays usable); with
            ``defer``, raised by the handle's ``wait()``.
        PendingResolveError : a deferred resolve's handle was not waited for.
        """
        if defer:
            with self._lock:
                out = self._resolve(row_ids, False, True)
                faults = self._faulter.last_faults
                if self._faulter.pending is None:
                    return DeferredResolve.finished(out, faults)
                ids = np.array(check_row_ids(row_ids, self.rows), copy=True)  # (host ids)
                return DeferredResolve(faults, commit=lambda: self._commit_deferred(ids))
        cuda = self.device == "cuda" and not host
        with self._lock:
            out = self._resolve(row_ids, cuda, False)
        return self._arena.to_device(out) if cuda and type(out) is np.ndarray else out

    def holds_all(self, row_ids: Any) -> bool:
        """True when a :meth:`resolve` of ``row_ids`` would neither fault, wait nor commit
        a prefetch (its ``last_faults`` would be 0): every row is resident and shown in
        the device map, none belongs to a prefetch not yet committed. Changes nothing (no
        touch, pin, count or commit). Raises as :meth:`resolve` does for ids outside the
        table, and ``PendingResolveError``."""
        with self._lock:
            if self._faulter.pending is not None:
                refuse_pending(self.name, True)
            # (a deferred touch goes on: the scan reads the row map, which no touch writes)
            if self._native_ids(row_ids, prefetch_idle=not self._slots.reserved):
                held = self._lru.all_resident(row_ids)
                if held is not None:  # (None: a bad id, raised below)
                    return held
            return self._slots.holds(check_row_ids(row_ids, self.rows))

    @property
    def last_faults(self) -> int:
        """Rows the latest :meth:`resolve` faulted in, or whose prefetch it waited for or
        completed, i.e. rows whose :meth:`device_map` entry that call changed (0: every row
        was resident and mapped before the call)."""
        return self._faulter.last_faults

    def end_step(self, after: Any = None) -> None:
        """End the step: unpin every slot pinned since the last :meth:`end_step`; the next
        step begins. ``after`` (GPU): a CUDA event recorded after the step's last gather
        (on the caller's stream); the cache's later writes wait for it, so a fault of the
        next step never overwrites a row still being read (``StepRows.end_step`` passes
        it). A deferred touch goes on, and a deferred resolve not yet waited for stays
        pending (its commit then pins nothing, its step having ended)."""
        with self._lock:
            if after is not None and self._arena.gpu:
                self._arena.stream.wait_event(after)
            if self._prefetcher.jobs and self._faulter.pending is None:
                self._lru.finish_touches()  # (a deferred fault may claim landed pieces'
                self._prefetcher.reap()  # rows: they are reaped after its commit)
            self._lru.end_step()
            self._prefetcher.end_step()
            self._counters.count_batch()

    def ready_event(self, *, landed: bool = True) -> Any:
        """GPU: an event recorded on the stream the cache writes the arena on, after every
        write so far; gathers that wait for it read every row a resolve returned. With
        ``landed`` the prefetches whose reads have finished are committed first (their rows
        appear in :meth:`device_map`: what a caller that gathers through the map needs; a
        caller that gathers by the slots a resolve returned does not, and skips their
        commit and its stream waits). None on the CPU (every write is done when its call
        returns) and where that stream is the caller's current stream (stream order
        suffices)."""
        with self._lock:
            if landed and self._prefetcher.jobs and self._faulter.pending is None:
                self._lru.finish_touches()
                self._prefetcher.reap()
            if not self._arena.gpu:
                return None
            stream = self._arena.stream
            if stream.ptr == self._arena.xp.cuda.get_current_stream().ptr:
                return None
            return self._arena.stream_event()

    def prefetch(self, row_ids: Any) -> PrefetchHandle:
        """Start reading the rows of a coming step; never blocks on I/O.

        ``row_ids`` as :meth:`resolve`'s. At this call the rows are touched most recently
        used and left unpinned; missing rows take the least recently used unpinned slots
        (never one the current step holds), and rows beyond the free or unpinned slots
        are dropped (``handle.dropped``): a prefetch never raises
        ``ArenaExhaustedError``. The prefetch thread reads them meanwhile in pieces, in
        call order; a resolve waits for the pieces it needs at least half of
        (``WAIT_SHARE``), reads its other rows in flight itself, and waits for other
        pieces only when it needs their slots as victims or to avoid exhaustion (or its
        own read of their rows failed), so the LRU order, the exhaustion rule and every
        fault count are those of a prefetch that completed at its call. A failed read
        maps nothing; the :meth:`resolve` that next needs one of its rows raises that
        error once. docs/cache.md ("Prefetch") has the whole contract.
        """
        ids = check_row_ids(row_ids, self.rows)
        with self._lock:
            self._settle_books()
            self._prefetcher.reap()
            if ids.size == 0:
                return PrefetchHandle([], 0, 0)
            return self._prefetcher.prefetch(sorted_unique(ids))

    def pause_prefetch(self) -> None:
        """No prefetch piece starts reading on the prefetch thread until
        :meth:`resume_prefetch`; returns once the pieces being read have finished (e.g. a
        server's turn of another model). Nothing blocks on the pause: a call of this cache
        that must wait for pieces not started (a resolve needing their slots, a prefetch,
        :meth:`close`) reads them on its own thread; a handle's ``wait()`` waits for the
        resume (give it a ``timeout`` where nothing else resumes); the process exits."""
        self._prefetcher.pause()

    def resume_prefetch(self) -> None:
        """Undo :meth:`pause_prefetch`."""
        self._prefetcher.resume()

    def device_map(self) -> Any:
        """The row -> slot map on the GPU: cupy int32[rows] (-1: not resident).

        Made on first call (``rows`` x 4 bytes of device memory) and from then on
        updated by every fault, on the cache's stream after the fault's arena writes. A
        slot read this way is only safe while the row is pinned, so a caller that gathers
        through the map first must still :meth:`resolve` the rows and redo its gathers if
        that call faulted (:attr:`last_faults`), as ``rowcache.embed.NgramEmbedding`` does.
        """
        if self.device != "cuda":
            raise ConfigError("device_map() needs a cache with device='cuda'")
        with self._lock:
            self._settle_books()
            return self._arena.device_map(self._slots)

    def global_ids(self, part: int, row_ids: Any) -> np.ndarray:
        """Global row ids (``row_offsets[part] + row_ids``) of the ``part``-th listed table."""
        if (
            isinstance(part, (bool, np.bool_))
            or not isinstance(part, (int, np.integer))
            or not 0 <= part < len(self.parts)
        ):
            raise ConfigError(
                f"part={part!r}: give an int index of a listed table, 0..{len(self.parts) - 1}"
            )
        ids = check_row_ids(row_ids, self.parts[int(part)].rows)
        return ids + int(self.row_offsets[int(part)])

    def stats(self, reset: bool = False) -> CacheStats:
        """A snapshot of the counters (a deferred resolve not yet waited for is counted at
        its ``wait()``); ``reset=True`` starts fresh counts."""
        with self._lock:
            if self._lru.touching:
                self._lru.finish_touches()
            if self._prefetcher.jobs and self._faulter.pending is None:
                self._prefetcher.reap()
            snap = self._counters.snapshot()
            if reset:
                self._counters.reset()
            return snap

    def inspect(self) -> CacheView:
        """A read-only view of the books (slot table, LRU, maps, pins, checks, prefetch
        pieces, per-part misses, fault phases, bookkeeping bytes): for checks, tests,
        benchmarks and timelines."""
        return self._view

    def close(self) -> None:
        """Stop the prefetch thread and close the cache's own readers' descriptors (the
        store's stay open); a deferred resolve not yet waited for is joined first and
        dropped. Idempotent; also on garbage collection and at the end of a ``with``
        block. The cache must not be used afterwards."""
        with self._lock:
            if self._faulter.pending is not None:
                try:
                    self._faulter.finish_pending()
                except Exception:  # (its read failed: nothing was committed)
                    pass
            self._finalizer()

    def __enter__(self) -> NgramRowCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- state -----------------------------------------------------------------
    @property
    def stream(self) -> Any:
        """The CUDA stream the cache writes the arena on (``device="cuda"``), else None."""
        return self._arena.stream

    @property
    def info(self) -> TableInfo:
        """The table of a single-table cache (a shared cache has ``parts``)."""
        if len(self.parts) != 1:
            raise ConfigError(
                f"this cache shares its arena among {len(self.parts)} tables ({self.name!r}); "
                "use cache.parts[k] and cache.row_offsets"
            )
        return self.parts[0]

    @property
    def resident(self) -> int:
        """Number of slots holding a row."""
        return self._slots.resident

    @property
    def row_map_kind(self) -> str:
        """``"dense"`` or ``"hash"``: how this cache maps rows to slots on the host
        (``rowcache.cache.row_map``)."""
        return self._slots.row_map.kind

    # -- names of the previous release: aliases for one release ----------------
    def resolve_host(self, row_ids: Any) -> np.ndarray:
        """Deprecated alias of ``resolve(row_ids, host=True)``, kept for one release."""
        out: np.ndarray = self.resolve(row_ids, host=True)
        return out

    def end_batch(self) -> None:
        """Deprecated alias of :meth:`end_step` (no ``after``), kept for one release."""
        self.end_step()

    def __getattr__(self, name: str) -> Any:
        moved = _MOVED.get(name)
        if moved is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        raise MovedError(f"NgramRowCache.{name} was removed: {moved}")

    def __repr__(self) -> str:
        return (
            f"NgramRowCache(table={self.name!r}, slots={self.num_slots}, device={self.device!r}, "
            f"arena={self.arena_kind!r}, reader={self.reader_kind!r}, resident={self.resident})"
        )


def _release(prefetcher: Prefetcher, reads: PartReader) -> None:
    """What a closed or collected cache lets go: the prefetch thread and the readers it made."""
    prefetcher.close()
    reads.close()


class MovedError(AttributeError, TypeError):
    """A member of ``NgramRowCache`` that this release removed; the message names the call
    that replaces it (an ``AttributeError`` too, so ``hasattr`` answers False)."""


_MOVED = {
    "resolve_deferred": "call resolve(row_ids, defer=True), which returns a DeferredResolve "
    "handle committed by its wait() (never by a later call)",
    "settle": "call the DeferredResolve handle's wait() (StepRows.settle() for a step)",
    "poll": "call ready_event(), which also commits the finished prefetches",
    "pending": "read cache.inspect().pending",
    "slot_table": "read cache.inspect().slot_table",
    "lru": "read cache.inspect().lru",
    "slot_map": "call cache.inspect().slot_map()",
    "pin_counts": "call cache.inspect().pin_counts()",
    "check": "call cache.inspect().check()",
    "is_resident": "call cache.inspect().is_resident(ids)",
    "prefetch_pieces": "call cache.inspect().prefetch_pieces()",
    "part_misses": "call cache.inspect().part_misses()",
    "fault_phases": "read cache.inspect().fault_phases",
    "rows_taken": "read cache.inspect().rows_taken",
    "pinned": "read cache.inspect().pinned",
    "overhead_bytes": "call cache.inspect().overhead_bytes()",
}
