"""rowcache.kernels._host (C) against its references: the packed host hash, and the row cache's
all-hits path against the cache's Python path (hypothesis-driven)."""

from __future__ import annotations

import dataclasses
import mmap
import shutil
import sysconfig

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rowcache
import rowcache.kernels.host as host
from rowcache.cache.row_cache import Tuning
from rowcache.cache.slots import READ, READING, RESIDENT
from rowcache.embed.ngram.dims import NgramDims
from rowcache.kernels.ngram.hash import ngram_hash_reference
from tests.kernels.support import assert_same_runs, hits_arrays, hits_call, lru_state

DIMS = NgramDims(vocab_size=500, hidden_size=48, max_ngram=4, splits=2, ratio=3, eos_token_id=2)


def test_native_module_is_built_where_a_compiler_exists():
    if shutil.which(sysconfig.get_config_var("CC").split()[0] or "cc") is None:
        pytest.skip("no C compiler here: the references run instead")
    assert host.native is not None, "rowcache.kernels._host was not built: run `pip install -e .`"


def _hash_reference_all(tokens, ctx_lens, seq_lens, mult, rows, eos):
    """Every position of each sequence through the whole-sequence reference, then the
    embedded ones selected: the spec that hash_packed must equal."""
    out, begin = [], 0
    for c, s in zip(ctx_lens, seq_lens):
        seq = tokens[begin : begin + c]
        ids = (
            ngram_hash_reference(seq, mult, rows, eos) if c else np.zeros((len(rows), 0), np.int64)
        )
        out.append(ids[:, c - s :])
        begin += c
    return np.concatenate(out, axis=1)


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12)), min_size=1, max_size=6),
    seed=st.integers(0, 2**31),
    offsets=st.booleans(),
)
def test_hash_packed_native_equals_references(lens, seed, offsets):
    if host.native is None:
        pytest.skip("rowcache.kernels._host not built")
    rng = np.random.default_rng(seed)
    ctx_lens = np.array([c for c, _ in lens], dtype=np.int64)
    seq_lens = np.array([min(s, c) for c, s in lens], dtype=np.int64)
    tokens = rng.integers(0, DIMS.vocab_size, int(ctx_lens.sum())).astype(np.int64)
    tokens[rng.random(tokens.size) < 0.15] = DIMS.eos_token_id
    tokens[rng.random(tokens.size) < 0.05] = 0
    mult, rows = DIMS.table_subset(np.array([0, 3, 5]))
    off = np.array([0, 1000, 77], dtype=np.int64) if offsets else None
    got = host.hash_packed(tokens, ctx_lens, seq_lens, mult, rows, DIMS.eos_token_id, off)
    want = _hash_reference_all(tokens, ctx_lens, seq_lens, mult, rows, DIMS.eos_token_id)
    if off is not None:
        want = want + off[:, None]
    np.testing.assert_array_equal(got, want)
    saved = host.native
    try:
        host.native = None  # the NumPy fallback
        np.testing.assert_array_equal(
            host.hash_packed(tokens, ctx_lens, seq_lens, mult, rows, DIMS.eos_token_id, off), want
        )
    finally:
        host.native = saved


@pytest.mark.parametrize("threads", [1, 2, 3, 8, 16])
def test_hash_packed_threads_equal_reference(threads):
    """A prefill-sized call split over the pool's threads (runs of tables) gives the
    reference's ids, offsets added, whatever the count; a call too small to split too."""
    if host.native is None:
        pytest.skip("rowcache.kernels._host not built")
    rng = np.random.default_rng(threads)
    ctx_lens = np.array([2048, 700, 3, 1500], dtype=np.int64)
    seq_lens = np.array([2048, 650, 3, 1], dtype=np.int64)
    tokens = rng.integers(0, DIMS.vocab_size, int(ctx_lens.sum())).astype(np.int64)
    tokens[rng.random(tokens.size) < 0.1] = DIMS.eos_token_id
    mult, rows = DIMS.table_subset(np.arange(DIMS.num_tables))
    off = np.cumsum(rows) - rows
    want = _hash_reference_all(tokens, ctx_lens, seq_lens, mult, rows, DIMS.eos_token_id)
    got = host.hash_packed(
        tokens, ctx_lens, seq_lens, mult, rows, DIMS.eos_token_id, off, threads=threads
    )
    np.testing.assert_array_equal(got, want + off[:, None])
    nine, five = np.array([9], dtype=np.int64), np.array([5], dtype=np.int64)
    small = host.hash_packed(tokens[:9], nine, five, mult, rows, DIMS.eos_token_id, threads=threads)
    want = _hash_reference_all(tokens[:9], nine, five, mult, rows, DIMS.eos_token_id)
    np.testing.assert_array_equal(small, want)


def test_pool_serves_concurrent_callers_and_a_forked_child():
    """Python threads calling the parallel kernels at once (the GIL released: one job
    runs on the pool, the others on their own threads) all get exact results; and a
    child forked after the pool started its workers gets exact results too (its pool
    restarts)."""
    if host.native is None:
        pytest.skip("rowcache.kernels._host not built")
    import os
    import threading
    import warnings

    rng = np.random.default_rng(3)
    ctx_lens = np.array([3000, 2000], dtype=np.int64)
    tokens = rng.integers(0, DIMS.vocab_size, int(ctx_lens.sum())).astype(np.int64)
    mult, rows = DIMS.table_subset(np.arange(DIMS.num_tables))
    want = _hash_reference_all(tokens, ctx_lens, ctx_lens, mult, rows, DIMS.eos_token_id)
    bad: list[str] = []

    def worker() -> None:
        for _ in range(20):
            got = host.hash_packed(tokens, ctx_lens, ctx_lens, mult, rows, DIMS.eos_token_id,
                                   threads=4)  # fmt: skip
            if not np.array_equal(got, want):
                bad.append("thread")

    ts = [threading.Thread(target=worker) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not bad
    with warnings.catch_warnings():  # Python 3.12 warns of fork in a threaded process:
        warnings.simplefilter("ignore", DeprecationWarning)  # that is what this tests
        pid = os.fork()
    if pid == 0:  # the child: exit code 0 only when its pooled calls are exact
        eos = DIMS.eos_token_id
        runs = [host.hash_packed(tokens, ctx_lens, ctx_lens, mult, rows, eos, threads=4)
                for _ in range(5)]  # fmt: skip
        os._exit(0 if all(np.array_equal(r, want) for r in runs) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def _state(c):
    lru = c.inspect().lru
    live = lru.log[lru.head : lru.tail]
    valid = lru.log_pos[live] == np.arange(lru.head, lru.tail)
    return (
        c.inspect().slot_table.row_map.to_dense().copy(),
        c.inspect().slot_table.slot_row.copy(),
        lru.pin_mask(),
        live[valid].copy(),  # the LRU order
        dataclasses.replace(c.stats(), fault_seconds=0.0),
        c.inspect().pinned,
    )


def _replay(store, ops, native):
    c = rowcache.NgramRowCache.assemble(store, "t", slots=64, tuning=Tuning(native=native))
    assert (c.inspect().lru.native is not None) == native
    if True:
        states, outs = [], []
        for op in ops:
            if op is None:
                c.end_step()
            else:
                try:
                    outs.append(c.resolve(op, host=True))
                except (rowcache.errors.RowRangeError, rowcache.ArenaExhaustedError) as e:
                    outs.append(str(e))
            states.append(_state(c))
        return states, outs


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31))
def test_lru_hits_native_equals_python_path(tmp_path_factory, seed):
    if host.native is None:
        pytest.skip("rowcache.kernels._host not built")
    rng = np.random.default_rng(seed)
    path = tmp_path_factory.mktemp("s") / "store"
    x = rng.standard_normal((200, 8)).astype(np.float32).astype(ml_dtypes.bfloat16)
    store = rowcache.build_store(path, {"t": x}, progress=False)
    ops = []
    for _ in range(60):
        r = rng.random()
        if r < 0.25:
            ops.append(None)
        elif r < 0.3:
            ops.append(np.array([5, 200], dtype=np.int64))  # out of range
        else:  # a hot set, so that most calls are all hits
            hot = rng.integers(0, 200 if r < 0.4 else 40, int(rng.integers(1, 50)))
            ops.append(hot.astype(np.int64))
    a_states, a_out = _replay(store, ops, True)
    b_states, b_out = _replay(store, ops, False)
    assert_same_runs(a_states, b_states, a_out, b_out)
    store.close()


def _lru_arrays(rows=20, slots=6):
    row_slot = np.full(rows, -1, dtype=np.int32)
    slot_row = np.full(slots, -1, dtype=np.int32)
    last_used = np.full(slots, -1, dtype=np.int64)
    log = np.zeros(2 * slots, dtype=np.int32)
    log[:slots] = np.arange(slots, dtype=np.int32)
    log_pos = np.arange(slots, dtype=np.int32)
    return row_slot, slot_row, last_used, log, log_pos


def test_lru_plan_and_commit_check_their_arguments_and_change_nothing_on_error():
    if host.native is None:
        pytest.skip("rowcache.kernels._host not built")
    nat = host.native
    rs, sr, lu, log, lp = _lru_arrays()
    state = np.zeros(6, dtype=np.uint8)  # every slot free
    off, pm, out = (
        np.array([0, 10, 20], dtype=np.int64),
        np.zeros(2, np.int64),
        np.empty(4, np.int32),
    )
    ids = np.array([7, 3, 7, 12], dtype=np.int64)
    work, scratch = np.empty(5 * ids.size, dtype=np.int32), np.empty(2 * ids.size, np.int32)
    saved = [a.copy() for a in (rs, sr, lu, log, lp, state)]
    c = nat.LruState(rs, sr, state, lu, log, lp, off, pm)

    def plan(ids=ids, work=work):
        return c.plan(ids, 0, 6, 0, False, 6, work, scratch)

    with pytest.raises(TypeError, match="ids"):
        plan(ids=ids.astype(np.int32))
    with pytest.raises(ValueError, match="shapes"):
        plan(work=work[:-1])
    with pytest.raises(ValueError, match="shapes"):  # the arrays are checked once, when made
        nat.LruState(rs, sr, np.zeros(5, np.uint8), lu, log, lp, off, pm)
    with pytest.raises(ValueError, match="shapes"):
        nat.LruState(rs, sr, state, lu, log, lp, np.array([0, 10, 19]), pm)
    assert plan(ids=np.array([3, 20], dtype=np.int64))[:2] == (2, 1)  # ids[1] out of range
    status, n_u, n_miss, fresh, n_ev, head, end, passed = plan()
    assert (status, n_u, n_miss, fresh, n_ev, head, end, passed) == (0, 3, 3, 0, 0, 3, 3, 0)
    np.testing.assert_array_equal(work[:3], [3, 7, 12])  # unique rows, ascending
    np.testing.assert_array_equal(work[8:11], [3, 7, 12])  # all missing
    np.testing.assert_array_equal(work[12:15], [0, 1, 2])  # victims: the log's head
    for a, b in zip((rs, sr, lu, log, lp, state), saved):
        np.testing.assert_array_equal(a, b)  # the plan changes nothing
    bad = work.copy()
    bad[12] = 99  # a victim outside the arena
    with pytest.raises(ValueError, match="out of range"):
        c.commit(ids, bad, n_u, n_miss, n_ev, head, 6, 0, out)
    for a, b in zip((rs, sr, lu, log, lp, state, pm), [*saved, np.zeros(2, np.int64)]):
        np.testing.assert_array_equal(a, b)  # a refused commit changes nothing
    fresh, head, tail = c.commit(ids, work, n_u, n_miss, n_ev, head, 6, 0, out)
    np.testing.assert_array_equal(state, [RESIDENT] * 3 + [0] * 3)  # the victims hold rows
    assert (fresh, head, tail) == (3, 3, 9)  # entries before the head are stale
    np.testing.assert_array_equal(out, [1, 0, 1, 2])
    np.testing.assert_array_equal(pm, [2, 1])
    np.testing.assert_array_equal(log[3:9], [3, 4, 5, 0, 1, 2])
    np.testing.assert_array_equal(lu, [0, 0, 0, -1, -1, -1])  # pinned in batch 0


def test_lru_plan_says_when_its_victims_pass_a_busy_slot_or_a_row_is_in_flight():
    """passed_busy = Lru.passed_reserved(end): a live entry of a slot a prefetch holds
    (SlotState READING or READ) lies before the last victim; status 4: a row of the call is
    in a READING slot. (The state array: the slot table's, rowcache.cache.slots.)"""
    if host.native is None:
        pytest.skip("rowcache.kernels._host not built")
    nat = host.native
    rs, sr, lu, log, lp = _lru_arrays()  # 6 free slots, logged 0..5
    ids = np.array([7, 3, 12], dtype=np.int64)
    work, scratch = np.empty(15, dtype=np.int32), np.empty(6, np.int32)

    off, pm = np.array([0, 20], dtype=np.int64), np.zeros(1, np.int64)

    def plan(busy, rs=rs, sr=sr, lu=lu):
        c = nat.LruState(rs, sr, busy, lu, log, lp, off, pm)
        return c.plan(ids, 0, 6, 0, True, 6, work, scratch)

    busy = np.full(6, RESIDENT, dtype=np.uint8)
    busy[1] = READING  # in flight: not a victim, and passed over
    r = plan(busy)
    assert (r[0], r[2], r[6], r[7]) == (0, 3, 4, 1)
    np.testing.assert_array_equal(work[9:12], [0, 2, 3])
    busy[:] = RESIDENT
    busy[5] = READING  # beyond the last victim: not passed
    assert (plan(busy)[0], plan(busy)[7]) == (0, 0)
    rs2, sr2 = rs.copy(), sr.copy()
    rs2[3], sr2[4] = 4, 3  # row 3 mapped in slot 4, whose read is in flight
    busy[4] = READING
    assert plan(busy, rs2, sr2)[:2] == (4, 3)
    busy[4] = RESIDENT  # landed and reaped: an ordinary hit
    r = plan(busy, rs2, sr2)
    assert (r[0], r[2], r[7]) == (0, 2, 0)
    # READ: its piece in flight, its row read into the slot by a resolve already
    busy = np.full(6, RESIDENT, dtype=np.uint8)
    busy[4] = READ  # row 3's slot, before the last victim: a hit, and not a passed slot
    r = plan(busy, rs2, sr2)
    assert (r[0], r[2], r[7]) == (0, 2, 0)
    np.testing.assert_array_equal(work[9:11], [0, 1])  # (slot 4 is no victim)
    busy[4], busy[1] = RESIDENT, READ  # an unpinned slot, no row of the call: passed, no victim
    r = plan(busy, rs2, sr2)
    assert (r[0], r[2], r[7]) == (0, 2, 1)
    np.testing.assert_array_equal(work[9:11], [0, 2])
    lu2 = lu.copy()
    lu2[1] = 0  # pinned in this batch (batch 0): no victim, and a hit of it in any order
    r = plan(busy, rs2, sr2, lu2)
    assert (r[0], r[2], r[7]) == (0, 2, 0)
    np.testing.assert_array_equal(work[9:11], [0, 2])
    busy[1], busy[4] = RESIDENT, READING  # still being read: status 4 for a row of the call in it
    assert plan(busy, rs2, sr2)[0] == 4


@pytest.mark.parametrize("case", ["blocks", "shuffled", "miss", "bad_late", "no_room"])
@pytest.mark.parametrize("threads", [2, 3, 8])
def test_lru_hits_threads_equal_one_thread(case, threads):
    """The parallel all-hits path (large calls split over threads) changes nothing: the
    same status, slots, pins and log as one thread, for a shared arena's step (disjoint
    ascending blocks: logged in parallel), for shuffled ids (one thread logs), and for a
    miss, a bad id in a late part and a full log (all report and change nothing)."""
    if host.native is None:
        pytest.skip("rowcache.kernels._host not built")
    rng = np.random.default_rng(7)
    arrays = hits_arrays(rng)
    mapped = arrays[4]
    # 12 blocks of 2,048 ids, block k from the k-th twelfth of the mapped rows (duplicates in)
    cuts = np.linspace(0, mapped.size, 13).astype(int)
    ids = np.concatenate(
        [rng.choice(mapped[cuts[k] : cuts[k + 1]], 2048) for k in range(12)]
    ).astype(np.int64)
    tail = mapped.size  # the log's live part is [0, slots)
    if case == "shuffled":
        ids = rng.permutation(ids)
    elif case == "miss":
        ids[5] = np.flatnonzero(arrays[0] < 0)[0]
    elif case == "bad_late":
        ids[3] = np.flatnonzero(arrays[0] < 0)[0]  # a miss early, a bad id late: status 2
        ids[-7] = arrays[0].size + 5
        ids[-3] = -1
    elif case == "no_room":
        tail = arrays[2].size - 100
    one = hits_call(ids, arrays, 1, tail)
    many = hits_call(ids, arrays, threads, tail)
    assert one[0] == many[0]
    want_status = {"blocks": 0, "shuffled": 0, "miss": 1, "bad_late": 2, "no_room": 3}[case]
    assert one[0][0] == want_status
    if case == "bad_late":
        assert one[0][1] == ids.size - 7
    for u, v in zip(one[1 + (want_status == 2) :], many[1 + (want_status == 2) :]):
        np.testing.assert_array_equal(u, v)  # (out is undefined after a bad id)
    if want_status:  # nothing changed
        for u, v in zip(one[2:], arrays[1:4]):
            np.testing.assert_array_equal(u, v)


def sparse_row_map(rows: int, mapped: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """int32[rows], a row -> slot map with ``slots`` at ``mapped`` and -1 (unmapped) on
    every page that holds a mapped row. The other pages are never written: an anonymous
    map is zeroed lazily, so a 2**31-row map costs the pages of its 4,000 mapped rows
    (~16 MB), not 8 GiB (in 4 KiB pages: transparent huge pages would fault 2 MiB a
    write). An id the sort got wrong lands on a -1 or on a zero page (slot 0, which one
    mapped row holds): either way ``out`` differs."""
    buf = mmap.mmap(-1, rows * 4)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    row_slot = np.frombuffer(buf, dtype=np.int32)  # (holds the map until it is dropped)
    per_page = mmap.PAGESIZE // row_slot.itemsize
    pages = np.unique(mapped // per_page)
    near = (pages[:, None] * per_page + np.arange(per_page)).ravel()
    row_slot[near[near < rows]] = -1
    row_slot[mapped] = slots
    return row_slot


@pytest.mark.parametrize("n", [33, 3000, 5000, 20_000, 70_000])
@pytest.mark.parametrize("rows", [1_000, 2**17 + 5, 2**24 + 3, 2**31 - 1])
def test_lru_hits_logs_distinct_slots_in_row_order(n, rows):
    """The radix sort (its passes depend on the call's largest id; small calls sort by
    insertion) against NumPy: the call's distinct rows' slots are logged in ascending
    row order, and every position gets its row's slot."""
    if host.native is None:
        pytest.skip("rowcache.kernels._host not built")
    rng = np.random.default_rng(n + rows)
    mapped = np.unique(rng.integers(0, rows, min(n, 4000)))
    mapped[-1] = rows - 1  # the largest id sets the sort's passes
    S = mapped.size
    row_slot = sparse_row_map(rows, mapped, rng.permutation(S).astype(np.int32))
    ids = rng.choice(mapped, n).astype(np.int64)
    ids[0] = rows - 1
    last_used = np.zeros(S, dtype=np.int64)
    log = np.zeros(S + len(np.unique(ids)), dtype=np.int32)
    log_pos = np.zeros(S, dtype=np.int32)
    out = np.zeros(n, dtype=np.int32)
    scratch = np.zeros(2 * n, dtype=np.int32)
    status, fresh, tail = lru_state(row_slot, last_used, log, log_pos).hits(ids, 0, 1, out, scratch)
    want = row_slot[np.unique(ids)]
    assert (status, fresh, tail) == (0, want.size, want.size)
    np.testing.assert_array_equal(log[:tail], want)
    np.testing.assert_array_equal(out, row_slot[ids])


def _compact_reference(log: np.ndarray, log_pos: np.ndarray, head: int, tail: int) -> int:
    """The cache's Python compaction (``Lru.compact`` without the native module)."""
    S = log_pos.size
    p = np.arange(head, tail)
    s = log[head:tail]
    ok = (s >= 0) & (s < S)
    live = np.zeros(tail - head, dtype=bool)
    live[ok] = log_pos[s[ok]] == p[ok]
    keep = s[live]
    log[: keep.size] = keep
    log_pos[keep] = np.arange(keep.size, dtype=np.int32)
    return int(keep.size)


@pytest.mark.skipif(host.native is None, reason="no native module")
@pytest.mark.parametrize("seed", range(4))
def test_lru_compact_threads_equal_the_serial_pass_and_python(seed):
    """A log long enough to be split (2 * 2**18 entries a part at least): every slot's one
    live entry at a random position, stale entries, garbage (-1, >= S) and slots whose
    log_pos points at another slot's entry (no live entry of their own), a random head;
    parallel, serial and Python compactions leave the same log, log_pos and tail."""
    rng = np.random.default_rng(seed)
    S = int(rng.integers(300_000, 700_000))
    C = 2 * S + int(rng.integers(0, 1 << 14))
    log = rng.integers(0, S, C).astype(np.int32)
    log[rng.random(C) < 0.01] = -1
    log[rng.random(C) < 0.01] = S + 5
    head = int(rng.integers(0, C // 8))
    tail = C - int(rng.integers(0, C // 16))
    live = np.sort(rng.choice(np.arange(head, tail), S, replace=False))
    slots = rng.permutation(S).astype(np.int32)
    log[live] = slots
    log_pos = np.empty(S, dtype=np.int32)
    log_pos[slots] = live
    orphans = rng.choice(S, 50, replace=False)  # pointing at some other slot's entry
    log_pos[orphans] = rng.choice(live, 50)
    log_pos[orphans[:5]] = C + 7  # and out of the log
    want = [log.copy(), log_pos.copy()]
    want_tail = _compact_reference(*want, head, tail)
    for threads in (1, 2, 5, 16):
        got = [log.copy(), log_pos.copy()]
        assert lru_state(None, None, *got).compact(head, tail, threads) == want_tail, threads
        np.testing.assert_array_equal(got[0][:want_tail], want[0][:want_tail])
        np.testing.assert_array_equal(got[0][want_tail:], log[want_tail:])  # untouched after
        np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.skipif(host.native is None, reason="no native module")
def test_lru_commit_compacts_a_full_log_on_threads_as_on_one():
    """A miss that finds the log full compacts it first (LruState.commit): on 4 threads of the
    step's pool (a log long enough to be split) as on one, and the slots land the same."""
    nat, rng = host.native, np.random.default_rng(11)
    S, R = 300_000, 700_000
    C = 2 * S
    row_slot = np.full(R, -1, dtype=np.int32)
    mapped = rng.choice(R, S, replace=False)
    row_slot[mapped] = np.arange(S, dtype=np.int32)
    slot_row = mapped.astype(np.int32)
    last_used = np.full(S, -1, dtype=np.int64)
    log = rng.integers(0, S, C).astype(np.int32)  # stale entries, then the live ones
    live = np.sort(rng.choice(C, S, replace=False))
    slots = rng.permutation(S).astype(np.int32)
    log[live] = slots
    log_pos = np.empty(S, dtype=np.int32)
    log_pos[slots] = live
    ids = np.setdiff1d(rng.choice(R, 64, replace=False), mapped)[:40].astype(np.int64)
    n = ids.size
    got = []
    for threads in (1, 4):
        rs, sr, lu, lg, lp = (a.copy() for a in (row_slot, slot_row, last_used, log, log_pos))
        work, scratch = np.empty(5 * n, dtype=np.int32), np.empty(2 * n, dtype=np.int32)
        off, pm, out = np.array([0, R], np.int64), np.zeros(1, np.int64), np.empty(n, np.int32)
        c = nat.LruState(rs, sr, np.full(S, RESIDENT, np.uint8), lu, lg, lp, off, pm)
        status, n_u, n_miss, _, n_ev, head, _, _ = c.plan(ids, 0, C, 0, False, S, work, scratch)
        assert (status, n_miss, n_ev) == (0, n, n)
        res = c.commit(ids, work, n_u, n_miss, n_ev, head, C, 0, out, threads)
        assert res[2] == S  # compacted: the S - n live entries past the victims, then n
        got.append((res, out, rs, sr, lu, lg[: res[2]], lp))
    for a, b in zip(*got):
        np.testing.assert_array_equal(a, b)


@pytest.mark.skipif(host.native is None, reason="no native module")
@pytest.mark.parametrize("layout", ["tables", "shuffled", "bad_id", "busy_hit", "few_tables"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lru_plan_and_commit_in_parts_as_on_one_thread(layout, seed):
    """A large call (a prefill step's ids, table by table, duplicates and ~1 % misses)
    planned and committed in parts on the step's pool (threads 2, 3, 5, 16) leaves exactly
    what one thread does: status, counts, work, victims, head/tail, maps, pins, log and
    slots. Ids not table by table (shuffled) take the one-part fallback; a bad id is
    reported at its first position; a hit in a busy slot gives status 4."""
    nat, rng = host.native, np.random.default_rng(seed)
    T, per, N = 12, 5_000, 900  # tables, rows a table, ids a table
    R, S = T * per, 30_000
    row_slot = np.full(R, -1, dtype=np.int32)
    mapped = rng.choice(R, 25_000, replace=False)
    row_slot[mapped] = rng.permutation(S)[: mapped.size].astype(np.int32)
    slot_row = np.full(S, -1, dtype=np.int32)
    slot_row[row_slot[mapped]] = mapped
    last_used = rng.integers(-1, 4, S).astype(np.int64)  # some pinned (batch 3)
    log = np.concatenate([rng.permutation(S), rng.integers(0, S, S)]).astype(np.int32)
    log_pos = np.empty(S, dtype=np.int32)
    log_pos[log[:S]] = np.arange(S, dtype=np.int32)
    tables = T if layout != "few_tables" else 3
    ids = np.concatenate([
        t * per + rng.choice(mapped[(mapped >= t * per) & (mapped < (t + 1) * per)] - t * per, N)
        for t in range(tables)
    ]).astype(np.int64)  # fmt: skip
    miss = rng.integers(0, ids.size, ids.size // 100)
    ids[miss] = ids[miss] // per * per + rng.integers(0, per, miss.size)
    busy = np.full(S, RESIDENT, dtype=np.uint8)  # the slot states (unused but for busy_hit)
    if layout == "shuffled":
        rng.shuffle(ids)
    elif layout == "bad_id":
        ids[rng.integers(ids.size // 2, ids.size, 2)] = R + 5
    elif layout == "busy_hit":
        busy[row_slot[ids[-3]]] = READING
    n = ids.size
    got = []
    for threads in (1, 2, 3, 5, 16):
        rs, sr, lu, lg, lp = (a.copy() for a in (row_slot, slot_row, last_used, log, log_pos))
        work, scratch = np.zeros(5 * n, dtype=np.int32), np.empty(2 * n, dtype=np.int32)
        off, pm = np.arange(T + 1, dtype=np.int64) * per, np.zeros(T, np.int64)
        c = nat.LruState(rs, sr, busy.copy(), lu, lg, lp, off, pm)
        plan = c.plan(ids, 0, S, 3, layout == "busy_hit", S - 2_000, work, scratch, threads)
        status, n_u, n_miss, _, n_ev, head = plan[:6]
        res = out = None
        if status == 0:
            assert n_miss > 0
            out = np.empty(n, np.int32)
            res = c.commit(ids, work, n_u, n_miss, n_ev, head, S, 3, out, threads)
            np.testing.assert_array_equal(out, rs[ids])
        else:
            assert status == {"bad_id": 2, "busy_hit": 4}[layout]
            if status == 2:
                assert n_u == int(np.flatnonzero(ids >= R)[0])
        # what the plan says: uniq, slots, missing (victims, evicted: planned only at 0)
        w = work.reshape(5, n)
        kept = [w[0, :n_u], w[1, :n_u], w[2, :n_miss]] if status != 2 else []
        kept += [w[3, :n_miss], w[4, :n_ev]] if status == 0 else []
        got.append((plan, res, out, *kept, rs, sr, lu, lg, lp))
    for k, other in enumerate(got[1:], 1):
        for i, (a, b) in enumerate(zip(got[0], other)):
            if isinstance(a, np.ndarray):
                np.testing.assert_array_equal(a, b, err_msg=f"item {i}, threads #{k}")
            else:
                assert a == b, (i, k)
