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
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rowcache.cache.arena import Arena
from rowcache.cache.config import CacheLayout, Tuning
from rowcache.cache.faulter import Faulter
from rowcache.cache.lru import HIT, MISS, Lru, sorted_unique
from rowcache.cache.parts import PartReader
from rowcache.cache.prefetch import PrefetchHandle, PrefetchJob
from rowcache.cache.prefetcher import Prefetcher
from rowcache.cache.row_map import make_row_map
from rowcache.cache.slots import SlotTable
from rowcache.cache.stats import CacheStats, Counters
from rowcache.errors import ConfigError
from rowcache.kernels.host import native as _native
from rowcache.kernels.loader import require_cupy
from rowcache.store.format import TableInfo
from rowcache.store.handle import RowStore, check_row_ids

__all__ = ["CacheStats", "NgramRowCache", "Tuning"]


class NgramRowCache:
    """A row-slot arena with LRU eviction and per-batch pinning over one table.

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
    table : bfloat16[slots, dim] or uint8[slots, dim] (FP8 codes); numpy or cupy.
    scales : float32[slots] for FP8 stores, else None.

    Thread safety: every method takes the cache's lock, so calls from several threads
    never corrupt the maps, pins or stats, and every slot returned to any caller holds its
    row until ``end_batch``. A batch is shared: one owner decides when it ends (after
    every gather that uses its slots has been issued).

    Streams (``device="cuda"``): the cache writes the arena on the CUDA stream current
    when it was built; gathers on that stream are ordered after the faults, work on other
    streams must wait on it. Prefetches write on a stream of their own that waits for the
    cache's stream as it was at the last ``end_batch``; the cache's stream waits for
    those writes before the rows are used (``poll``, or the ``resolve`` that needs them).
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
        self._build(store, table, slots, device, policy, reader, arena, queue_depth, direct,
                    Tuning(), None)  # fmt: skip

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
        cache._build(store, table, slots, device, "lru", reader, arena, queue_depth, direct,
                     tuning or Tuning(), part_reader)  # fmt: skip
        return cache

    def _build(
        self, store: Any, table: Any, slots: Any, device: str, policy: str, reader: str,
        arena: str, queue_depth: int | None, direct: bool | None, tuning: Tuning,
        part_reader: Callable[[PartReader], PartReader] | None,
    ) -> None:  # fmt: skip
        lay = CacheLayout.of(store, table, slots, device, policy, reader, arena)
        self.store, self.part_tables, self.parts = store, lay.part_tables, lay.parts
        self.row_offsets, self.rows, self.name = lay.row_offsets, lay.rows, lay.name
        self.dim, self.record_bytes, self.dtype = lay.dim, lay.record_bytes, lay.dtype
        self.num_slots, self.device, self.policy = lay.num_slots, device, policy
        self.arena_kind = lay.arena_kind
        xp: Any = require_cupy("NgramRowCache(device='cuda')") if device == "cuda" else np
        demand, self.reader_kind = PartReader.demand_reader(store, device, reader, queue_depth,
                                                           direct)  # fmt: skip
        reads = PartReader(store, self.part_tables, self.row_offsets, demand)
        reads = part_reader(reads) if part_reader is not None else reads
        self._lock = threading.RLock()
        self._counters = Counters(len(self.parts))
        native = _native if tuning.native else None
        row_map = make_row_map(self.rows, self.num_slots, self.record_bytes, _native,
                               tuning.row_map)  # fmt: skip
        self._slots = SlotTable(self.rows, self.num_slots, row_map)
        self._lru = Lru(self._slots, self._counters, native, self.row_offsets,
                        defer_min=tuning.defer_min, log_slack=tuning.log_slack)  # fmt: skip
        self._arena = Arena(self.num_slots, self.dim, self.record_bytes, self.dtype, device,
                            self.arena_kind, xp)  # fmt: skip
        self._reads = reads
        self._prefetcher = Prefetcher(self._slots, self._lru, self._arena, reads, self._counters,
                                      self.name, piece_rows=tuning.piece_rows,
                                      merge=tuning.merge_in_flight)  # fmt: skip
        self._faulter = Faulter(self._slots, self._lru, self._arena, reads, self._counters,
                                self._prefetcher, self.name)  # fmt: skip
        self.table, self.scales = self._arena.table, self._arena.scales

    # -- the order of every call -----------------------------------------------
    def _catch_up(self) -> None:
        """Before a call that reads the books: finish the pending deferred fault (join its
        read, commit; raises its read's error) and the deferred touches."""
        if self._faulter.pending is not None:
            self._faulter.finish_pending()
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
        with self._lock:
            native = self._native_ids(row_ids)
            if native and self._lru.touching and self._faulter.pending is None:
                found, out = self._lru.hits_queued(row_ids)  # behind the pending touch
                if found == HIT:
                    self._faulter.hit()
                    return out
                if found == MISS:  # (the touches are finished)
                    self._prefetcher.start_call()
                    return self._faulter.fault(row_ids, device_out, defer)
            self._catch_up()
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

    # -- the public API ----------------------------------------------------------
    def resolve(self, row_ids: Any) -> Any:
        """Slots holding ``row_ids``, faulting missing rows in; pins them until ``end_batch``.

        Parameters
        ----------
        row_ids : int[n] (numpy, or cupy: copied to the host), any order, duplicates ok.

        Returns
        -------
        int32[n] slots in input order: numpy for ``device="cpu"``, cupy for ``"cuda"``.

        Raises
        ------
        RowRangeError : an id outside the table (nothing changes).
        ArenaExhaustedError : the batch needs more slots than are free or unpinned
            (nothing changes: maps, pins and stats are as before the call).
        CorruptDataError : a read failed (nothing is mapped; the cache stays usable).
        """
        cuda = self.device == "cuda"
        out = self._resolve(row_ids, cuda, False)
        return self._arena.to_device(out) if cuda and type(out) is np.ndarray else out

    def resolve_host(self, row_ids: Any) -> np.ndarray:
        """:meth:`resolve`, with the slots left on the host: int32[n] (numpy), for callers
        that pack them into their own upload. On ``device="cuda"`` the faulted rows are
        written on the cache's stream, so gathers of these slots must be issued on that
        stream (or wait on it). Pinned until :meth:`end_batch`."""
        out: np.ndarray = self._resolve(row_ids, False, False)
        return out

    def resolve_deferred(self, row_ids: Any) -> int:
        """:meth:`resolve` for a caller that reads the arena only through
        :meth:`device_map`, in stream order on the cache's stream: on ``device="cuda"`` a
        call that must read rows returns while they are being read. The read runs on a
        reader's own thread; the cache's stream holds until it ends, then one launch
        writes the rows and updates the device map. The host's side (pins, LRU order,
        maps, stats) is committed by the next call on the cache (:meth:`settle`, or any
        other but :meth:`poll` and :meth:`end_batch`, which leave it pending: the commit
        then pins nothing, its batch having ended), which first waits for the read; if the
        read failed, that call raises its ``CorruptDataError`` and the cache is exactly as
        before this call (the launch wrote nothing: what the caller computed from these
        rows is invalid). Returns :attr:`last_faults`. On ``device="cpu"`` the rows are
        written by that next call. Where the reader cannot read apart (the Python or kvikio
        engine), and for a call without reads, it is :meth:`resolve_host`. Ids and errors
        as :meth:`resolve`'s (out-of-range ids and exhaustion raise at this call)."""
        with self._lock:
            self._resolve(row_ids, False, True)
            return self._faulter.last_faults

    def settle(self) -> None:
        """Commit a :meth:`resolve_deferred` call whose read may still run: wait for the
        read, then pin, log and map as :meth:`resolve` does; raises the read's error
        (the cache as before that call). Every other method does this first too, but
        :meth:`poll` and :meth:`end_batch`."""
        with self._lock:
            self._catch_up()

    @property
    def pending(self) -> bool:
        """A :meth:`resolve_deferred` call is not yet settled."""
        return self._faulter.pending is not None

    def holds_all(self, row_ids: Any) -> bool:
        """True when a :meth:`resolve` of ``row_ids`` would neither fault, wait nor commit
        a prefetch (its ``last_faults`` would be 0): every row is resident and shown in
        the device map, none belongs to a prefetch not yet committed. Changes nothing (no
        touch, pin, count or commit); settles a pending deferred fault (may raise). Raises
        as :meth:`resolve` does for ids outside the table."""
        with self._lock:
            if self._faulter.pending is not None:
                self._faulter.finish_pending()
            if self._native_ids(row_ids, prefetch_idle=not self._slots.reserved):
                held = self._lru.all_resident(row_ids)  # (no touch changes a mapping)
                if held is not None:  # (None: a bad id, raised below)
                    return held
            return self._slots.holds(check_row_ids(row_ids, self.rows))

    @property
    def last_faults(self) -> int:
        """Rows the latest :meth:`resolve` / :meth:`resolve_host` faulted in, or whose
        prefetch it waited for or completed, i.e. rows whose :meth:`device_map` entry
        that call changed (0: every row was resident and mapped before the call)."""
        return self._faulter.last_faults

    def end_batch(self) -> None:
        """Unpin every slot pinned since the last ``end_batch``; the next batch begins. A
        deferred touch or fault goes on (it pins for its own batch, i.e. not at all now)."""
        with self._lock:
            if self._prefetcher.jobs and self._faulter.pending is None:
                self._lru.finish_touches()  # (a deferred fault may claim landed pieces'
                self._prefetcher.reap()  # rows: they are reaped after its commit)
            self._lru.end_batch()
            self._prefetcher.end_batch()
            self._counters.count_batch()

    def prefetch(self, row_ids: Any) -> PrefetchHandle:
        """Start reading the rows of a coming step; never blocks on I/O.

        ``row_ids`` as :meth:`resolve`'s. At this call the rows are touched most recently
        used and left unpinned; missing rows take the least recently used unpinned slots
        (never one the current batch holds), and rows beyond the free or unpinned slots
        are dropped (``handle.dropped``): a prefetch never raises
        ``ArenaExhaustedError``. The prefetch thread reads them meanwhile in pieces, in
        call order; a resolve that needs rows in flight reads them itself, and waits for
        pieces only when it needs their slots as victims or to avoid exhaustion (or its
        own read of their rows failed), so the LRU order, the exhaustion rule and every
        fault count are those of a prefetch that completed at its call. A failed read
        maps nothing; the :meth:`resolve` that next needs one of its rows raises that
        error once. docs/cache.md ("Prefetch") has the whole contract.
        """
        ids = check_row_ids(row_ids, self.rows)
        with self._lock:
            self._catch_up()
            self._prefetcher.reap()
            if ids.size == 0:
                return PrefetchHandle([], 0, 0)
            return self._prefetcher.prefetch(sorted_unique(ids))

    def poll(self) -> int:
        """Commit the prefetches whose reads have finished (their rows appear in
        :meth:`device_map`); returns the rows still in flight. With a
        :meth:`resolve_deferred` call not yet settled it does nothing."""
        with self._lock:
            if self._prefetcher.jobs and self._faulter.pending is None:
                self._lru.finish_touches()
                self._prefetcher.reap()
            return self._slots.reserved

    def pause_prefetch(self) -> None:
        """No prefetch piece starts reading until :meth:`resume_prefetch`; returns once
        the pieces being read have finished (e.g. a server's turn of another model)."""
        self._prefetcher.pause()

    def resume_prefetch(self) -> None:
        """Undo :meth:`pause_prefetch`."""
        self._prefetcher.resume()

    def prefetch_pieces(self) -> list[PrefetchJob]:
        """The prefetch pieces in flight or not yet reaped (for timelines: their ``rows``,
        ``started``, ``times``); read-only."""
        with self._lock:
            return self._prefetcher.pieces()

    @property
    def rows_taken(self) -> int:
        """Rows resolves took over from prefetch pieces not started, since creation."""
        return self._prefetcher.rows_taken

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
            self._catch_up()
            return self._arena.device_map(self._slots)

    @property
    def stream(self) -> Any:
        """The CUDA stream the cache writes the arena on (``device="cuda"``), else None."""
        return self._arena.stream

    def stats(self, reset: bool = False) -> CacheStats:
        """A snapshot of the counters; ``reset=True`` starts fresh counts."""
        with self._lock:
            self._catch_up()
            if self._prefetcher.jobs:
                self._prefetcher.reap()
            snap = self._counters.snapshot()
            if reset:
                self._counters.reset()
            return snap

    def part_misses(self) -> np.ndarray:
        """int64[len(parts)]: ``stats().misses`` split by the listed table they fell in
        (since creation or the last ``stats(reset=True)``)."""
        with self._lock:
            self._catch_up()
            return self._counters.part_misses.copy()

    @property
    def fault_phases(self) -> np.ndarray:
        """float64[4]: seconds of the demand faults' phases since creation, summed: plan,
        read, commit (with the CPU's scatter), launch (a copy; a deferred fault's read is
        the time its join waited)."""
        return self._counters.phases()

    @property
    def info(self) -> TableInfo:
        """The table of a single-table cache (a shared cache has ``parts``)."""
        if len(self.parts) != 1:
            raise ConfigError(
                f"this cache shares its arena among {len(self.parts)} tables ({self.name!r}); "
                "use cache.parts[k] and cache.row_offsets"
            )
        return self.parts[0]

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

    @property
    def resident(self) -> int:
        """Number of slots holding a row."""
        return self._slots.resident

    def is_resident(self, row_ids: Any) -> np.ndarray:
        """bool[n]: which of ``row_ids`` (global) are mapped now (being read or not);
        changes nothing."""
        ids = check_row_ids(row_ids, self.rows)
        with self._lock:
            return self._slots.slots_of(ids) >= 0

    @property
    def pinned(self) -> int:
        """Number of slots pinned by the current batch."""
        with self._lock:
            self._catch_up()
            return self._lru.pinned

    def overhead_bytes(self) -> dict[str, int]:
        """Host bookkeeping bytes: per-slot arrays and the row map (dense: 4 bytes a row;
        a hash: 16-32 bytes a slot; ``row_map_kind`` says which)."""
        t, lru = self._slots, self._lru
        per_slot = sum(a.nbytes for a in (t.slot_row, t.state, lru.last_used, lru.log, lru.log_pos))
        return {"per_slot_arrays": per_slot, "row_map": t.row_map.nbytes}

    @property
    def row_map_kind(self) -> str:
        """``"dense"`` or ``"hash"``: how this cache maps rows to slots on the host
        (``rowcache.cache.row_map``)."""
        return self._slots.row_map.kind

    def slot_map(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of ``(row -> slot [rows], slot_row [slots])`` (-1 = unmapped), for checks
        (dense: 4 bytes a row, whatever the map's kind)."""
        with self._lock:
            self._catch_up()
            if self._prefetcher.jobs:
                self._prefetcher.reap()
            return self._slots.row_map.to_dense().copy(), self._slots.slot_row.copy()

    def pin_counts(self) -> np.ndarray:
        """int32[slots]: 1 for each slot pinned by the current batch (however many of
        the batch's resolves used it), else 0."""
        with self._lock:
            self._catch_up()
            return self._lru.pin_mask().astype(np.int32)

    @property
    def slot_table(self) -> SlotTable:
        """The slot table (row -> slot, slot -> row, states; ``check()``), for checks:
        read it, never write it."""
        return self._slots

    @property
    def lru(self) -> Lru:
        """The LRU (recency, pins, the log; ``check()``), for checks: read it, never write it."""
        return self._lru

    def check(self) -> list[str]:
        """Every broken invariant of the slot table and the LRU (after settling), one
        sentence each; empty when sound."""
        with self._lock:
            self._catch_up()
            return self._slots.check() + self._lru.check()

    def __repr__(self) -> str:
        return (
            f"NgramRowCache(table={self.name!r}, slots={self.num_slots}, device={self.device!r}, "
            f"arena={self.arena_kind!r}, reader={self.reader_kind!r}, resident={self.resident})"
        )
