"""Exact LRU curves and batch mode against brute-force simulations; SHARDS accuracy."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from rowcache.errors import ArenaExhaustedError, ConfigError
from rowcache.tools.mrc import batch_lru_misses, combine_keys, miss_ratio_curve
from rowcache.tools.stack import (
    INF,
    batch_stack_distances,
    count_greater_before,
    dedup_batches,
    lru_stack_distances,
    previous_use,
    stable_argsort,
    weighted_distances,
)


def brute_lru_misses(keys, size):
    cache: OrderedDict[int, None] = OrderedDict()
    misses = 0
    for k in keys:
        if k in cache:
            cache.move_to_end(k)
        else:
            misses += 1
            if len(cache) >= size:
                cache.popitem(last=False)
            cache[k] = None
    return misses


def brute_batch_cache(keys, batch_ids, slots):
    """Per-row model of the row cache: a batch's unique rows are looked up, then misses
    take free slots, then evict unpinned rows of smallest (last batch, row id); every
    row of the batch gets the batch as recency."""
    last: dict[int, int] = {}  # resident row -> last batch
    misses = 0
    batches: dict[int, list[int]] = {}
    for k, b in zip(keys.tolist(), batch_ids.tolist()):
        batches.setdefault(b, []).append(k)
    for b in sorted(batches):
        rows = sorted(set(batches[b]))
        if len(rows) > slots:
            raise ArenaExhaustedError("batch too big")
        missing = [r for r in rows if r not in last]
        misses += len(missing)
        for r in rows:
            if r in last:
                last[r] = b  # pinned: never a victim in this batch
        free = slots - len(last)
        victims = sorted((lb, r) for r, lb in last.items() if lb != b)
        for _, r in victims[: max(0, len(missing) - free)]:
            del last[r]
        for r in missing:
            last[r] = b
    return misses


def test_stack_distances_equal_brute_force_lru_at_every_size(rng):
    for _ in range(40):
        n = int(rng.integers(1, 400))
        keys = rng.integers(0, int(rng.integers(1, 60)), n)
        dist = lru_stack_distances(keys)
        for size in range(1, 70, 3):
            assert int(np.count_nonzero(dist > size)) == brute_lru_misses(keys.tolist(), size)


def test_stack_distances_first_use_is_inf():
    d = lru_stack_distances(np.array([5, 6, 5, 5, 7, 6]))
    assert d.tolist() == [INF, INF, 2, 1, INF, 3]


def test_exact_curve_matches_brute_force(rng):
    keys = (rng.zipf(1.3, 3000) % 500).astype(np.int64)
    sizes = np.arange(1, 300, 7)
    curve = miss_ratio_curve(keys, sizes)
    expect = [brute_lru_misses(keys.tolist(), int(s)) for s in sizes]
    np.testing.assert_array_equal(curve.misses, expect)
    assert curve.exact and curve.min_feasible == 1
    assert curve.compulsory == np.unique(keys).size / keys.size
    assert np.all(np.diff(curve.miss_ratio) <= 0)


def test_batch_mode_equals_brute_force_cache_at_every_size(rng):
    for _ in range(40):
        n = int(rng.integers(5, 300))
        keys = (rng.zipf(1.2, n) % int(rng.integers(2, 50))).astype(np.int64)
        bids = np.sort(rng.integers(0, max(1, n // int(rng.integers(1, 10))), n))
        sizes = np.arange(1, 50)
        misses, feas, unique = batch_lru_misses(keys, bids, sizes)
        assert feas == max(np.unique(keys[bids == b]).size for b in np.unique(bids))
        assert unique == np.unique(keys).size
        for s, m in zip(sizes.tolist(), misses.tolist()):
            if s < feas:
                assert np.isnan(m)
                with pytest.raises(ArenaExhaustedError):
                    brute_batch_cache(keys, bids, s)
            else:
                assert m == brute_batch_cache(keys, bids, s), (s, keys, bids)


def test_batch_of_one_equals_per_access_lru(rng):
    keys = (rng.zipf(1.2, 2000) % 300).astype(np.int64)
    sizes = np.arange(1, 200, 9)
    a = miss_ratio_curve(keys, sizes)
    b = miss_ratio_curve(keys, sizes, batch=1)
    np.testing.assert_array_equal(a.misses, b.misses)


def test_shards_fixed_rate_within_error_on_zipf(rng):
    n = 400_000
    keys = (rng.zipf(1.1, n) % 200_000).astype(np.int64)
    # SHARDS is stated for sizes of at least ~50 sampled rows (C * rate >= 50).
    sizes = np.array([1000, 5000, 20000, 60000])
    exact = miss_ratio_curve(keys, sizes)
    est = miss_ratio_curve(keys, sizes, method="shards", sample_rate=0.05, salts=3)
    assert not est.exact and abs(est.sample_rate - 0.05) < 1e-6
    err = np.abs(est.miss_ratio - exact.miss_ratio)
    assert err.max() < 0.01, err
    assert np.all(est.miss_ratio_std >= 0) and est.miss_ratio_std.max() < 0.02
    assert abs(est.unique - exact.unique) / exact.unique < 0.1


def test_shards_fixed_size_bounds_the_sample_and_tracks_exact(rng):
    n = 200_000
    keys = (rng.zipf(1.1, n) % 100_000).astype(np.int64)
    sizes = np.array([5000, 30000])
    exact = miss_ratio_curve(keys, sizes)
    chunks = np.array_split(keys, 7)
    est = miss_ratio_curve(iter(chunks), sizes, method="shards", sample_size=4000)
    assert est.accesses == n
    assert est.sample_rate * exact.unique < 6000
    assert np.abs(est.miss_ratio - exact.miss_ratio).max() < 0.04


def test_shards_from_chunks_equals_shards_from_array(rng):
    keys = rng.integers(0, 5000, 50_000)
    sizes = [10, 100, 1000]
    a = miss_ratio_curve(keys, sizes, method="shards", sample_rate=0.1)
    b = miss_ratio_curve(iter(np.array_split(keys, 5)), sizes, method="shards", sample_rate=0.1)
    np.testing.assert_array_equal(a.miss_ratio, b.miss_ratio)


def test_combine_keys_shared_arena():
    k = combine_keys(np.array([0, 1, 0]), np.array([7, 7, 7]))
    assert k[0] == k[2] != k[1]
    with pytest.raises(ConfigError):
        combine_keys(0, np.array([-1]))


def test_bad_arguments_raise_config_error():
    keys = np.arange(10)
    with pytest.raises(ConfigError, match="sizes"):
        miss_ratio_curve(keys, [0])
    with pytest.raises(ConfigError, match="method"):
        miss_ratio_curve(keys, [1], method="magic")
    with pytest.raises(ConfigError, match="policy"):
        miss_ratio_curve(keys, [1], policy="fifo")
    with pytest.raises(ConfigError, match="accesses"):
        miss_ratio_curve(np.zeros((2, 2), np.int64), [1])
    with pytest.raises(ConfigError, match="non-decreasing"):
        miss_ratio_curve(keys, [1], batch=np.arange(10)[::-1])
    with pytest.raises(ConfigError, match="sample_rate"):
        miss_ratio_curve(keys, [1], method="shards", sample_rate=2.0)


def test_chunk_pairs_carry_batches(rng):
    keys = (rng.zipf(1.2, 5000) % 800).astype(np.int64)
    bids = np.arange(5000) // 16
    sizes = np.array([16, 50, 200, 700])
    whole = miss_ratio_curve(keys, sizes, batch=bids)
    pairs = list(zip(np.array_split(keys, 3), np.array_split(bids, 3)))
    exact = miss_ratio_curve(iter(pairs), sizes)
    np.testing.assert_array_equal(exact.misses, whole.misses)
    full = miss_ratio_curve(iter(pairs), sizes, method="shards", sample_rate=1.0)
    assert full.batched and full.sample_rate == 1.0
    np.testing.assert_array_equal(full.misses, whole.misses)
    with pytest.raises(ConfigError, match="both"):
        miss_ratio_curve(pairs, sizes, batch=4)


def test_shards_heavy_keys_at_full_rate_are_exact(rng):
    keys = (rng.zipf(1.2, 4000) % 900).astype(np.int64)
    bids = np.arange(4000) // 16
    sizes = np.array([16, 40, 200, 800])
    for batch in (None, bids):
        exact = miss_ratio_curve(keys, sizes, batch=batch)
        est = miss_ratio_curve(keys, sizes, method="shards", sample_rate=1.0, heavy=50, batch=batch)
        np.testing.assert_allclose(est.misses, exact.misses, rtol=1e-12)
        assert est.min_feasible == exact.min_feasible


def test_shards_heavy_keys_cut_the_error_on_zipf(rng):
    keys = (rng.zipf(1.1, 300_000) % 150_000).astype(np.int64)
    sizes = np.array([1000, 5000, 20000])
    exact = miss_ratio_curve(keys, sizes)
    plain = miss_ratio_curve(keys, sizes, method="shards", sample_rate=0.01, salts=4)
    hv = miss_ratio_curve(keys, sizes, method="shards", sample_rate=0.01, salts=4, heavy=8192)
    err_plain = np.abs(plain.miss_ratio - exact.miss_ratio).max()
    err_hv = np.abs(hv.miss_ratio - exact.miss_ratio).max()
    assert err_hv < 0.006 and err_hv < err_plain
    assert hv.miss_ratio_std.max() < plain.miss_ratio_std.max()
    with pytest.raises(ConfigError, match="heavy"):
        miss_ratio_curve(keys, sizes, method="shards", sample_size=100, heavy=10)


def brute_greater_before(ranks):
    return [int(np.count_nonzero(ranks[:i] > ranks[i])) for i in range(ranks.size)]


def test_count_greater_before_equals_brute_force(rng):
    # Sizes around powers of two and the small-block width cover the partial blocks.
    for m in [*range(40), 63, 64, 65, 127, 200, 513, 1000]:
        ranks = rng.permutation(m)
        got = count_greater_before(ranks)
        assert got.tolist() == brute_greater_before(ranks), m
        by_rank = count_greater_before(ranks, by_rank=True)
        assert np.array_equal(by_rank[ranks], got)


def test_count_greater_before_sorted_and_reversed():
    m = 3000
    assert not count_greater_before(np.arange(m)).any()
    assert count_greater_before(np.arange(m)[::-1]).tolist() == list(range(m))


def test_stable_argsort_equals_numpy_stable(rng):
    cases = [
        rng.integers(0, 3, 1000),
        rng.integers(-(2**20), 2**20, 5000),
        rng.integers(0, 2**40, 5000),
        rng.integers(-(2**62), 2**62, 1000),  # beyond 48 bits: NumPy's merge sort
        np.array([7]),
        np.zeros(0, np.int64),
    ]
    for vals in cases:
        np.testing.assert_array_equal(stable_argsort(vals), np.argsort(vals, kind="stable"))


def test_previous_use_equals_dict_scan(rng):
    keys = rng.integers(-50, 2**33, 3000) % 977 - 300
    last: dict[int, int] = {}
    expect = []
    for i, k in enumerate(keys.tolist()):
        expect.append(last.get(k, -1))
        last[k] = i
    assert previous_use(keys).tolist() == expect


def test_distances_equal_divide_and_conquer_on_a_long_trace(rng):
    # The counting by inversions against the independent CDQ count (unit weights).
    n = 60_000
    keys = (rng.zipf(1.1, n) % 20_000).astype(np.int64)
    dist = lru_stack_distances(keys)
    ref, _, _ = weighted_distances(keys, np.ones(n))
    np.testing.assert_array_equal(np.where(dist == INF, np.inf, dist.astype(float)), ref)
    bids = np.repeat(np.arange(n), rng.integers(1, 30, n))[:n]
    bdist, bsizes = batch_stack_distances(keys, bids)
    bref, _, bw = weighted_distances(keys, np.ones(n), bids)
    np.testing.assert_array_equal(np.where(bdist == INF, np.inf, bdist.astype(float)), bref)
    np.testing.assert_array_equal(bsizes, bw)


def test_batch_distances_do_not_depend_on_access_order_within_the_trace(rng):
    keys = (rng.zipf(1.2, 2000) % 300).astype(np.int64)
    bids = np.sort(rng.integers(0, 200, 2000))
    shuffle = rng.permutation(2000)
    a = batch_stack_distances(keys, bids)
    b = batch_stack_distances(keys[shuffle], bids[shuffle])
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    uk, ub, idx = dedup_batches(keys[shuffle], bids[shuffle], return_index=True)
    assert np.array_equal(keys[shuffle][idx], uk)
    pairs = sorted(set(zip(bids.tolist(), keys.tolist())))
    assert list(zip(ub.tolist(), uk.tolist())) == [
        (int(np.searchsorted(np.unique(bids), b)), k) for b, k in pairs
    ]


def test_exact_pass_past_the_packed_limit_raises_config_error(rng, monkeypatch):
    import rowcache.tools.inversions as inversions
    import rowcache.tools.stack as stack

    monkeypatch.setattr(inversions, "PACKED_LIMIT", 100)
    assert stack.count_greater_before(rng.permutation(99)).size == 99
    with pytest.raises(ConfigError, match="shards"):
        stack.count_greater_before(rng.permutation(100))
    with pytest.raises(ConfigError, match="reuses"):
        miss_ratio_curve(np.arange(300) % 7, [1, 2])


def test_bench_synthetic_trace_is_a_valid_server_trace(tmp_path):
    import bench.mrc as mod
    from rowcache.embed.ngram.dims import NgramDims
    from rowcache.tools.parallel import sample_trace
    from rowcache.tools.trace import ServerModel

    dims = NgramDims.longcat_flash_lite()
    model = ServerModel(batch=4, chunk=64, decode=16)
    tr = mod.write_synthetic_trace(
        str(tmp_path / "t"), 120_001, dims=dims, model=model, chunk_positions=1500
    )
    assert tr.positions == -(-120_001 // 12) and tr.num_tables == 12
    assert len(tr.chunks) == -(-tr.positions // 1500)
    steps = tr.steps_array()
    assert np.all(np.diff(steps) >= 0) and steps[-1] == tr.steps - 1
    # A step holds at most one unit (a prefill chunk or a token) of each slot.
    assert np.bincount(steps).max() <= model.batch * model.chunk
    for t in (0, 11):
        rows, _ = tr.table_accesses(t)
        assert rows.min() >= 0 and rows.max() < tr.table_rows[t]
        counts = np.bincount(rows)
        assert counts.max() > 20 * rows.size / np.count_nonzero(counts)  # skewed (Zipf)
    smp = sample_trace(tr, 0.5, shared=False)
    assert smp[("0", 0)].total == tr.positions


def test_shards_scaled_size_counts_the_reused_key_once():
    from rowcache.tools.mrc import curve_from_samples, scaled_sizes
    from rowcache.tools.shards import HASH_SPACE, Sample

    # Sampled [a, b, a] at rate 1/4: b stands for 4 keys, a's reuse sees 1 + 4 = 5
    # distinct keys, so it hits from C = 5 (scaling a's own 1 too would say C = 8).
    rate = 0.25
    keys = np.array([1, 2, 1])
    pos = np.arange(3)
    thr = HASH_SPACE // 4
    sizes = np.array([4, 5, 8])
    plain = Sample(keys, pos, 12, rate, thr)
    weighted = Sample(keys, pos, 12, rate, thr, forced=np.zeros(3, dtype=bool))
    for smp in (plain, weighted):
        curve = curve_from_samples([smp], sizes)
        np.testing.assert_allclose(curve.miss_ratio, [1.0, 2 / 3, 2 / 3])
    np.testing.assert_array_equal(scaled_sizes(np.arange(1, 50), 1.0), np.arange(1, 50))
    assert scaled_sizes(np.array([1, 4, 5, 8, 9]), rate).tolist() == [1, 1, 2, 2, 3]
