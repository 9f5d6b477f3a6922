"""The serving judge, ``python -m bench.serve``: three quick runs whose reports every check
reads (the two-server run, and two runs of the one-slot server that differ from it in one
setting: its series one after the other, and a history filling a small arena first), its
options checked by its parser in-process, and its parts (the floor, the lookahead bound, the
turns, the step split) on their own."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

import rowcache
import rowcache.kernels.host as host
from bench.serve.args import parse
from bench.serve.floor import Floor
from bench.serve.report import _step_split, lookahead_bound
from bench.serve.run import warm_plan
from bench.serve.series import Series, interleave, turn_ends
from rowcache import NgramRowCache
from rowcache.cache.row_cache import Tuning
from tests.cache.support import Hooked
from tests.support import run_judge


def serve(*args: str) -> tuple[dict, str]:
    """One quick run's JSON report and its stderr."""
    proc = run_judge("serve", "--quick", "--json", *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr


@pytest.fixture(scope="module")
def two_servers() -> tuple[dict, str]:
    """Both servers, cold, their series in turns of 7 steps: lookahead one and three steps
    ahead, the cached series again, the deferred-reads series, and a cProfile of the 64-slot
    server's lookahead series on its prefill steps."""
    return serve(
        "--lookahead-steps", "1,3", "--repeat-cached", "--deferred", "--interleave", "7",
        "--profile", "x64:lookahead:prefill",
    )  # fmt: skip


@pytest.fixture(scope="module")
def one_after_other() -> dict:
    """The one-slot server alone, its series one after the other (no turns)."""
    return serve("--servers", "x1", "--interleave", "0")[0]


@pytest.fixture(scope="module")
def with_history() -> dict:
    """The one-slot server after 20,000 tokens of history, in an arena too small for
    every row of history and trace."""
    return serve("--servers", "x1", "--history", "20000", "--arena-bytes", "700e3")[0]


def phases_of(rep: dict, server: str) -> dict[str, dict]:
    return {p["phase"]: p for p in rep["phases"] if p["phase"].endswith(" " + server)}


# --- the two-server run -------------------------------------------------------------------


def test_serve_ratios_from_printed_figures(two_servers):
    rep, _ = two_servers
    s = rep["settings"]
    assert s["lookahead_steps"] == [1, 3] and s["interleave"] == 7
    assert s["outputs_checked"] > 0 and s["outputs_mismatched"] == 0
    assert list(s["timed_steps"]) == ["x64", "x1"]
    phases = {p["phase"]: p for p in rep["phases"]}
    assert {"decode x64", "chunked prefill x64", "decode x1"} <= set(phases)
    assert set(phases_of(rep, "x1")) == {"decode x1", "chunked prefill x1", "all steps x1"}
    for p in phases.values():
        assert p["resident_tok_s"] > 0 and p["cached_tok_s"] > 0
        assert p["ratio"] == pytest.approx(p["cached_tok_s"] / p["resident_tok_s"], rel=1e-9)
        assert 0 <= p["hit_rate"] <= 1 and p["faults_per_token"] >= 0
        if p["fault_over_floor"] is not None:
            want = p["fault_ms_per_step"] / p["floor_uring_ms_per_step"]
            assert p["fault_over_floor"] == pytest.approx(want, rel=1e-9)
        want = p["lookahead_tok_s"] / p["resident_tok_s"]
        assert p["lookahead_ratio"] == pytest.approx(want, rel=1e-9)
        assert p["deferred_ratio"] > 0  # (on the CPU the deferred series reads in the call)
        if not p["phase"].endswith("x64"):  # depths beyond the first: x64 server only
            assert "lookahead3_ratio" not in p
            continue
        assert p["lookahead3_ratio"] > 0 and 0 <= p["lookahead3_hit_rate"] <= 1
        if p["phase"].startswith("chunked prefill"):  # prompts prefetched: fewer faults
            assert p["lookahead3_hit_rate"] > p["hit_rate"]
            # a perfect prefetch leaves the decode tokens' faults: a higher ceiling
            assert p["lookahead3_demand_bound"] > p["floor_bound_ratio"]
        assert 0 < p["lookahead_demand_bound"] <= 1 and 0 < p["lookahead3_demand_bound"] <= 1


def test_serve_prefetch_timeline_of_each_lookahead_series(two_servers):
    tl = two_servers[0]["settings"]["prefetch_timeline"]
    assert {"x64 lookahead", "x64 lookahead3", "x64 deferred"} <= set(tl)
    for t in tl.values():
        assert t["pieces"] > 0 and t["rows"] > 0 and t["rows_per_s_reading"] > 0
        assert 0 <= t["rows_reread"] <= t["rows"]
        assert t["read_ms_per_piece"] > 0 and t["write_ms_per_piece"] >= 0
        assert 0 < t["busy_share"] < 1 and 0 <= t["unread_share_at_start"] <= 1
        assert 0 <= t["late_steps"] <= t["prefill_steps"] > 0


def test_serve_step_split_covers_every_step(two_servers):
    rep, _ = two_servers
    for p in rep["phases"]:  # the cached series again, last: the same steps and faults
        assert p["again_ratio"] > 0 and p["again_faulting_steps"] == p["faulting_steps"]
    for p in rep["phases"]:  # the faulting / hit-only split covers every step
        assert p["floor_uring_idle_ms_per_step"] > 0 and p["fault_over_idle_floor"] > 0
        f = p["faulting_steps"]
        assert 0 <= f <= 1 and p["embed_call_cached_ms"] > 0 and p["embed_call_resident_ms"] > 0
        ph = p["fault_phases_ms"]  # the native miss path's phases: all of its fault time
        assert set(ph) == {"plan", "read", "commit", "launch"} and min(ph.values()) >= 0
        if host.native is not None:  # (the Python path times no phases)
            assert sum(ph.values()) * f == pytest.approx(p["fault_ms_per_step"], rel=1e-6)
        for pre, key in (("", "resident"), ("", "cached"), ("again_", "cached")):
            assert 0 < p[f"{pre}step_ms_p50_{key}"] <= p[f"{pre}step_ms_p99_{key}"]
        parts = [(f, "faulting"), (1 - f, "hit_only")]
        for key in ("resident", "cached"):
            mean = sum(w * p[f"{tag}_{key}_ms"] for w, tag in parts if w > 0)
            tps = p[f"{key}_tok_s"]
            assert mean == pytest.approx(1e3 * p["tokens_per_step"] / tps, rel=1e-6)


def test_serve_profile_prints_the_series_host_work(two_servers):
    _, err = two_servers
    head = "--- cProfile: server x64 lookahead, prefill timed step's host work"
    assert head in err and "function calls" in err.split(head)[1]


def test_serve_series_in_turns_fault_what_they_fault_one_after_the_other(
    two_servers, one_after_other
):
    """Series run in turns of 7 steps fault exactly what they fault one after the other
    (each keeps its cache, prefetches and place between turns); outputs still equal."""
    turns = phases_of(two_servers[0], "x1")
    one = phases_of(one_after_other, "x1")
    assert one_after_other["settings"]["interleave"] == 0 and list(one) == list(turns)
    for name, a in one.items():
        for key in ("steps", "hit_rate", "faults_per_token", "lookahead_hit_rate"):
            assert a[key] == turns[name][key], (name, key)


def test_serve_history_fills_the_arena_first(two_servers, with_history):
    cold = two_servers[0]["settings"]["history"]
    assert cold["tokens"] == 0 and cold["order"] == "none"
    warm = with_history["settings"]
    h = warm["history"]
    assert 0 < h["tokens"] <= 20000 and h["rows_read"] > 0
    assert warm["outputs_mismatched"] == 0
    # an arena that cannot hold every row: the history in its order, and the series evict
    assert h["order"] == "in the history's order" and min(h["evictions"].values()) > 0
    assert h["resident_rows"] == warm["arena"]["slots"]
    # the one-slot server's trace is a few requests: without a history nearly all first touches
    rate = {
        k: phases_of(rep, "x1")["decode x1"]["hit_rate"]
        for k, rep in (("cold", two_servers[0]), ("warm", with_history))
    }
    assert rate["warm"] > rate["cold"] + 0.5


def test_serve_warm_plan_one_sorted_pass_where_the_arena_holds_every_row():
    """The history's rows come in one sorted pass where the arena holds every row of history
    and trace (no series can evict, so the order changes no fault), else in its order."""
    chunks = [np.array([5, 9]), np.array([1, 9])]
    step = SimpleNamespace(batch=SimpleNamespace(host_ids=lambda: np.array([[3], [4]])))
    offsets = np.array([0, 100])  # the trace touches rows 3 and 104
    pieces, order = warm_plan(chunks, [[step]], offsets, slots=5)
    assert order.startswith("one sorted pass") and np.concatenate(pieces).tolist() == [1, 5, 9]
    pieces, order = warm_plan(chunks, [[step]], offsets, slots=4)
    assert order == "in the history's order" and pieces is chunks
    assert warm_plan([], [[step]], offsets, slots=1) == ([], "none")


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_serve_quick_on_the_gpu(graphs):
    """Cached == resident on the sampled steps, eager and with the decode steps replayed
    from CUDA graphs (``--decode-graphs``); with graphs, also the deferred-reads series
    prefetching ahead: a decode step's deferred reads belong to the graphs' embedding, which
    settles them before its prefetch (the cache refuses another embedding's prefetch while
    they are pending)."""
    more = ["--decode-graphs", "--deferred", "--lookahead-steps", "4"] if graphs else []
    rep, _ = serve("--device", "cuda", "--servers", "x64", *more)
    assert rep["settings"]["device"] == "cuda" and rep["settings"]["outputs_mismatched"] == 0
    assert rep["settings"]["decode_graphs"] is graphs and rep["settings"]["outputs_checked"] > 0
    for p in rep["phases"]:
        assert p["ratio"] == pytest.approx(p["cached_tok_s"] / p["resident_tok_s"], rel=1e-9)
        if graphs:
            assert p["deferred_ratio"] > 0


# --- the options, checked by the parser ---------------------------------------------------


def parse_error(capsys, *argv: str) -> str:
    """The parser's message for ``--quick ARGV``, which it refuses with status 2."""
    with pytest.raises(SystemExit) as e:
        parse(["--quick", *argv], "the serving judge")
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("bad", ["0", "1,1", "x"])
def test_serve_lookahead_steps_are_checked(capsys, bad):
    assert "--lookahead-steps" in parse_error(capsys, "--lookahead-steps", bad)


@pytest.mark.parametrize("bad", ["x2:cached", "x64", "x64:cached:both", "x1:cached:decode:x"])
def test_serve_profile_names_a_server_series_and_kind(capsys, bad):
    assert "--profile" in parse_error(capsys, "--servers", "x64", "--profile", bad)


def test_serve_profile_names_a_series_the_server_runs(capsys):
    err = parse_error(capsys, "--servers", "x64", "--profile", "x64:lookahed")
    assert "runs no series 'lookahed'" in err and "lookahead" in err
    err = parse_error(capsys, "--profile", "x1:lookahead3", "--lookahead-steps", "1,3")
    assert "runs no series 'lookahead3'" in err  # deeper series: the 64-slot server's only
    _, args = parse(["--quick", "--servers", "x64", "--lookahead-steps", "2", "--profile",
                     "x64:lookahead:prefill"], "")  # fmt: skip
    assert args.profile == (" x64", "lookahead", "prefill") and args.lookahead_list == [2]
    _, args = parse(["--quick", "--repeat-cached", "--profile"], "")  # alone: x1's cached
    assert args.profile == (" x1", "cached", None)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--decode-graphs"], "--decode-graphs needs --device cuda"),
        (["--interleave", "-1"], "--interleave -1"),
        (["--servers", "x2"], "--servers"),
        (["--servers", "x1,x1"], "--servers"),
        (["--servers", ""], "--servers"),
        (["--history", "-1"], "--history -1"),
    ],
)
def test_serve_options_are_checked(capsys, argv, message):
    assert message in parse_error(capsys, *argv)


# --- its parts ----------------------------------------------------------------------------


def test_serve_floor_reread_check_reads_fresh_pages_then_the_run_s(tmp_path):
    """bench.serve's re-read check: per step as many pages as the step read, none of
    them read in the run, then the run's own pages again; both through bench/floor.c."""
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


def test_serve_interleave_rotates_the_series_and_settles_between_turns():
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
    assert turn_ends(10, 4) == [4, 8, 10]
    quiet = np.ones(11, bool)
    quiet[[4, 5, 9]] = False  # prefill steps within reach of steps 4, 5 and 9
    assert turn_ends(10, 4, quiet) == [6, 10]  # pushed from 4 to 6; 10 is the end
    assert turn_ends(20, 4, np.zeros(21, bool)) == [4, 8, 12, 16, 20]  # none quiet: as before
    quiet = np.zeros(21, bool)
    quiet[[7, 15]] = True
    assert turn_ends(20, 4, quiet) == [7, 11, 15, 19, 20]  # within a second block, else 4


def test_serve_series_holds_its_prefetches_between_turns(tiny_store):
    """At a turn's end a lookahead series waits for the piece being read and no other
    piece starts until its next turn (its reads neither slow nor gain from another's)."""
    store, _ = tiny_store
    gate, started = threading.Event(), []

    def gated(rows):
        started.append(rows.size)
        assert gate.wait(10)

    cache = NgramRowCache.assemble(
        store, "t", slots=200, tuning=Tuning(piece_rows=8),
        part_reader=lambda reads: Hooked(reads, gated),
    )  # fmt: skip
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

    def rec(dt, charged=0.0):  # a decode step's record, as Series.out holds it
        return (dt, 64, "decode", 9, 1, 0.001, 0.0, 0.002, 0.0, 0.0, (0.0,) * 4, charged)

    res = [rec(0.010) for _ in range(100)]
    cached = [rec(0.012) for _ in range(99)] + [rec(0.512, charged=0.5)]
    out = _step_split(res, cached)
    assert out["step_ms_p99_cached"] == pytest.approx(12.0)
    assert out["faulting_cached_ms"] == pytest.approx(17.0)  # the charge is in the time
    cached[-1] = rec(0.512)  # not charged: a step that took that long
    assert _step_split(res, cached)["step_ms_p99_cached"] > 12.0
