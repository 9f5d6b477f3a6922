"""NgramRowCache.prefetch against the reference LRU: prefetch, resolve and end_batch
interleaved, reads slowed so that resolves meet prefetches in flight, failures injected."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from rowcache import NgramRowCache
from rowcache.cache.lru import member
from rowcache.cache.row_cache import Tuning
from rowcache.cache.slots import READING, SlotState
from rowcache.errors import ArenaExhaustedError, CorruptDataError
from tests.cache.support import (
    Gate,
    Hooked,
    RefLRU,
    check_invariants,
    check_pieces,
    expected,
    gated_cache,
    gather,
    make_multi_store,
    make_store,
)


class RefPrefetchLRU(RefLRU):
    """RefLRU plus the prefetch contract: as if the prefetch completed at its call."""

    def __init__(self, slots):
        super().__init__(slots)
        self.failed: set[int] = set()

    def prefetch(self, ids, fail=False):
        uniq = sorted(set(int(i) for i in ids))
        missing = [r for r in uniq if r not in self.order]
        hits = set(uniq) - set(missing)
        free = self.slots - len(self.order)
        evictable = [r for r in self.order if self.pins.get(r, 0) == 0 and r not in hits]
        take = missing[: free + len(evictable)]
        for r in evictable[: max(0, len(take) - free)]:
            del self.order[r]
            self.evictions += 1
        for r in uniq:
            if r in hits or r in take:
                self.order[r] = None
                self.order.move_to_end(r)
        if fail:
            for r in take:
                del self.order[r]
            self.failed.update(take)
        return len(take), len(missing) - len(take)

    def resolve(self, ids):
        bad = self.failed & set(int(i) for i in ids)
        if bad:
            self.failed -= set(int(i) for i in ids)
            raise CorruptDataError("reference: prefetch failed")
        super().resolve(ids)


class Slow:
    """A hook on a cache's reads (``part_reader=Hooked(..., slow)``): prefetch-thread reads
    sleep a little (so resolves meet them in flight), and a prefetch asked to fail fails
    every read of its rows (it is waited for at once, so no resolve takes its rows over
    first)."""

    def __init__(self, rng):
        self.rng = rng
        self.failing = np.zeros(0, dtype=np.int64)

    def wrap(self, reads):
        return Hooked(reads, self)

    def prefetch(self, cache, ids, fail):
        if fail:  # the rows this prefetch will read: those neither resident nor in flight
            u = np.unique(np.asarray(ids, dtype=np.int64))
            self.failing = u[~cache.inspect().is_resident(u)]
        h = cache.prefetch(ids)
        if fail:
            h.wait()
            self.failing = self.failing[:0]
        return h

    def __call__(self, rows):
        if threading.current_thread().name.startswith("rowcache-prefetch"):
            time.sleep(float(self.rng.uniform(0, 0.003)))
            if np.isin(rows, self.failing).any():
                raise CorruptDataError("injected: read of shard failed")


def read_pinned(cache, slots):
    """Slots whose piece is in flight but whose rows a resolve read itself and pinned."""
    lru = cache.inspect().lru
    return (cache.inspect().slot_table.state[slots] == SlotState.READ) & (
        lru.last_used[slots] == lru.batch
    )


def _check_stats(cache, lru):
    s = cache.stats()
    assert (s.misses, s.hits, s.evictions) == (lru.faults, lru.hits, lru.evictions)


@pytest.mark.parametrize(
    "dtype,piece,row_map",
    [("bf16", 1024, "dense"), ("fp8", 1024, "hash"), ("bf16", 7, "dense"), ("bf16", 7, "hash")],
)
def test_prefetch_model_based_against_reference_lru(tmp_path, rng, dtype, piece, row_map):
    """(piece 7: prefetches read in many pieces, so resolves take rows of queued ones over)"""
    store, _ = make_store(tmp_path, rng, dtype=dtype)
    slots = 120
    slow = Slow(np.random.default_rng(1))
    cache = NgramRowCache.assemble(
        store, "t", slots=slots, tuning=Tuning(piece_rows=piece, row_map=row_map),
        part_reader=slow.wrap,
    )  # fmt: skip
    assert cache.row_map_kind == row_map
    lru = RefPrefetchLRU(slots)
    handles = []
    seen = {"exhausted": 0, "failed": 0, "dropped": 0}
    at = np.random.default_rng(2)  # log positions to check passed_reserved at
    for _ in range(160):
        op = rng.choice(["resolve", "resolve", "prefetch", "end", "wait"])
        if op == "prefetch":
            ids = rng.zipf(1.3, int(rng.integers(1, 150))) % 3000
            fail = bool(rng.random() < 0.15)
            want_rows, want_dropped = lru.prefetch(ids, fail=fail)
            h = slow.prefetch(cache, ids, fail)
            if fail:  # the reference knows of the failure at once: let the cache see it too
                h.wait()
            assert (h.rows, h.dropped) == (want_rows, want_dropped)
            seen["failed"] += fail and want_rows > 0
            seen["dropped"] += want_dropped > 0
            handles.append(h)
        elif op == "resolve":
            if rng.random() < 0.2:  # near the arena's size: exhaustion, deep victims
                ids = rng.choice(3000, int(rng.integers(60, 125)), replace=False)
            else:
                ids = rng.zipf(1.3, int(rng.integers(1, 90))) % 3000
            try:
                lru.resolve(ids)
            except (ArenaExhaustedError, CorruptDataError) as e:
                with pytest.raises(type(e)):
                    cache.resolve(ids)
                seen["exhausted" if isinstance(e, ArenaExhaustedError) else "failed"] += 1
                continue
            got = cache.resolve(ids)
            np.testing.assert_array_equal(
                gather(cache, got).view(np.uint16), expected(store, ids).view(np.uint16)
            )
        elif op == "end":
            cache.end_step()
            lru.end_batch()
        else:
            for h in handles:
                assert h.wait(timeout=10)
            handles.clear()
        _check_stats(cache, lru)
        check_invariants(cache, lru)
        check_pieces(cache)
        # passed_reserved scans the log's window: the same answer as over every job's slots
        c = cache.inspect().lru
        for end in {c.head, c.tail, int(at.integers(c.head, c.tail + 1))}:
            # (but a slot a resolve read itself and pinned: a hit in any order)
            by_jobs = any(
                bool(((c.log_pos[j.slots] < end) & ~read_pinned(cache, j.slots)).any())
                for j in cache.inspect().prefetch_pieces()
            )
            assert c.passed_reserved(end) == by_jobs, end
    assert seen["exhausted"] and seen["failed"] and seen["dropped"], seen
    for h in handles:
        h.wait()
    s = cache.stats()
    assert s.prefetched > 0 and s.rows_read == s.misses + s.prefetched + s.rows_reread
    if piece < 100:  # resolves did take rows of queued pieces over
        assert cache.inspect().rows_taken > 0


def test_prefetch_never_takes_pinned_slots_nor_exhausts_the_batch(tiny_store):
    store, x = tiny_store
    slow = Slow(np.random.default_rng(0))
    cache = NgramRowCache.assemble(store, "t", slots=10, part_reader=slow.wrap)
    cur = cache.resolve(np.arange(6))  # pinned by the current batch
    h = slow.prefetch(cache, np.arange(100, 110), False)  # only 4 unpinned slots: 6 dropped
    assert (h.rows, h.dropped) == (4, 6)
    row_slot, _ = cache.inspect().slot_map()
    assert np.array_equal(row_slot[np.arange(6)], cur)  # the batch's rows stay
    # the current batch still gets its 4 remaining slots: the resolve waits for the reads
    got = cache.resolve(np.arange(6, 10))
    np.testing.assert_array_equal(cache.table[got].view(np.uint16), x[6:10].view(np.uint16))
    with pytest.raises(ArenaExhaustedError):  # the rule is unchanged: 10 of 10 pinned
        cache.resolve([500])
    assert cache.stats().evictions == 4  # the free slots went first, then the prefetched rows


def test_prefetch_then_resolve_faults_nothing_twice(rng, tiny_store):
    store, x = tiny_store
    slow = Slow(np.random.default_rng(0))
    cache = NgramRowCache.assemble(store, "t", slots=200, part_reader=slow.wrap)
    ids = rng.choice(3000, 150, replace=False)
    h = slow.prefetch(cache, np.concatenate([ids, ids[:20]]), False)
    assert h.rows == 150 and not h.exception()
    got = cache.resolve(ids)  # reads the rows in flight itself (or took them over)
    assert cache.last_faults == 150  # the rows whose mapping this call completed
    np.testing.assert_array_equal(cache.table[got].view(np.uint16), x[ids].view(np.uint16))
    assert h.wait(10) and h.done()
    cache.ready_event()  # commits the finished prefetches
    s = cache.stats()
    assert (s.misses, s.hits, s.prefetched) == (0, 150, 150)
    assert s.rows_read == 150 + s.rows_reread and s.rows_reread in (0, 150)
    again = cache.prefetch(ids)
    assert again.rows == 0 and again.done()
    cache.resolve(ids)
    assert cache.last_faults == 0 and cache.stats().rows_read == s.rows_read


def test_failed_prefetch_maps_nothing_and_raises_once_at_resolve(tiny_store):
    store, x = tiny_store
    slow = Slow(np.random.default_rng(0))
    cache = NgramRowCache.assemble(store, "t", slots=50, part_reader=slow.wrap)
    h = slow.prefetch(cache, np.arange(10, 20), True)
    assert h.wait(10) and isinstance(h.exception(), CorruptDataError)
    cache.resolve([1, 2])  # rows the prefetch did not hold: fine
    row_slot, slot_row = cache.inspect().slot_map()
    assert (row_slot[10:20] == -1).all() and (slot_row >= 0).sum() == 2
    before = cache.stats()
    with pytest.raises(CorruptDataError, match="prefetch of row 15"):
        cache.resolve([15, 1])
    assert cache.stats() == before  # nothing changed
    got = cache.resolve([15, 1])  # raised once; now an ordinary fault
    np.testing.assert_array_equal(cache.table[got].view(np.uint16), x[[15, 1]].view(np.uint16))
    assert cache.stats().prefetched == 0


def test_prefetch_shared_arena_rows_of_every_part(tmp_path, rng):
    store, xs = make_multi_store(tmp_path, rng)
    names = [t.name for t in store.tables]
    cache = NgramRowCache(store, names, slots=300)
    gids = np.concatenate([cache.global_ids(k, np.arange(5, 40, 3)) for k in range(len(names))])
    h = cache.prefetch(gids)
    h.wait()
    got = cache.resolve(gids)
    assert cache.stats().misses == 0
    k0 = np.arange(5, 40, 3)
    np.testing.assert_array_equal(
        cache.table[got[: k0.size]].view(np.uint16), xs[names[0]][k0].view(np.uint16)
    )


def gated(tmp_path, rng, slots, piece=8, merge=True):
    """A cache of ``slots`` over a fresh store, its prefetches read in pieces of ``piece``
    rows through a :class:`Gate` (``merge``: rows in flight read in a resolve's own read);
    returns (x, cache, gate)."""
    store, x = make_store(tmp_path, rng)
    gate = Gate()
    cache = NgramRowCache.assemble(
        store, "t", slots=slots, tuning=Tuning(piece_rows=piece, merge_in_flight=merge),
        part_reader=gate.wrap,
    )  # fmt: skip
    return x, cache, gate


def no_reserved(cache):
    """No slot is reserved by a prefetch piece (and the count agrees)."""
    t = cache.inspect().slot_table
    return t.reserved == 0 and not (t.state >= READING).any()


def test_resolve_reads_rows_of_queued_pieces_itself(tmp_path, rng):
    """A resolve that needs rows of prefetch pieces still queued reads just those rows
    (not after the piece in flight and every piece before them); each row is read once,
    and the handle is done only when every piece, and the rows taken over, are."""
    x, cache, gate = gated(tmp_path, rng, 200)
    ids = np.arange(100, 164)  # 8 pieces of 8 rows
    h = cache.prefetch(ids)
    assert h.rows == 64 and gate.started.wait(10)  # piece 0 in flight, held
    want = np.array([141, 150, 143, 100 + 47])  # rows of pieces 5 and 6, queued
    got = cache.resolve(want)  # does not wait for piece 0
    np.testing.assert_array_equal(cache.table[got].view(np.uint16), x[want].view(np.uint16))
    assert [r.tolist() for r in gate.caller_reads] == [[141, 143, 147, 150]]
    assert not h.done() and not h.wait(timeout=0.01)
    s = cache.stats()
    assert (s.misses, s.hits, s.prefetched, s.rows_read) == (0, 4, 4, 4)
    gate.open.set()
    assert h.wait(10) and h.done() and h.exception() is None
    got = cache.resolve(ids)
    np.testing.assert_array_equal(cache.table[got].view(np.uint16), x[ids].view(np.uint16))
    s = cache.stats()
    assert (s.misses, s.hits, s.prefetched, s.rows_read) == (0, 64, 64, 64)  # once a batch
    cache.end_step()
    check_invariants_no_ref(cache)


def test_resolve_reads_rows_of_a_piece_being_read_itself(tmp_path, rng):
    """A resolve that needs rows of the piece being read reads just those rows itself,
    into the slots the piece reserved, and does not wait for the piece; the piece still
    lands (the same bytes again), and only then are the slots victims again."""
    x, cache, gate = gated(tmp_path, rng, 40)
    ids = np.arange(100, 132)  # 4 pieces of 8 rows
    h = cache.prefetch(ids)
    assert gate.started.wait(10)  # piece 0 (rows 100..107) in flight, held
    want = np.array([105, 101, 105])
    got = cache.resolve(want)  # does not wait for piece 0
    np.testing.assert_array_equal(cache.table[got].view(np.uint16), x[want].view(np.uint16))
    assert [r.tolist() for r in gate.caller_reads] == [[101, 105]] and not h.done()
    s = cache.stats()
    assert (s.misses, s.hits, s.rows_read, s.rows_reread, s.prefetched) == (0, 2, 2, 2, 0)
    assert cache.last_faults == 2  # shown in the device map by this call
    cache.end_step()
    # 8 free slots left; 9 new rows need one more: the LRU's next victims are the unpinned
    # slots of piece 0, read or not, so the resolve waits for the piece (as if it had
    # landed at its call) rather than take a slot it still writes
    threading.Timer(0.2, gate.open.set).start()
    t0 = time.perf_counter()
    got = cache.resolve(np.arange(500, 509))
    assert time.perf_counter() - t0 > 0.15 and h.done()
    np.testing.assert_array_equal(cache.table[got].view(np.uint16), x[500:509].view(np.uint16))
    cache.end_step()
    got = cache.resolve(ids[8:])
    np.testing.assert_array_equal(cache.table[got].view(np.uint16), x[ids[8:]].view(np.uint16))
    s = cache.stats()
    assert (s.misses, s.prefetched, s.rows_reread) == (9, 32, 2)
    assert s.rows_read == s.misses + s.prefetched + s.rows_reread and s.evictions == 1
    assert no_reserved(cache)
    check_invariants_no_ref(cache)


@pytest.mark.parametrize("merge", [True, False])
def test_a_resolve_that_mostly_needs_pieces_in_flight_waits_for_them(tmp_path, rng, merge):
    """A resolve that needs at least ``WAIT_SHARE`` of a piece in flight (being read, or
    queued behind it) waits for it: nothing read twice, nothing read by the resolve;
    one that needs a few of another piece's rows still reads them itself."""
    x, cache, gate = gated(tmp_path, rng, 200, merge=merge)
    ids = np.arange(100, 132)  # 4 pieces of 8 rows
    h = cache.prefetch(ids)
    assert gate.started.wait(10)  # piece 0 in flight, held
    want = np.concatenate([np.arange(100, 106), np.arange(108, 114), [125]])  # 6/8, 6/8, 1/8
    threading.Timer(0.2, gate.open.set).start()
    t0 = time.perf_counter()
    got = cache.resolve(want)
    assert time.perf_counter() - t0 > 0.15  # waited for pieces 0 and 1
    np.testing.assert_array_equal(cache.table[got].view(np.uint16), x[want].view(np.uint16))
    # row 125 read by the resolve (taken over, or beside piece 3 once the thread started it:
    # then read twice), or not at all (piece 3 landed first); nothing else
    assert [r.tolist() for r in gate.caller_reads] in ([[125]], [])
    s = cache.stats()
    assert s.rows_reread <= 1 and s.misses == 0 and s.prefetch_wait_seconds > 0.1
    reread = s.rows_reread
    cache.end_step()
    assert h.wait(10)
    got = cache.resolve(ids)
    np.testing.assert_array_equal(cache.table[got].view(np.uint16), x[ids].view(np.uint16))
    s = cache.stats()
    assert (s.misses, s.prefetched, s.rows_reread, s.rows_read) == (0, 32, reread, 32 + reread)
    cache.end_step()
    assert no_reserved(cache)
    check_invariants_no_ref(cache)


@pytest.mark.parametrize("merge", [True, False])
def test_rows_in_flight_are_read_in_the_resolves_own_read(tmp_path, rng, merge):
    """A native resolve needing misses, rows of a piece being read and rows of a queued
    piece reads them all in one read (``merge``; unmerged: the rows in flight apart,
    first), into the victims and the reserved slots; the state after it is the same."""
    x, cache, gate = gated(tmp_path, rng, 60, merge=merge)
    h = cache.prefetch(np.arange(100, 124))  # pieces 100.., 108.., 116..; the first held
    assert gate.started.wait(10)
    want = np.array([300, 103, 117, 300, 5, 103])
    got = cache.resolve(want)
    np.testing.assert_array_equal(cache.table[got].view(np.uint16), x[want].view(np.uint16))
    reads = [r.tolist() for r in gate.caller_reads]
    assert reads == ([[5, 103, 117, 300]] if merge else [[117], [103], [5, 300]])
    s = cache.stats()
    assert (s.misses, s.hits, s.prefetched, s.rows_reread, s.rows_read) == (2, 2, 1, 1, 4)
    assert cache.last_faults == 4 and cache.inspect().rows_taken == 1
    assert s.prefetch_wait_seconds == 0 or not merge
    gate.open.set()
    assert h.wait(10) and h.exception() is None
    cache.end_step()
    got = cache.resolve(np.arange(100, 124))
    np.testing.assert_array_equal(cache.table[got].view(np.uint16), x[100:124].view(np.uint16))
    s = cache.stats()
    assert (s.misses, s.prefetched, s.rows_reread) == (2, 24, 1)
    assert s.rows_read == s.misses + s.prefetched + s.rows_reread
    assert no_reserved(cache)
    check_invariants_no_ref(cache)


def test_a_failed_merged_read_changes_nothing_and_settles(tmp_path, rng):
    """The resolve's one read (its misses and rows in flight) fails on a missing row: the
    rows in flight are read apart as before (their slots stay reserved by their piece
    meanwhile), and the call raises the miss's read error with nothing else changed."""
    x, cache, gate = gated(tmp_path, rng, 60)
    h = cache.prefetch(np.arange(100, 116))
    assert gate.started.wait(10)
    gate.fail = np.array([7])
    before = cache.inspect().slot_map()[0].copy()
    with pytest.raises(CorruptDataError, match="injected"):
        cache.resolve([7, 103, 111])
    reads = [r.tolist() for r in gate.caller_reads]
    assert reads == [[7, 103, 111], [111], [103], [7]]  # one read; then apart, then the miss
    row_slot = cache.inspect().slot_map()[0]
    assert row_slot[7] == -1 and (row_slot[100:116] == before[100:116]).all()
    state = cache.inspect().slot_table.state[row_slot[[103, 111]]]
    assert (state == [SlotState.READ, SlotState.RESIDENT]).all()  # read beside; taken over
    s = cache.stats()
    assert (s.misses, s.hits, s.rows_read, s.rows_reread, s.prefetched) == (0, 0, 2, 1, 1)
    gate.fail = gate.fail[:0]
    gate.open.set()
    assert h.wait(10)
    got = cache.resolve([7, 103, 111])
    np.testing.assert_array_equal(
        cache.table[got].view(np.uint16), x[[7, 103, 111]].view(np.uint16)
    )
    cache.end_step()
    assert no_reserved(cache)
    check_invariants_no_ref(cache)


def test_rows_read_beside_a_piece_that_fails_stay_mapped(tmp_path, rng):
    """A piece that fails after a resolve read some of its rows itself: those rows stay
    mapped (their read succeeded), the others map nothing and raise once."""
    x, cache, gate = gated(tmp_path, rng, 100)
    h = cache.prefetch(np.arange(0, 8))
    assert gate.started.wait(10)
    got = cache.resolve([2, 5])
    gate.fail, gate.fail_pieces = np.arange(8), True
    gate.open.set()
    assert h.wait(10) and isinstance(h.exception(), CorruptDataError)
    cache.end_step()
    cache.ready_event()  # commits the finished prefetches
    row_slot, _ = cache.inspect().slot_map()
    assert (row_slot[[2, 5]] >= 0).all() and (row_slot[[0, 1, 3, 4, 6, 7]] == -1).all()
    got = cache.resolve([5, 2])
    np.testing.assert_array_equal(cache.table[got].view(np.uint16), x[[5, 2]].view(np.uint16))
    with pytest.raises(CorruptDataError, match="prefetch of row 3 failed"):
        cache.resolve([2, 3])
    gate.fail = gate.fail[:0]
    got = cache.resolve([2, 3])  # raised once; now an ordinary fault
    np.testing.assert_array_equal(cache.table[got].view(np.uint16), x[[2, 3]].view(np.uint16))
    s = cache.stats()
    assert (s.misses, s.hits, s.prefetched, s.rows_reread) == (1, 4, 0, 2)
    assert no_reserved(cache)
    check_invariants_no_ref(cache)


def test_a_failed_read_beside_a_piece_waits_for_the_piece(tmp_path, rng):
    """A resolve whose own read of a piece's rows fails changes nothing and waits for the
    piece instead, whose read may still succeed."""
    x, cache, gate = gated(tmp_path, rng, 100)
    h = cache.prefetch(np.arange(0, 8))
    assert gate.started.wait(10)
    gate.fail = np.array([6])  # the resolve's own reads of row 6 fail
    threading.Timer(0.2, gate.open.set).start()
    t0 = time.perf_counter()
    got = cache.resolve([6, 1])
    assert time.perf_counter() - t0 > 0.15 and h.done() and h.exception() is None
    np.testing.assert_array_equal(cache.table[got].view(np.uint16), x[[6, 1]].view(np.uint16))
    s = cache.stats()
    assert (s.misses, s.hits, s.prefetched, s.rows_reread, s.rows_read) == (0, 2, 8, 0, 8)
    check_invariants_no_ref(cache)


def test_rows_taken_over_that_fail_map_nothing_and_raise_once(tmp_path, rng):
    x, cache, gate = gated(tmp_path, rng, 100, piece=4)
    h = cache.prefetch(np.arange(0, 16))
    assert gate.started.wait(10)
    gate.fail = np.array([9])
    with pytest.raises(CorruptDataError, match="prefetch of row 9"):
        cache.resolve([9, 50])
    row_slot, _ = cache.inspect().slot_map()
    assert row_slot[9] == -1 and row_slot[50] == -1  # the call changed nothing else
    assert isinstance(h.exception(), CorruptDataError)  # the handle shows the failure
    gate.fail = gate.fail[:0]
    got = cache.resolve([9, 50])  # raised once; now an ordinary fault
    np.testing.assert_array_equal(cache.table[got].view(np.uint16), x[[9, 50]].view(np.uint16))
    gate.open.set()
    assert h.wait(10)
    got = cache.resolve(np.arange(16))
    np.testing.assert_array_equal(cache.table[got].view(np.uint16), x[:16].view(np.uint16))
    s = cache.stats()  # only the needed row was taken over: its piece read 8, 10, 11
    assert (s.misses, s.prefetched, s.rows_read) == (2, 15, 17)


def check_invariants_no_ref(cache):
    row_slot, slot_row = cache.inspect().slot_map()
    mapped = np.flatnonzero(row_slot >= 0)
    assert np.array_equal(slot_row[row_slot[mapped]], mapped)


@pytest.mark.parametrize("native", [True, False])
def test_holds_all_says_whether_a_resolve_would_fault_or_wait(native, tiny_store):
    """``holds_all`` is True exactly when a resolve of the rows would neither fault, wait
    nor commit a prefetch: resident rows yes; a missing row, a row of a prefetch in
    flight or landed but not committed, or of a failed prefetch no; bad ids raise as
    resolve does; it changes no state or count. ``native``: int64 arrays through the C
    scan (no prefetch busy), else the NumPy path."""
    from rowcache.errors import RowRangeError
    from rowcache.kernels import host

    store, _ = tiny_store
    gate = Gate()
    cache = NgramRowCache.assemble(
        store, "t", slots=100, tuning=Tuning(native=native), part_reader=gate.wrap
    )
    assert (cache.inspect().lru.native is not None) == (native and host.native is not None)

    def holds(ids):
        return cache.holds_all(np.asarray(ids, dtype=np.int64) if native else ids)

    assert holds(np.zeros(0, dtype=np.int64))
    cache.resolve([3, 4, 5])
    cache.end_step()
    before, maps = cache.stats(), cache.inspect().slot_map()
    assert holds([5, 3, 3]) and not holds([3, 6])
    with pytest.raises(RowRangeError, match=r"row_ids\[1\]"):
        holds([3, store.tables[0].rows])
    with pytest.raises(RowRangeError):
        holds([-1])
    assert cache.stats() == before
    for a, b in zip(cache.inspect().slot_map(), maps):
        np.testing.assert_array_equal(a, b)
    h = cache.prefetch([20, 21])
    assert gate.started.wait(10)
    assert not holds([3, 20]) and holds([3, 4])  # 20 is in flight
    gate.open.set()
    assert h.wait(10)
    assert not holds([20])  # landed, not yet committed: a resolve would commit it
    cache.ready_event()  # commits the finished prefetches
    assert holds([3, 20, 21])
    gate.fail, gate.fail_pieces = np.array([30]), True  # the cache's reads of row 30 fail
    h = cache.prefetch([30])
    h.wait(10)
    assert h.exception() is not None
    assert not holds([30]) and holds([3])  # 30's error is owed
    cache.ready_event()  # commits the finished prefetches
    assert not holds([30]) and holds([3])
    with pytest.raises(CorruptDataError):
        cache.resolve([30])
    cache.end_step()
    assert holds([3, 4, 5])


def test_member_is_isin_against_a_sorted_set(rng):
    """The prefetcher's membership test: np.isin, for any values against a sorted set."""
    for n, k, hi in ((0, 1, 5), (1, 1, 3), (50, 1, 10), (1024, 7, 40), (1024, 300, 5000)):
        values = rng.integers(-2, hi + 2, n).astype(np.int32)
        s = np.unique(rng.integers(0, hi, k)).astype(np.int32)
        got = member(values, s)
        assert got.dtype == bool and np.array_equal(got, np.isin(values, s)), (n, k, hi)


def test_exhaustion_waits_for_prefetches_then_names_pins_and_reservations(tmp_path, rng):
    """A batch that does not fit while prefetch pieces hold slots first waits for them (their
    slots may become victims), then is refused with the batch's pins and the slots still
    reserved by prefetches named (it once said '0 free or unpinned (0 pinned by the step)'
    where the pieces held the slots)."""
    store, _ = make_store(tmp_path, rng)
    cache, gate = gated_cache(store, "t", 50)
    cache.resolve(np.arange(30))  # 30 pinned
    cache.prefetch(np.arange(1000, 1015))  # 15 reserved while the gate holds the read
    assert gate.started.wait(10)
    threading.Timer(0.3, gate.open.set).start()  # the pieces land while the resolve waits
    msg = (
        r"needs 25 more slots but only 20 of 50 are free or unpinned "
        r"\(30 pinned by the step, 0 reserved by prefetches in flight\)"
    )
    with pytest.raises(ArenaExhaustedError, match=msg):
        cache.resolve(np.arange(2000, 2025))
    cache.end_step()
    check_pieces(cache)
