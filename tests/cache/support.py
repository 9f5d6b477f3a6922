"""What the row cache's tests share: the cache's contract as a pure-Python LRU with pin
counts (:class:`RefLRU`), tiny stores and the rows they should give back, the cache's map
invariants, batch streams and a gate on the prefetch thread's reads. Not a test module."""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

import rowcache
import rowcache.kernels.reference as ref
from rowcache import NgramRowCache
from rowcache.cache.parts import PartReader
from rowcache.cache.row_cache import Tuning
from rowcache.errors import ArenaExhaustedError, CorruptDataError
from rowcache.kernels.reference import BF16


class RefLRU:
    """The cache's contract, one row at a time: free slots first, then the least recently
    touched unpinned row; a call touches its unique rows in ascending order."""

    def __init__(self, slots):
        self.slots = slots
        self.order = OrderedDict()  # row -> None, least recently touched first
        self.pins: dict[int, int] = {}
        self.seen_in_batch: set[int] = set()
        self.faults = self.hits = self.evictions = 0

    def resolve(self, ids):
        uniq = sorted(set(int(i) for i in ids))
        missing = [r for r in uniq if r not in self.order]
        hits = set(uniq) - set(missing)
        free = self.slots - len(self.order)
        evictable = [r for r in self.order if self.pins.get(r, 0) == 0 and r not in hits]
        if len(missing) > free + len(evictable):
            raise ArenaExhaustedError("reference: exhausted")
        for r in evictable[: max(0, len(missing) - free)]:
            del self.order[r]
            self.evictions += 1
        for r in uniq:
            self.order[r] = None
            self.order.move_to_end(r)
            self.pins[r] = self.pins.get(r, 0) + 1
        self.faults += len(missing)
        self.hits += len([r for r in hits if r not in self.seen_in_batch])
        self.seen_in_batch.update(uniq)

    def end_batch(self):
        self.pins.clear()
        self.seen_in_batch.clear()


def make_store(tmp_path, rng, rows=3000, dim=32, dtype="bf16"):
    """A one-table store ``t`` of ``rows`` random rows of width ``dim`` in small shards;
    returns ``(store, rows)`` (the ``tiny_store`` fixture's, at the defaults)."""
    x = rng.standard_normal((rows, dim), dtype=np.float32).astype(BF16)
    store = rowcache.build_store(
        tmp_path / f"s-{dtype}", {"t": x}, dtype=dtype, progress=False, shard_bytes=16 * 4096
    )
    return store, x


def make_multi_store(tmp_path, rng, dtype="bf16"):
    """Four tables ``t0``..``t3`` of 300 + 7i random rows of width 16 (an arena to share);
    returns ``(store, {name: rows})``."""
    tabs = {
        f"t{i}": rng.standard_normal((300 + 7 * i, 16), dtype=np.float32).astype(BF16)
        for i in range(4)
    }
    store = rowcache.build_store(
        tmp_path / f"m-{dtype}", tabs, dtype=dtype, progress=False, shard_bytes=4 * 4096
    )
    return store, tabs


def gather(cache, slots):
    """The rows in ``slots`` of the cache's arena, by the kernels' NumPy references."""
    if cache.dtype == "bf16":
        return ref.batched_embed_reference(np.asarray(slots), cache.table)
    return ref.batched_embed_fp8_reference(np.asarray(slots), cache.table, cache.scales)


def expected(store, ids):
    """What table ``t`` of ``store`` holds at ``ids``, as the cache gathers it (FP8 dequantized)."""
    got = store.read_rows("t", ids)
    if store.dtype == "bf16":
        return got
    return ref.dequantize_fp8_reference(*got)


def expected_part(store, name, ids):
    """:func:`expected` for table ``name``."""
    got = store.read_rows(name, ids)
    return got if store.dtype == "bf16" else ref.dequantize_fp8_reference(*got)


def check_invariants(cache, ref_lru):
    """The cache's two maps invert each other, fit its slots, and map the rows the
    reference LRU holds."""
    row_slot, slot_row = cache.inspect().slot_map()
    mapped = np.flatnonzero(slot_row >= 0)
    assert np.array_equal(row_slot[slot_row[mapped]], mapped), (
        "slot -> row -> slot is not the identity"
    )
    rows = np.flatnonzero(row_slot >= 0)
    assert np.array_equal(slot_row[row_slot[rows]], rows), "row -> slot -> row is not the identity"
    assert mapped.size <= cache.num_slots
    assert set(rows.tolist()) == set(ref_lru.order), "resident rows differ from the reference LRU"


def batches(rng, rows, slots, n):
    """Zipf ids, duplicates, near-arena-size batches, and multi-call batches."""
    for b in range(n):
        kind = b % 5
        if kind == 3:
            size = int(slots * rng.uniform(0.8, 1.0))
            ids = rng.choice(rows, size=size, replace=False)
            yield [np.concatenate([ids, ids[: size // 3]])]
        elif kind == 4:
            yield [rng.integers(0, rows, int(rng.integers(1, 70))) for _ in range(3)]
        else:
            yield [rng.zipf(1.2, int(rng.integers(0, 200))) % rows]


class Hooked(PartReader):
    """The cache's reads (a :class:`PartReader`), each calling ``hook(rows)`` first: the
    hook may sleep, wait or raise (a reader that delays or fails)."""

    def __init__(self, inner: PartReader, hook) -> None:
        super().__init__(inner.store, inner.part_tables, inner.row_offsets, inner.reader)
        self.hook = hook

    def read(self, rows, staging, reader=None):
        self.hook(rows)
        return super().read(rows, staging, reader)


def python_engine(reads: PartReader) -> PartReader:
    """The cache's reads (``NgramRowCache.assemble(..., part_reader=python_engine)``) through
    a sibling of its reader made with ``engine="python"``: the engine that calls
    ``os.preadv`` for every read, so that a test that replaces ``os.preadv`` injects its
    faults into the cache's reads (the native engines never call it)."""
    r = reads.reader
    python = reads.store.new_reader(**r.options(engine="python"))
    assert python.engine == "python"
    return PartReader(reads.store, reads.part_tables, reads.row_offsets, python)


class Gate:
    """A hook on a cache's reads (``NgramRowCache.assemble(..., part_reader=gate.wrap)``):
    prefetch-thread reads wait for ``open``; reads by any other thread (a resolve taking
    rows over) of rows in ``fail`` raise."""

    def __init__(self):
        self.open = threading.Event()
        self.started = threading.Event()
        self.fail = np.zeros(0, dtype=np.int64)
        self.caller_reads: list[np.ndarray] = []
        self.fail_pieces = False  # the prefetch thread's reads of rows in ``fail`` raise too

    def wrap(self, reads: PartReader) -> PartReader:
        return Hooked(reads, self)

    def __call__(self, rows):
        if threading.current_thread().name.startswith("rowcache-prefetch"):
            self.started.set()
            assert self.open.wait(10)
            if self.fail_pieces and np.isin(rows, self.fail).any():
                raise CorruptDataError("injected: read of shard failed")
        else:
            self.caller_reads.append(rows.copy())
            if np.isin(rows, self.fail).any():
                raise CorruptDataError("injected: read of shard failed")


def gated_cache(store, table, slots, piece=None, **kw):
    """A cache over ``store`` whose reads go through a new :class:`Gate` (prefetch pieces of
    ``piece`` rows where given); returns (cache, gate)."""
    gate = Gate()
    tuning = Tuning(piece_rows=piece) if piece else None
    cache = NgramRowCache.assemble(store, table, slots=slots, tuning=tuning,
                                   part_reader=gate.wrap, **kw)  # fmt: skip
    return cache, gate


def check_pieces(cache):
    """The cache's slot table and LRU are sound (``check()`` of each; no deferred resolve
    is pending: the view refuses to read past one)."""
    assert cache.inspect().check() == []
    assert cache.inspect().slot_table.check() == []
    assert cache.inspect().lru.check() == []
