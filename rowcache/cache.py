"""``NgramRowCache``: a bounded arena of row slots over one store table.

Owns the host-side bookkeeping (row -> slot map, slot -> row map, per-slot batch of
last use, an LRU log: 24 bytes per slot), the fault path (victims, coalesced reads into a
staging buffer, scatter into the arena), and the stats. Rows are gathered from
``cache.table`` by the same kernels that gather from a resident table
(``kernels.batched_embed`` / ``batched_embed_fp8``). Every step loops per batch,
per extent or per call, never per row.

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
full: O(1) amortized per access, no O(slots) scan per fault.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from kernels._cuda import require_cupy
from kernels.host import native as _native
from kernels.reference import scatter_records_reference

from .errors import ArenaExhaustedError, ConfigError, CorruptDataError
from .format import TableInfo
from .prefetch import PrefetchBuffers, PrefetchHandle, PrefetchJob
from .reader import RowReader
from .store import RowStore, check_row_ids

POLICIES = ("lru",)
DEVICES = ("cpu", "cuda")
ARENAS = ("device", "host")
READERS = ("auto", "posix", "kvikio")
OUT_RING = 4  # pinned buffers for slots on their way to the device


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
    ``resolve`` of such a row is a hit). ``prefetch_wait_seconds``: time resolves
    spent waiting for prefetches still in flight.
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

    @property
    def hit_rate(self) -> float:
        """hits / (hits + misses), 0.0 before any lookup."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


def _sorted_unique(a: np.ndarray) -> np.ndarray:
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
    reader : ``"posix"`` (threads + ``os.preadv``), ``"kvikio"`` (``CuFile.pread``
        into the pinned staging buffer; GPU machines), or ``"auto"``: kvikio only where
        GPUDirect Storage is available, POSIX otherwise (without GDS kvikio runs the
        same POSIX reads through its own thread pool; see bench/RESULTS.md).
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
    must wait on that stream first.
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
        self._lock = threading.RLock()
        self._stats: dict[str, Any] = dict.fromkeys((f.name for f in fields(CacheStats)), 0)
        self._stats["fault_seconds"] = 0.0
        self._stats["prefetch_wait_seconds"] = 0.0
        # Lookahead (rowcache.prefetch): jobs in flight or done but not yet reaped, the
        # slots they reserved, and failed prefetches' rows awaiting the resolve that raises.
        self._jobs: list[PrefetchJob] = []
        self._busy = np.zeros(0, dtype=bool)
        self._failed: list[tuple[np.ndarray, BaseException]] = []
        self._pf_pool: ThreadPoolExecutor | None = None
        self._pf_buffers: PrefetchBuffers | None = None
        self._reaped_rows = 0
        self._n_busy = 0
        self._scratch = np.empty(0, dtype=np.int32)  # the native hit path's sort buffer

        dim = self.dim
        rec = self.record_bytes
        if device == "cpu":
            self.table = np.zeros((S, dim), dtype=self._value_dtype())
            self.scales = np.ones(S, dtype=np.float32) if self.dtype == "fp8" else None
            self._staging = np.empty((0, rec), dtype=np.uint8)
        else:
            self._init_gpu(S, dim, rec)

    # -- construction helpers ----------------------------------------------
    def _value_dtype(self) -> Any:
        from .sources import BF16

        return BF16 if self.dtype == "bf16" else np.uint8

    def _make_reader(
        self, reader: str, queue_depth: int | None, direct: bool | None
    ) -> tuple[RowReader, str]:
        base = self.store.reader
        qd = base.queue_depth if queue_depth is None else queue_depth
        use_direct = base.direct if direct is None else direct
        if reader == "auto":
            from .kvikio_reader import gds_available

            reader = "kvikio" if self.device == "cuda" and gds_available() else "posix"
        # siblings of the store's reader: the same pinned files and page checks
        if reader == "kvikio":
            from .kvikio_reader import KvikioRowReader

            opts = base.options(queue_depth=qd, direct=False)
            return self.store.new_reader(KvikioRowReader, **opts), "kvikio"
        if qd == base.queue_depth and use_direct == base.direct:
            return base, "posix"
        return self.store.new_reader(**base.options(queue_depth=qd, direct=use_direct)), "posix"

    def _init_gpu(self, S: int, dim: int, rec: int) -> None:
        cp = self._xp
        vdt = self._value_dtype()
        nbytes = S * dim * np.dtype(vdt).itemsize
        if self.arena_kind == "device":
            self.table = cp.zeros((S, dim), dtype=vdt)
            self.scales = cp.ones(S, dtype=cp.float32) if self.dtype == "fp8" else None
        else:
            self._host_mem: list[Any] = []
            self.table = self._mapped_array((S, dim), vdt, nbytes)
            self.table[...] = 0
            if self.dtype == "fp8":
                self.scales = self._mapped_array((S,), np.float32, S * 4)
                self.scales[...] = 1
            else:
                self.scales = None
        self._stream = cp.cuda.get_current_stream()
        self._device_id = cp.cuda.Device().id
        self._staging = np.empty((0, rec), dtype=np.uint8)
        self._dev_staging = cp.empty((0, rec), dtype=cp.uint8)
        self._copy_done = None
        self._out_ring: list[tuple[np.ndarray, Any]] = [
            (np.empty(0, dtype=np.int32), None)
        ] * OUT_RING
        self._out_next = 0

    def _mapped_array(self, shape: tuple[int, ...], dtype: Any, nbytes: int) -> Any:
        """A cupy array over pinned host memory mapped into the device (zero-copy)."""
        cp = self._xp
        mem = cp.cuda.PinnedMemory(max(nbytes, 1), cp.cuda.runtime.hostAllocMapped)
        self._host_mem.append(mem)
        um = cp.cuda.UnownedMemory(mem.ptr, max(nbytes, 1), mem)
        return cp.ndarray(shape, dtype=dtype, memptr=cp.cuda.MemoryPointer(um, 0))

    def _staging_rows(self, n: int) -> np.ndarray:
        """Host staging buffer of at least ``n`` records (pinned on the GPU path)."""
        if self._staging.shape[0] < n:
            cap = max(n, 2 * self._staging.shape[0], 256)
            rec = self.record_bytes
            if self.device == "cuda":
                import cupyx

                self._staging = cupyx.empty_pinned((cap, rec), dtype=np.uint8)
                self._dev_staging = self._xp.empty((cap, rec), dtype=self._xp.uint8)
            else:
                self._staging = np.empty((cap, rec), dtype=np.uint8)
        return self._staging

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
        with self._lock:
            out = self._hits_native(row_ids)
            if out is None:
                ids = check_row_ids(row_ids, self.rows)
                self._reaped_rows = 0
                out = self._resolve_unique(ids)
            if self.device == "cuda":
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

    def poll(self) -> int:
        """Commit the prefetches whose reads have finished (their rows appear in
        :meth:`device_map`, in stream order after their arena writes); returns the
        rows still in flight. Every other method does this too; a caller that reads
        the device map before resolving calls it first."""
        with self._lock:
            if self._jobs:
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
        cache's prefetch thread meanwhile. A later :meth:`resolve` waits only for jobs
        still in flight that it needs (a row of theirs, or their slots as victims,
        or their slots to avoid exhaustion), so the LRU order, the exhaustion rule and
        every fault count are exactly those of a prefetch that completed at its call.
        A failed read maps nothing (its slots are left free), and the
        :meth:`resolve` that next needs one of its rows raises that read's error once
        (a later call faults the row normally). On ``device="cuda"`` the arena writes
        go on the cache's stream; the device map shows the rows from the first call
        after their read completed.
        """
        ids = check_row_ids(row_ids, self.rows)
        with self._lock:
            self._reap()
            if ids.size == 0:
                return PrefetchHandle([], 0, 0)
            return self._prefetch(_sorted_unique(ids))

    def _prefetch(self, rows_u: np.ndarray) -> PrefetchHandle:
        """The prefetch of sorted unique rows, under the lock."""
        slots_u = self._row_slot[rows_u]
        miss = slots_u < 0
        hit = slots_u[~miss]
        busy = self._busy_mask()
        # resident rows (in flight or not) move to the tail, pins unchanged; not victims
        was_busy = busy[hit].copy()
        busy[hit] = True
        unpinned_hits = int(np.count_nonzero(~was_busy & (self._last_used[hit] != self._batch)))
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
            saved = self._n_busy
            self._n_busy += 1  # _choose_victims must look at the mask
            victims, new_head, end = self._choose_victims(int(missing.size))
            self._n_busy = saved
            if saved and self._passed_busy(end):  # LRU reaches a slot in flight
                busy[hit] = was_busy
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
            busy[victims] = True
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
        job = PrefetchJob(missing, victims)
        self._jobs.append(job)
        if self._pf_pool is None:
            self._pf_pool = ThreadPoolExecutor(1, thread_name_prefix="rowcache-prefetch")
            self._pf_buffers = PrefetchBuffers(self._prefetch_reader())
        self._pf_pool.submit(job.run, self, self._pf_buffers)
        return PrefetchHandle([job], int(missing.size), dropped)

    def device_map(self) -> Any:
        """The row -> slot map on the GPU: cupy int32[rows] (-1: not resident).

        Made on first call (``rows`` x 4 bytes of device memory) and from then on
        updated by every fault, on the cache's stream after the fault's arena writes:
        a kernel on that stream can look rows up without the host. A slot read this
        way is only safe to use while the row is pinned, so a caller that gathers
        through the map first must still :meth:`resolve` the rows (which pins them and
        keeps the LRU exact), and redo its gathers if that call faulted
        (:attr:`last_faults`), as ``embed.NgramEmbedding`` does.
        """
        if self.device != "cuda":
            raise ConfigError("device_map() needs a cache with device='cuda'")
        with self._lock:
            if self._dev_map is None:
                m = self._row_slot
                if self._n_busy:  # rows whose prefetch is in flight are not mapped yet
                    m = m.copy()
                    m[self._slot_row[np.flatnonzero(self._busy)]] = -1
                with self._stream:
                    self._dev_map = self._xp.asarray(m)
            return self._dev_map

    def _sync_device_map(self, evicted: np.ndarray, rows: np.ndarray, victims: np.ndarray) -> None:
        cp = self._xp
        with self._stream:
            upd_rows = np.concatenate([evicted.astype(np.int64), rows.astype(np.int64)])
            upd_slots = np.concatenate([np.full(evicted.size, -1, np.int32), victims])
            # evicted rows first, then the new ones: a row evicted and faulted back in
            # the same call cannot happen (its slot would be a hit), so order is moot
            self._dev_map[cp.asarray(upd_rows)] = cp.asarray(upd_slots)

    @property
    def stream(self) -> Any:
        """The CUDA stream the cache writes the arena on (``device="cuda"``), else None."""
        return getattr(self, "_stream", None)

    def end_batch(self) -> None:
        """Unpin every slot pinned since the last ``end_batch``; the next batch begins."""
        with self._lock:
            if self._jobs:
                self._reap()
            # A slot is pinned while its last use is the current batch: moving to the
            # next batch unpins every slot at once.
            self._pinned = 0
            self._batch += 1
            self._stats["batches"] += 1

    def stats(self, reset: bool = False) -> CacheStats:
        """A snapshot of the counters; ``reset=True`` starts fresh counts."""
        with self._lock:
            if self._jobs:
                self._reap()
            snap = CacheStats(**self._stats)
            if reset:
                for k in self._stats:
                    self._stats[k] = 0
                self._stats["fault_seconds"] = 0.0
                self._stats["prefetch_wait_seconds"] = 0.0
            return snap

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

    # -- internals -----------------------------------------------------------
    def _hits_native(self, row_ids: Any) -> np.ndarray | None:
        """The all-hits path in one C call (``kernels/_host.c``), or None where the
        Python path must run: a miss, a bad id, prefetches to settle, no native module,
        input that is not a contiguous int64 NumPy vector. Same state, same stats."""
        if (
            _native is None
            or type(row_ids) is not np.ndarray
            or row_ids.dtype != np.int64
            or row_ids.ndim != 1
            or not row_ids.flags.c_contiguous
            or self._jobs
            or self._failed
            or row_ids.size == 0
        ):
            return None
        n = row_ids.size
        if self._scratch.size < 2 * n:
            self._scratch = np.empty(max(2 * n, 2 * self._scratch.size), dtype=np.int32)
        out = np.empty(n, dtype=np.int32)
        status, fresh, tail = _native.lru_hits(
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
        )
        if status == 3:  # the log is full: compact (as _touch would), then once more
            self._compact()
            status, fresh, tail = _native.lru_hits(
                row_ids, self.rows, self._row_slot, self._last_used, self._log,
                self._log_pos, self._tail, self._batch, out, self._scratch,
            )  # fmt: skip
        if status != 0:
            return None
        self._tail = tail
        st = self._stats
        st["lookups"] += n
        st["hits"] += fresh
        self._pinned += fresh
        self._last_faults = 0
        return out

    def _resolve_unique(self, ids: np.ndarray) -> np.ndarray:
        """Resolve a checked batch; returns its slots (int32, input order)."""
        self._last_faults = 0
        if ids.size == 0:
            return np.empty(0, dtype=np.int32)
        if self._jobs or self._failed:
            self._settle(ids)  # prefetches this call needs: waited for, reaped, errors raised
        s = self._row_slot[ids]
        if int(s.min()) >= 0:  # every row resident: the hot path (no fault, no eviction)
            rows_u = _sorted_unique(ids)
            self._count(ids.size, self._row_slot[rows_u], 0)
            self._last_faults = self._reaped_rows
            return s
        rows_u = _sorted_unique(ids)  # the call's rows, ascending: the touch order
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
            raise ArenaExhaustedError(
                f"table {self.name!r}: this batch needs {n_miss} more slots but only "
                f"{free_or_unpinned} of {self.num_slots} are free or unpinned "
                f"({self._pinned} pinned by the batch); call end_batch() more often, split the "
                "batch, or give the cache more slots"
            )
        t0 = time.perf_counter()
        self._last_used[uhit] = self._batch  # pinned: the call's hits are no victims
        try:
            victims, new_head, end = self._choose_victims(n_miss)
            if self._n_busy and self._passed_busy(end):
                # LRU order reaches a slot still in flight: as if it had landed, wait
                self._last_used[uhit] = hit_last
                self._wait_jobs(self._jobs)
                return self._resolve_unique(ids)
            self._fault(missing_rows, victims)  # raises before any other state change
        except BaseException:
            self._last_used[uhit] = hit_last  # a failed call changes nothing
            raise
        # Commit: unmap victims, map the new rows. Every log entry before new_head is
        # now stale (a victim's, or a hit's that _touch re-logs), so the head skips them.
        self._head = new_head
        old = self._slot_row[victims]
        evicted = old[old >= 0]
        self._row_slot[evicted] = -1
        self._row_slot[missing_rows] = victims
        self._slot_row[victims] = missing_rows
        if self._dev_map is not None:  # the device mirror, in stream order with the scatter
            self._sync_device_map(evicted, missing_rows, victims)
        self._last_faults = n_miss + self._reaped_rows
        st = self._stats
        st["evictions"] += int(evicted.size)
        st["fault_seconds"] += time.perf_counter() - t0
        slots_u[miss] = victims
        self._last_used[uhit] = hit_last  # _count tells fresh hits by their last use
        self._count(ids.size, slots_u, n_miss)
        return self._row_slot[ids]

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

    def _choose_victims(self, need: int) -> tuple[np.ndarray, int, int]:
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
            if self._n_busy:
                ok &= ~self._busy[s]
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

    # -- lookahead bookkeeping (the jobs themselves: rowcache.prefetch) ------------
    def _busy_mask(self) -> np.ndarray:
        """bool[slots]: slots reserved by a prefetch in flight (made on first prefetch)."""
        if self._busy.size != self.num_slots:
            self._busy = np.zeros(self.num_slots, dtype=bool)
        return self._busy

    def _reap(self) -> None:
        """Commit every finished prefetch: release its slots, count its reads, show its
        rows in the device map; a failed one unmaps its rows and leaves their slots free."""
        keep: list[PrefetchJob] = []
        for job in self._jobs:
            if not job.event.is_set():
                keep.append(job)
                continue
            self._busy[job.slots] = False
            self._n_busy -= int(job.slots.size)
            if job.error is not None:
                self._row_slot[job.rows] = -1
                self._slot_row[job.slots] = -1
                self._log_front(job.slots)  # free slots are taken first, as at the start
                self._failed.append((job.rows, job.error))
                continue
            rows, nbytes, ops = job.read
            st = self._stats
            st["rows_read"] += rows
            st["bytes_read"] += nbytes
            st["read_ops"] += ops
            st["prefetched"] += int(job.rows.size)
            self._reaped_rows += int(job.rows.size)
            if self._dev_map is not None:  # after the job's arena writes, in stream order
                self._sync_device_map(job.rows[:0], job.rows, job.slots)
        self._jobs = keep

    def _wait_jobs(self, jobs: list[PrefetchJob]) -> None:
        t0 = time.perf_counter()
        for job in list(jobs):
            job.event.wait()
        self._stats["prefetch_wait_seconds"] += time.perf_counter() - t0
        self._reap()

    def _settle(self, ids: np.ndarray) -> None:
        """Before a resolve of ``ids``: reap finished prefetches, wait for those in
        flight that hold a row of ``ids``, and raise the error of a failed prefetch of
        one of them (once; nothing else changes)."""
        if self._jobs:
            self._reap()
        if self._jobs:
            s = self._row_slot[ids]
            s = s[s >= 0]
            needed = s[self._busy[s]]
            if needed.size:
                self._wait_jobs([j for j in self._jobs if np.isin(j.slots, needed).any()])
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
        prefetch in flight holds (the LRU would have taken it had the read landed)."""
        return any(bool((self._log_pos[j.slots] < end).any()) for j in self._jobs)

    # -- the demand fault ----------------------------------------------------
    def _read_parts(
        self, rows: np.ndarray, staging: np.ndarray, reader: RowReader | None = None
    ) -> tuple[int, int, int]:
        """Records of global ``rows`` (sorted, unique) into ``staging[:n]``; returns
        (rows, bytes, read ops) read. Touches no cache state (prefetch threads call it)."""
        reader = reader or self._reader
        # Global rows are sorted, so each part's rows are one contiguous run of them, and
        # the parts in order are the staging order: one read plan and one dispatch for all.
        bounds = np.searchsorted(rows, self.row_offsets)
        _, rs = reader.read_runs(rows, bounds, self._part_array, self.row_offsets[:-1], out=staging)
        return rs.rows, rs.bytes_read, rs.read_ops

    def _prefetch_reader(self) -> RowReader:
        """The reader prefetch jobs use: a POSIX reader of their own (its own ring and
        buffers: a native batch runs one at a time per reader, so a demand fault never
        queues behind a prefetch); kvikio's reader is shared (thread-safe)."""
        r = self._reader
        if type(r) is RowReader:
            return self.store.new_reader(**r.options())
        return r

    def _fault(self, rows: np.ndarray, victims: np.ndarray) -> None:
        """Read ``rows`` (sorted, unique) and write them into ``victims``' arena rows."""
        n = rows.size
        st = self._stats
        if self.device == "cuda" and self._copy_done is not None:
            self._copy_done.synchronize()  # the staging buffer's last copy has left it
        staging = self._staging_rows(n)
        rows_read, nbytes, ops = self._read_parts(rows, staging)
        st["rows_read"] += rows_read
        st["bytes_read"] += nbytes
        st["read_ops"] += ops
        records = staging[:n]
        if self.device == "cpu":
            scatter_records_reference(records, victims, self.table, self.scales)
            return
        import kernels.scatter

        cp = self._xp
        dev = self._dev_staging[:n]
        with self._stream:  # copy and scatter on one stream, whatever the caller's current one
            dev.set(records, stream=self._stream)
            self._copy_done = self._stream.record()
            kernels.scatter.scatter_records(dev, cp.asarray(victims), self.table, self.scales)

    def _to_device(self, out: np.ndarray) -> Any:
        """``out`` as a new cupy array, copied asynchronously through a ring of pinned buffers.

        A ring, so that a call waits only for the copy of the call ``OUT_RING`` calls
        ago (long done), never for the stream's recent work.
        """
        cp = self._xp
        n = out.size
        k = self._out_next
        self._out_next = (k + 1) % OUT_RING
        buf, done = self._out_ring[k]
        if done is not None:
            done.synchronize()  # this buffer's previous copy has left it
        if buf.size < n:
            import cupyx

            buf = cupyx.empty_pinned(max(n, 2 * buf.size, 1024), dtype=np.int32)
        buf[:n] = out
        dev = cp.empty(n, dtype=cp.int32)
        with self._stream:
            dev.set(buf[:n], stream=self._stream)
            self._out_ring[k] = (buf, self._stream.record())
        return dev

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
        if _native is not None:
            self._tail = _native.lru_compact(self._log, self._log_pos, self._head, self._tail)
            self._head = 0
            return
        live = self._log[self._head : self._tail]
        keep = live[self._log_pos[live] == np.arange(self._head, self._tail, dtype=np.int32)]
        self._log[: keep.size] = keep
        self._log_pos[keep] = np.arange(keep.size, dtype=np.int32)
        self._head, self._tail = 0, keep.size

    def __repr__(self) -> str:
        return (
            f"NgramRowCache(table={self.name!r}, slots={self.num_slots}, device={self.device!r}, "
            f"arena={self.arena_kind!r}, reader={self.reader_kind!r}, resident={self.resident})"
        )
