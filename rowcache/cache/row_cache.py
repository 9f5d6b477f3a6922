"""``NgramRowCache``: a bounded arena of row slots over one store table.

Owns the cache's construction, its public calls (resolve, end_batch, stats, maps)
and its state: the host-side bookkeeping (row -> slot map, slot -> row map, per-slot
batch of last use, an LRU log: 24 bytes per slot) and the stats. The pieces that work
on that state are mixins: the LRU log and the native hit path (``rowcache.cache.lru``), the
fault path (``rowcache.cache.fault``; its buffers and GPU launch: ``rowcache.cache.buffers``),
faults whose read outlives the call (``rowcache.cache.deferred``: ``resolve_deferred``,
``settle``), the device map (``rowcache.cache.device_map``), the prefetch bookkeeping
(``rowcache.cache.prefetch_book``; rows in flight that a resolve needs: ``rowcache.cache.in_flight``;
the jobs: ``rowcache.cache.prefetch``). Rows are gathered from ``cache.table`` by the same
kernels that gather from a resident table (``rowcache.kernels.batched_embed`` /
``batched_embed_fp8``). Every step loops per batch, per extent or per call, never per row.

LRU log. Recency is the batch in which a slot was last resolved. Each resolve
appends its slots to a log (an int32 array) in ascending row-id order;
``log_pos[slot]`` is the position of the slot's newest entry, so older entries of
that slot are stale. Victims are the first valid log entries from the head, i.e.
least recently used first; within one batch a smaller row id counts as older.
With that tie rule batch-LRU is a stack algorithm, which is what lets
``rowcache.tools.miss_ratio_curve(..., batch=...)`` predict this cache's fault
count exactly at every size in one pass (tested by replaying traces through it).

Pinning. A batch pins every slot it resolved until ``end_batch``: a slot is pinned
exactly when its batch of last use is the current batch, so ``end_batch`` unpins
them all in O(1) and a resolve whose rows are all resident (the hot path) costs one
sort of its ids, two gathers and two scatters. The log is compacted in place when
full: O(1) amortized per access, no O(slots) scan per fault (in C, split over the host
threads for a long log).

Deferred touch. An all-hits resolve of at least ``rowcache.cache.lru.DEFER_MIN`` ids (a
prefill step's; where the process may use 4 CPUs or more) returns once its scan has
found every row resident, and a background C thread pins and logs its slots
(``csrc/lru_touch.c``: the sort and the log writes, ~90 % of the call; on a worker pool of
its own, ``rowcache.kernels.host.TOUCH_THREADS``). The cache's lock
finishes that touch before any later call reads the state, so every call sees what it
would have seen without the deferral (``end_batch`` and ``poll`` go on without waiting:
the touch pins for its own batch).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from rowcache.cache.deferred import DeferredFaults
from rowcache.cache.device_map import DeviceMap
from rowcache.cache.fault import FaultPath
from rowcache.cache.lru import DEFER_MIN, LruLog, SettlingLock, sorted_unique  # noqa: F401  (sorted_unique: likewise)
from rowcache.cache.prefetch import PrefetchBuffers, PrefetchJob
from rowcache.cache.prefetch_book import PrefetchBook
from rowcache.errors import ConfigError
from rowcache.kernels.host import native as _native
from rowcache.kernels.loader import require_cupy
from rowcache.store.format import TableInfo
from rowcache.store.handle import RowStore, check_row_ids

POLICIES = ("lru",)
DEVICES = ("cpu", "cuda")
ARENAS = ("device", "host")
READERS = ("auto", "posix", "kvikio")


@dataclass(frozen=True)
class CacheStats:
    """Counters of a cache since creation or the last ``stats(reset=True)``.

    ``lookups``: ids passed to ``resolve``. ``hits`` / ``misses``: unique rows of a
    batch found resident / faulted in (a row resolved twice in one batch counts
    once). ``evictions``: mapped rows dropped for others. ``rows_read``,
    ``bytes_read``, ``read_ops``: what the fault path read from the store (bytes
    include page padding and coalesced neighbours; prefetches' reads included).
    ``fault_seconds``: wall time spent in the demand fault path. ``batches``:
    ``end_batch`` calls. ``prefetched``: rows read by completed prefetches (a later
    ``resolve`` of such a row is a hit; rows a resolve took over from a piece not
    started count here too). ``prefetch_wait_seconds``: time resolves spent waiting
    for prefetches still in flight, or reading the rows they took over.
    ``rows_reread``: rows read twice, in ``rows_read`` twice: a resolve that needed rows
    of a prefetch piece being read read them itself rather than wait for the whole piece
    (the piece reads them too).
    """

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    rows_read: int = 0
    bytes_read: int = 0
    read_ops: int = 0
    fault_seconds: float = 0.0
    batches: int = 0
    prefetched: int = 0
    prefetch_wait_seconds: float = 0.0
    rows_reread: int = 0

    @property
    def hit_rate(self) -> float:
        """hits / (hits + misses), 0.0 before any lookup."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class NgramRowCache(LruLog, FaultPath, DeferredFaults, DeviceMap, PrefetchBook):
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
    reader : ``"posix"`` (threads + ``os.preadv``), ``"kvikio"`` (``CuFile.pread``
        into the pinned staging buffer; GPU machines), or ``"auto"``: kvikio only where
        GPUDirect Storage is available, POSIX otherwise (without GDS kvikio runs the
        same POSIX reads through its own thread pool; see docs/results/).
    arena : with ``device="cuda"``, ``"device"`` (HBM) or ``"host"`` (pinned host
        memory mapped into the device: the unified-memory layout).
    queue_depth : reads in flight on a fault.
    direct : read with ``O_DIRECT`` (POSIX reader).

    Attributes
    ----------
    table : bfloat16[slots, dim] or uint8[slots, dim] (FP8 codes); numpy or cupy.
    scales : float32[slots] for FP8 stores, else None.

    Thread safety
    -------------
    Every method takes an internal lock, so calls from several threads never
    corrupt the maps, pins or stats, and every slot returned to any caller holds
    its row until ``end_batch``. A batch is shared: resolves from several threads
    before ``end_batch`` join the same batch, and ``end_batch`` unpins all of them.
    So several threads may resolve concurrently, but one owner must decide when the
    batch ends (after every gather that uses its slots has been issued).

    Streams (``device="cuda"``)
    ---------------------------
    The cache copies slots to the device and writes faulted rows into the arena on
    the CUDA stream that was current when it was built. Gathers issued on that same
    stream (the usual case) are ordered after both, and a later fault cannot
    overwrite a slot before earlier gathers on it have run. Work on other streams
    must wait on that stream first. Prefetches copy and write their rows on a stream
    of their own: it waits for the cache's stream as it was at the last ``end_batch``
    (an evicted slot's gathers were issued before it), not for what was queued after
    (the rest of a model's step), and the cache's stream waits for those writes before
    the rows are used (``poll``, or the ``resolve`` that needs them).
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
        if not isinstance(store, RowStore):
            raise ConfigError(f"store must be a RowStore, got {type(store).__name__}")
        self.store = store
        names: list[Any] = list(table) if isinstance(table, (list, tuple)) else [table]
        if not names:
            raise ConfigError(
                "table=[]: give a table, or a non-empty list of tables to share the arena"
            )
        self.part_tables = [store.table_index(t) for t in names]
        if len(set(self.part_tables)) != len(self.part_tables):
            raise ConfigError(f"table={table!r} names a table twice")
        self.parts = [store.tables[i] for i in self.part_tables]
        self._part_array = np.asarray(self.part_tables, dtype=np.int32)
        first = self.parts[0]
        for p in self.parts[1:]:
            if p.dim != first.dim:
                raise ConfigError(
                    f"table={table!r}: tables sharing an arena need one width; "
                    f"{first.name!r} has dim {first.dim}, {p.name!r} has {p.dim}"
                )
        rows = np.array([p.rows for p in self.parts], dtype=np.int64)
        self.row_offsets = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        self._part_bases = np.ascontiguousarray(self.row_offsets[:-1])  # each part's first row
        self.rows = int(self.row_offsets[-1])
        if self.rows >= 2**31:
            raise ConfigError(
                f"table={table!r} has {self.rows} rows; one cache maps fewer than 2**31 "
                "(its maps are int32): split the tables over several caches"
            )
        self.dim = first.dim
        self.record_bytes = first.record_bytes
        self.name = "+".join(p.name for p in self.parts)
        if device not in DEVICES:
            raise ConfigError(f"device={device!r} is not supported; allowed: {', '.join(DEVICES)}")
        if policy not in POLICIES:
            raise ConfigError(
                f"policy={policy!r} is not supported; allowed: {', '.join(POLICIES)} "
                "(compare others offline with rowcache.tools.miss_ratio_curve)"
            )
        if reader not in READERS:
            raise ConfigError(f"reader={reader!r} is not supported; allowed: {', '.join(READERS)}")
        if arena not in ARENAS:
            raise ConfigError(f"arena={arena!r} is not supported; allowed: {', '.join(ARENAS)}")
        if (
            isinstance(slots, bool)
            or not isinstance(slots, (int, np.integer))
            or not 1 <= slots <= self.rows
        ):
            raise ConfigError(
                f"slots={slots!r}: give an integer in 1..{self.rows} (the rows of {self.name!r})"
            )
        self.num_slots = S = int(slots)
        self.device = device
        self.arena_kind = arena if device == "cuda" else "host"
        self.dtype = store.dtype
        self.policy = policy
        self._xp: Any = require_cupy("NgramRowCache(device='cuda')") if device == "cuda" else np
        self._reader, self.reader_kind = self._make_reader(reader, queue_depth, direct)

        # Host bookkeeping: dense arrays, never a Python object per row.
        self._row_slot = np.full(self.rows, -1, dtype=np.int32)
        self._slot_row = np.full(S, -1, dtype=np.int32)
        self._last_used = np.full(S, -1, dtype=np.int64)  # batch of last use; == batch: pinned
        # The LRU log: slots in touch order, stale entries skipped (log_pos[slot] is the
        # slot's live entry). Slack of S entries: a compaction (O(S)) every S / k calls
        # of k unique rows, i.e. about one entry moved per row touched.
        self._log = np.empty(S + max(S, 1 << 14), dtype=np.int32)
        self._log[:S] = np.arange(S, dtype=np.int32)
        self._log_pos = np.arange(S, dtype=np.int32)
        self._head, self._tail = 0, S
        self._batch = 0
        self._pinned = 0
        self._last_faults = 0
        self._dev_map: Any = None
        self._lock = SettlingLock(self)
        self._touching = []  # deferred touches in flight (rowcache.cache.lru)
        self._defer_min = DEFER_MIN
        self._stats: dict[str, Any] = dict.fromkeys((f.name for f in fields(CacheStats)), 0)
        self._stats["fault_seconds"] = 0.0
        self._stats["prefetch_wait_seconds"] = 0.0
        self._fault_phases = np.zeros(4)  # rowcache.cache.fault: plan, read, commit, launch
        # Lookahead (rowcache.cache.prefetch): jobs in flight or done but not yet reaped, the
        # slots they reserved, and failed prefetches' rows awaiting the resolve that raises.
        self._jobs: list[PrefetchJob] = []
        self._busy = np.zeros(0, dtype=np.uint8)  # rowcache.cache.state.BUSY_READING
        self._failed: list[tuple[np.ndarray, BaseException]] = []
        self._pf_pool: ThreadPoolExecutor | None = None
        self._pf_buffers: PrefetchBuffers | None = None
        self._steal_buffers: PrefetchBuffers | None = None
        self._batch_done: Any = None
        self._pf_queue: collections.deque[PrefetchJob] = collections.deque()
        self._pf_qlock = threading.Lock()
        self._piece_rows = 0  # 0: rowcache.cache.prefetch_book.PIECE_ROWS
        self._defer = False
        self._deferred = None
        self._ctl = None
        self._apart_reader = None
        self._seq = 0
        self._merge_in_flight = True  # False: a benchmark's ablation (_take_over, _read_in_flight)
        self._rows_taken = 0
        self._reaped_rows = 0
        self._n_busy = 0
        self._scratch = np.empty(0, dtype=np.int32)  # the native hit path's sort buffer
        self._scratch2 = np.empty(0, dtype=np.int32)  # a queued touch's (rowcache.cache.lru)
        self._part_misses = np.zeros(len(self.parts), dtype=np.int64)

        dim = self.dim
        rec = self.record_bytes
        if device == "cpu":
            self.table = np.zeros((S, dim), dtype=self._value_dtype())
            self.scales = np.ones(S, dtype=np.float32) if self.dtype == "fp8" else None
            self._staging = np.empty((0, rec), dtype=np.uint8)
        else:
            self._init_gpu(S, dim, rec)

    # -- the public API ----------------------------------------------------
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
        with self._lock.raw:  # behind a deferred touch: scanned without waiting for it
            out = (
                self._hits_queued(row_ids, cuda) if self._touching and not self._deferred else None
            )
            if out is not None:  # a fault's launch may have carried the slots already
                return self._to_device(out) if cuda and type(out) is np.ndarray else out
        with self._lock:
            out = self._hits_native(row_ids, cuda)  # a fault's launch may carry the slots
            if out is None:
                ids = check_row_ids(row_ids, self.rows)
                self._reaped_rows = 0
                out = self._resolve_unique(ids)
            if cuda and type(out) is np.ndarray:
                return self._to_device(out)
        return out

    def resolve_host(self, row_ids: Any) -> np.ndarray:
        """:meth:`resolve`, with the slots left on the host: int32[n] (numpy).

        For callers that pack the slots into their own upload (one copy per step
        with their other inputs). On ``device="cuda"`` the faulted rows are written
        into the arena on the cache's stream, so gathers of these slots must be issued
        on that stream (or wait on it). Pinned until :meth:`end_batch`, like
        :meth:`resolve`.
        """
        with self._lock.raw:  # behind a deferred touch: scanned without waiting for it
            out = self._hits_queued(row_ids) if self._touching and not self._deferred else None
            if out is not None:
                return out
        with self._lock:
            out = self._hits_native(row_ids)
            if out is not None:
                return out
            ids = check_row_ids(row_ids, self.rows)
            self._reaped_rows = 0
            return self._resolve_unique(ids)

    @property
    def last_faults(self) -> int:
        """Rows the latest :meth:`resolve` / :meth:`resolve_host` faulted in, or whose
        prefetch it waited for or completed, i.e. rows whose :meth:`device_map` entry
        that call changed (0: every row was resident and mapped before the call)."""
        return self._last_faults

    def end_batch(self) -> None:
        """Unpin every slot pinned since the last ``end_batch``; the next batch begins."""
        with self._lock.raw:  # a deferred touch may go on: it pins for its own batch
            # (a deferred fault goes on too: its commit pins for the batch of its call,
            # i.e. not at all once that batch has ended; no reap before it)
            if self._jobs and self._deferred is None:
                if self._touching:
                    self._finish_touch()
                self._reap()
            # A slot is pinned while its last use is the current batch: moving to the
            # next batch unpins every slot at once.
            self._pinned = 0
            if self._pf_pool is not None and self.device == "cuda":
                self._record_batch_done()  # later prefetches may overwrite this batch's slots
            self._batch += 1
            self._stats["batches"] += 1

    def stats(self, reset: bool = False) -> CacheStats:
        """A snapshot of the counters; ``reset=True`` starts fresh counts."""
        with self._lock:
            if self._jobs:
                self._reap()
            snap = CacheStats(**self._stats)
            if reset:
                self._part_misses[:] = 0
                for k in self._stats:
                    self._stats[k] = 0
                self._stats["fault_seconds"] = 0.0
                self._stats["prefetch_wait_seconds"] = 0.0
            return snap

    def part_misses(self) -> np.ndarray:
        """int64[len(parts)]: ``stats().misses`` split by the listed table they fell in
        (since creation or the last ``stats(reset=True)``)."""
        with self._lock:
            return self._part_misses.copy()

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
        return int(np.count_nonzero(self._slot_row >= 0))

    @property
    def pinned(self) -> int:
        """Number of slots pinned by the current batch."""
        with self._lock:
            return self._pinned

    def overhead_bytes(self) -> dict[str, int]:
        """Host bookkeeping bytes: per-slot arrays and the per-table row map."""
        per_slot = sum(
            a.nbytes
            for a in (
                self._slot_row,
                self._last_used,
                self._log,
                self._log_pos,
            )
        )
        return {"per_slot_arrays": per_slot, "row_map": self._row_slot.nbytes}

    def slot_map(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of ``(row_slot [rows], slot_row [slots])`` (-1 = unmapped), for checks."""
        with self._lock:
            if self._jobs:
                self._reap()
            return self._row_slot.copy(), self._slot_row.copy()

    def pin_counts(self) -> np.ndarray:
        """int32[slots]: 1 for each slot pinned by the current batch (however many of
        the batch's resolves used it), else 0."""
        with self._lock:
            return (self._last_used == self._batch).astype(np.int32)

    def _host_lib(self) -> Any:
        """The native host kernels, looked up in this module (tests swap ``_native``)."""
        return _native

    def __repr__(self) -> str:
        return (
            f"NgramRowCache(table={self.name!r}, slots={self.num_slots}, device={self.device!r}, "
            f"arena={self.arena_kind!r}, reader={self.reader_kind!r}, resident={self.resident})"
        )
