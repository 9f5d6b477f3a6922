"""The row -> slot map (rowcache.cache.row_map): the native hash against a dict, the rule
that picks dense or hash, and a cache over each kind giving the same answers."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rowcache
from rowcache.cache.config import Tuning
from rowcache.cache.row_map import (
    MAP_SHARE,
    DenseRowMap,
    HashRowMap,
    dense_bytes,
    hash_bytes,
    hash_capacity,
    row_map_kind,
)
from rowcache.errors import ConfigError
from rowcache.kernels import host

pytestmark = pytest.mark.skipif(host.native is None, reason="rowcache.kernels._host not built")
native = host.native


def _agree(m, ref: dict, rows: int) -> None:
    assert m.check() == []
    ids = np.arange(rows, dtype=np.int64)
    want = np.full(rows, -1, dtype=np.int32)
    if ref:
        want[np.fromiter(ref.keys(), np.int64)] = np.fromiter(ref.values(), np.int32)
    np.testing.assert_array_equal(m.get(ids), want)
    np.testing.assert_array_equal(m.to_dense(), want)
    r, s = m.items()
    assert r.tolist() == sorted(ref) and s.tolist() == [ref[k] for k in sorted(ref)]


@settings(max_examples=60, deadline=None)
@given(
    rows=st.sampled_from([5, 64, 1000, 2**31 - 1]),
    slots=st.integers(1, 40),
    ops=st.lists(
        st.tuples(st.booleans(), st.lists(st.integers(0, 10**9), max_size=12)), max_size=60
    ),
)
def test_hash_map_equals_a_dict(rows, slots, ops):
    """Random sets and unsets (at most ``slots`` rows held, as in a cache; a small capacity,
    so clusters wrap around the end and deletions shift entries back) against a dict."""
    m, ref = HashRowMap(rows, slots, native), {}
    for k, (is_set, raw) in enumerate(ops):
        keys = list(dict.fromkeys(x % rows for x in raw))
        if is_set:
            new = [x for x in keys if x not in ref]
            keys = [x for x in keys if x in ref] + new[: slots - len(ref)]
            vals = [(x * 7 + k) % (2**31 - 1) for x in keys]
            m.set(np.array(keys, np.int64), np.array(vals, np.int32))
            ref.update(zip(keys, vals))
        else:
            m.unset(np.array(keys, np.int64))
            for x in keys:
                ref.pop(x, None)
        assert m.count == len(ref)
        assert m.check() == []
    if rows <= 1000:
        _agree(m, ref, rows)
    else:
        probe = np.array([*sorted(ref), 0, rows - 1], np.int64)
        got = m.get(probe)
        assert got.tolist() == [ref.get(int(x), -1) for x in probe]


def _home(row: int, cap: int) -> int:
    """csrc/row_map.h's rm_home: the Fibonacci hash's top bits."""
    return ((row * 0x9E3779B1) & 0xFFFFFFFF) >> (32 - cap.bit_length() + 1)


def test_hash_map_collisions_wrap_and_shift_back():
    """Three rows of one home, the last pair of a capacity of 4: their cluster wraps around
    the table's end; each deleted, in turn, shifts the others back and keeps them found,
    and a fourth row homed in the wrapped part is found too."""
    cap = hash_capacity(2)
    assert cap == 4
    last = [r for r in range(10**6) if _home(r, cap) == cap - 1][:3]
    first = next(r for r in range(10**6) if _home(r, cap) == 0)
    rows = np.array(last, np.int64)
    for gone in [None, *last]:
        m = HashRowMap(10**6, 2, native)
        m.set(rows, np.array([10, 20, 30], np.int32))
        ref = dict(zip(last, [10, 20, 30]))
        if gone is not None:
            m.unset(np.array([gone]))
            del ref[gone]
            m.set(np.array([first], np.int64), np.array([40], np.int32))
            ref[first] = 40
        assert m.check() == [] and m.count == len(ref)
        q = np.array([*last, first], np.int64)
        assert m.get(q).tolist() == [ref.get(int(r), -1) for r in q]


def test_hash_map_refuses_what_does_not_fit_before_any_change():
    m = HashRowMap(100, 2, native)  # capacity 4: three rows at most
    m.set(np.array([1, 2], np.int64), np.array([0, 1], np.int32))
    with pytest.raises(ValueError, match="2 new rows do not fit"):
        m.set(np.array([3, 4], np.int64), np.array([2, 3], np.int32))
    assert m.count == 2 and m.get(np.array([3, 4])).tolist() == [-1, -1]
    with pytest.raises(ValueError, match=r"row 100 \(at 1\) is outside \[0, 100\)"):
        m.set(np.array([3, 100], np.int64), np.array([2, 3], np.int32))
    with pytest.raises(ValueError, match="row -1"):
        m.get(np.array([-1]))
    with pytest.raises(ValueError, match="row 100"):
        m.unset(np.array([5, 100]))
    with pytest.raises(ValueError, match="slot -3"):
        m.set(np.array([3], np.int64), np.array([-3], np.int32))
    assert m.count == 2 and m.check() == []
    h = native.RowHash(10, 4)
    with pytest.raises(ValueError, match="already initialized"):
        h.__init__(10, 8)
    for rows, cap in ((0, 4), (2**31, 4), (10, 3), (10, 1), (10, 2**31)):
        with pytest.raises(ValueError, match="power of"):
            native.RowHash(rows, cap)


def test_an_lru_state_refuses_a_hash_too_small_for_its_slots():
    S = 8
    arrays = (np.full(S, -1, np.int32), np.zeros(S, np.uint8), np.zeros(S, np.int64),
              np.zeros(2 * S, np.int32), np.zeros(S, np.int32))  # fmt: skip
    offsets, misses = np.array([0, 100], np.int64), np.zeros(1, np.int64)
    with pytest.raises(ValueError, match="more than S pairs"):
        native.LruState(native.RowHash(100, 8), *arrays, offsets, misses)
    native.LruState(native.RowHash(100, 16), *arrays, offsets, misses)
    with pytest.raises(ValueError, match="ascending from 0 to R"):  # R is the hash's rows
        native.LruState(native.RowHash(99, 16), *arrays, offsets, misses)


def test_the_rule_picks_a_hash_only_where_a_dense_map_is_big_and_the_hash_smaller():
    assert hash_capacity(1) == 2 and hash_capacity(8) == 16 and hash_capacity(9) == 32
    assert hash_bytes(1000) == 8 * 2048 and dense_bytes(1000) == 4000
    # the reported V4.1 (264-byte rows: 1.5 %) stays dense; the demo's 128-byte rows do not
    assert row_map_kind(384 << 20, 1 << 20, 264, native) == "dense"
    assert row_map_kind(384 << 20, 1 << 20, 128, native) == "hash"
    assert 4 / 128 > MAP_SHARE > 4 / 264
    # small rows, but an arena about as large as the table: the hash would be larger
    assert row_map_kind(1000, 900, 32, native) == "dense"
    assert row_map_kind(1000, 900, 32, native, "hash") == "hash"
    assert row_map_kind(1000, 10, 32, None) == "dense"  # no native module: dense
    with pytest.raises(ConfigError, match="needs the native module"):
        row_map_kind(1000, 10, 32, None, "hash")
    with pytest.raises(ConfigError, match=r"row_map='sparse': give one of 'auto', 'dense', 'hash'"):
        Tuning(row_map="sparse")


def test_dense_and_hash_maps_answer_alike(rng):
    rows, slots = 5000, 300
    d, h = DenseRowMap(rows), HashRowMap(rows, slots, native)
    held: dict[int, int] = {}
    for _ in range(50):
        gone = rng.choice(list(held), size=min(len(held), 40), replace=False) if held else []
        gone = np.array(gone, np.int64)
        d.unset(gone)
        h.unset(gone)
        for g in gone.tolist():
            del held[g]
        free = sorted(set(range(slots)) - set(held.values()))
        new = rng.choice(
            np.setdiff1d(np.arange(rows), list(held)), size=min(40, len(free)), replace=False
        )
        d.set(new, np.array(free[: new.size], np.int32))
        h.set(new, np.array(free[: new.size], np.int32))
        held.update(zip(new.tolist(), free[: new.size]))
        q = rng.integers(0, rows, 500)
        np.testing.assert_array_equal(d.get(q), h.get(q))
    for a, b in zip(d.items(), h.items()):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(d.to_dense(), h.to_dense())


def test_a_cache_of_small_rows_maps_them_in_a_hash_bounded_by_its_arena(tmp_path, rng):
    """64-byte rows over 40,000 rows and 500 slots: the rule's hash, 8 KiB against the dense
    map's 160 KB; the same slots, values and stats as a dense cache over the same calls."""
    tab = rng.standard_normal((40_000, 32)).astype(np.float32)
    store = rowcache.build_store(tmp_path / "s", {"t": tab}, dtype="bf16", progress=False)
    auto = rowcache.NgramRowCache(store, "t", slots=500)
    dense = rowcache.NgramRowCache.assemble(store, "t", slots=500, tuning=Tuning(row_map="dense"))
    assert auto.row_map_kind == "hash" and dense.row_map_kind == "dense"
    assert auto.inspect().overhead_bytes()["row_map"] == hash_bytes(500) == 8192
    assert dense.inspect().overhead_bytes()["row_map"] == 160_000
    for step in range(30):
        ids = rng.integers(0, 40_000, 400) if step % 3 else rng.integers(0, 600, 400)
        a, b = auto.resolve(ids), dense.resolve(ids)
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(auto.table[a], dense.table[b])
        auto.end_step()
        dense.end_step()
        if step % 5 == 0:  # a coming step's rows, read ahead by both
            ahead = rng.integers(0, 40_000, 100)
            assert auto.prefetch(ahead).wait(30) and dense.prefetch(ahead).wait(30)
        assert auto.inspect().check() == [] and auto.stats().misses == dense.stats().misses
    np.testing.assert_array_equal(auto.table[auto.resolve(np.arange(100))].view(np.uint16),
                                  store.read_rows("t", np.arange(100)).view(np.uint16))  # fmt: skip
