"""The Engram judge (``bench/engram.py``): its quick run, the store's sizing from the free
disk and memory, and the counter-based rows it streams into the store and the tables."""

from __future__ import annotations

import json
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
import pytest

from bench._common import random_bf16_rows, random_bf16_rows_threaded
from bench.engram import GIB, size_store, store_bytes
from rowcache.errors import ConfigError
from tests.support import run_judge

V41 = {"layers": 2, "dim": 256, "dtype": "fp8"}


def test_engram_quick_compares_cached_with_resident_and_sizes_the_arena_by_tune():
    proc = run_judge("engram", "--quick", "--json")
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    modes = {r["mode"]: r for r in rep["results"]}
    assert set(modes) == {"decode x1", "decode x64", "prefill 512"}
    for r in modes.values():
        assert r["resident tok/s"] > 0 and r["cached tok/s"] > 0
        assert r["cached/resident"] == pytest.approx(r["cached tok/s"] / r["resident tok/s"])
        assert 0 <= r["fault_rate"] <= 1 and r["hit_rate"] == pytest.approx(1 - r["fault_rate"])
        assert r["faults/tok"] > 0 and r["reads/step"] > 0
    st = rep["settings"]
    assert st["store_bytes"] > 0 and st["engram_layers"] == [1, 15] and st["build_GB_s"] > 0
    assert st["arena"] == "tune" and 0 < st["tune_used_bytes"] <= st["tune_budget_bytes"]
    assert st["tune_budget_bytes"] == (121 - 70) * GIB
    assert 0 < st["tune_fault_rate"] < 1 and st["arena_slots"] > 0
    # the prefill mode runs the whole text traced, from a cold arena that ends up holding it
    # all: tune's faults but for the n-grams across a file's end (the trace's requests are
    # files, the mode one stream)
    assert modes["prefill 512"]["run_fault_rate"] == pytest.approx(st["tune_fault_rate"], 0.01)
    assert any(line.startswith("check: cached == resident bit for bit") for line in st["log"])
    la = modes["prefill 512"]  # prefill chunks are read a step ahead; decode steps cannot be
    assert la["lookahead tok/s"] > 0 and "lookahead tok/s" not in modes["decode x1"]


def test_engram_v41_quick_runs_v41s_format_warmed_and_checks_every_series_bit_for_bit():
    """``--format v41 --quick``: the fp8_block_e8m0 store and its checkpoint-layout copy,
    tune on the whole (quick) text with the codec's 264-byte rows, the arena warmed by the
    history, and every series checked against the generator's rows before its timing."""
    proc = run_judge("engram", "--format", "v41", "--quick", "--json")
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    st, log = rep["settings"], rep["log"]
    assert rep["bench"] == "bench.engram" and st["format"] == "v41"
    assert (st["codec"], st["record_bytes"], st["rows_per_page"]) == ("fp8_block_e8m0", 264, 15)
    assert st["engram_layers"] == [1, 14] and st["rows_bound"] == "--rows"
    rows = sum(st["rows_per_layer"])
    assert st["store_bytes"] >= rows * 4096 // 15 and st["checkpoint_bytes"] >= rows * 264
    # tune: the codec's rows, the budget scaled by the tables' share of V4.1's
    assert st["tune_record_bytes"] == 264 and st["v41_rows"] == 768_022_850
    share = rows / st["v41_rows"]
    assert st["tune_budget_scale"] == pytest.approx(share)
    raised = any(n.startswith("tune's budget raised") for n in st["arena_notes"])
    assert raised or st["tune_budget_bytes"] == int((121 - 70) * GIB * share)
    assert 0 < st["tune_used_bytes"] <= st["tune_budget_bytes"]
    assert st["arena_bytes"] == st["arena_slots"] * 264 and st["arena_slots"] < rows
    # the history: the text before the modes, its end state loaded into the arena
    assert (
        st["history_tokens"] + sum(m["steps"] * m["B"] * m["T"] for m in st["modes"].values())
        == st["text_tokens"]
    )
    assert st["warmed"]["rows"] == st["warmed"]["resident"] == st["arena_slots"]
    # the series: resident, the checkpoint layout (mapped), cached; pinned host is a GPU one
    assert st["series"] == ["resident", "ckpt", "cached"]
    label = st["ckpt_label"]
    assert label in ("ckpt", "ckpt uncapped")
    checks = st["checks"]
    assert checks["resident"] == checks["cached"] == checks["ckpt"] > 0
    for s in ("resident", "cached", label):
        assert any(line.startswith(f"check: {s} == the generator's rows") for line in log)
    if label == "ckpt":
        m = st["ckpt_mapped"]
        assert m["capped"] and m["limit_bytes"] >= st["arena_bytes"] + m["own_bytes"]
        assert m["warm_pages"] == st["arena_bytes"] // 4096
    modes = {r["mode"]: r for r in rep["results"]}
    assert set(modes) == {"decode x1", "decode x64", "prefill 128"}
    for r in modes.values():
        for s in ("resident", "cached", label):
            assert r[f"{s} tok/s"] > 0 and r[f"{s}_ready_ms"] > 0
            assert r[f"{s}_ready2_ms"] >= r[f"{s}_ready_ms"]
        assert r["cached/resident"] == pytest.approx(r["cached tok/s"] / r["resident tok/s"])
        assert r[f"cached/{label}"] == pytest.approx(r["cached tok/s"] / r[f"{label} tok/s"])
        assert 0 <= r["hit_rate"] <= 1 and r["cached reads/tok"] >= 0
        assert r[f"{label} reads/tok"] >= 0  # major faults a token: two pages a row missed
        assert 0 < r["window_ms"] < r["window2_ms"]  # layer 1, then layer 14
        if "floor_ms" in r:  # gcc built the native reader
            assert r["floor_ms"] > 0 and r[f"{label}_floor_ms"] > 0


@pytest.mark.gpu
def test_engram_v41_quick_on_the_gpu_checks_every_series_with_pinned_host():
    proc = run_judge("engram", "--format", "v41", "--quick", "--device", "cuda", "--json")
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    st = rep["settings"]
    assert st["series"] == ["resident", "host", "ckpt", "cached"]
    assert st["checks"]["host"] == st["checks"]["resident"] == st["checks"]["cached"] > 0
    for r in rep["results"]:
        for s in ("resident", "host", "cached", st["ckpt_label"]):
            assert r[f"{s} tok/s"] > 0


@pytest.mark.gpu
def test_engram_quick_on_the_gpu_checks_cached_against_resident_and_pinned_host():
    proc = run_judge("engram", "--quick", "--device", "cuda", "--json")
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    log = rep["settings"]["log"]
    for series in ("resident", "host"):  # the tables made on the GPU, the store from its rows
        assert any(line.startswith(f"check: cached == {series} bit for bit") for line in log)
    for r in rep["results"]:
        assert r["resident tok/s"] > 0 and r["host tok/s"] > 0 and r["cached tok/s"] > 0


def test_size_store_takes_the_largest_store_the_disk_holds_less_its_margin():
    s = size_store(
        store_gib="auto", free_disk=100 * GIB, device_free=139 * GIB, host_free=120 * GIB, **V41
    )
    room = 100 * GIB - 15 * GIB  # 15 % of the free space, more than 4 GiB
    assert s.bound == "disk" and s.resident and s.host
    assert store_bytes(s.rows_per_layer, 2, 256, "fp8") == s.store_bytes <= room
    assert store_bytes(s.rows_per_layer + 1, 2, 256, "fp8") > room  # the largest that fits
    assert s.store_bytes > 0.99 * room
    small = size_store(
        store_gib="auto", free_disk=10 * GIB, device_free=None, host_free=None, **V41
    )
    assert small.store_bytes <= 6 * GIB < store_bytes(small.rows_per_layer + 1, 2, 256, "fp8")


def test_size_store_keeps_the_disks_size_and_skips_a_series_that_does_not_fit():
    free = {"store_gib": "auto", "free_disk": 100 * GIB, **V41}
    roomy = size_store(device_free=139 * GIB, host_free=120 * GIB, **free)
    tight = size_store(device_free=40 * GIB, host_free=120 * GIB, **free)
    assert tight.rows_per_layer == roomy.rows_per_layer and tight.bound == "disk"
    assert not tight.resident and tight.host
    assert any(line.startswith("resident:") and "does not fit" in line for line in tight.lines)
    no_host = size_store(device_free=139 * GIB, host_free=50 * GIB, **free)
    assert no_host.resident and not no_host.host
    cpu = size_store(device_free=None, host_free=30 * GIB, **free)  # resident in host memory
    assert not cpu.resident and not cpu.host


def test_size_store_takes_a_given_size_within_the_disk():
    s = size_store(store_gib="2.5", free_disk=100 * GIB, device_free=None, host_free=None, **V41)
    assert s.bound == "--store-gib" and s.store_bytes <= 2.5 * GIB
    assert store_bytes(s.rows_per_layer + 1, 2, 256, "fp8") > 2.5 * GIB


@pytest.mark.parametrize(
    ("gib", "free", "match"),
    [
        ("auto", 4 * GIB, r"--store-gib auto: .* free, less a margin of 4.0 GiB.*--workdir"),
        ("90", 100 * GIB, r"--store-gib 90: .*give at most --store-gib 85.0"),
        ("0.01", 100 * GIB, r"--store-gib 0.01: give auto or at least"),
        ("nan", 100 * GIB, r"--store-gib nan: give auto or at least"),
        ("big", 100 * GIB, r"--store-gib big: give auto or at least"),
    ],
)
def test_size_store_refuses_what_does_not_fit_naming_the_flag(gib, free, match):
    with pytest.raises(ConfigError, match=match):
        size_store(store_gib=gib, free_disk=free, device_free=None, host_free=None, **V41)


def test_random_rows_are_a_function_of_key_row_and_column_alone():
    whole = random_bf16_rows(np, 14, 0, 1000, 7)  # 7 values a row: words straddle rows
    assert whole.dtype == np.uint16 and whole.shape == (1000, 7)
    assert np.array_equal(random_bf16_rows(np, 14, 0, 1000, 7), whole)  # deterministic
    for a, b in ((0, 1), (3, 5), (1, 999), (333, 1000), (17, 17)):
        assert np.array_equal(random_bf16_rows(np, 14, a, b, 7), whole[a:b])
    assert not np.array_equal(random_bf16_rows(np, 1, 0, 1000, 7), whole)  # another layer
    with ThreadPoolExecutor(3) as pool:
        assert np.array_equal(random_bf16_rows_threaded(pool, 3, 14, 5, 1000, 7), whole[5:])
    values = np.abs(whole.view(ml_dtypes.bfloat16).astype(np.float32))
    assert values.min() >= 2.0**-7 and values.max() < 2.0
    assert 0.4 < (whole >> 15).mean() < 0.6  # both signs
    assert len(np.unique(whole)) > 1500  # not a handful of values


def test_random_rows_cost_memory_of_the_range_not_the_table():
    far = 1 << 34  # rows of a table far larger than this machine's memory
    tracemalloc.start()
    try:
        rows = random_bf16_rows(np, 1, far, far + 4096, 256)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert rows.shape == (4096, 256) and peak < 4 * rows.nbytes
    near = random_bf16_rows(np, 1, far + 4000, far + 4100, 256)
    assert np.array_equal(near[:96], rows[4000:])


@pytest.mark.gpu
def test_random_rows_are_the_same_bits_on_the_gpu():
    import cupy as cp

    for a, b, dim in ((0, 777, 7), (5, 4096, 256), (1 << 30, (1 << 30) + 9, 64)):
        assert np.array_equal(
            random_bf16_rows(cp, 3, a, b, dim).get(), random_bf16_rows(np, 3, a, b, dim)
        )
