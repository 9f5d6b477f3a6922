"""The store and cache benchmark scripts run end to end at --quick size (CPU)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

import rowcache.kernels.host as host

ROOT = pathlib.Path(__file__).resolve().parent.parent


def judge(name: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m bench.<name> ARGS`` from the repository root."""
    return subprocess.run(
        [sys.executable, "-m", f"bench.{name}", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


def run(script: str, *args: str) -> str:
    proc = judge(script.removesuffix(".py"), "--quick", *args)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_bench_build_quick_prints_ratio():
    rep = json.loads(run("build.py", "--json"))
    bf16 = next(r for r in rep["results"] if r["dtype"] == "bf16")
    assert bf16["build_GB_s"] > 0 and bf16["plain_write_GB_s"] > 0
    assert bf16["ratio"] == pytest.approx(bf16["build_GB_s"] / bf16["plain_write_GB_s"], rel=1e-6)
    engines = {(r["engine"], r["threads"]) for r in rep["results"] if r["dtype"] == "fp8"}
    cores = rep["settings"]["cores"]
    assert {("cpu", max(1, cores - 1)), ("cpu", cores), ("reference", "-")} <= engines
    assert all(r["ratio"] > 0 for r in rep["results"])


def test_bench_read_quick_measures_all_baselines():
    rep = json.loads(run("read.py", "--json"))
    row = rep["results"][0]
    for key in (
        "read_rows_rows_s",
        "memmap_rows_s",
        "raw_4k_direct_rows_s",
        "raw_4k_direct_batched_rows_s",
    ):
        assert row[key] > 0, key
    best = max(row["read_rows_rows_s"], row["read_rows_direct_rows_s"])  # the faster reader mode
    assert row["vs_raw"] == pytest.approx(best / row["raw_4k_direct_rows_s"], rel=1e-6)


def test_bench_cache_quick_reports_hit_fault_and_memory():
    out = run("cache.py")
    assert "hit path" in out and "fault path" in out and "bookkeeping memory" in out
    assert "Traceback" not in out


def test_bench_torch_step_quick_module_vs_direct_and_greedy():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    rep = json.loads(run("torch_step.py", "--device", "cpu", "--json"))
    steps = {(r["variant"], r["step"]) for r in rep["steps"]}
    assert {(v, s) for v in ("resident", "cached") for s in ("decode x1", "decode x64")} <= steps
    for r in rep["steps"]:
        assert r["direct_us"] > 0 and r["ratio"] == pytest.approx(r["module_us"] / r["direct_us"])
    g = rep["greedy"]
    assert g["identical"] and g["resident_tok_s"] > 0 and g["cached_tok_s"] > 0


def test_bench_fault_quick_measures_the_floor_in_the_same_run():
    rep = json.loads(run("fault.py", "--json"))
    assert [r["k"] for r in rep["results"]] == [1, 12, 48]
    for row in rep["results"]:
        assert row["floor_ms"] > 0 and row["checked_ms"] > 0 and row["warm_ms"] > 0
        assert row["ratio"] == pytest.approx(row["checked_ms"] / row["floor_ms"], rel=1e-6)


def test_bench_serve_quick_ratios_from_printed_figures():
    rep = json.loads(run("serve.py", "--json", "--lookahead-steps", "1,3"))
    s = rep["settings"]
    assert s["lookahead_steps"] == [1, 3]
    assert s["outputs_checked"] > 0 and s["outputs_mismatched"] == 0
    phases = {p["phase"]: p for p in rep["phases"]}
    assert {"decode x64", "chunked prefill x64", "decode x1"} <= set(phases)
    for p in phases.values():
        assert p["resident_tok_s"] > 0 and p["cached_tok_s"] > 0
        assert p["ratio"] == pytest.approx(p["cached_tok_s"] / p["resident_tok_s"], rel=1e-9)
        assert 0 <= p["hit_rate"] <= 1 and p["faults_per_token"] >= 0
        if p["fault_over_floor"] is not None:
            want = p["fault_ms_per_step"] / p["floor_uring_ms_per_step"]
            assert p["fault_over_floor"] == pytest.approx(want, rel=1e-9)
        if isinstance(p["lookahead_tok_s"], str):
            assert p["lookahead_tok_s"] == p["lookahead_ratio"] == "n/a (no prefetch in this tree)"
        else:
            want = p["lookahead_tok_s"] / p["resident_tok_s"]
            assert p["lookahead_ratio"] == pytest.approx(want, rel=1e-9)
            if not p["phase"].endswith("x64"):  # depths beyond the first: x64 server only
                assert "lookahead3_ratio" not in p
                continue
            assert p["lookahead3_ratio"] > 0 and 0 <= p["lookahead3_hit_rate"] <= 1
            if p["phase"].startswith("chunked prefill"):  # prompts prefetched: fewer faults
                assert p["lookahead3_hit_rate"] > p["hit_rate"]
                # a perfect prefetch leaves the decode tokens' faults: a higher ceiling
                assert p["lookahead3_demand_bound"] > p["floor_bound_ratio"]
            assert 0 < p["lookahead_demand_bound"] <= 1 and 0 < p["lookahead3_demand_bound"] <= 1
    # each lookahead series' prefetch thread, from its jobs' timestamps
    tl = s["prefetch_timeline"]
    assert {"x64 lookahead", "x64 lookahead3"} <= set(tl)
    for t in tl.values():
        assert t["pieces"] > 0 and t["rows"] > 0 and t["rows_per_s_reading"] > 0
        assert 0 <= t["rows_reread"] <= t["rows"]
        assert t["read_ms_per_piece"] > 0 and t["write_ms_per_piece"] >= 0
        assert 0 < t["busy_share"] < 1 and 0 <= t["unread_share_at_start"] <= 1
        assert 0 <= t["late_steps"] <= t["prefill_steps"] > 0


def test_bench_serve_lookahead_steps_are_checked():
    for bad in ("0", "1,1", "x"):
        proc = judge("serve", "--quick", "--lookahead-steps", bad)
        assert proc.returncode == 2 and "--lookahead-steps" in proc.stderr, bad


def test_bench_serve_profile_names_a_server_series_and_kind():
    def serve(*a):
        return judge("serve", "--quick", *a)

    for bad in ("x2:cached", "x64", "x64:cached:both", "x1:cached:decode:x"):
        proc = serve("--servers", "x64", "--profile", bad)
        assert proc.returncode == 2 and "--profile" in proc.stderr, bad
    proc = serve("--servers", "x64", "--profile", "x64:lookahed")
    assert proc.returncode == 2 and "runs no series 'lookahed'" in proc.stderr
    proc = serve("--servers", "x64", "--lookahead-steps", "2", "--profile",
                 "x64:lookahead:prefill")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    head = "--- cProfile: server x64 lookahead, prefill timed step's host work"
    assert head in proc.stderr and "function calls" in proc.stderr.split(head)[1]


def test_bench_serve_quick_one_server_and_its_step_split():
    rep = json.loads(run("serve.py", "--json", "--servers", "x1", "--repeat-cached"))
    phases = {p["phase"]: p for p in rep["phases"]}
    assert set(phases) == {"decode x1", "chunked prefill x1", "all steps x1"}
    for p in phases.values():  # the cached series again, last: the same steps and faults
        assert p["again_ratio"] > 0 and p["again_faulting_steps"] == p["faulting_steps"]
    assert list(rep["settings"]["timed_steps"]) == ["x1"]
    for p in phases.values():  # the faulting / hit-only split covers every step
        assert p["floor_uring_idle_ms_per_step"] > 0 and p["fault_over_idle_floor"] > 0
        f = p["faulting_steps"]
        assert 0 <= f <= 1 and p["embed_call_cached_ms"] > 0 and p["embed_call_resident_ms"] > 0
        ph = p["fault_phases_ms"]  # the native miss path's phases: all of its fault time
        assert set(ph) == {"plan", "read", "commit", "launch"} and min(ph.values()) >= 0
        if host.native is not None:  # (the Python path times no phases)
            assert sum(ph.values()) * f == pytest.approx(p["fault_ms_per_step"], rel=1e-6)
        for key in ("resident", "cached", "again"):
            pre = "" if key != "again" else "again_"
            key = key if key != "again" else "cached"
            assert 0 < p[f"{pre}step_ms_p50_{key}"] <= p[f"{pre}step_ms_p99_{key}"]
        parts = [(f, "faulting"), (1 - f, "hit_only")]
        for key in ("resident", "cached"):
            mean = sum(w * p[f"{tag}_{key}_ms"] for w, tag in parts if w > 0)
            tps = p[f"{key}_tok_s"]
            assert mean == pytest.approx(1e3 * p["tokens_per_step"] / tps, rel=1e-6)
    proc = judge("serve", "--quick", "--decode-graphs")
    assert proc.returncode == 2 and "--decode-graphs needs --device cuda" in proc.stderr
    proc = judge("serve", "--quick", "--interleave", "-1")
    assert proc.returncode == 2 and "--interleave -1" in proc.stderr
    for bad in ("x2", "x1,x1", ""):
        proc = judge("serve", "--quick", "--servers", bad)
        assert proc.returncode == 2 and "--servers" in proc.stderr, bad


def test_bench_serve_quick_history_fills_the_arena_first():
    cold = json.loads(run("serve.py", "--json"))
    warm = json.loads(run("serve.py", "--json", "--history", "20000"))
    assert (
        cold["settings"]["history"]["tokens"] == 0
        and cold["settings"]["history"]["order"] == "none"
    )
    h = warm["settings"]["history"]
    assert 0 < h["tokens"] <= 20000 and h["rows_read"] > 0 and h["resident_rows"] > 0
    assert h["resident_rows"] <= warm["settings"]["arena"]["slots"]
    # tune's arena holds every row here: one sorted pass, and no series evicts
    assert h["order"].startswith("one sorted pass") and set(h["evictions"].values()) == {0}
    assert warm["settings"]["outputs_mismatched"] == 0
    small = json.loads(run("serve.py", "--json", "--history", "20000", "--arena-bytes", "700e3"))
    hs = small["settings"]["history"]
    # an arena that cannot hold every row: the history in its order, and the series evict
    assert hs["order"] == "in the history's order" and min(hs["evictions"].values()) > 0
    assert hs["resident_rows"] == small["settings"]["arena"]["slots"]
    rate = {
        r: {p["phase"]: p["hit_rate"] for p in rep["phases"]}
        for r, rep in (("c", cold), ("w", warm))
    }
    # the one-slot server's trace is a few requests: without a history nearly all first touches
    assert rate["w"]["decode x1"] > rate["c"]["decode x1"] + 0.5


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_bench_serve_quick_on_the_gpu(graphs):
    """Cached == resident on the sampled steps, eager and with the decode steps replayed
    from CUDA graphs (``--decode-graphs``)."""
    rep = json.loads(run("serve.py", "--device", "cuda", "--json", *["--decode-graphs"] * graphs))
    assert rep["settings"]["device"] == "cuda" and rep["settings"]["outputs_mismatched"] == 0
    assert rep["settings"]["decode_graphs"] is graphs and rep["settings"]["outputs_checked"] > 0
    for p in rep["phases"]:
        assert p["ratio"] == pytest.approx(p["cached_tok_s"] / p["resident_tok_s"], rel=1e-9)


def test_bench_sizing_check_quick_cache_equals_exact_prediction():
    rep = json.loads(run("sizing_check.py", "--json"))
    rows = rep["results"]
    assert {r["arena"] for r in rows} >= {"table 0", "table 11", "all tables", "shared"}
    assert all(r["equal"] and r["faults"] == r["exact_pred"] for r in rows)
    shared = [r for r in rows if r["arena"] == "shared"]
    assert len(shared) == 2 and all(
        r["embed_steps"] > 0 and r["embed_tokens_s"] > 0 for r in shared
    )
    for r in rows:
        assert r["shards_err_pct"] == pytest.approx(
            100 * (r["shards_pred"] - r["faults"]) / max(1, r["faults"]), rel=1e-6, abs=1e-9
        )


def test_bench_fullsize_quick_reports_anonymous_peak_and_verifies(tmp_path):
    rep = json.loads(run("fullsize.py", "--json", "--verify", "--store", str(tmp_path / "s")))
    row = rep["results"][0]
    assert row["tables"] == 3 and row["verify_ok"] is True
    assert row["peak_RssAnon_MB"] >= row["RssAnon_before_MB"] > 0
    assert row["ratio_vs_plain"] == pytest.approx(row["source_GB_s"] / row["plain_write_GB_s"])


def test_serve_floor_reread_check_reads_fresh_pages_then_the_run_s(tmp_path):
    """bench.serve's re-read check: per step as many pages as the step read, none of
    them read in the run, then the run's own pages again; both through bench/floor.c."""
    import ml_dtypes
    import numpy as np

    import rowcache
    from bench.serve.floor import Floor

    x = np.random.default_rng(0).standard_normal((20_000, 256)).astype(ml_dtypes.bfloat16)
    store = rowcache.build_store(tmp_path / "s", {"a": x, "b": x[:9000]}, progress=False)
    floor = Floor(store, direct=False)
    try:
        layout = (np.array([0, 20_000, 29_000]), [0, 1])
        rng = np.random.default_rng(1)
        steps = [
            floor.pages(layout, np.sort(rng.choice(29_000, 60, replace=False))) for _ in range(4)
        ]
        calls = []
        run = floor.run
        floor.run = lambda s, mode, n: calls.append(s) or run(s, mode, n)
        rep = floor.reread_check(steps, 8)
    finally:
        floor.close()
        store.close()
    fresh, again = calls
    assert again is steps and rep["steps"] == 4
    seen = {tuple(p) for q in steps for p in q.tolist()}
    assert all(not seen & {tuple(p) for p in q.tolist()} for q in fresh)
    assert all(0 < a.shape[0] <= b.shape[0] for a, b in zip(fresh, steps))
    assert rep["fresh_ms_per_step"] > 0 and rep["reread_ms_per_step"] > 0


def test_serve_lookahead_bound_models_prefetches_ahead():
    import numpy as np

    from bench.serve.report import lookahead_bound

    res = np.full(8, 1.0)
    pre = np.array([True] * 8)
    # every prefetch shorter than the step before it: hidden at any depth (but step 0's)
    assert lookahead_bound(res, np.full(8, 0.5), pre, 1).tolist() == [1.5] + [1.0] * 7
    # one slow read: one step ahead waits for it; three ahead spread it over quiet steps
    floor = np.array([0, 0, 0, 0, 2.5, 0, 0, 0.0])
    one, three = lookahead_bound(res, floor, pre, 1), lookahead_bound(res, floor, pre, 3)
    assert one.sum() == pytest.approx(8 + 1.5) and three.sum() == pytest.approx(8.0)
    # decode steps are never prefetched: their floor adds to their step
    dec = np.array([True, False, True, False, True, False, True, False])
    assert lookahead_bound(res, np.full(8, 0.25), dec, 4)[1::2].tolist() == [1.25] * 4
    # a disk slower than the steps: never faster than its 7 reads, deeper never slower
    slow = [lookahead_bound(res, np.full(8, 2.0), pre, d).sum() for d in (1, 2, 7)]
    assert slow == sorted(slow, reverse=True) and min(slow) >= 2.0 * 7 + 1.0


def test_bench_serve_interleaved_series_keep_their_state():
    """Series run in turns of 7 steps fault exactly what they fault one after the other
    (each keeps its cache, prefetches and place between turns); outputs still equal."""
    one = json.loads(run("serve.py", "--json", "--servers", "x1", "--interleave", "0"))
    turns = json.loads(run("serve.py", "--json", "--servers", "x1", "--interleave", "7"))
    assert turns["settings"]["interleave"] == 7 and turns["settings"]["outputs_mismatched"] == 0
    for a, b in zip(one["phases"], turns["phases"], strict=True):
        for key in ("steps", "hit_rate", "faults_per_token", "lookahead_hit_rate"):
            assert a[key] == b[key], (a["phase"], key)


def test_serve_interleave_rotates_the_series_and_settles_between_turns():
    from bench.serve.series import interleave

    calls = []

    class Recorder:  # the scheduling alone: which series runs which steps, in what order
        def __init__(self, name):
            self.name = name

        def run(self, lo, hi, settle=False):
            calls.append((self.name, lo, hi, settle))

        def finish(self):
            return [self.name]

    out = interleave({n: Recorder(n) for n in "abc"}, 10, 4)
    assert out == {"a": ["a"], "b": ["b"], "c": ["c"]}
    assert calls == [
        ("a", 0, 4, True), ("b", 0, 4, True), ("c", 0, 4, True),
        ("b", 4, 8, True), ("c", 4, 8, True), ("a", 4, 8, True),
        ("c", 8, 10, False), ("a", 8, 10, False), ("b", 8, 10, False),
    ]  # fmt: skip


def test_serve_turns_end_where_no_prefetch_is_in_flight():
    import numpy as np

    from bench.serve.series import turn_ends

    assert turn_ends(10, 4) == [4, 8, 10]
    quiet = np.ones(11, bool)
    quiet[[4, 5, 9]] = False  # prefill steps within reach of steps 4, 5 and 9
    assert turn_ends(10, 4, quiet) == [6, 10]  # pushed from 4 to 6; 10 is the end
    assert turn_ends(20, 4, np.zeros(21, bool)) == [4, 8, 12, 16, 20]  # none quiet: as before
    quiet = np.zeros(21, bool)
    quiet[[7, 15]] = True
    assert turn_ends(20, 4, quiet) == [7, 11, 15, 19, 20]  # within a second block, else 4


def test_serve_series_holds_its_prefetches_between_turns(tmp_path, rng, monkeypatch):
    """At a turn's end a lookahead series waits for the piece being read and no other
    piece starts until its next turn (its reads neither slow nor gain from another's)."""
    import threading
    import time

    import numpy as np

    import rowcache.cache.prefetch_book as prefetch_book
    from bench.serve.series import Series
    from rowcache import NgramRowCache
    from tests.rowcache.test_cache import make_store

    monkeypatch.setattr(prefetch_book, "PIECE_ROWS", 8)
    store, _ = make_store(tmp_path, rng)
    cache = NgramRowCache(store, "t", slots=200)
    real, gate, started = cache._read_parts, threading.Event(), []

    def gated(rows, staging, reader=None):
        started.append(rows.size)
        assert gate.wait(10)
        return real(rows, staging, reader)

    cache._read_parts = gated
    s = Series(None, [], 0, None, None, None, cache)
    h = cache.prefetch(np.arange(100, 164))  # 8 pieces of 8 rows
    s.handles.append((1, h))
    t0 = time.monotonic()
    while not started and time.monotonic() - t0 < 10:
        time.sleep(0.001)
    threading.Timer(0.05, gate.set).start()
    s._hold()  # returns once the piece in flight is read
    time.sleep(0.05)
    assert started == [8] and not h.done()
    assert s.finish() == [] and h.done() and started == [8] * 8
    store.close()


def test_serve_step_latency_leaves_out_a_turns_end_charged_to_a_step():
    """A turn's end charged to a step (a lookahead series finishing its piece in flight,
    ``Series.run``) is in the step's seconds, so in tokens/s, but not in its latency."""
    from bench.serve.report import _step_split

    def rec(dt, charged=0.0):  # a decode step's record, as Series.out holds it
        return (dt, 64, "decode", 9, 1, 0.001, 0.0, 0.002, 0.0, 0.0, (0.0,) * 4, charged)

    res = [rec(0.010) for _ in range(100)]
    cached = [rec(0.012) for _ in range(99)] + [rec(0.512, charged=0.5)]
    out = _step_split(res, cached)
    assert out["step_ms_p99_cached"] == pytest.approx(12.0)
    assert out["faulting_cached_ms"] == pytest.approx(17.0)  # the charge is in the time
    cached[-1] = rec(0.512)  # not charged: a step that took that long
    assert _step_split(res, cached)["step_ms_p99_cached"] > 12.0
