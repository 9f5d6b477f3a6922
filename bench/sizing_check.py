"""The offline sizing tools against the real cache: predicted faults and fault time vs measured.

Real text (this interpreter's standard library source, DeepSeek's tokenizer) runs through
the trace's server model (``rowcache.tools.ServerModel``: 64 request slots, prefill chunks
of 512, decode one token a step, round robin) over a store of LongCat n-gram tables. Then:

1. ``profile_trace`` (the ``rowcache profile`` library call) draws the exact batch-LRU
   curves (one per table, one for a shared arena) and SHARDS estimates (``--rate``, 1 %);
2. ``measure_io`` (``rowcache bench-io``) measures this machine's disk on the store itself;
3. ``tune`` (``rowcache tune``) splits each budget (``--budget``: the 121 GB box's
   ``memory=121GiB,reserve=70GiB``, and a tight ``arena=1GiB`` where rows are evicted);
4. the real caches replay the same trace, one batch a server step: one ``NgramRowCache``
   per table at tune's rows, then ONE shared ``NgramRowCache`` of their sum, read by an
   ``rowcache.embed.NgramEmbedding`` of ``CachedTable``s: the first ``--embed-steps`` decode-only
   steps run the whole layer (hash, resolve, gather, GEMM: tokens/s), the rest resolve only.

Printed per table and for the shared arena: the faults the cache took against the exact
prediction (they must be equal: the batch-LRU model is the cache's semantics, ties by row
id) and the SHARDS estimate (its error), and tune's fault I/O time per token against the
cache's measured ``fault_seconds`` per token. ``--quick``: a tiny store and dims (the test).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rowcache
from bench._common import report
from rowcache.embed import CachedTable, NgramDims, NgramEmbedding
from rowcache.kernels.reference import BF16
from rowcache.tools import ServerModel, build_trace, measure_io, profile_trace, tune
from rowcache.tools.mrc import miss_ratio_curve
from rowcache.tools.tokens import iter_requests, stdlib_files
from rowcache.tools.trace import schedule_request

QUICK_DIMS = {"vocab_size": 4096, "hidden_size": 12 * 16, "max_ngram": 4, "splits": 4, "ratio": 2}


def log(msg: str) -> None:
    print(f"[sizing {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load_requests(dims: NgramDims, tokens: int, max_request: int, tokenizer: str) -> list[Any]:
    """Stdlib requests, in file order, until ``tokens`` tokens."""
    reqs, n = [], 0
    for r in iter_requests(
        stdlib_files(),
        vocab_size=dims.vocab_size,
        eos_token_id=dims.eos_token_id,
        tokenizer=tokenizer,
        max_request_tokens=max_request,
    ):
        reqs.append(np.asarray(r, dtype=np.int64))
        n += r.size
        if n >= tokens:
            break
    return reqs


def server_units(reqs: list[Any], model: ServerModel) -> list[list[tuple[int, int, int]]]:
    """Per server step, its units ``(request, first position, end position)`` in slot
    order: the scheduler of ``build_trace`` (first slot to free, round robin)."""
    free = [(0, s) for s in range(model.batch)]
    units: dict[int, list[tuple[int, int, int, int]]] = {}
    for r, toks in enumerate(reqs):
        if toks.size == 0:
            continue
        start, slot = heapq.heappop(free)
        heapq.heappush(free, (start + model.units(toks.size)[2], slot))
        steps = schedule_request(model, toks.size, start)
        cut = np.flatnonzero(np.diff(steps)) + 1
        for a, b in zip([0, *cut.tolist()], [*cut.tolist(), toks.size]):
            units.setdefault(int(steps[a]), []).append((slot, r, a, b))
    return [[u[1:] for u in sorted(units.get(s, []))] for s in range(max(units) + 1)]


def step_batches(trace: Any, table: int | None) -> Any:
    """``rows`` of each server step in order (int64 [n] or [tables, n]), across chunk files."""
    carry_r, carry_s = None, None
    for rows, steps in trace.iter_chunks(table):
        if carry_r is not None:
            rows = np.concatenate([carry_r, rows], axis=-1)
            steps = np.concatenate([carry_s, steps])
        cut = np.flatnonzero(np.diff(steps)) + 1
        bounds = [0, *cut.tolist()]
        for a, b in itertools.pairwise([*bounds, steps.size]):
            if b == steps.size:
                carry_r, carry_s = rows[..., a:b], steps[a:b]
            else:
                yield int(steps[a]), rows[..., a:b]
    if carry_r is not None and carry_s.size:
        yield int(carry_s[0]), carry_r


def replay_table(store: Any, trace: Any, t: int, slots: int, args: Any) -> Any:
    slots = min(slots, store.tables[t].rows)  # tune's grid may pass the table's rows
    cache = rowcache.NgramRowCache(
        store, t, slots=slots, device=args.device, queue_depth=args.queue_depth, direct=args.direct
    )
    for _, rows in step_batches(trace, t):
        cache.resolve(rows.astype(np.int64), host=True)
        cache.end_step()
    return cache.stats()


def replay_shared(
    store: Any, trace: Any, dims: NgramDims, reqs: list[Any], slots: int, args: Any
) -> tuple[Any, dict[str, Any]]:
    """One shared arena under an NgramEmbedding; decode-only steps first through the layer."""
    T = dims.num_tables
    slots = min(slots, sum(t.rows for t in store.tables))
    cache = rowcache.NgramRowCache(
        store,
        list(range(T)),
        slots=slots,
        device=args.device,
        queue_depth=args.queue_depth,
        direct=args.direct,
    )
    xp: Any = np
    if args.device == "cuda":
        import cupy as xp
    rng = np.random.default_rng(1)
    word = xp.asarray(
        rng.standard_normal((dims.vocab_size, dims.hidden_size), np.float32).astype(BF16)
    )
    projs = (rng.standard_normal((T, dims.hidden_size, dims.table_dim), np.float32) * 0.05).astype(
        BF16
    )
    emb = NgramEmbedding(dims, word, [CachedTable(cache, part=i) for i in range(T)], projs)
    offsets = cache.row_offsets[:T, None]
    units = server_units(reqs, trace_model(trace))
    N = dims.max_ngram - 1
    embedded = tok = faults_emb = 0
    t_emb = 0.0
    for step, rows in step_batches(trace, None):
        us = units[step]
        if embedded < args.embed_steps and all(b - a == 1 for _, a, b in us):
            ctxs = [reqs[r][max(0, a - N) : b] for r, a, b in us]
            before = cache.stats().misses
            t0 = time.perf_counter()
            out = emb.embed_batch(ctxs, [b - a for _, a, b in us])
            if args.device == "cuda":
                xp.cuda.runtime.deviceSynchronize()
            t_emb += time.perf_counter() - t0
            assert out.shape[0] == len(us) == rows.shape[1]
            embedded += 1
            tok += len(us)
            faults_emb += cache.stats().misses - before
        else:
            cache.resolve((rows.astype(np.int64) + offsets).ravel(), host=True)
            cache.end_step()
    serve = {
        "embed_steps": embedded,
        "embed_tokens": tok,
        "embed_tokens_s": tok / t_emb if t_emb else None,
        "embed_faults_per_token": faults_emb / tok if tok else None,
    }
    return cache.stats(), serve


def trace_model(trace: Any) -> ServerModel:
    m = trace.model
    return m if isinstance(m, ServerModel) else ServerModel(**m)


def shared_keys(trace: Any) -> Any:
    t = trace.num_tables
    tcol = (np.arange(t, dtype=np.int64) << 40)[:, None]
    for rows, steps in trace.iter_chunks():
        yield (tcol | rows.astype(np.int64)).T.ravel(), np.repeat(steps, t)


def parse_budget(text: str) -> dict[str, str]:
    out = {}
    for part in text.split(","):
        k, _, v = part.partition("=")
        if k not in ("memory", "reserve", "arena") or not v:
            raise SystemExit(f"--budget {text!r}: give memory=SIZE,reserve=SIZE or arena=SIZE")
        out[{"memory": "memory_bytes", "reserve": "reserve_bytes", "arena": "arena_bytes"}[k]] = v
    return out


def quick_store(workdir: str, dims: NgramDims) -> str:
    rng = np.random.default_rng(0)
    tables = {
        str(i): rng.standard_normal((dims.table_rows(i), dims.table_dim), np.float32).astype(BF16)
        for i in range(dims.num_tables)
    }
    path = os.path.join(workdir, "store")
    rowcache.build_store(path, tables, progress=False, shard_bytes=1 << 20).close()
    return path


def grid_point(trace, t, rows, exact, approx, rate) -> tuple[float, float]:
    """Profile's exact and SHARDS misses of table ``t`` at ``rows`` (tune stays on the
    profiled grid; off it, the same curves are drawn at ``rows``)."""
    hit = np.flatnonzero(exact.sizes == rows)
    if hit.size:
        i = int(hit[0])
        return float(exact.curves[str(t)].misses[i]), float(approx.curves[str(t)].misses[i])
    chunks = lambda: trace.iter_chunks(t)  # noqa: E731
    pred = miss_ratio_curve(chunks(), [rows]).misses[0]
    est = miss_ratio_curve(chunks(), [rows], method="shards", sample_rate=rate)
    return float(pred), float(est.misses[0])


def check_budget(store, trace, dims, reqs, exact, approx, dev, budget, args) -> list[dict]:
    rep = tune(exact, device=dev, queue_depth=args.queue_depth, **budget)
    label = ",".join(f"{k.split('_')[0]}={v}" for k, v in budget.items())
    rows = {int(k): int(v) for k, v in rep.rows.items()}
    log(f"{label}: tune rows {rows}, {rep.faults_per_token:.3f} faults/token predicted")
    tokens = trace.positions
    out, fault_s, misses_all = [], 0.0, 0
    for t in range(dims.num_tables):
        t0 = time.perf_counter()
        st = replay_table(store, trace, t, rows[t], args)
        pred, est = grid_point(trace, t, rows[t], exact, approx, args.rate)
        fault_s += st.fault_seconds
        misses_all += st.misses
        out.append(
            {
                "budget": label,
                "arena": f"table {t}",
                "slots": rows[t],
                "accesses": st.lookups,
                "faults": st.misses,
                "exact_pred": int(pred),
                "equal": bool(st.misses == pred),
                "shards_pred": est,
                "shards_err_pct": 100 * (est - st.misses) / max(1, st.misses),
                "replay_s": time.perf_counter() - t0,
            }
        )
    meas = fault_s / tokens
    out.append(
        {
            "budget": label,
            "arena": "all tables",
            "slots": sum(rows.values()),
            "accesses": sum(r["accesses"] for r in out),
            "faults": misses_all,
            "exact_pred": int(sum(r["exact_pred"] for r in out)),
            "equal": all(r["equal"] for r in out),
            "shards_pred": sum(r["shards_pred"] for r in out),
            "shards_err_pct": 100
            * (sum(r["shards_pred"] for r in out) - misses_all)
            / max(1, misses_all),
            "faults_per_token": misses_all / tokens,
            "tune_faults_per_token": rep.faults_per_token,
            "tune_fault_us_per_token": 1e6 * rep.fault_seconds_per_token,
            "measured_fault_us_per_token": 1e6 * meas,
            "fault_time_ratio": meas / rep.fault_seconds_per_token,
        }
    )
    S = sum(rows.values())
    t0 = time.perf_counter()
    st, serve = replay_shared(store, trace, dims, reqs, S, args)
    pred = miss_ratio_curve(shared_keys(trace), [S]).misses[0]
    est = miss_ratio_curve(shared_keys(trace), [S], method="shards", sample_rate=args.rate).misses[
        0
    ]
    reads, _ = dev.reads_per_s(store.tables[0].record_bytes, args.queue_depth)
    out.append(
        {
            "budget": label,
            "arena": "shared",
            "slots": S,
            "accesses": st.lookups,
            "faults": st.misses,
            "exact_pred": int(pred),
            "equal": bool(st.misses == pred),
            "shards_pred": float(est),
            "shards_err_pct": 100 * (float(est) - st.misses) / max(1, st.misses),
            "faults_per_token": st.misses / tokens,
            "hit_rate": st.hit_rate,
            "tune_fault_us_per_token": 1e6 * float(pred) / tokens / reads,
            "measured_fault_us_per_token": 1e6 * st.fault_seconds / tokens,
            "fault_time_ratio": (st.fault_seconds / tokens) / (float(pred) / tokens / reads),
            "replay_s": time.perf_counter() - t0,
            **serve,
        }
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--store", default=None, help="a store of LongCat tables (12 x 10,223,617+2i)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--tokens", type=int, default=1_000_000, help="stdlib tokens to trace")
    ap.add_argument("--max-request", type=int, default=2048, help="tokens a request at most")
    ap.add_argument("--tokenizer", default="deepseek")
    ap.add_argument(
        "--budget",
        action="append",
        default=None,
        help="tune budgets (repeatable); default: memory=121GiB,reserve=70GiB and arena=1GiB",
    )
    ap.add_argument("--rate", type=float, default=0.01, help="SHARDS sampling rate")
    ap.add_argument("--queue-depth", type=int, default=16, help="the caches' reads in flight")
    ap.add_argument("--no-direct", dest="direct", action="store_false", help="page-cached reads")
    ap.add_argument("--embed-steps", type=int, default=400, help="decode steps through the layer")
    ap.add_argument("--io-seconds", type=float, default=1.0, help="per measure_io point")
    ap.add_argument("--workdir", default=None, help="keep the trace here (default: temp dir)")
    ap.add_argument("--quick", action="store_true", help="tiny store and dims, for the test suite")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    own = args.workdir is None
    workdir = tempfile.mkdtemp(prefix="sizing-check-") if own else args.workdir
    os.makedirs(workdir, exist_ok=True)
    try:
        if args.quick:
            dims = NgramDims(eos_token_id=2, **QUICK_DIMS)
            args.tokens, args.tokenizer, args.rate = 10_000, "words", 0.2
            args.embed_steps, args.io_seconds = 20, 0.1
            args.budget = args.budget or ["arena=256KiB", "arena=4MiB"]
            path = quick_store(workdir, dims)
        else:
            dims = NgramDims.longcat_flash_lite()
            if args.store is None:
                raise SystemExit("--store is needed (or --quick)")
            path = args.store
        budgets = [
            parse_budget(b) for b in args.budget or ["memory=121GiB,reserve=70GiB", "arena=1GiB"]
        ]
        store = rowcache.RowStore.open(path)
        want = [dims.table_rows(i) for i in range(dims.num_tables)]
        if [t.rows for t in store.tables] != want:
            raise SystemExit(
                f"{path}: tables have {[t.rows for t in store.tables]} rows, need {want}"
            )
        log(f"tokenizing {args.tokens:,} stdlib tokens ({args.tokenizer})")
        reqs = load_requests(dims, args.tokens, args.max_request, args.tokenizer)
        trace = build_trace(
            reqs, dims, os.path.join(workdir, "trace"), overwrite=True, progress=False
        )
        log(f"trace: {trace.positions:,} tokens, {len(reqs):,} requests; profiling")
        t0 = time.perf_counter()
        grid = None
        exact = profile_trace(trace, grid, method="exact", dtype=store.dtype, progress=False)
        t_exact = time.perf_counter() - t0
        approx = profile_trace(
            trace,
            exact.sizes,
            method="shards",
            sample_rate=args.rate,
            dtype=store.dtype,
            progress=False,
            shared=False,
        )
        log(f"exact profile {t_exact:.0f} s; measuring the disk on the store")
        dev = measure_io(
            path,
            record_bytes=store.tables[0].record_bytes,
            seconds=args.io_seconds,
            queue_depths=(1, 4, args.queue_depth),
            progress=False,
        )
        rows = []
        for b in budgets:
            rows += check_budget(store, trace, dims, reqs, exact, approx, dev, b, args)
        store.close()
        report(
            "bench/sizing_check.py: rowcache profile/tune predictions vs the real cache",
            rows,
            args.json,
            {
                "store": path,
                "device": args.device,
                "tokens": trace.positions,
                "requests": len(reqs),
                "tables": dims.num_tables,
                "table_rows": f"{want[0]:,}..{want[-1]:,}",
                "shards_rate": args.rate,
                "queue_depth": args.queue_depth,
                "direct": args.direct,
                "reads_per_s": dev.reads_per_s(store.tables[0].record_bytes, args.queue_depth)[0],
                "exact_profile_s": t_exact,
            },
        )
        ok = all(r["equal"] for r in rows)
        if not ok:
            log("MISMATCH: a cache's faults differ from the exact prediction")
        return 0 if ok else 1
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
