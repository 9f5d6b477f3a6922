"""The serving judge's report: each phase's figures from the timed series, and the printed table.

Owns :func:`phase_rows` (per phase of one server: tokens/s of each variant, ratios, hit
rate, faults per token, fault time against the native floor, and the bounds the disk alone
allows) and :func:`render` (the settings' lines and the table ``python -m bench.serve`` prints).
"""

from __future__ import annotations

from typing import Any

import numpy as np

ROW_BYTES = {"bf16": 512.0, "fp8": 4096 / 15}  # stored bytes a row (rows never straddle a page)
NO_PREFETCH = "n/a (no prefetch in this tree)"
EXTRA_SERIES = ("again", "deferred")
"""The series beside resident, cached and lookahead (--repeat-cached, --deferred), in the
order their columns print."""


def extra_series(names: Any) -> list[str]:
    """The extra series among ``names``, in a fixed order."""
    names = list(names)
    return [v for v in EXTRA_SERIES if v in names]


def lookahead_bound(
    res_s: np.ndarray, floor_s: np.ndarray, prefill: np.ndarray, depth: int
) -> np.ndarray:
    """Seconds each step would take when prefill steps' faults are prefetched ``depth``
    steps ahead and read at the floor (an estimate: optimistic, as the other bounds).

    A model of the lookahead series: one disk reads the prefetches in the order they are
    issued, each taking its step's floor; at the start of step t the prefetches of steps
    t+1..t+depth not issued yet are issued; a prefill step starts once the step before it
    has ended and its prefetch has been read; a decode step (never prefetched) adds its
    own floor to its resident time. Demand reads and prefetches do not slow each other
    here, and a prefill step's decode tokens count as prefetched."""
    n = res_s.size
    done = np.zeros(n)  # when each step's prefetch has been read
    end = np.zeros(n)
    disk = t = 0.0
    ahead = 1
    for k in range(n):
        start = max(t, done[k]) if k and prefill[k] else t
        for j in range(max(ahead, k + 1), min(k + depth, n - 1) + 1):
            if prefill[j]:
                disk = max(disk, start) + floor_s[j]
                done[j] = disk
        ahead = max(ahead, k + depth + 1)
        demand = floor_s[k] if (k == 0 or not prefill[k]) else 0.0
        end[k] = start + res_s[k] + demand
        t = end[k]
    return np.diff(end, prepend=0.0)


def phase_rows(
    series: dict[str, Any],
    floors: dict[str, np.ndarray],
    name: str,
    idle_floor: np.ndarray | None = None,
    demand_floor: dict[str, np.ndarray] | None = None,
) -> list[dict]:
    """Per phase of one server: tokens/s of each variant, ratios, hits, faults vs floor
    (``floors``: seconds a step of each engine read back to back; ``idle_floor``: io_uring's
    after the idle of a decode step, reported beside them, not used in the bounds;
    ``demand_floor``: per lookahead series, io_uring's seconds a step for the rows that
    series faulted itself, giving ``{series}_demand_bound``: its ratio with every prefetch
    on time and its own faults at the floor)."""
    rows = []
    res_all = np.array([r[0] for r in series["resident"]])
    is_prefill = np.array([r[2] == "prefill" for r in series["resident"]])
    floor_all = np.min(list(floors.values()), axis=0) if floors else np.zeros(res_all.size)
    depth_of = {
        v: int(v[len("lookahead") :])
        for v in series
        if v.startswith("lookahead") and v != "lookahead"
    }
    modelled = {v: lookahead_bound(res_all, floor_all, is_prefill, d) for v, d in depth_of.items()}
    kinds = {"decode": "decode" + name, "prefill": "chunked prefill" + name}
    if len({r[2] for r in series["resident"]}) > 1:
        # A prefetch read during another phase's steps slows those: each phase's own
        # ratios move time between phases, and the server's whole series is the judge.
        kinds[None] = "all steps" + name
    for kind, label in kinds.items():
        sel = {v: [r for r in recs if kind in (None, r[2])] for v, recs in series.items()}
        if not sel["resident"]:
            continue
        idx = np.array([i for i, r in enumerate(series["resident"]) if kind in (None, r[2])])
        tps = {
            v: sum(r[1] for r in s) / sum(r[0] for r in s) if s else None for v, s in sel.items()
        }
        c = sel["cached"]
        hits, misses = sum(r[3] for r in c), sum(r[4] for r in c)
        row = {
            "phase": label,
            "steps": len(c),
            "tokens_per_step": sum(r[1] for r in c) / len(c),
            "resident_tok_s": tps["resident"],
            "cached_tok_s": tps["cached"],
            "ratio": tps["cached"] / tps["resident"],
            "hit_rate": hits / (hits + misses) if hits + misses else 1.0,
            "faults_per_token": misses / sum(r[1] for r in c),
            "fault_ms_per_step": 1e3 * sum(r[5] for r in c) / len(c),
        }
        for mode, f in floors.items():
            row[f"floor_{mode}_ms_per_step"] = 1e3 * float(f[idx].sum()) / len(c)
        fl = row.get("floor_uring_ms_per_step")
        row["fault_over_floor"] = row["fault_ms_per_step"] / fl if fl else None
        if idle_floor is not None:
            fi = 1e3 * float(idle_floor[idx].sum()) / len(c)
            row["floor_uring_idle_ms_per_step"] = fi
            row["fault_over_idle_floor"] = row["fault_ms_per_step"] / fi if fi else None
        # What the disk alone allows: each resident step plus its faults' floor (the
        # faster engine) read serially, or hidden behind the step by a perfect lookahead.
        floor_s = (
            np.min([f[idx] for f in floors.values()], axis=0) if floors else np.zeros(idx.size)
        )
        res_s = np.array([r[0] for r in sel["resident"]])
        row["floor_bound_ratio"] = float(res_s.sum() / (res_s + floor_s).sum())
        row["floor_bound_overlap_ratio"] = float(res_s.sum() / np.maximum(res_s, floor_s).sum())
        row.update(_step_split(sel["resident"], c))
        for v, f in (demand_floor or {}).items():
            row[f"{v}_demand_bound"] = float(res_s.sum() / (res_s + f[idx]).sum())
        la = tps.get("lookahead")
        row["lookahead_tok_s"] = la if la is not None else NO_PREFETCH
        row["lookahead_ratio"] = la / tps["resident"] if la is not None else NO_PREFETCH
        if la is not None:
            h, m = sum(r[3] for r in sel["lookahead"]), sum(r[4] for r in sel["lookahead"])
            row["lookahead_hit_rate"] = h / (h + m) if h + m else 1.0
            row["lookahead_wait_ms_per_step"] = 1e3 * sum(r[6] for r in sel["lookahead"]) / len(c)
        for v in extra_series(sel):  # --repeat-cached, --deferred
            row[f"{v}_ratio"] = tps[v] / tps["resident"]
        for v in sel:  # the other series' step split too (JSON; decode work is the same)
            if v not in ("resident", "cached"):
                row.update({f"{v}_{k}": x for k, x in _step_split(sel["resident"], sel[v]).items()})
        for v in sorted(depth_of):
            h, m = sum(r[3] for r in sel[v]), sum(r[4] for r in sel[v])
            row[f"{v}_ratio"] = tps[v] / tps["resident"]
            row[f"{v}_hit_rate"] = h / (h + m) if h + m else 1.0
            row[f"{v}_wait_ms_per_step"] = 1e3 * sum(r[6] for r in sel[v]) / len(c)
            row[f"{v}_bound"] = float(res_all[idx].sum() / modelled[v][idx].sum())
        rows.append(row)
    return rows


def _step_split(res: list[Any], cached: list[Any]) -> dict[str, Any]:
    """Where the cached series' extra time is: ms a step of the resident and cached series
    on the steps the cached series faulted in and on those it did not, and the ms a step
    the embedding call held the host thread (both series; the rest of the step is the
    device's, waited for at the step's end)."""
    if not cached or len(res) != len(cached):
        return {}
    r = np.array([x[0] for x in res]) * 1e3
    c = np.array([x[0] for x in cached]) * 1e3
    faulted = np.array([x[4] > 0 for x in cached])
    out: dict[str, Any] = {"faulting_steps": float(faulted.mean())}
    for tag, m in (("faulting", faulted), ("hit_only", ~faulted)):
        out[f"{tag}_resident_ms"] = float(r[m].mean()) if m.any() else None
        out[f"{tag}_cached_ms"] = float(c[m].mean()) if m.any() else None
    if len(res[0]) > 7:
        out["embed_call_resident_ms"] = float(np.mean([x[7] for x in res]) * 1e3)
        out["embed_call_cached_ms"] = float(np.mean([x[7] for x in cached]) * 1e3)
    if len(cached[0]) > 11:  # a step's latency: its time but a turn's end charged to it
        for tag, x in (("resident", res), ("cached", cached)):
            lat = np.array([v[0] - v[11] for v in x]) * 1e3
            out[f"step_ms_p50_{tag}"] = float(np.percentile(lat, 50))
            out[f"step_ms_p99_{tag}"] = float(np.percentile(lat, 99))
    if len(cached[0]) > 10 and faulted.any():  # the demand fault's phases (rowcache.cache.faulter)
        ph = np.array([x[10] for x in cached])[faulted].mean(axis=0) * 1e3
        out["fault_phases_ms"] = dict(zip(("plan", "read", "commit", "launch"), map(float, ph)))
    return out


def render(settings: dict[str, Any], phases: list[dict[str, Any]]) -> None:
    from bench._common import fmt_cell

    s, a, r = settings, settings["arena"], settings["rest_model"]
    rec = ROW_BYTES[s["dtype"]]
    print(f"# bench.serve on {s['machine']}, device {s['device']}")
    print(
        f"tables: 12 x {s['rows_per_table']:,} x 256 {s['dtype']} ({s['rows_choice']}); "
        f"store {s['store_GB']:.2f} GB, built in {s['store_build_s']:.0f} s"
    )
    print(
        f"text: {s['text']}; {s['requests']} requests; server {s['server']}: "
        f"{s['steps_x64']} steps (x64), {s['steps_x1']} (x1), timed: "
        + ", ".join(f"{k} steps {lo}-{hi - 1}" for k, (lo, hi) in s["timed_steps"].items())
        + f" (the first {s['warm_fraction']:.0%} fill the arena; the drain after the last "
        "admission is not run)"
    )
    print(
        f"arena: {a['slots']:,} slots ({a['slots'] * rec / 1e9:.2f} GB) shared by the 12 tables; "
        f"rowcache tune, budget {a['budget_bytes'] / 1e9:.2f} GB, expected "
        f"{a['expected_faults_per_token']:.2f} faults/token" + "".join(f"; {n}" for n in a["notes"])
    )
    h = s["history"]
    if h["tokens"]:
        print(
            f"history: each cached series starts with the rows of the {h['tokens']:,} tokens "
            f"before the trace prefetched into the arena ({h['rows_read']:,} rows, "
            f"{h['GB_read']:.2f} GB in {h['read_ops']:,} reads, {h['seconds']:.1f} s); "
            f"{h['resident_rows']:,} rows resident at the start; {h['order']}"
        )
    else:
        print("history: none (the server starts cold: --history)")
    print(
        f"rest of model ({r['name']}): decode x1 {r['decode1_s'] * 1e3:.2f} ms, x64 "
        f"{r['decode64_s'] * 1e3:.2f} ms, prefill at {r['flop_rate'] / 1e12:.0f} TFLOP/s"
    )
    if s.get("decode_graphs"):
        print(
            "decode steps (no prefill chunk) replayed from CUDA graphs in every series "
            "(--decode-graphs); prefill steps eager"
        )
    ok = (
        "yes, bit for bit"
        if not s["outputs_mismatched"]
        else f"NO: {s['outputs_mismatched']} differ"
    )
    print(f"cached == resident on {s['outputs_checked']} sampled steps: {ok}")
    la = phases and isinstance(phases[0]["lookahead_tok_s"], str)
    print(f"lookahead: {NO_PREFETCH if la else s['lookahead']}")
    rr = s.get("reread_check") or {}
    if rr.get("steps"):
        x = rr["fresh_ms_per_step"] / max(rr["reread_ms_per_step"], 1e-9)
        print(
            f"disk re-read check ({rr['steps']} x64 steps): {rr['fresh_pages_per_step']:.0f} "
            f"pages never read in this run {rr['fresh_ms_per_step']:.3f} ms a step, this run's "
            f"{rr['pages_per_step']:.0f} pages read again {rr['reread_ms_per_step']:.3f} ms (x{x:.2f})"
            + (
                "; re-reads are cheaper: this disk caches beneath the machine (a VM's host), so "
                "the floor and the series after the first read partly cached pages"
                if x > 1.5
                else ""
            )
        )
    else:
        print("disk re-read check: not run (no page of the store was left unread)")
    extra = extra_series(k[: -len("_ratio")] for k in phases[0] if k.endswith("_ratio"))
    cols = [
        ("phase", "phase"),
        ("steps", "steps"),
        ("tok/step", "tokens_per_step"),
        ("resident tok/s", "resident_tok_s"),
        ("cached tok/s", "cached_tok_s"),
        ("ratio", "ratio"),
        ("lookahead tok/s", "lookahead_tok_s"),
        ("la ratio", "lookahead_ratio"),
        ("hit rate", "hit_rate"),
        ("la hit rate", "lookahead_hit_rate"),
        *(
            (("la demand bound", "lookahead_demand_bound"),)
            if "lookahead_demand_bound" in phases[0]
            else ()
        ),
        *(
            (f"la{d} {what}", f"lookahead{d}_{key}")
            for d in s.get("lookahead_steps", [1])[1:]
            for what, key in (
                ("ratio", "ratio"),
                ("hit rate", "hit_rate"),
                ("bound", "bound"),
                ("demand bound", "demand_bound"),
            )
        ),
        *((f"{v} ratio", f"{v}_ratio") for v in extra),
        ("faults/tok", "faults_per_token"),
        ("fault ms/step", "fault_ms_per_step"),
        ("floor uring ms", "floor_uring_ms_per_step"),
        ("floor threads ms", "floor_threads_ms_per_step"),
        ("fault/floor", "fault_over_floor"),
        ("floor after idle ms", "floor_uring_idle_ms_per_step"),
        ("fault/idle floor", "fault_over_idle_floor"),
        ("bound", "floor_bound_ratio"),
        ("la bound", "floor_bound_overlap_ratio"),
    ]
    cells = [[fmt_cell(p.get(k)).replace(NO_PREFETCH, "n/a") for _, k in cols] for p in phases]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (h, _) in enumerate(cols)]
    print("  ".join(h.rjust(w) for (h, _), w in zip(cols, widths)))
    for c in cells:
        print("  ".join(x.rjust(w) for x, w in zip(c, widths)))
    split = [p for p in phases if p.get("faulting_steps") is not None]
    if split:
        print(
            "ms a step (resident / cached), on the steps the cached series faulted in and on "
            "the others; and the embedding call's time on the host thread:"
        )
        for p in split:
            f = [fmt_cell(p.get(k)) for k in ("faulting_resident_ms", "faulting_cached_ms",
                                          "hit_only_resident_ms", "hit_only_cached_ms",
                                          "embed_call_resident_ms", "embed_call_cached_ms")]  # fmt: skip
            print(
                f"  {p['phase']}: faulting {p['faulting_steps']:.0%} of steps: {f[0]} / {f[1]}; "
                f"the others: {f[2]} / {f[3]}; embedding call {f[4]} / {f[5]}"
            )
            for v in ("lookahead", *extra):
                if p.get(f"{v}_faulting_steps") is not None:
                    g = [fmt_cell(p.get(f"{v}_{k}")) for k in ("faulting_cached_ms", "hit_only_cached_ms",
                                                           "embed_call_cached_ms")]  # fmt: skip
                    print(f"    {v}: faulting {g[0]}, the others {g[1]}, embedding call {g[2]}")
            lat = [(v, p.get(f"{v}step_ms_p50_cached"), p.get(f"{v}step_ms_p99_cached"))
                   for v in ("", "lookahead_", *(f"{a}_" for a in extra))]  # fmt: skip
            if lat[0][1] is not None:
                print(
                    f"    step latency ms, p50 / p99: resident {p['step_ms_p50_resident']:.2f} / "
                    f"{p['step_ms_p99_resident']:.2f}; "
                    + "; ".join(
                        f"{v.rstrip('_') or 'cached'} {a:.2f} / {b:.2f}"
                        for v, a, b in lat
                        if a is not None
                    )
                )
            for v in ("", "lookahead_", *(f"{a}_" for a in extra)):
                ph = p.get(f"{v}fault_phases_ms")
                if ph:
                    print(
                        f"    {v or 'cached_'}fault, ms a faulting step: "
                        + ", ".join(f"{k} {x:.3f}" for k, x in ph.items())
                    )
    for what, tl in (s.get("prefetch_timeline") or {}).items():
        print(
            f"prefetch thread, {what}: {tl['pieces']} pieces, {tl['rows']:,} rows "
            f"({tl['rows_taken_over']:,} taken over by resolves, "
            f"{tl.get('rows_reread', 0):,} read again beside pieces being read); a piece reads "
            f"{tl['read_ms_per_piece']:.2f} ms ({tl['rows_per_s_reading']:,.0f} rows/s) and "
            f"writes {tl['write_ms_per_piece']:.2f} ms after queueing {tl['queued_ms_median']:.1f} "
            f"ms (median); busy {tl['busy_share']:.0%} of the timed steps; prefill steps late: "
            f"{tl['late_steps']} of {tl['prefill_steps']} (by {tl['late_ms_median_of_late']:.1f} "
            f"ms, median), {tl['unread_share_at_start']:.0%} of a step's rows unread at its "
            f"start; prefetch calls {tl['prefetch_calls_ms_per_step']:.3f} ms a step"
        )
    print(
        f"(ratio = cached tok/s / resident tok/s; floor = the same pages re-read by bench/floor.c, "
        f"queue depth {s['queue_depth']}, one step's pages after another's; floor after idle = "
        "io_uring's after sleeping a decode step's rest of the model before each step's "
        "pages; bound = the ratio if each step cost the resident step plus its faults' floor; la bound = with the floor hidden behind the step by a perfect "
        "lookahead one step ahead; laN bound = a model of prefetches N steps ahead read at the "
        "floor by one disk (bench.serve.report.lookahead_bound), which counts a prefill step's "
        "decode tokens as prefetched; demand bound = every prefetch on time and the series' own "
        "faults (its decode tokens) at the floor; all estimates, the floor being "
        "re-read in a pass of its own. Prefetches read during other steps slow those: with "
        "lookahead, compare the 'all steps' rows; "
        f"{s['seconds']:.0f} s in all)"
    )
