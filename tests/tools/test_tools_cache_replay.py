"""Batch-mode curves equal the fault counts of the real NgramRowCache replaying the trace."""

from __future__ import annotations

import numpy as np
import pytest

import rowcache
from rowcache.tools.mrc import miss_ratio_curve


@pytest.fixture
def store(tmp_path, rng):
    table = rng.standard_normal((400, 4)).astype(np.float32)
    s = rowcache.build_store(tmp_path / "store", {"t": table}, progress=False)
    yield s
    s.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_batch_curve_equals_cache_replay(store, rng, device):
    n = 3000
    keys = (rng.zipf(1.15, n) % 400).astype(np.int64)
    lengths = rng.integers(1, 40, 400)
    bids = np.repeat(np.arange(lengths.size), lengths)[:n]
    sizes = np.array([40, 41, 45, 60, 90, 150, 399])
    curve = miss_ratio_curve(keys, sizes, batch=bids)
    assert curve.exact and curve.batched
    bounds = np.flatnonzero(np.diff(bids)) + 1
    for size, expect in zip(sizes.tolist(), curve.misses.tolist()):
        if size < curve.min_feasible:
            assert np.isnan(expect)
            continue
        cache = rowcache.NgramRowCache(store, "t", slots=size, device=device)
        for part in np.split(keys, bounds):
            cache.resolve(part)
            cache.end_step()
        assert cache.stats().misses == expect, size


def test_infeasible_size_matches_cache_refusal(store):
    keys = np.array([1, 2, 3, 4, 1, 2])
    bids = np.array([0, 0, 0, 0, 1, 1])
    curve = miss_ratio_curve(keys, [3, 4], batch=bids)
    assert curve.min_feasible == 4
    assert np.isnan(curve.miss_ratio[0]) and curve.misses[1] == 4
    cache = rowcache.NgramRowCache(store, "t", slots=3)
    with pytest.raises(rowcache.ArenaExhaustedError):
        cache.resolve(keys[:4])
