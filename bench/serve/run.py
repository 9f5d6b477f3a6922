"""The serving judge's run: the store, the arena tuned on the trace, the resident and
cached series of each server taking turns, the floor, the report (the package's
docstring says what it measures)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np

import bench.serve
from bench._common import machine
from bench.serve.args import parse, series_depths
from bench.serve.floor import Floor
from bench.serve.model import REST_MODELS, make_workload
from bench.serve.report import ROW_BYTES, phase_rows, render
from bench.serve.series import Series, interleave, prefetch_timeline, prefetcher
from bench.serve.steps import history_rows, load_requests, load_text, server_steps
from rowcache.cache.row_cache import NgramRowCache
from rowcache.embed.layer import NgramEmbedding
from rowcache.embed.ngram.dims import NgramDims
from rowcache.embed.tables import Bf16Table, CachedTable, Fp8Table
from rowcache.kernels.reference import BF16
from rowcache.store.builder import build_store
from rowcache.store.handle import RowStore
from rowcache.tools.profile import profile_trace
from rowcache.tools.trace import ServerModel
from rowcache.tools.trace_build import build_trace
from rowcache.tools.tune import tune
from rowcache.units import parse_bytes

FULL_ROWS = 10_223_617  # LongCat-Flash-Lite's table 0: 78 x 131,072 + 1


def log(msg: str) -> None:
    """Progress on stderr (a run cut short by a time limit keeps what it measured)."""
    print(f"[serve {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pick_rows(args: Any, xp: Any) -> tuple[int, str]:
    """Rows per table: LongCat's where disk and memory hold them, else the largest that fit."""
    if args.rows != "auto":
        return int(args.rows), "given (--rows)"
    where = os.path.abspath(args.workdir or tempfile.gettempdir())
    old = os.path.join(where, "store")  # a store kept there is rebuilt in its own place
    free = (
        sum(e.stat().st_size for e in os.scandir(old) if e.is_file()) if os.path.isdir(old) else 0
    )
    while not os.path.exists(where):
        where = os.path.dirname(where)
    free += shutil.disk_usage(where).free
    disk = int((0.9 * free - (1 << 30)) / (12 * ROW_BYTES[args.dtype]))
    # the resident tables, and every cached series' arena (alive at once: the series take
    # turns), an arena at most the tables' size in RAM, ~0.2 of it in HBM (tune's budget)
    arenas = len(series_depths(args, "x64", args.lookahead_list))
    per_row = (
        12
        * 256
        * (2 if args.dtype == "bf16" else 1)
        * (1 + arenas if xp is np else 1 + 0.2 * arenas)
    )
    if xp is np:  # resident tables in RAM next to the store's page cache
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") * 0.4
    else:  # resident tables in HBM next to the arena, word table and staging
        mem = xp.cuda.runtime.memGetInfo()[0] * 0.8 - (2 << 30)
    rows = min(FULL_ROWS, disk, int(mem / per_row))
    why = "LongCat's full size" if rows == FULL_ROWS else ("disk" if rows == disk else "memory")
    return max(rows, 1024), f"auto ({why}: {free / 1e9:.0f} GB free disk)"


def window_table(base: Any, rows: int, dim: int) -> Any:
    """Row r = base[r : r + dim]: distinct synthetic rows with no memory of their own
    (numpy or cupy ``base``; ``ascontiguousarray`` of it materializes the table)."""
    xp = sys.modules["cupy"] if type(base).__module__.startswith("cupy") else np
    return xp.lib.stride_tricks.as_strided(base, shape=(rows, dim), strides=(2, 2))


def materialize(xp: Any, base: np.ndarray, rows: int, dim: int) -> Any:
    """The window table of ``base`` as a contiguous bf16 array on ``xp``'s device
    (copied as uint16 there: the same bits, whatever the library's bf16 support)."""
    u16 = xp.asarray(base.view(np.uint16))
    return xp.ascontiguousarray(window_table(u16, rows, dim)).view(BF16)


def open_or_build(path: str, dims: NgramDims, bases: list[np.ndarray], dtype: str) -> RowStore:
    T, d = dims.num_tables, dims.table_dim
    try:
        store = RowStore.open(path)
        if store.dtype == dtype and [t.rows for t in store.tables] == [
            dims.table_rows(i) for i in range(T)
        ]:
            return store
        store.close()
    except Exception:
        pass
    src = {str(i): window_table(bases[i], dims.table_rows(i), d) for i in range(T)}
    return build_store(path, src, dtype=dtype, overwrite=True, progress=False)


def arena_slots(args: Any, dims: NgramDims, reqs: list[Any], workdir: str) -> tuple[int, dict]:
    """Slots of the shared arena: ``rowcache tune`` on a profile of the same trace."""
    trace = build_trace(
        reqs,
        dims,
        os.path.join(workdir, "trace"),
        model=args.model,
        overwrite=True,
        progress=False,
    )
    scale = dims.table_rows(0) / FULL_ROWS
    if args.arena_bytes:
        kw = {"arena_bytes": parse_bytes(args.arena_bytes, "--arena-bytes")}
    else:  # the budget of a 121 GB machine, scaled to these tables' share of LongCat's
        budget = parse_bytes(args.memory, "--memory") - parse_bytes(args.reserve, "--reserve")
        kw = {"arena_bytes": int(budget * min(1.0, scale))}
    prof = profile_trace(
        trace, dtype=args.dtype, shared=False, progress=False, workers=min(12, os.cpu_count() or 1)
    )
    rep = tune(prof, dtype=args.dtype, **kw)
    slots = min(sum(rep.rows.values()), sum(dims.table_rows(i) for i in range(12)))
    info = {
        "budget_bytes": rep.budget_bytes,
        "used_bytes": rep.used_bytes,
        "slots": slots,
        "expected_faults_per_token": rep.faults_per_token,
        "notes": rep.notes,
        "trace_steps": trace.steps,
    }
    return slots, info | {"trace_step_tokens": np.bincount(trace.steps_array())}


def warm_plan(
    chunks: list[np.ndarray], servers: list[list[Any]], offsets: np.ndarray, slots: int
) -> tuple[list[np.ndarray], str]:
    """The prefetch calls that bring the history's rows in: its chunks in order, or,
    where the arena holds every row that history and trace touch (so that no series
    evicts and the order cannot change a fault), one sorted pass in dense pieces
    (their pages merge into long reads)."""
    if not chunks:
        return [], "none"
    hist = np.unique(np.concatenate(chunks))
    trace = [np.unique(st.batch.host_ids() + offsets[:, None]) for sv in servers for st in sv]
    if np.unique(np.concatenate([hist, *trace])).size > slots:
        return chunks, "in the history's order"
    pieces = np.array_split(hist, -(-hist.size // 1_000_000))
    return pieces, "one sorted pass: the arena holds every row of history and trace"


def main(argv: list[str] | None = None) -> int:
    _, args = parse(argv, bench.serve.__doc__)
    depths, servers_on = args.lookahead_list, args.servers_on
    xp: Any = np
    if args.device == "cuda":
        import cupy as xp
    sync = (lambda: xp.cuda.get_current_stream().synchronize()) if xp is not np else lambda: None
    rest = REST_MODELS[args.rest or ("h200" if xp is not np else "unified-121GB")]
    rest = rest.scaled(args.rest_scale) if args.rest_scale != 1 else rest
    t_start = time.perf_counter()
    rows, rows_why = pick_rows(args, xp)
    ld = NgramDims.longcat_flash_lite()
    hidden = 96 if args.quick else ld.hidden_size
    dims = NgramDims(
        vocab_size=ld.vocab_size,
        hidden_size=hidden,
        max_ngram=4,
        splits=4,
        ratio=(rows - 0.5) / ld.vocab_size,
        eos_token_id=2,
    )
    T, d, D = dims.num_tables, dims.table_dim, dims.hidden_size
    if args.write_tokens:
        toks, src = load_text(args.history + args.tokens, dims.vocab_size, dims.eos_token_id)
        np.save(args.write_tokens, toks.astype(np.int32))
        print(f"wrote {toks.size:,} tokens ({src}) to {args.write_tokens}")
        return 0
    reqs, text, hist = load_requests(
        args.tokens,
        dims.vocab_size,
        dims.eos_token_id,
        args.max_request,
        args.history,
        args.tokens_npy,
    )
    args.model = ServerModel(batch=64, chunk=args.chunk, decode=args.decode)
    steps64, tok64 = server_steps(dims, args.model, reqs)
    one = ServerModel(batch=1, chunk=args.chunk, decode=args.decode)
    steps1, _ = server_steps(dims, one, reqs[: args.b1_requests])

    own = args.workdir is None
    workdir = tempfile.mkdtemp(prefix="bench-serve-") if own else args.workdir
    os.makedirs(workdir, exist_ok=True)
    store = floor = None
    try:
        slots, tuned = arena_slots(args, dims, hist + reqs, workdir)
        step_tokens = tuned.pop("trace_step_tokens")
        if not hist:  # with a history the trace also holds the history's steps
            assert np.array_equal(step_tokens, tok64), "steps differ from the trace"
        rng = np.random.default_rng(0)
        bases = [
            (rng.standard_normal(dims.table_rows(i) + d, dtype=np.float32) * 0.02).astype(BF16)
            for i in range(T)
        ]
        t0 = time.perf_counter()
        store = open_or_build(os.path.join(workdir, "store"), dims, bases, args.dtype)
        build_s = time.perf_counter() - t0
        log(
            f"store {rows:,} rows/table {args.dtype} ready in {build_s:.0f} s; arena {slots:,} slots"
        )
        resident = []
        for i in range(T):  # the same values as the store, materialized on the device
            a = materialize(xp, bases[i], dims.table_rows(i), d)
            resident.append(Bf16Table(a) if args.dtype == "bf16" else Fp8Table.quantize(a))
            del a
        w = (rng.standard_normal(dims.vocab_size + D, dtype=np.float32) * 0.02).astype(BF16)
        word = materialize(xp, w, dims.vocab_size, D)
        projs = [
            (rng.standard_normal((D, d), dtype=np.float32) / np.sqrt(d)).astype(BF16)
            for _ in range(T)
        ]
        emb_r = NgramEmbedding(dims, word, resident, projs)

        def graphed(tables: list[Any], **kw: Any) -> Any:  # the decode steps' embedding
            if not args.decode_graphs:
                return None
            return NgramEmbedding(dims, word, tables, projs, cuda_graphs=True, **kw)

        work = make_workload(args.device)
        floor = Floor(store, direct=not args.no_direct)

        sizes = [dims.table_rows(i) for i in range(T)]  # the shared arena's global row ids
        layout = (np.r_[0, np.cumsum(sizes)], [store.table_index(str(i)) for i in range(T)])
        warm_rows, order = warm_plan(
            history_rows(dims, hist, layout[0][:-1]), [steps64, steps1], layout[0][:-1], slots
        )
        warmed: dict[str, Any] = {"tokens": sum(r.size for r in hist), "order": order}

        def new_cache() -> NgramRowCache:
            cache = NgramRowCache(
                store,
                [str(i) for i in range(T)],
                slots=slots,
                device=args.device,
                queue_depth=args.queue_depth,
                direct=not args.no_direct,
            )
            if warm_rows:  # the history's rows, in its order (untimed)
                t0 = time.perf_counter()
                for rows_ in warm_rows:
                    cache.prefetch(rows_).wait()
                st = cache.stats()
                dt = time.perf_counter() - t0
                warmed.update(seconds=dt, rows_read=st.prefetched, read_ops=st.read_ops)
                warmed.update(GB_read=st.bytes_read / 1e9, GB_s=st.bytes_read / 1e9 / dt)
                warmed["resident_rows"] = cache.resident
                log(f"arena warmed by the history: {json.dumps(warmed)}")
            return cache

        servers, mismatched, checked, api = {}, 0, 0, ""
        reread: dict[str, float] = {}
        timed: dict[str, list[int]] = {}
        timelines: dict[str, dict] = {}
        records: dict[str, dict] = {}  # every timed step of every series (--save only)
        for name, steps, slots_n in ((" x64", steps64, 64), (" x1", steps1, 1)):
            if name.strip() not in servers_on:
                continue
            # steady state: once the last request is admitted the slots drain (untimed)
            full = [k for k, st in enumerate(steps) if st.batch.num_seqs == slots_n]
            steps = steps[: full[-1] + 1 if full else len(steps)]
            warm = int(args.warm * len(steps))
            timed[name.strip()] = [warm, len(steps)]
            ref: list[Any] = []
            common = (steps, warm, rest, work, sync)
            runs = {
                "resident": Series(
                    emb_r, *common, check=(args.check_every, ref), graphs=graphed(resident)
                )
            }
            misses: list[np.ndarray] = []
            demand: dict[str, list[np.ndarray]] = {}  # a lookahead series' own faults
            variants = series_depths(args, name.strip(), depths)
            caches, outputs, prof = {}, {}, None
            for variant, depth in variants.items():
                if depth:
                    demand[variant] = []
                cache = caches[variant] = new_cache()
                ctabs = [CachedTable(cache, i) for i in range(T)]
                defer = {"defer_reads": True} if variant == "deferred" else {}
                emb_c = NgramEmbedding(dims, word, ctabs, projs, **defer)
                if depth and prefetcher(emb_c, cache) is None:
                    break
                api = (
                    "NgramEmbedding.prefetch_packed"
                    if hasattr(emb_c, "prefetch_packed")
                    else ("NgramRowCache.prefetch of the ids the bench hashes on the host")
                )
                if args.profile and args.profile[:2] == (name, variant):
                    import cProfile

                    prof = cProfile.Profile()
                outputs[variant] = []
                runs[variant] = Series(
                    emb_c,
                    *common,
                    cache,
                    depth,
                    record=misses if variant == "cached" else demand.get(variant),
                    check=(args.check_every, outputs[variant]),
                    graphs=graphed(ctabs, **defer),
                    profile=prof if args.profile and args.profile[:2] == (name, variant) else None,
                    profile_kind=args.profile[2] if args.profile else None,
                )
            block = args.interleave if args.interleave > 0 else len(steps)
            # a turn ends where no lookahead series has a prefetch in flight, if one is near
            deepest = max([d for v, d in variants.items() if v in runs] or [0])
            quiet = None
            if deepest:  # quiet[k]: no prefill step in k .. k + deepest - 1
                pre = np.r_[[st.prefill is not None for st in steps], np.zeros(deepest, bool)]
                quiet = ~np.lib.stride_tricks.sliding_window_view(pre, deepest).any(axis=1)
            series = interleave(runs, len(steps), block, quiet)
            log(f"server{name}: {', '.join(runs)} done ({len(steps)} steps, blocks of {block})")
            for v, r in runs.items():
                if r.lookahead and (tl := prefetch_timeline(r)):
                    timelines[f"{name.strip()} {v}"] = tl
                    log(f"server{name} {v} prefetch thread: {json.dumps(tl)}")
            ref_h = {k: (y.get() if xp is not np else y).view(np.uint16) for k, y in ref}
            if prof is not None:
                import pstats

                _, series_name, kind = args.profile
                print(
                    f"--- cProfile: server{name} {series_name}, {kind or 'every'} timed step's "
                    f"host work, {len(steps)} steps",
                    file=sys.stderr,
                )
                ps = pstats.Stats(prof, stream=sys.stderr)
                ps.sort_stats("tottime").print_stats(30)
                ps.sort_stats("cumulative").print_stats(40)
                ps.print_callers(25)  # (the cumulative order's first 25)
            for variant, cache in caches.items():
                ev = cache.stats().evictions
                warmed.setdefault("evictions", {})[f"{name.strip()} {variant}"] = ev
                assert not (ev and order.startswith("one sorted")), "the arena evicted"
            for got in outputs.values():
                for k, y in got:
                    checked += 1
                    mismatched += not np.array_equal(
                        (y.get() if xp is not np else y).view(np.uint16), ref_h[k]
                    )
            del runs, caches, outputs, emb_c, ctabs, cache  # the arenas, before the next server
            pg = [floor.pages(layout, m) for m in misses]
            floors = {mode: floor.run(pg, mode, args.queue_depth) for mode in ("uring", "threads")}
            # the same reads after the idle of the server's decode step (a small batch after
            # ~1 ms idle reads 2-3x slower than back to back on the H200 VM: RESULTS.md)
            idle_s = rest.decode64_s if name == " x64" else rest.decode1_s
            idle = floor.run(pg, "uring", args.queue_depth, gap_us=idle_s * 1e6)
            if name == " x64":  # do re-reads of this run's pages cost what first reads do?
                some = [q for q in pg if q.shape[0]][-args.reread_steps :]
                reread = floor.reread_check(some, args.queue_depth)
            # what a lookahead series faulted itself (decode tokens, rows it prefetched too
            # late to be in flight), at the floor: the ceiling of a perfect prefetch
            demand_floor = {
                v: floor.run([floor.pages(layout, m) for m in ms], "uring", args.queue_depth)
                for v, ms in demand.items()
                if len(ms) == len(misses)
            }
            servers[name] = phase_rows(series, floors, name, idle, demand_floor)
            records[name.strip()] = {"floor_uring_s": floors["uring"].tolist(), **series}
            log(f"server{name}: floor done: " + json.dumps(servers[name], default=float))
        phases = [r for rows_ in servers.values() for r in rows_]
        settings = {
            "device": args.device,
            "machine": machine(),
            "dtype": args.dtype,
            "rows_per_table": rows,
            "rows_choice": rows_why,
            "tables": T,
            "hidden": D,
            "store_GB": sum(t.nbytes for t in store.tables) / 1e9,
            "store_build_s": build_s,
            "text": text,
            "requests": len(reqs),
            "server": f"64 slots, chunk {args.chunk}, decode {args.decode}",
            "steps_x64": len(steps64),
            "steps_x1": len(steps1),
            "warm_fraction": args.warm,
            "timed_steps": timed,
            "rest_model": rest.__dict__,
            "arena": tuned,
            "history": warmed,
            "queue_depth": args.queue_depth,
            "direct": not args.no_direct,
            "decode_graphs": args.decode_graphs,
            "interleave": args.interleave,
            "reread_check": reread,
            "prefetch_timeline": timelines,
            "outputs_checked": checked,
            "outputs_mismatched": mismatched,
            "lookahead": (
                "prefill chunks of step t+1"
                if depths[0] == 1
                else f"prefill chunks of steps t+1..t+{depths[0]}"
            )
            + " prefetched during step t ("
            + api
            + "); decode tokens are sampled at the end "
            "of step t and never prefetched"
            + "".join(f"; la{d}: steps t+1..t+{d}" for d in depths[1:]),
            "lookahead_steps": depths,
            "seconds": time.perf_counter() - t_start,
        }
    finally:
        if floor is not None:
            floor.close()
        if store is not None:
            store.close()
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    report = {"bench": "serve", "settings": settings, "phases": phases}
    if args.save:
        with open(args.save, "w") as f:
            json.dump(report | {"step_records": records}, f, default=float)
    if args.json:
        print(json.dumps(report, indent=1, default=float))
        return 0 if mismatched == 0 else 1
    render(settings, phases)
    return 0 if mismatched == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
