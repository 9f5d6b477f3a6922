"""NgramRowCache.resolve_deferred: a fault whose read outlives the call, committed by the
next call. Against the same calls made with resolve_host on a twin cache (maps, arena,
stats, pins and LRU order equal after every settle), with prefetches in flight, and with
a failed read (the next call raises; nothing changed)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from rowcache import NgramRowCache
from rowcache.cache.parts import PartReader
from rowcache.errors import ArenaExhaustedError, CorruptDataError
from tests.cache.support import check_pieces, gated_cache, make_multi_store, make_store

pytest.importorskip("rowcache.io._rcio", reason="reads apart need the native reader")

COUNTED = ("lookups", "hits", "misses", "evictions", "rows_read", "bytes_read", "read_ops",
           "batches", "prefetched", "rows_reread")  # fmt: skip


def same_state(a: NgramRowCache, b: NgramRowCache) -> None:
    """Two caches that made the same calls hold the same rows in the same slots, with
    the same pins, LRU order, arena rows and counts."""
    ra, sa = a.slot_map()
    rb, sb = b.slot_map()
    np.testing.assert_array_equal(ra, rb)
    np.testing.assert_array_equal(sa, sb)
    np.testing.assert_array_equal(a.pin_counts(), b.pin_counts())
    mapped = np.flatnonzero(sa >= 0)
    np.testing.assert_array_equal(a.table[mapped].view(np.uint8), b.table[mapped].view(np.uint8))
    sta, stb = a.stats(), b.stats()
    assert [getattr(sta, f) for f in COUNTED] == [getattr(stb, f) for f in COUNTED]
    # the LRU order: the victims a large call would take are the same
    assert a.lru.choose_victims(min(20, a.num_slots - a.pinned))[0].tolist() == (
        b.lru.choose_victims(min(20, b.num_slots - b.pinned))[0].tolist()
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
            b.resolve_host(ids)
        except ArenaExhaustedError:
            with pytest.raises(ArenaExhaustedError):
                a.resolve_deferred(ids)
            a.end_batch(), b.end_batch()
            continue
        faults = a.resolve_deferred(ids)
        assert faults == b.last_faults
        deferred += a.pending
        if kind == 2:
            a.settle()  # explicitly
        if kind in (3, 6):
            a.end_batch(), b.end_batch()
        same_state(a, b)  # (slot_map settles)
        got = a.resolve_host(ids)  # hits now: the arena holds the rows
        np.testing.assert_array_equal(got, b.resolve_host(ids))
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


@pytest.mark.parametrize("raiser", ["settle", "end_batch", "resolve", "stats", "prefetch"])
def test_a_failed_deferred_read_raises_at_the_next_call_and_changes_nothing(raiser, tiny_store):
    store, x = tiny_store
    cache = NgramRowCache(store, "t", slots=100)
    cache.resolve_host(np.arange(0, 40))
    cache.end_batch()
    cache.settle()
    before = cache.slot_map(), cache.pin_counts(), cache.stats()
    flip_byte(store, 0, 2222)
    assert cache.resolve_deferred(np.array([5, 2222, 1500, 7])) == 2  # 2222, 1500 read
    assert cache.pending  # not raised yet
    assert cache.poll() == 0 and cache.pending  # poll leaves it
    if raiser == "end_batch":  # the batch ends; the next call raises
        cache.end_batch()
        assert cache.pending
        raiser = "settle"
    call = {
        "settle": cache.settle,
        "resolve": lambda: cache.resolve([9]),
        "stats": cache.stats,
        "prefetch": lambda: cache.prefetch([600]),
    }[raiser]
    with pytest.raises(CorruptDataError, match="checksum"):
        call()
    assert not cache.pending and cache.last_faults == 0
    row_slot, slot_row = cache.slot_map()
    np.testing.assert_array_equal(row_slot, before[0][0])
    np.testing.assert_array_equal(slot_row, before[0][1])
    s = cache.stats()
    for f in ("lookups", "hits", "misses", "evictions", "rows_read", "read_ops"):
        assert getattr(s, f) == getattr(before[2], f), f
    np.testing.assert_array_equal(cache.pin_counts(), before[1])
    got = cache.resolve([5, 1500, 7])  # the cache goes on: the good rows fault normally
    np.testing.assert_array_equal(cache.table[got].view(np.uint16), x[[5, 1500, 7]].view(np.uint16))


def test_deferred_read_takes_rows_of_pieces_in_flight_too(tiny_store):
    """Rows of prefetch pieces in flight are read in the deferred read, beside its misses,
    and committed at the next call as a resolve_host would."""
    store, x = tiny_store
    cache, gate = gated_cache(store, "t", 60, piece=8)
    h = cache.prefetch(np.arange(100, 124))
    assert gate.started.wait(10)  # piece 100.. held; 108.., 116.. queued
    assert cache.resolve_deferred(np.array([300, 103, 117, 5])) == 4
    assert not gate.caller_reads  # read apart, by the reader's thread, not PartReader.read
    cache.settle()
    s = cache.stats()
    assert (s.misses, s.hits, s.prefetched, s.rows_reread, s.rows_read) == (2, 2, 1, 1, 4)
    got = cache.resolve(np.array([300, 103, 117, 5]))
    np.testing.assert_array_equal(
        cache.table[got].view(np.uint16), x[[300, 103, 117, 5]].view(np.uint16)
    )
    gate.open.set()
    assert h.wait(10)
    cache.end_batch()
    got = cache.resolve(np.arange(100, 124))
    np.testing.assert_array_equal(cache.table[got].view(np.uint16), x[100:124].view(np.uint16))
    assert cache.slot_table.reserved == 0
    check_pieces(cache)


def test_two_caches_on_one_store_both_read_apart(tmp_path, rng):
    """Two caches over one store (one reader) deferring in turn: the second reads apart on
    a sibling reader of its own; both commit what resolve_host would."""
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
        b1.resolve_host(i1)
        b2.resolve_host(i2)
        assert (a1.resolve_deferred(i1), a2.resolve_deferred(i2)) == (
            b1.last_faults,
            b2.last_faults,
        )
        assert a1.pending and a2.pending
        for c in (a1, a2, b1, b2):
            c.end_batch()
        same_state(a1, b1)
        same_state(a2, b2)
    assert reads[1].reads_apart_alone and not reads[0].reads_apart_alone
