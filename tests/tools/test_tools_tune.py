"""`tune` on hand-computable curves; byte parsing; device profiles."""

from __future__ import annotations

import pytest

from rowcache.errors import ConfigError
from rowcache.tools.benchio import DeviceProfile
from rowcache.tools.tune import tune
from rowcache.units import parse_bytes


def profile():
    # 4-byte bf16 rows (dim 2). Hull of b skips its size 20 (not convex).
    return {
        "tokens": 100,
        "record_bytes": 4,
        "dtype": "bf16",
        "table_rows": [1000, 1000],
        "tables": {
            "a": {"sizes": [10, 20, 30], "misses": [100, 40, 30], "accesses": 200},
            "b": {"sizes": [10, 20, 30], "misses": [100, 90, 20], "accesses": 200},
        },
    }


def device():
    return DeviceProfile(
        path="x",
        file_bytes=1,
        direct=True,
        random={"4096": {"1": 500.0, "8": 1000.0}},
        sequential_bytes_per_s=1e9,
        seconds_per_point=1.0,
    )


def test_greedy_split_by_marginal_gain():
    r = tune(profile(), arena_bytes=120)
    assert r.rows == {"a": 20, "b": 10} and r.used_bytes == 120
    assert r.faults_per_token == pytest.approx(1.4)
    assert r.fault_rate == {"a": pytest.approx(0.2), "b": pytest.approx(0.5)}
    r = tune(profile(), arena_bytes=239)
    assert r.rows == {"a": 20, "b": 30} and r.faults_per_token == pytest.approx(0.6)
    r = tune(profile(), arena_bytes="1KiB")
    assert r.rows == {"a": 30, "b": 30} and r.used_bytes == 240
    assert any("largest profiled" in n for n in r.notes)


def test_skips_a_step_that_does_not_fit_but_takes_smaller_ones():
    p = profile()
    p["tables"]["b"] = {"sizes": [10, 40], "misses": [100, 0], "accesses": 200}
    # b's step (+120 B, gain 100) has the best gain per byte but does not fit in 200 B.
    r = tune(p, arena_bytes=200)
    assert r.rows == {"a": 30, "b": 10}


def test_fault_time_target_and_fp8_host():
    r = tune(
        profile(),
        memory_bytes=20_120,
        reserve_bytes=20_000,
        device=device(),
        target_fault_rate=0.2,
    )
    assert r.budget_bytes == 120 and r.reads_per_s == 1000.0 and r.queue_depth == 8
    assert r.fault_seconds_per_token == pytest.approx(1.4 / 1000)
    assert r.meets_target is False and r.min_bytes_for_target == 200
    assert r.fp8_host_bytes == 2000 * 6 and r.fp8_host_fits is False
    r = tune(profile(), memory_bytes="20KiB", reserve_bytes="1K")
    assert r.fp8_host_fits is True
    fp8 = tune(profile(), arena_bytes=180, dtype="fp8")
    assert fp8.record_bytes == 6 and fp8.rows == {"a": 20, "b": 10}
    r = tune(profile(), arena_bytes=1000, device=device(), target_fault_seconds=1e-3)
    assert r.meets_target and r.min_bytes_for_target == 200


def test_tune_errors():
    with pytest.raises(ConfigError, match="budget"):
        tune(profile())
    with pytest.raises(ConfigError, match="smallest feasible"):
        tune(profile(), arena_bytes=50)
    with pytest.raises(ConfigError, match="device profile"):
        tune(profile(), arena_bytes=100, target_fault_seconds=1.0)
    with pytest.raises(ConfigError, match="not both"):
        tune(profile(), arena_bytes=100, memory_bytes=200)
    with pytest.raises(ConfigError, match="not a profile"):
        tune({"tables": {}}, arena_bytes=1)


def test_parse_bytes():
    assert parse_bytes("121GiB") == 121 << 30
    assert parse_bytes("1.5 KiB") == 1536
    assert parse_bytes("12G") == parse_bytes("12GiB") == 12 << 30  # binary, as reports print
    assert parse_bytes("20e9") == 20 * 10**9
    assert parse_bytes(7) == 7
    with pytest.raises(ConfigError, match=r"ambiguous \(10\^9 or 2\^30.*20GiB"):
        parse_bytes("20GB")
    with pytest.raises(ConfigError, match="2\\^62"):
        parse_bytes("1e400B")
    with pytest.raises(ConfigError, match="memory"):
        parse_bytes("lots", "memory")
