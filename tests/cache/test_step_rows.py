"""StepRows: a step's rows over its caches. One prefetch and one resolve per cache whatever
its number of members, slots back in the members' order (2-D ids and ragged lists), the
step ended once per cache (also as a context manager), deferred resolves committed by the
owner (settle, or its next call) and never by a cache's later call, and one-line errors for
bad members and ids. CPU; the GPU's stream order runs through the embeddings' GPU tests."""

from __future__ import annotations

import numpy as np
import pytest

from rowcache import NgramRowCache
from rowcache.cache.step_rows import StepRows
from rowcache.errors import ConfigError, CorruptDataError, PendingResolveError
from tests.cache.support import check_pieces, expected_part, gather, make_multi_store
from tests.cache.test_deferred import flip_byte


@pytest.fixture
def two_caches(tmp_path, rng):
    """A shared cache over t0..t2 and one over t3, with members in a non-consecutive
    order: [(shared, 0), (single, 0), (shared, 2), (shared, 1)]."""
    store, _tabs = make_multi_store(tmp_path, rng)
    shared = NgramRowCache(store, ["t0", "t1", "t2"], slots=300)
    single = NgramRowCache(store, "t3", slots=100)
    members = [(shared, 0), (single, 0), (shared, 2), (shared, 1)]
    names = ["t0", "t3", "t2", "t1"]
    yield store, shared, single, StepRows(members), names
    store.close()


def _count(monkeypatch, cache):
    calls = []
    real = cache.resolve

    def counting(ids, **kw):
        calls.append(int(np.asarray(ids).size))
        return real(ids, **kw)

    monkeypatch.setattr(cache, "resolve", counting)
    return calls


def test_one_resolve_per_cache_and_slots_in_member_order(two_caches, rng, monkeypatch):
    store, shared, single, rows, names = two_caches
    assert rows.caches == [shared, single] and len(rows) == 4 and rows
    a, b = _count(monkeypatch, shared), _count(monkeypatch, single)
    for _step in range(6):
        ids = rng.integers(0, 300, (4, 12))
        with rows:
            slots = rows.resolve(ids)
            assert slots.shape == (4, 12) and slots.dtype == np.int32
            for k, name in enumerate(names):  # each member's rows, by the reference gather
                cache = single if k == 1 else shared
                np.testing.assert_array_equal(
                    gather(cache, slots[k]).view(np.uint16),
                    expected_part(store, name, ids[k]).view(np.uint16),
                )
        assert shared.inspect().pinned == 0 and single.inspect().pinned == 0
    assert (len(a), len(b)) == (6, 6)  # one call per cache and step
    assert a == [36] * 6 and b == [12] * 6
    assert shared.stats().batches == 6 and single.stats().batches == 6  # ended once each
    check_pieces(shared)
    check_pieces(single)


def test_ragged_ids_a_member_and_host_slots(two_caches, rng):
    store, shared, single, rows, names = two_caches
    ids = [rng.integers(0, 300, n) for n in (5, 0, 9, 3)]
    slots = rows.resolve(ids, host=True)
    assert [s.size for s in slots] == [5, 0, 9, 3]
    for k, name in enumerate(names):
        cache = single if k == 1 else shared
        np.testing.assert_array_equal(
            gather(cache, slots[k]).view(np.uint16),
            expected_part(store, name, ids[k]).view(np.uint16),
        )
    rows.end_step()


def test_prefetch_holds_all_and_faults(two_caches, rng):
    _, shared, single, rows, _ = two_caches
    ids = rng.integers(0, 300, (4, 20))
    assert not rows.holds_all(ids)
    h = rows.prefetch(ids)
    off = shared.row_offsets
    cold = np.unique(np.concatenate([ids[0] + off[0], ids[2] + off[2], ids[3] + off[1]])).size
    assert (h.rows, h.dropped) == (cold + np.unique(ids[1]).size, 0)  # one prefetch a cache
    assert h.wait(10) and h.exception() is None
    assert rows.ready_events() == []  # (the CPU: none; it commits the landed pieces)
    assert rows.holds_all(ids)
    rows.resolve(ids)
    assert rows.faults == 0  # every row came by the prefetch
    rows.end_step()
    more = ids.copy()
    more[1, 0] = 299 if 299 not in ids[1] else 298
    if not single.inspect().is_resident([more[1, 0]])[0]:
        rows.resolve(more)
        assert rows.faults == 1
        rows.end_step()


def test_deferred_resolves_are_committed_by_the_owner_only(two_caches, rng):
    store, shared, single, rows, _ = two_caches
    ids = rng.integers(0, 300, (4, 15))
    assert rows.resolve(ids, defer=True) is None
    assert rows.faults > 0
    if rows.pending:  # read apart: a cache's own later call refuses, never commits
        with pytest.raises(PendingResolveError, match=r"wait\(\)"):
            shared.resolve(np.arange(3))
    slots = rows.resolve(ids)  # the owner's next call commits first: all hits now
    assert rows.faults == 0 and not rows.pending
    assert not shared.inspect().pending and not single.inspect().pending
    rows.end_step()
    # a failed deferred read: settle raises it once every cache was waited for
    flip_byte(store, 3, 77)  # t3's row 77 (the single cache)
    bad = np.zeros((4, 2), dtype=np.int64)
    bad[:, 0], bad[1] = 150, [77, 78]
    rows.resolve(bad, defer=True)
    with pytest.raises(CorruptDataError, match="checksum"):
        rows.settle()
    assert not rows.pending and not single.inspect().pending
    assert not single.inspect().is_resident([77]).any()  # nothing of it committed
    rows.settle()  # nothing left: no error
    rows.end_step()
    assert slots.shape == (4, 15)


def test_resolve_member_reads_one_table(two_caches, rng):
    store, shared, single, rows, _names = two_caches
    ids = rng.integers(0, 300, 10)
    got = rows.resolve_member(2, ids)  # t2, a part of the shared cache
    np.testing.assert_array_equal(
        gather(shared, got).view(np.uint16), expected_part(store, "t2", ids).view(np.uint16)
    )
    got = rows.resolve_member(1, ids)  # t3, the single cache
    np.testing.assert_array_equal(
        gather(single, got).view(np.uint16), expected_part(store, "t3", ids).view(np.uint16)
    )
    rows.end_step()
    assert shared.inspect().pinned == 0 and single.inspect().pinned == 0


def test_bad_members_and_ids_are_one_line_errors(two_caches):
    _, shared, single, rows, _ = two_caches
    with pytest.raises(ConfigError, match=r"members\[0\]: give a \(cache, part\) pair"):
        StepRows([shared])
    with pytest.raises(ConfigError, match=r"members\[1\]: give an NgramRowCache"):
        StepRows([(shared, 0), (object(), 0)])
    with pytest.raises(ConfigError, match=r"members\[0\]: part=3 is out of range.*0\.\.2"):
        StepRows([(shared, 3)])
    with pytest.raises(ConfigError, match=r"part must be an int"):
        StepRows([(single, True)])
    with pytest.raises(ConfigError, match=r"give int \[4, n\]"):
        rows.resolve(np.zeros((3, 5), dtype=np.int64))
    with pytest.raises(ConfigError, match=r"one id vector a member \(4\), got 2"):
        rows.prefetch([np.arange(3), np.arange(3)])
    assert not StepRows([])
    assert StepRows([]).resolve([]) == []


def test_ids_made_global_by_the_caller_split_the_same(two_caches, rng):
    """``global_ids(ids + offsets[:, None], offset=False)`` (a caller whose hash adds the
    members' offsets as it writes, as LongCat's does) splits into exactly the caches' ids
    ``global_ids(ids)`` makes, for members spread over caches and for one cache holding
    every member in order (whose ids are then taken as they are), 2-D and ragged."""
    _, shared, single, rows, _ = two_caches
    assert rows.offsets.tolist() == [
        shared.row_offsets[0],
        single.row_offsets[0],
        shared.row_offsets[2],
        shared.row_offsets[1],
    ]
    whole = StepRows([(shared, 0), (shared, 1), (shared, 2)])
    for step_rows in (rows, whole):
        m = len(step_rows)
        ids = rng.integers(0, 300, (m, 9))
        made = step_rows.global_ids(ids + step_rows.offsets[:, None], offset=False)
        want = step_rows.global_ids(ids)
        for a, b in zip(made.per_group, want.per_group):
            assert a.dtype == np.int64 and a.flags.c_contiguous
            np.testing.assert_array_equal(a, b)
        ragged = [ids[k, : k + 2] for k in range(m)]
        made = step_rows.global_ids(
            [r + o for r, o in zip(ragged, step_rows.offsets)], offset=False
        )
        for a, b in zip(made.per_group, step_rows.global_ids(ragged).per_group):
            np.testing.assert_array_equal(a, b)
        with step_rows:  # and resolve the same slots either way
            np.testing.assert_array_equal(
                step_rows.resolve(
                    step_rows.global_ids(ids + step_rows.offsets[:, None], offset=False)
                ),
                step_rows.resolve(ids),
            )
    with pytest.raises(ConfigError, match="ids"):
        whole.global_ids(np.zeros((2, 4), np.int64), offset=False)
