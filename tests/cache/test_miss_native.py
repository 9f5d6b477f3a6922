"""The native miss path of NgramRowCache.resolve (rowcache.kernels._host lru_plan / lru_commit)
against the cache's Python path, its reference: same slots, maps, LRU log, pins, stats
and errors after every call, and a failed read changes nothing."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rowcache
import rowcache.kernels.host as host
from rowcache.cache.row_cache import Tuning
from rowcache.errors import ArenaExhaustedError, CorruptDataError, RowRangeError
from tests.cache.support import Hooked

PARTS = {"a": 70, "b": 45, "c": 30}  # rows of the tables that share one arena

pytestmark = pytest.mark.skipif(host.native is None, reason="rowcache.kernels._host not built")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    rng = np.random.default_rng(7)
    tables = {
        name: rng.standard_normal((rows, 8)).astype(np.float32).astype(ml_dtypes.bfloat16)
        for name, rows in PARTS.items()
    }
    s = rowcache.build_store(tmp_path_factory.mktemp("miss") / "store", tables, progress=False)
    yield s
    s.close()


class Failing:
    """A hook on a cache's reads: once ``armed``, every read raises."""

    armed = False

    def __call__(self, rows):
        if self.armed:
            raise CorruptDataError("injected: short read")


def _cache(store, slots, native, small_log=True, hook=None, row_map="auto"):
    """A shared-arena cache on the native (or the Python) path; ``small_log``: a log of
    2 * slots entries, so that compaction happens every few calls; ``hook``: on its reads;
    ``row_map``: the row map's kind."""
    tuning = Tuning(native=native, log_slack=slots if small_log else None, row_map=row_map)
    return rowcache.NgramRowCache.assemble(
        store, list(PARTS), slots=slots, tuning=tuning,
        part_reader=None if hook is None else (lambda r: Hooked(r, hook)),
    )  # fmt: skip


def _state(c):
    row_slot, slot_row = c.inspect().slot_map()
    return {
        "row_slot": row_slot,
        "slot_row": slot_row,
        "last_used": c.inspect().lru.last_used.copy(),
        "head_tail": (c.inspect().lru.head, c.inspect().lru.tail),
        "log": c.inspect().lru.log[c.inspect().lru.head : c.inspect().lru.tail].copy(),
        "log_pos": c.inspect().lru.log_pos.copy(),
        "stats": dataclasses.replace(c.stats(), fault_seconds=0.0),
        "part_misses": c.inspect().part_misses(),
        "pinned": c.inspect().pinned,
        "last_faults": c.last_faults,
    }


def _assert_same(a, b, where):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], np.ndarray):
            np.testing.assert_array_equal(a[k], b[k], err_msg=f"{k} after {where}")
        else:
            assert a[k] == b[k], f"{k} after {where}"


def _call(c, op):
    try:
        return c.resolve(op)
    except (RowRangeError, ArenaExhaustedError) as e:
        return f"{type(e).__name__}: {e}"


def _ops(rng, total, slots, n_ops):
    """Random resolves (duplicates, hot rows, misses, an exhausting batch, bad ids,
    int32 and strided inputs) and end_batch calls."""
    hot = rng.choice(total, size=max(2, slots // 2), replace=False)
    ops = []
    for _ in range(n_ops):
        r = rng.random()
        if r < 0.2:
            ops.append(None)
            continue
        n = int(rng.integers(0, max(2, slots // 2)))
        if r < 0.25:
            n = int(rng.integers(slots - 2, slots + 4))  # near or past the arena's size
        from_hot = rng.random(n) < 0.5
        ids = np.where(from_hot, rng.choice(hot, n), rng.integers(0, total, n)).astype(np.int64)
        if n and rng.random() < 0.3:
            ids = np.concatenate([ids, ids[rng.integers(0, n, n // 2 + 1)]])  # duplicates
        if r < 0.28 and ids.size:
            ids[int(rng.integers(0, ids.size))] = total + int(rng.integers(0, 3))  # bad id
        elif r < 0.31:
            ids = ids.astype(np.int32)  # the Python entry point, then the native path
        elif r < 0.34:
            ids = np.repeat(ids, 2)[::2]  # not contiguous
        ops.append(ids)
    return ops


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    slots=st.sampled_from([3, 8, 17, 40]),
    row_map=st.sampled_from(["dense", "hash"]),
)
def test_miss_native_equals_python_path(store, seed, slots, row_map):
    """(the Python path over the other kind of row map: both paths and both maps agree)"""
    rng = np.random.default_rng(seed)
    total = sum(PARTS.values())
    other = "hash" if row_map == "dense" else "dense"
    nat, ref = _cache(store, slots, True, row_map=row_map), _cache(store, slots, False, row_map=other)
    _assert_same(_state(nat), _state(ref), "creation")
    for i, op in enumerate(_ops(rng, total, slots, 80)):
        if op is None:
            nat.end_step()
            ref.end_batch()
        else:
            a, b = _call(nat, op), _call(ref, op)
            if isinstance(b, str):
                assert a == b, f"op {i}"
            else:
                assert isinstance(a, np.ndarray) and a.dtype == np.int32, f"op {i}"
                np.testing.assert_array_equal(a, b, err_msg=f"op {i}")
        _assert_same(_state(nat), _state(ref), f"op {i}")
    assert nat.stats().misses > 0


def test_miss_native_compacts_the_log_as_the_python_path(store):
    """The default log (slack of 2**14 entries) compacts too: many calls of many rows."""
    rng = np.random.default_rng(3)
    total = sum(PARTS.values())
    nat, ref = _cache(store, 100, True, False), _cache(store, 100, False, False)
    compactions = 0
    for i in range(700):
        ids = rng.integers(0, total, 40).astype(np.int64)
        tail = nat.inspect().lru.tail
        np.testing.assert_array_equal(nat.resolve(ids), ref.resolve(ids), err_msg=f"call {i}")
        compactions += nat.inspect().lru.tail < tail
        nat.end_step()
        ref.end_batch()
        if i % 50 == 0 or nat.inspect().lru.tail < tail:
            _assert_same(_state(nat), _state(ref), f"call {i}")
    assert compactions >= 1


def test_miss_native_rows_land_in_their_slots(store):
    c = _cache(store, 20, True)
    x = {name: np.asarray(store.read_rows(name, np.arange(rows))) for name, rows in PARTS.items()}
    want = np.concatenate(list(x.values()))
    rng = np.random.default_rng(1)
    for _ in range(30):
        ids = rng.integers(0, want.shape[0], 12).astype(np.int64)
        slots = c.resolve(ids)
        np.testing.assert_array_equal(c.table[slots].view(np.uint16), want[ids].view(np.uint16))
        c.end_step()


@pytest.mark.parametrize("native", [True, False])
def test_miss_native_failed_read_changes_nothing(store, native):
    fail = Failing()
    c = _cache(store, 12, native, hook=fail)
    c.resolve(np.arange(10, dtype=np.int64))
    c.end_step()
    c.resolve(np.array([3, 4, 60], dtype=np.int64))  # some pinned in this batch
    before = _state(c)

    fail.armed = True
    with pytest.raises(CorruptDataError, match="injected"):
        c.resolve(np.array([4, 5, 80, 81, 130, 5], dtype=np.int64))  # hits and misses
    after = _state(c)
    assert after.pop("last_faults") == 0  # the latest call faulted nothing in
    before.pop("last_faults")
    _assert_same(after, before, "a failed read")
    fail.armed = False
    ref = _cache(store, 12, not native)
    for op in ([np.arange(10, dtype=np.int64)], None, [np.array([3, 4, 60], dtype=np.int64)]):
        ref.end_batch() if op is None else ref.resolve(op[0])
    ids = np.array([4, 5, 80, 81, 130, 5], dtype=np.int64)
    np.testing.assert_array_equal(c.resolve(ids), ref.resolve(ids))
    _assert_same(_state(c), _state(ref), "the retried call")
