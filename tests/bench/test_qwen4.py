"""The Qwen4 n-gram table's judge (``bench/qwen4.py``): its quick run's report, the bit-for-bit
checks of the cached and mapped series, and the generated codes it streams into the store."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench.qwen4 import Cgroup, codes_at, codes_range, parse_budget, parse_mode, qwen4_config
from rowcache.errors import ConfigError
from tests.support import run_judge

BUDGETS = ["tune", "1/32", "1/8", "1/2"]
MODES = ["decode x1", "decode x32", "decode x64", "prefill 64"]


def test_qwen4_quick_reports_every_series_at_every_budget_after_the_bit_for_bit_checks():
    proc = run_judge("qwen4", "--quick", "--json")
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    st = rep["settings"]
    assert rep["bench"] == "bench.qwen4"
    assert st["codec"] == "fp8_table_scale" and st["row_bytes"] == 160 and st["dim"] == 160
    assert st["layers"] == 40 and st["table_layer"] == 1  # rows enter at decoder layer 2
    assert st["store_bytes"] > st["rows"] * 160 and st["build_s"] >= 0
    assert 0 < st["tune_used_bytes"] <= st["tune_budget_bytes"] == (121 - 88) * 2**30
    assert st["series"] == ["resident", "mmap", "cached"]  # pinned host: a GPU series
    label = st["mmap_label"]
    assert label in ("mmap", "mmap uncapped")
    assert (label == "mmap") == (not st["page_cache_cap"].startswith("no memory cgroup"))
    # the bit-for-bit checks ran before timing, for both disk series
    assert st["checks"]["cached"] > 0 and st["checks"]["mmap"] == st["checks"]["cached"]
    for series in ("cached", "mmap"):
        assert any(
            line.startswith(f"check: {series} == resident bit for bit") for line in rep["log"]
        )
    rows = {(r["budget"], r["mode"]): r for r in rep["results"]}
    assert set(rows) == {(b, m) for b in BUDGETS for m in MODES}
    for (b, _), r in rows.items():
        info = st["budgets"][b]
        assert "mmap_error" not in info, info["mmap_error"]
        assert r["arena"] and info["slots"] * 160 == info["bytes"]
        if label == "mmap":
            m = info["mmap"]
            assert m["capped"] and m["limit_bytes"] >= info["bytes"] + m["own_bytes"]
        for k in ("resident tok/s", f"{label} tok/s", "cached tok/s"):
            assert r[k] > 0
        assert r[f"cached/{label}"] == pytest.approx(r["cached tok/s"] / r[f"{label} tok/s"])
        assert r["cached/resident"] == pytest.approx(r["cached tok/s"] / r["resident tok/s"])
        assert 0 <= r["hit_rate"] <= 1 and r["faults/tok"] >= 0 and r["reads/step"] >= 0
        assert r["window_ms"] > 0 and r["cached_ready_ms"] > 0 and r["mmap_ready_ms"] > 0
        assert r["mmap majflt/step"] >= 0
        if "floor_ms" in r:  # the native reader (gcc) re-read the cached series' pages
            assert r["bound tok/s"] > 0
            assert r["cached/bound"] == pytest.approx(r["cached tok/s"] / r["bound tok/s"])
    two = {
        (t["budget"], t["mode"]) for t in rep["targets"] if t["target"].startswith("cached >= 2x")
    }
    assert two == {(b, m) for b in ("1/32", "1/8") for m in ("decode x32", "prefill 64")}
    for t in rep["targets"]:
        assert t["met"] in (True, False, None) and t["value"] > 0
        assert (t["met"] is None) == (label != "mmap" and "mmap" in t["target"])


def test_qwen4_quick_without_a_cap_labels_the_mapped_series_uncapped():
    proc = run_judge(
        "qwen4",
        "--quick",
        "--json",
        "--page-cache-cap",
        "none",
        "--budgets",
        "1/8",
        "--modes",
        "decode x32",
    )
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["settings"]["mmap_label"] == "mmap uncapped"
    assert any("runs UNCAPPED" in line for line in rep["log"])
    (row,) = rep["results"]
    assert row["mmap uncapped tok/s"] > 0 and "mmap tok/s" not in row
    assert all(t["met"] is None for t in rep["targets"] if "mmap" in t["target"])


def test_generated_codes_are_counter_based_and_never_nan():
    a = codes_range(np, 100, 164, 160)
    rows = np.array([163, 100, 131], dtype=np.int64)
    assert np.array_equal(codes_at(np, rows, 160), a[rows - 100])
    assert a.dtype == np.uint8 and a.shape == (64, 160)
    assert not ((a & 0x7F) == 0x7F).any()  # no E4M3 NaN code
    assert len(np.unique(a)) > 200  # the rest of the byte values all show up
    with pytest.raises(ConfigError):
        codes_at(np, rows, 12)


def test_rows_budgets_and_modes_parse():
    cfg = qwen4_config(80_000)
    assert cfg.ngram_vocab_size_base == 5_000 and cfg.head_dim == 160
    assert qwen4_config(None).ngram_vocab_size_base == 20_000_000
    assert parse_budget("tune", 1000) is None and parse_budget("1/8", 1000) == 0.125
    assert parse_budget("0.5", 1000) == 0.5
    for bad in ("0", "2", "x/y"):
        with pytest.raises(ConfigError):
            parse_budget(bad, 1000)
    assert parse_mode("prefill", 512) == ("prefill 512", 1, 512)
    assert parse_mode("decode x32", 512) == ("decode x32", 32, 1)
    with pytest.raises(ConfigError):
        parse_mode("decode", 512)
    assert Cgroup(allowed=False).version is None


def test_mapped_table_reads_the_stores_shards_as_one_table(tmp_path):
    from bench._common import store_files
    from bench.qwen4 import SCALE, MappedTable
    from rowcache import build_store
    from rowcache.embed.tables import Fp8TableScaleTable
    from rowcache.store.sources import Fp8TableScaleSource, GeneratedRows

    rows, dim = 1_000, 160
    src = GeneratedRows(rows, dim, lambda a, b: codes_range(np, a, b, dim), dtype=np.uint8)
    store = build_store(
        tmp_path / "s",
        {"t": Fp8TableScaleSource(src, SCALE)},
        shard_bytes=8 * 4096,
        progress=False,
    )
    info = store.tables[0]
    files = store_files(store)
    assert len(files) > 3  # 8 pages of 25 rows a shard
    spec = {
        "files": files,
        "rows_per_page": info.rows_per_page,
        "pages_per_shard": info.pages_per_shard,
        "rec": info.record_bytes,
        "advice": "random",
    }
    table = MappedTable(spec, np)
    ids = np.random.default_rng(0).integers(0, rows, 300)
    assert np.array_equal(table.codes(ids), codes_at(np, ids, dim))
    resident = Fp8TableScaleTable(  # dequantized as the resident table gathers
        codes_range(np, 0, rows, dim), SCALE
    )
    assert np.array_equal(table.gather(ids).view(np.uint16), resident.gather(ids).view(np.uint16))
    table.close()


@pytest.mark.gpu
def test_qwen4_quick_on_the_gpu_checks_cached_and_mmap_against_resident():
    proc = run_judge("qwen4", "--quick", "--device", "cuda", "--json")
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    st = rep["settings"]
    assert st["series"] == ["resident", "host", "mmap", "cached"]
    assert st["checks"]["cached"] > 0 and st["checks"]["mmap"] == st["checks"]["cached"]
    label = st["mmap_label"]
    for r in rep["results"]:
        for k in ("resident tok/s", "host tok/s", f"{label} tok/s", "cached tok/s"):
            assert r[k] > 0, k
