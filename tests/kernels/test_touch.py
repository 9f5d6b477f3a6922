"""The deferred touch (kernels/_touch.h) against lru_hits, and a cache that defers its
touches against one that does not (same slots, state, stats and errors)."""

from __future__ import annotations

import dataclasses
import os
import threading

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rowcache
import rowcache.kernels.host as host
from rowcache.cache.row_cache import Tuning
from tests.kernels.support import assert_same_runs, hits_arrays, hits_call, lru_state

pytestmark = pytest.mark.skipif(host.native is None, reason="rowcache.kernels._host not built")


def _deferred_call(ids, arrays, threads, tail, head=0):
    """LruState.scan, then touch_start and its wait, on copies of ``arrays``."""
    nat = host.native
    row_slot, last_used, log, log_pos = (a.copy() for a in arrays[:4])
    out = np.zeros(ids.size, dtype=np.int32)
    scratch = np.zeros(2 * ids.size, dtype=np.int32)
    status, bad = lru_state(row_slot).scan(ids, out, scratch, threads)
    if status:
        return (status, bad), out, last_used, log, log_pos
    h = lru_state(row_slot, last_used, log, log_pos).touch_start(scratch, ids.size, head, tail, 2,
                            threads)  # fmt: skip
    res = h if type(h) is tuple else nat.lru_touch_wait(h)
    return res, out, last_used, log, log_pos


@pytest.mark.parametrize("case", ["blocks", "shuffled", "miss", "bad_late", "full_log"])
@pytest.mark.parametrize("threads", [1, 3, 8])
def test_scan_and_deferred_touch_equal_lru_hits(case, threads):
    """The same slots, status, pins and LRU log as one lru_hits call: a shared arena's
    step (disjoint blocks), shuffled ids (one part logs), a miss and a bad id (the scan
    reports them and nothing changes), and a log with no room (the touch compacts it
    first, as the cache does when lru_hits answers 3)."""
    rng = np.random.default_rng(11)
    arrays = hits_arrays(rng)
    mapped = arrays[4]
    cuts = np.linspace(0, mapped.size, 13).astype(int)
    ids = np.concatenate(
        [rng.choice(mapped[cuts[k] : cuts[k + 1]], 2048) for k in range(12)]
    ).astype(np.int64)
    tail = mapped.size
    if case == "shuffled":
        ids = rng.permutation(ids)
    elif case == "miss":
        ids[5] = np.flatnonzero(arrays[0] < 0)[0]
    elif case == "bad_late":
        ids[3] = np.flatnonzero(arrays[0] < 0)[0]
        ids[-7] = arrays[0].size + 5
    elif case == "full_log":  # live entries at the end of a full log, stale ones before
        log, log_pos = arrays[2], arrays[3]
        S, C = log_pos.size, log.size
        log[:] = rng.integers(0, S, C).astype(np.int32)
        log[C - S :] = rng.permutation(S).astype(np.int32)
        log_pos[log[C - S :]] = np.arange(C - S, C, dtype=np.int32)
        tail = C
    got = _deferred_call(ids, arrays, threads, tail)
    if case in ("miss", "bad_late"):
        want = hits_call(ids, arrays, 1, tail)
        assert got[0] == ((1, 0) if case == "miss" else (2, ids.size - 7))
        assert want[0][0] == got[0][0]
        if case == "miss":
            np.testing.assert_array_equal(got[1], want[1])
        for u, v in zip(got[2:], arrays[1:4]):
            np.testing.assert_array_equal(u, v)  # the scan changed nothing
        return
    if case == "full_log":
        compacted = hits_call(ids, arrays, 1, tail)
        assert compacted[0][0] == 3  # lru_hits leaves the compaction to its caller
        ref = [a.copy() for a in arrays[:4]]
        new_tail = lru_state(None, None, ref[2], ref[3]).compact(0, tail)
        want = hits_call(ids, (*ref, mapped), 1, new_tail)
        assert got[0] == (0, want[0][1], 0, want[0][2])
    else:
        want = hits_call(ids, arrays, 1, tail)
        assert got[0] == (0, want[0][1], 0, want[0][2])
    for u, v in zip(got[1:], want[1:]):
        np.testing.assert_array_equal(u, v)


def test_touch_arguments_are_checked_and_many_pending_touches_finish():
    nat = host.native
    rng = np.random.default_rng(3)
    row_slot, last_used, log, log_pos, mapped = hits_arrays(rng, 5000, 2000, 2000)
    scratch = np.zeros(64, dtype=np.int32)
    with pytest.raises(ValueError, match="shapes"):
        lru_state(row_slot, last_used, log, log_pos).touch_start(scratch, 33, 0, 2000, 1)
    with pytest.raises(TypeError, match="last_used"):
        lru_state(row_slot, log, log, log_pos).touch_start(scratch, 4, 0, 2000, 1)
    with pytest.raises(ValueError, match="no touch"):
        nat.lru_touch_wait(99)
    # more touches pending than the C side holds (32): the later ones run in the call
    arrays = [(a.copy(), b.copy(), c.copy()) for a, b, c in [(last_used, log, log_pos)] * 40]
    handles, want = [], []
    for lu, lg, lp in arrays:
        ids = np.sort(rng.choice(mapped, 30)).astype(np.int64)
        out, scr = np.empty(30, np.int32), np.empty(60, np.int32)
        assert lru_state(row_slot).scan(ids, out, scr)[0] == 0
        handles.append(lru_state(row_slot, lu, lg, lp).touch_start(scr, 30, 0, 2000, 2))
        ref = hits_call(ids, (row_slot, last_used, log, log_pos), 1, 2000)
        want.append(ref)
    assert sum(type(h) is tuple for h in handles) >= 8  # ran by their callers
    for h, (lu, lg, lp), ref in zip(handles, arrays, want):
        res = h if type(h) is tuple else nat.lru_touch_wait(h)
        assert res == (0, ref[0][1], 0, ref[0][2])
        np.testing.assert_array_equal(lu, ref[2])
        np.testing.assert_array_equal(lg, ref[3])
        np.testing.assert_array_equal(lp, ref[4])


def _sequential(steps, arrays, tail):
    """LruState.hits call after call (compacting when it answers 3, as the cache does) on
    copies of ``arrays``: per call (fresh, head, tail), and the arrays after the last."""
    row_slot, last_used, log, log_pos = (a.copy() for a in arrays[:4])
    head, got = 0, []
    for ids, batch in steps:
        out, scr = np.empty(ids.size, np.int32), np.empty(2 * ids.size, np.int32)
        c = lru_state(row_slot, last_used, log, log_pos)
        st_, fresh, t = c.hits(ids, tail, batch, out, scr, 2)
        if st_ == 3:
            tail, head = c.compact(head, tail), 0
            st_, fresh, t = c.hits(ids, tail, batch, out, scr, 2)
        assert st_ == 0
        tail = t
        got.append((0, fresh, head, tail))
    return got, (last_used, log, log_pos)


@pytest.mark.parametrize("spare", [30_000, 9_000])  # 9,000: the log fills mid-chain
@pytest.mark.parametrize("threads", [1, 4])
def test_chained_touches_equal_lru_hits_in_turn(spare, threads):
    """Touches started one behind another (``after``: each starts from the log bounds
    the previous one leaves; its own head and tail are ignored), batches changing on the
    way, waited for at the end: each result and the final pins and log are those of
    lru_hits calls in turn. A chain over a log that fills compacts inside a touch."""
    nat = host.native
    rng = np.random.default_rng(5)
    arrays = hits_arrays(rng, spare=spare)
    row_slot, mapped = arrays[0], arrays[4]
    steps = [(rng.choice(mapped, 3000 + 500 * k).astype(np.int64), 2 + k // 2) for k in range(7)]
    want, final = _sequential(steps, arrays, mapped.size)
    last_used, log, log_pos = (a.copy() for a in arrays[1:4])
    handles, keep = [], []
    for k, (ids, batch) in enumerate(steps):
        out, scr = np.empty(ids.size, np.int32), np.empty(2 * ids.size, np.int32)
        assert lru_state(row_slot).scan(ids, out, scr, threads)[0] == 0
        np.testing.assert_array_equal(out, row_slot[ids])
        head, tail = (0, mapped.size) if k == 0 else (0, 0)  # ignored when following
        after = handles[-1] if handles else -1
        handles.append(lru_state(row_slot, last_used, log, log_pos).touch_start(scr, ids.size,
                                           head, tail, batch, threads, after))  # fmt: skip
        keep.append(scr)
    assert [nat.lru_touch_wait(h) for h in handles] == want
    for u, v in zip((last_used, log, log_pos), final):
        np.testing.assert_array_equal(u, v)
    if spare == 9_000:
        assert any(w[2] == 0 and k for k, w in enumerate(want))  # compacted mid-chain


def test_chained_touch_arguments_and_a_follower_run_by_its_caller():
    """``after`` names a pending touch (else ValueError, nothing held); with every C slot
    pending, a follower runs in its caller once the touch it follows is done."""
    nat = host.native
    rng = np.random.default_rng(9)
    arrays = hits_arrays(rng, 5000, 2000, 2000)
    row_slot, mapped = arrays[0], arrays[4]
    ids = np.sort(rng.choice(mapped, 300)).astype(np.int64)
    out, scr = np.empty(300, np.int32), np.empty(600, np.int32)
    assert lru_state(row_slot).scan(ids, out, scr)[0] == 0
    lu, lg, lp = (a.copy() for a in arrays[1:4])
    for bad in (-2, 32, 5):  # 5: no such touch pending
        with pytest.raises(ValueError, match="no touch"):
            lru_state(row_slot, lu, lg, lp).touch_start(scr, 300, 0, 2000, 2, 1, bad)
    steps = [(ids, 2), (ids[::-1].copy(), 3)]
    want, final = _sequential(steps, arrays, 2000)
    fillers = []  # the other slots, held by touches of their own arrays
    for _ in range(40):
        a = [x.copy() for x in arrays[1:4]]
        fs = np.empty(600, np.int32)
        assert lru_state(row_slot).scan(ids, out, fs)[0] == 0
        fillers.append((a, fs))
    first = lru_state(row_slot, lu, lg, lp).touch_start(scr, 300, 0, 2000, 2, 2)
    fillers = [(lru_state(row_slot, *a).touch_start(fs, 300, 0, 2000, 2), a) for a, fs in fillers]
    s2 = np.empty(600, np.int32)
    assert lru_state(row_slot).scan(steps[1][0], out, s2)[0] == 0
    second = lru_state(row_slot, lu, lg, lp).touch_start(s2, 300, 0, 0, 3, 2, first)
    assert type(second) is tuple  # no slot free: run here, after the first
    assert [nat.lru_touch_wait(first), second] == want
    for u, v in zip((lu, lg, lp), final):
        np.testing.assert_array_equal(u, v)
    for h, _ in fillers:
        if type(h) is not tuple:
            nat.lru_touch_wait(h)


def _state(c):
    s = c.stats()  # settles a deferred touch
    lru = c.inspect().lru
    live = lru.log[lru.head : lru.tail]
    valid = lru.log_pos[live] == np.arange(lru.head, lru.tail)
    return (
        c.inspect().slot_table.row_map.to_dense().copy(),
        c.inspect().slot_table.slot_row.copy(),
        lru.pin_mask(),
        live[valid].copy(),
        dataclasses.replace(s, fault_seconds=0.0, prefetch_wait_seconds=0.0),
        c.inspect().pinned,
    )


def _run(store, ops, defer_min, every=1):
    """``ops`` on a fresh cache; the state after every ``every``-th op (observing it
    settles deferred touches: between observations they queue one behind another)."""
    c = rowcache.NgramRowCache.assemble(store, "t", slots=300, tuning=Tuning(defer_min=defer_min))
    outs, states = [], []
    for i, (kind, arg) in enumerate(ops):
        try:
            if kind == "end":
                c.end_step()
            elif kind == "prefetch":
                c.prefetch(arg).wait()
            elif kind == "resolve":
                outs.append(c.resolve(arg))
            else:
                outs.append(c.resolve(arg, host=True))
        except (rowcache.errors.RowRangeError, rowcache.ArenaExhaustedError) as e:
            outs.append(type(e).__name__)
        if i % every:
            continue
        if kind != "end" or len(states) % 3 == 0:  # some end_batch calls go unobserved
            states.append(_state(c))
    states.append(_state(c))
    return outs, states


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), every=st.sampled_from([1, 4]))
def test_a_cache_that_defers_its_touches_equals_one_that_does_not(tmp_path_factory, seed, every):
    """Model-based: resolve, resolve_host, prefetch and end_batch interleaved, with every
    all-hits call deferring its touch (``Tuning(defer_min=1)``) against none deferring: the
    same slots, errors, maps, pins, LRU order and stats after every call, or after every
    4th (unobserved, touches queue behind one another: ``Lru.hits_queued``)."""
    rng = np.random.default_rng(seed)
    path = tmp_path_factory.mktemp("s") / "store"
    x = rng.standard_normal((1000, 8)).astype(np.float32).astype(ml_dtypes.bfloat16)
    store = rowcache.build_store(path, {"t": x}, progress=False)
    ops = []
    for _ in range(50):
        r = rng.random()
        if r < 0.25:
            ops.append(("end", None))
        elif r < 0.3:
            ops.append(("resolve_host", np.array([5, 1000], dtype=np.int64)))
        elif r < 0.36:
            ops.append(("prefetch", rng.integers(0, 1000, 20).astype(np.int64)))
        else:  # a hot set: most calls hit every row; some need more slots than there are
            n = int(rng.integers(1, 400 if r > 0.97 else 120))
            ids = rng.integers(0, 1000 if r < 0.45 else 150, n).astype(np.int64)
            ops.append(("resolve" if r < 0.6 else "resolve_host", ids))
    a_out, a_states = _run(store, ops, 1, every)
    b_out, b_states = _run(store, ops, 1 << 62, every)
    assert_same_runs(a_states, b_states, a_out, b_out)
    store.close()


def test_threads_and_a_forked_child_see_finished_touches(tmp_path):
    """Calls from several threads each wait for the touch before them; a child forked
    while touches are pending sees them finished."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4000, 8)).astype(np.float32).astype(ml_dtypes.bfloat16)
    store = rowcache.build_store(tmp_path / "s", {"t": x}, progress=False)
    c = rowcache.NgramRowCache.assemble(store, "t", slots=4000, tuning=Tuning(defer_min=1))
    c.resolve(np.arange(4000, dtype=np.int64), host=True)
    c.end_step()
    errors = []

    def work(seed):
        r = np.random.default_rng(seed)
        try:
            for _ in range(50):
                ids = r.integers(0, 4000, 3000).astype(np.int64)
                np.testing.assert_array_equal(c.inspect().slot_table.slot_row[c.resolve(ids, host=True)], ids)
        except Exception as e:  # reported below
            errors.append(e)

    ts = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    c.resolve(rng.integers(0, 4000, 3000).astype(np.int64), host=True)  # pending at the fork
    pid = os.fork()
    if pid == 0:  # the child: the touch is finished and its own calls work
        try:
            s = c.stats()
            ok = s.hits + s.misses <= s.lookups and not c.inspect().lru.touching
            c.resolve(np.arange(100, dtype=np.int64), host=True)
            c.stats()
            os._exit(0 if ok else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    store.close()
