"""NgramRowCache.resolve(ids, defer=True): a fault whose read outlives the call, committed
by its handle's wait() and never by a later call (which raises PendingResolveError). Against
the same calls made with resolve(ids, host=True) on a twin cache (maps, arena, stats, pins
and LRU order equal after every wait), with prefetches in flight, and with a failed read
(the wait raises; nothing changed)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from rowcache import NgramRowCache
from rowcache.cache.parts import PartReader
from rowcache.errors import ArenaExhaustedError, CorruptDataError, PendingResolveError
from tests.cache.support import check_pieces, gated_cache, make_multi_store, make_store

pytest.importorskip("rowcache.io._rcio", reason="reads apart need the native reader")

COUNTED = ("lookups", "hits", "misses", "evictions", "rows_read", "bytes_read", "read_ops",
           "batches", "prefetched", "rows_reread")  # fmt: skip


def same_state(a: NgramRowCache, b: NgramRowCache) -> None:
    """Two caches that made the same calls hold the same rows in the same slots, with
    the same pins, LRU order, arena rows and counts."""
    ra, sa = a.inspect().slot_map()
    rb, sb = b.inspect().slot_map()
    np.testing.assert_array_equal(ra, rb)
    np.testing.assert_array_equal(sa, sb)
    np.testing.assert_array_equal(a.inspect().pin_counts(), b.inspect().pin_counts())
    mapped = np.flatnonzero(sa >= 0)
    np.testing.assert_array_equal(a.table[mapped].view(np.uint8), b.table[mapped].view(np.uint8))
    sta, stb = a.stats(), b.stats()
    assert [getattr(sta, f) for f in COUNTED] == [getattr(stb, f) for f in COUNTED]
    # the LRU order: the victims a large call would take are the same
    assert a.inspect().lru.choose_victims(min(20, a.num_slots - a.inspect().pinned))[0].tolist() == (
        b.inspect().lru.choose_victims(min(20, b.num_slots - b.inspect().pinned))[0].tolist()
    )
    check_pieces(a)
    check_pieces(b)


@pytest.mark.parametrize("shared", [False, True])
def test_deferred_resolves_leave_what_resolve_host_leaves(tmp_path, rng, shared):
    if shared:
        store, tabs = make_multi_store(tmp_path, rng)
        names, rows = list(tabs), sum(t.shape[0] for t in tabs.values())
    else:
        store, _ = make_store(tmp_path, rng)
        names, rows = "t", 3000
    a = NgramRowCache(store, names, slots=160)
    b = NgramRowCache(store, names, slots=160)
    deferred = 0
    for step in range(80):
        ids = rng.zipf(1.3, int(rng.integers(1, 90))) % rows
        kind = step % 7
        if kind == 5:  # a prefetch, landed before the next call (its timing is not compared)
            a.prefetch(ids).wait()
            b.prefetch(ids).wait()
            continue
        try:
            want = b.resolve(ids, host=True)
        except ArenaExhaustedError:
            with pytest.raises(ArenaExhaustedError):
                a.resolve(ids, defer=True)
            a.end_step(), b.end_step()
            continue
        h = a.resolve(ids, defer=True)
        assert h.faults == b.last_faults
        deferred += not h.committed
        if not h.committed:  # a later call never commits it: it refuses
            with pytest.raises(PendingResolveError, match="wait"):
                a.inspect().slot_map()
            with pytest.raises(PendingResolveError, match="wait"):
                a.resolve(ids[:1], host=True)
        if kind in (3, 6):  # the step ends before the commit: it then pins nothing
            a.end_step(), b.end_step()
        np.testing.assert_array_equal(h.wait(), want)  # the slots resolve gave
        same_state(a, b)
        got = a.resolve(ids, host=True)  # hits now: the arena holds the rows
        np.testing.assert_array_equal(got, b.resolve(ids, host=True))
    assert deferred > 10


def flip_byte(store, part, row):
    info = store.tables[part]
    shard, off = info.locate(np.array([row]))
    path = os.path.join(store.path, store.shards[part][int(shard[0])].file)
    with open(path, "r+b") as f:
        f.seek(int(off[0]) + 3)
        b = f.read(1)
        f.seek(int(off[0]) + 3)
        f.write(bytes([b[0] ^ 0x04]))


@pytest.mark.parametrize("caller", ["wait", "end_step", "resolve", "stats", "prefetch"])
def test_a_failed_deferred_read_raises_at_its_wait_and_changes_nothing(caller, tiny_store):
    store, x = tiny_store
    cache = NgramRowCache(store, "t", slots=100)
    cache.resolve(np.arange(0, 40), host=True)
    cache.end_step()
    before = cache.inspect().slot_map(), cache.inspect().pin_counts(), cache.stats()
    flip_byte(store, 0, 2222)
    h = cache.resolve(np.array([5, 2222, 1500, 7]), defer=True)
    assert h.faults == 2  # 2222, 1500 read
    assert not h.committed and cache.inspect().pending  # not raised yet
    assert cache.ready_event() is None and cache.inspect().pending  # (the CPU) leaves it
    if caller == "end_step":  # the step ends; the handle still raises at its wait
        cache.end_step()
        assert cache.inspect().pending
    if caller in ("resolve", "prefetch"):  # a later call refuses; it commits nothing
        call = {"resolve": lambda: cache.resolve([9]), "prefetch": lambda: cache.prefetch([600])}
        with pytest.raises(PendingResolveError, match=r"wait\(\)"):
            call[caller]()
        assert cache.inspect().pending
    if caller == "stats":  # counts without the pending resolve, which stays pending
        s = cache.stats()
        for f in ("lookups", "misses", "rows_read"):
            assert getattr(s, f) == getattr(before[2], f), f
        assert cache.inspect().pending
    with pytest.raises(CorruptDataError, match="checksum"):
        h.wait()
    with pytest.raises(CorruptDataError, match="checksum"):  # the same error again
        h.wait()
    assert not cache.inspect().pending and cache.last_faults == 0
    row_slot, slot_row = cache.inspect().slot_map()
    np.testing.assert_array_equal(row_slot, before[0][0])
    np.testing.assert_array_equal(slot_row, before[0][1])
    s = cache.stats()
    for f in ("lookups", "hits", "misses", "evictions", "rows_read", "read_ops"):
        assert getattr(s, f) == getattr(before[2], f), f
    np.testing.assert_array_equal(cache.inspect().pin_counts(), before[1])
    got = cache.resolve([5, 1500, 7])  # the cache goes on: the good rows fault normally
    np.testing.assert_array_equal(cache.table[got].view(np.uint16), x[[5, 1500, 7]].view(np.uint16))


def test_deferred_read_takes_rows_of_pieces_in_flight_too(tiny_store):
    """Rows of prefetch pieces in flight are read in the deferred read, beside its misses,
    and committed by the handle's wait() as resolve(host=True) would."""
    store, x = tiny_store
    cache, gate = gated_cache(store, "t", 60, piece=8)
    h = cache.prefetch(np.arange(100, 124))
    assert gate.started.wait(10)  # piece 100.. held; 108.., 116.. queued
    d = cache.resolve(np.array([300, 103, 117, 5]), defer=True)
    assert d.faults == 4
    assert not gate.caller_reads  # read apart, by the reader's thread, not PartReader.read
    d.wait()
    s = cache.stats()
    assert (s.misses, s.hits, s.prefetched, s.rows_reread, s.rows_read) == (2, 2, 1, 1, 4)
    got = cache.resolve(np.array([300, 103, 117, 5]))
    np.testing.assert_array_equal(
        cache.table[got].view(np.uint16), x[[300, 103, 117, 5]].view(np.uint16)
    )
    gate.open.set()
    assert h.wait(10)
    cache.end_step()
    got = cache.resolve(np.arange(100, 124))
    np.testing.assert_array_equal(cache.table[got].view(np.uint16), x[100:124].view(np.uint16))
    assert cache.inspect().slot_table.reserved == 0
    check_pieces(cache)


def test_two_caches_on_one_store_both_read_apart(tmp_path, rng):
    """Two caches over one store (one reader) deferring in turn: the second reads apart on
    a sibling reader of its own; both commit what resolve(host=True) would."""
    store, tabs = make_multi_store(tmp_path, rng)
    names = list(tabs)
    reads: list[PartReader] = []  # a1's and a2's
    a1, a2 = (
        NgramRowCache.assemble(store, n, slots=k, part_reader=lambda r: reads.append(r) or r)
        for n, k in ((names[:2], 100), (names[2:], 90))
    )
    b1, b2 = NgramRowCache(store, names[:2], slots=100), NgramRowCache(store, names[2:], slots=90)
    for _ in range(12):
        i1, i2 = rng.integers(0, 600, 30), rng.integers(0, 600, 25)
        b1.resolve(i1, host=True)
        b2.resolve(i2, host=True)
        h1, h2 = a1.resolve(i1, defer=True), a2.resolve(i2, defer=True)
        assert (h1.faults, h2.faults) == (b1.last_faults, b2.last_faults)
        assert not h1.committed and not h2.committed
        for c in (a1, a2, b1, b2):
            c.end_step()
        h1.wait(), h2.wait()
        same_state(a1, b1)
        same_state(a2, b2)
    assert reads[1].reads_apart_alone and not reads[0].reads_apart_alone
