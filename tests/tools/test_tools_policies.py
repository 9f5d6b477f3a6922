"""SIEVE and OPT simulators: OPT is a lower bound; SIEVE against a list-based model."""

from __future__ import annotations

import numpy as np
import pytest

from rowcache.errors import ConfigError
from rowcache.tools.mrc import miss_ratio_curve
from rowcache.tools.policies import simulate


def sieve_model(keys, size):
    """SIEVE straight from the paper's pseudo-code, on a Python list (index 0 = tail)."""
    queue: list[int] = []  # oldest first
    visited: dict[int, bool] = {}
    hand = None  # index into queue, moves towards the newest
    misses = 0
    for k in keys:
        if k in visited:
            visited[k] = True
            continue
        misses += 1
        if len(queue) >= size:
            i = 0 if hand is None else hand
            while visited[queue[i]]:
                visited[queue[i]] = False
                i = i + 1 if i + 1 < len(queue) else 0
            victim = queue.pop(i)
            del visited[victim]
            hand = i if i < len(queue) else None
        queue.append(k)
        visited[k] = False
    return misses


def opt_brute(keys, size):
    cache: set[int] = set()
    misses = 0
    for i, k in enumerate(keys):
        if k in cache:
            continue
        misses += 1
        if len(cache) >= size:
            later = keys[i + 1 :]
            far = {x: later.index(x) if x in later else len(keys) for x in cache}
            cache.remove(max(sorted(cache), key=far.__getitem__))
        cache.add(k)
    return misses


def test_sieve_matches_list_model(rng):
    for _ in range(30):
        n = int(rng.integers(1, 300))
        keys = (rng.zipf(1.3, n) % int(rng.integers(2, 40))).tolist()
        for size in (1, 2, 3, 5, 8, 13, 40):
            assert simulate("sieve", np.array(keys), size) == sieve_model(keys, size)


def test_opt_matches_brute_force(rng):
    for _ in range(20):
        n = int(rng.integers(1, 120))
        keys = rng.integers(0, int(rng.integers(2, 20)), n).tolist()
        for size in (1, 2, 4, 7):
            assert simulate("opt", np.array(keys), size) == opt_brute(keys, size)


def test_opt_is_a_lower_bound_of_every_policy_at_every_size(rng):
    keys = (rng.zipf(1.2, 4000) % 700).astype(np.int64)
    sizes = np.array([1, 5, 20, 80, 200, 500])
    curves = {p: miss_ratio_curve(keys, sizes, policy=p) for p in ("lru", "sieve", "opt")}
    assert np.all(curves["opt"].misses <= curves["lru"].misses)
    assert np.all(curves["opt"].misses <= curves["sieve"].misses)
    assert np.all(curves["opt"].misses >= curves["opt"].unique)
    lru_sim = [simulate("lru", keys, int(s)) for s in sizes]
    np.testing.assert_array_equal(curves["lru"].misses, lru_sim)


def test_policy_on_shards_sample(rng):
    keys = (rng.zipf(1.2, 50_000) % 20_000).astype(np.int64)
    c = miss_ratio_curve(keys, [1000, 4000], policy="sieve", method="shards", sample_rate=0.1)
    assert np.all((c.miss_ratio > 0) & (c.miss_ratio <= 1))


def test_simulate_rejects_bad_policy_and_size():
    with pytest.raises(ConfigError, match="policy"):
        simulate("arc", np.arange(3), 2)
    with pytest.raises(ConfigError, match="size"):
        simulate("lru", np.arange(3), 0)
