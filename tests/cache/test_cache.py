"""NgramRowCache against a pure-Python LRU with pin counts, and its failure modes."""

from __future__ import annotations

import os
import threading

import ml_dtypes
import numpy as np
import pytest

import rowcache
from rowcache import NgramRowCache
from rowcache.errors import ArenaExhaustedError, ConfigError, CorruptDataError, RowRangeError
from tests.cache.support import (
    batches,
    check_invariants,
    expected,
    expected_part,
    gather,
    make_multi_store,
    make_store,
    python_engine,
)

BF16 = ml_dtypes.bfloat16


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_cache_model_based_against_reference_lru(tmp_path, rng, dtype, ref_lru):
    store, _ = make_store(tmp_path, rng, dtype=dtype)
    slots = 150
    cache = NgramRowCache(store, "t", slots=slots)
    lru = ref_lru(slots)
    exhausted = 0
    for calls in batches(rng, 3000, slots, 60):
        held = {}
        for ids in calls:
            try:
                lru.resolve(ids)
            except ArenaExhaustedError:
                with pytest.raises(ArenaExhaustedError):
                    cache.resolve(ids)
                exhausted += 1
                continue
            got = cache.resolve(ids)
            assert got.dtype == np.int32 and got.shape == ids.shape
            np.testing.assert_array_equal(
                gather(cache, got).view(np.uint16), expected(store, ids).view(np.uint16)
            )
            held.update(zip(ids.tolist(), got.tolist()))
            # Pinned slots were never evicted: every slot handed out in this batch still holds its row.
            row_slot, _ = cache.inspect().slot_map()
            assert all(row_slot[r] == s for r, s in held.items())
            assert cache.inspect().pinned == len(set(held.values()))
        s = cache.stats()
        assert (s.misses, s.hits, s.evictions) == (lru.faults, lru.hits, lru.evictions)
        check_invariants(cache, lru)
        cache.end_step()
        lru.end_batch()
        assert cache.inspect().pinned == 0 and not cache.inspect().pin_counts().any()
    s = cache.stats()
    assert s.rows_read == s.misses and s.read_ops <= s.rows_read and s.batches == 60
    assert exhausted > 0, "the sequence never exercised arena exhaustion"
    assert s.bytes_read >= s.rows_read * store.tables[0].record_bytes


def test_cache_log_compaction_long_run(tmp_path, rng, ref_lru):
    store, x = make_store(tmp_path, rng, rows=500, dim=8)
    cache = NgramRowCache(store, "t", slots=20)
    lru = ref_lru(20)
    for _ in range(400):
        ids = rng.integers(0, 40, int(rng.integers(1, 15)))
        got = cache.resolve(ids)
        lru.resolve(ids)
        np.testing.assert_array_equal(cache.table[got].view(np.uint16), x[ids].view(np.uint16))
        cache.end_step()
        lru.end_batch()
    check_invariants(cache, lru)
    assert cache.stats().misses == lru.faults


def test_cache_arena_exhausted_leaves_state_unchanged(tiny_store):
    store, _ = tiny_store
    cache = NgramRowCache(store, "t", slots=50)
    cache.resolve(np.arange(30))
    before = (cache.inspect().slot_map(), cache.inspect().pin_counts(), cache.stats(), cache.table.copy())
    with pytest.raises(ArenaExhaustedError, match="needs 25 more slots but only 20"):
        cache.resolve(np.arange(100, 125))
    after = (cache.inspect().slot_map(), cache.inspect().pin_counts(), cache.stats(), cache.table.copy())
    for a, b in zip(before[0], after[0]):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(before[1], after[1])
    assert before[2] == after[2]
    np.testing.assert_array_equal(before[3].view(np.uint16), after[3].view(np.uint16))
    # Still usable: the 20 free slots can be used, and after end_step everything can.
    cache.resolve(np.arange(100, 120))
    cache.end_step()
    cache.resolve(np.arange(200, 250))


def test_cache_row_range_error_before_any_change(tiny_store):
    store, _ = tiny_store
    cache = NgramRowCache(store, "t", slots=50)
    cache.resolve(np.array([1, 2]))
    with pytest.raises(RowRangeError, match=r"row_ids\[1\] = 3000"):
        cache.resolve(np.array([5, 3000]))
    with pytest.raises(RowRangeError):
        cache.resolve(np.array([-1]))
    assert cache.stats().lookups == 2 and cache.resident == 2 and cache.inspect().pinned == 2


@pytest.mark.parametrize("failure", ["eio", "short"])
def test_cache_read_failure_maps_nothing_and_stays_usable(monkeypatch, failure, tiny_store):
    store, x = tiny_store
    store = rowcache.RowStore.open(store.path, merge_gap=0)  # one read per row
    # the Python engine calls os.preadv, which the test replaces below
    cache = NgramRowCache.assemble(store, "t", slots=40, queue_depth=1, part_reader=python_engine)
    first = cache.resolve(np.arange(40))
    cache.end_step()
    table_before = cache.table.copy()
    real = os.preadv
    calls = {"n": 0}

    def flaky(fd, bufs, off):
        calls["n"] += 1
        if calls["n"] == 3:
            if failure == "eio":
                raise OSError(5, "Input/output error")
            return 0  # end of file: a short read
        return real(fd, bufs, off)

    monkeypatch.setattr(os, "preadv", flaky)
    ids = np.arange(100, 100 + 20 * 128, 128)  # 20 rows two pages apart: each its own read
    with pytest.raises(CorruptDataError):
        cache.resolve(ids)
    monkeypatch.setattr(os, "preadv", real)
    row_slot, slot_row = cache.inspect().slot_map()
    assert (row_slot[ids] == -1).all(), "a row whose read failed was mapped"
    np.testing.assert_array_equal(slot_row[first], np.arange(40))  # old rows still mapped ...
    np.testing.assert_array_equal(
        cache.table.view(np.uint16), table_before.view(np.uint16)
    )  # ... and intact
    assert cache.stats().misses == 40 and cache.inspect().pinned == 0
    got = cache.resolve(ids)  # usable again
    np.testing.assert_array_equal(cache.table[got].view(np.uint16), x[ids].view(np.uint16))


def test_cache_stats_reset_and_counts(tiny_store):
    store, _ = tiny_store
    cache = NgramRowCache(store, "t", slots=100)
    cache.resolve(np.array([1, 1, 2, 3]))
    cache.resolve(np.array([3, 4]))  # same batch: 3 is not a second hit
    s = cache.stats(reset=True)
    assert (s.lookups, s.hits, s.misses, s.evictions) == (6, 0, 4, 0)
    assert s.fault_seconds > 0 and s.hit_rate == 0.0
    cache.end_step()
    cache.resolve(np.array([1, 2, 9]))
    s = cache.stats()
    assert (s.lookups, s.hits, s.misses, s.batches) == (3, 2, 1, 1)


def test_cache_empty_batch(tiny_store):
    store, _ = tiny_store
    cache = NgramRowCache(store, "t", slots=10)
    out = cache.resolve(np.array([], dtype=np.int64))
    assert out.shape == (0,) and out.dtype == np.int32
    cache.end_step()


def test_cache_bad_arguments(tiny_store):
    store, _ = tiny_store
    with pytest.raises(ConfigError, match="slots=0"):
        NgramRowCache(store, "t", slots=0)
    with pytest.raises(ConfigError, match="slots=3001"):
        NgramRowCache(store, "t", slots=3001)
    with pytest.raises(ConfigError, match="policy='fifo'"):
        NgramRowCache(store, "t", slots=10, policy="fifo")
    with pytest.raises(ConfigError, match="device='tpu'"):
        NgramRowCache(store, "t", slots=10, device="tpu")
    with pytest.raises(ConfigError, match="reader='mmap'"):
        NgramRowCache(store, "t", slots=10, reader="mmap")
    with pytest.raises(ConfigError, match="table='nope'"):
        NgramRowCache(store, "nope", slots=10)
    with pytest.raises(ConfigError, match="integer array"):
        NgramRowCache(store, "t", slots=10).resolve(np.array([0.5]))


def test_cache_overhead_per_slot_within_5_percent_of_bf16_rows(tmp_path, rng):
    # Bookkeeping does not depend on the row width: a narrow table with many rows will do.
    store, _ = make_store(tmp_path, rng, rows=200_000, dim=4)
    cache = NgramRowCache(store, "t", slots=100_000)
    per_slot = cache.inspect().overhead_bytes()["per_slot_arrays"] / cache.num_slots
    assert per_slot <= 0.05 * 512, per_slot  # a LongCat BF16 row is 512 bytes


def test_cache_concurrent_resolves_keep_invariants(tmp_path, rng):
    """The thread-safety promise: concurrent resolves never corrupt the maps, and every
    slot handed to any thread holds its row until end_step."""
    store, x = make_store(tmp_path, rng, rows=2000, dim=16)
    cache = NgramRowCache(store, "t", slots=1200)
    errors: list[BaseException] = []

    def worker(seed):
        r = np.random.default_rng(seed)
        try:
            for _ in range(5):
                ids = r.integers(0, 2000, 40)
                got = cache.resolve(ids)
                np.testing.assert_array_equal(
                    cache.table[got].view(np.uint16), x[ids].view(np.uint16)
                )
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    for _round in range(4):
        threads = [threading.Thread(target=worker, args=(100 * _round + i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        cache.end_step()
    assert not errors, errors[0]
    row_slot, slot_row = cache.inspect().slot_map()
    mapped = np.flatnonzero(slot_row >= 0)
    assert np.array_equal(row_slot[slot_row[mapped]], mapped)
    np.testing.assert_array_equal(
        cache.table[mapped].view(np.uint16), x[slot_row[mapped]].view(np.uint16)
    )


def test_cache_cupy_input_rejected_gracefully_on_cpu_device_without_gpu(tiny_store):
    store, _ = tiny_store
    if rowcache.cache.row_cache.np is None:  # pragma: no cover
        pytest.skip()
    from rowcache.kernels import gpu_available

    if gpu_available():
        pytest.skip("GPU present: covered by the GPU tests")
    with pytest.raises(rowcache.GpuUnavailableError, match="device='cpu'"):
        NgramRowCache(store, "t", slots=10, device="cuda")


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_shared_cache_over_several_tables_matches_reference(tmp_path, rng, dtype, ref_lru):
    store, tabs = make_multi_store(tmp_path, rng, dtype)
    names = ["t2", "t0", "t3"]  # any order: global ids follow the list
    cache = NgramRowCache(store, names, slots=120)
    assert cache.row_offsets.tolist() == [0, 314, 614, 935]
    assert cache.rows == 935 and cache.name == "t2+t0+t3"
    lru = ref_lru(120)
    for _ in range(40):
        local = [rng.zipf(1.3, 30) % tabs[n].shape[0] for n in names]
        ids = np.concatenate([cache.global_ids(k, ids_k) for k, ids_k in enumerate(local)])
        got = cache.resolve(ids)
        lru.resolve(ids)
        rows = gather(cache, got)
        want = [expected_part(store, n, ids_k) for n, ids_k in zip(names, local)]
        np.testing.assert_array_equal(rows.view(np.uint16), np.concatenate(want).view(np.uint16))
        check_invariants(cache, lru)
        assert cache.stats().misses == lru.faults
        cache.end_step()
        lru.end_batch()
    with pytest.raises(ConfigError, match="shares its arena among 3 tables"):
        cache.info  # noqa: B018
    with pytest.raises(RowRangeError):
        cache.global_ids(0, np.array([314]))  # t2 has 314 rows
    with pytest.raises(ConfigError, match="part=3"):
        cache.global_ids(3, np.array([0]))


def test_shared_cache_bad_table_lists(tmp_path, rng):
    store, _ = make_multi_store(tmp_path, rng)
    with pytest.raises(ConfigError, match="twice"):
        NgramRowCache(store, ["t0", 0], slots=10)
    with pytest.raises(ConfigError, match=r"table=\[\]"):
        NgramRowCache(store, [], slots=10)
    x = rng.standard_normal((10, 8), dtype=np.float32)
    y = rng.standard_normal((10, 4), dtype=np.float32)
    s2 = rowcache.build_store(tmp_path / "w", {"a": x, "b": y}, progress=False)
    with pytest.raises(ConfigError, match="one width"):
        NgramRowCache(s2, ["a", "b"], slots=5)
