"""CLI subcommands of the offline tools: ``trace``, ``profile``, ``tune``, ``bench-io``.

Only parsing and rendering; the work is in ``rowcache.tools``. Reports print a
table by default and JSON with ``--json``; ``profile --png`` draws the curves.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ConfigError


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n}"


def _count(text: str) -> int:
    """``4096``, ``64K``, ``1.5M``, ``2G`` (powers of 1000) -> int."""
    t = text.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(t[-1:], 1)
    try:
        v = float(t[:-1] if mult > 1 else t) * mult
    except ValueError:
        raise ConfigError(f"{text!r} is not a count (use e.g. 4096, 64K, 1.5M)") from None
    if v < 1:
        raise ConfigError(f"{text!r}: a size must be >= 1")
    return int(v)


def _sizes(text: str | None) -> np.ndarray | None:
    if not text:
        return None
    return np.unique(np.array([_count(x) for x in text.split(",") if x.strip()], dtype=np.int64))


def _dims(args: argparse.Namespace) -> Any:
    from embed.dims import NgramDims

    if args.config:
        try:
            cfg = json.loads(Path(args.config).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"--config {args.config}: cannot read a config.json: {e}") from e
        return NgramDims.from_config(cfg)
    return NgramDims.longcat_flash_lite()


def _emit(obj: dict[str, Any]) -> None:
    print(
        json.dumps(obj, indent=1, default=lambda x: x.tolist() if hasattr(x, "tolist") else str(x))
    )


# --- trace -------------------------------------------------------------------
def _cmd_trace(args: argparse.Namespace) -> int:
    from .tools.tokens import iter_requests
    from .tools.trace import ServerModel, build_trace

    dims = _dims(args)
    model = ServerModel(batch=args.batch, chunk=args.chunk, decode=args.decode)
    reqs = iter_requests(
        args.inputs,
        vocab_size=dims.vocab_size,
        eos_token_id=dims.eos_token_id,
        tokenizer=args.tokenizer,
        max_request_tokens=args.max_request_tokens,
    )
    if args.max_requests:
        import itertools

        reqs = itertools.islice(reqs, args.max_requests)
    trace = build_trace(
        reqs,
        dims,
        args.out,
        model=model,
        chunk_positions=args.chunk_positions,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    info = {
        "trace": str(trace.path),
        "requests": trace.requests,
        "tokens": trace.positions,
        "steps": trace.steps,
        "tables": trace.num_tables,
        "chunks": len(trace.chunks),
        "model": {"batch": model.batch, "chunk": model.chunk, "decode": model.decode},
    }
    if args.json:
        _emit(info)
    else:
        print(
            f"trace {info['trace']}: {info['requests']:,} requests, {info['tokens']:,} tokens, "
            f"{info['steps']:,} server steps (batch {model.batch}, chunk {model.chunk}, "
            f"decode {model.decode}), {info['tables']} tables, {info['chunks']} chunk files"
        )
    return 0


# --- profile -----------------------------------------------------------------
def _fmt_rate(x: float) -> str:
    return "   n/a" if np.isnan(x) else f"{x:.4f}"


def _print_profile(rep: Any) -> None:
    sizes = rep.sizes
    fpt = rep.faults_per_token()
    byt = rep.arena_bytes()
    shared = rep.shared
    print(
        f"{rep.trace}: {rep.tokens:,} tokens, {rep.num_tables} tables, {rep.dtype} rows of "
        f"{rep.record_bytes} B; method {next(iter(rep.curves.values())).method}"
        + (", batch = server step" if next(iter(rep.curves.values())).batched else ", per access")
    )
    head = f"{'rows/table':>12} {'all arenas':>12} {'fault rate':>10} {'faults/tok':>10}"
    if shared is not None:
        head += f" {'shared rate':>11} {'shared f/tok':>12}"
    print(head)
    accesses = sum(c.accesses for c in rep.curves.values())
    for i, s in enumerate(sizes.tolist()):
        total_rate = fpt[i] * rep.tokens / max(1, accesses)
        line = f"{s:>12,} {_human(float(byt[i])):>12} {_fmt_rate(total_rate):>10} {fpt[i]:>10.4f}"
        if shared is not None:
            line += (
                f" {_fmt_rate(float(shared.miss_ratio[i])):>11}"
                f" {float(shared.misses[i]) / max(1, rep.tokens):>12.4f}"
            )
        print(line)
    print("\nfault rate per table (columns) at each size (rows):")
    names = list(rep.curves)
    print(f"{'rows/table':>12} " + " ".join(f"{n:>7}" for n in names))
    for i, s in enumerate(sizes.tolist()):
        vals = " ".join(f"{_fmt_rate(float(rep.curves[n].miss_ratio[i])):>7}" for n in names)
        print(f"{s:>12,} {vals}")
    floor = " ".join(f"{rep.curves[n].compulsory:>7.4f}" for n in names)
    feas = " ".join(f"{rep.curves[n].min_feasible:>7}" for n in names)
    print(f"{'compulsory':>12} {floor}\n{'min feasible':>12} {feas}")
    if rep.policies:
        print(f"\npolicies on a SHARDS sample of table {rep.policy_table} (per access):")
        print(f"{'rows':>12} " + " ".join(f"{p:>7}" for p in rep.policies))
        for i, s in enumerate(sizes.tolist()):
            vals = " ".join(
                f"{_fmt_rate(float(c.miss_ratio[i])):>7}" for c in rep.policies.values()
            )
            print(f"{s:>12,} {vals}")


def _cmd_profile(args: argparse.Namespace) -> int:
    from .tools.profile import profile_trace
    from .tools.trace import Trace

    sizes = _sizes(args.sizes)
    trace = Trace.open(args.trace)
    policies = [p for p in (args.policies or "").split(",") if p]
    rep = profile_trace(
        trace,
        sizes,
        method=args.method,
        sample_rate=args.rate,
        sample_size=args.sample_size,
        salts=args.salts,
        batch=not args.per_access,
        shared=not args.no_shared,
        policies=policies,
        policy_table=args.policy_table,
        policy_rate=args.policy_rate,
        dtype=args.dtype,
        progress=not args.no_progress,
        workers=args.workers,
        heavy=args.heavy,
    )
    if args.png:
        from .tools.plot import plot_profile

        plot_profile(rep, args.png)
    if args.save:
        Path(args.save).write_text(json.dumps(rep.to_dict()))
    if args.json:
        _emit(rep.to_dict())
    else:
        _print_profile(rep)
        if args.png:
            print(f"\nplot: {args.png}")
    return 0


# --- tune ---------------------------------------------------------------------
def _cmd_tune(args: argparse.Namespace) -> int:
    from .tools.benchio import DeviceProfile
    from .tools.tune import tune

    try:
        prof = json.loads(Path(args.profile).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(
            f"{args.profile}: not a profile JSON (rowcache profile --json): {e}"
        ) from e
    device = DeviceProfile.load(args.device) if args.device else None
    rep = tune(
        prof,
        arena_bytes=args.arena,
        memory_bytes=args.memory,
        reserve_bytes=args.reserve,
        dtype=args.dtype,
        device=device,
        queue_depth=args.queue_depth,
        target_fault_rate=args.target_rate,
        target_fault_seconds=args.target_seconds,
    )
    if args.json:
        _emit(rep.to_dict())
        return 0
    print(
        f"budget {_human(rep.budget_bytes)} for {rep.dtype} arenas ({rep.record_bytes} B rows); "
        f"used {_human(rep.used_bytes)}"
    )
    print(f"{'table':>8} {'rows':>14} {'bytes':>12} {'fault rate':>10}")
    for name, r in rep.rows.items():
        print(
            f"{name:>8} {r:>14,} {_human(r * rep.record_bytes):>12} {rep.fault_rate[name]:>10.4f}"
        )
    print(f"expected faults/token: {rep.faults_per_token:.4f}")
    if rep.fault_seconds_per_token is not None:
        print(
            f"expected fault I/O per token: {rep.fault_seconds_per_token * 1e6:.1f} us "
            f"(at {rep.reads_per_s:,.0f} reads/s, queue depth {rep.queue_depth})"
        )
    if rep.target:
        need = "n/a" if rep.min_bytes_for_target is None else _human(rep.min_bytes_for_target)
        print(
            f"target {rep.target}: {'met' if rep.meets_target else 'NOT met'}; smallest arena meeting it: {need}"
        )
    if rep.fp8_host_fits is not None:
        verdict = "fits" if rep.fp8_host_fits else "does not fit"
        print(
            f"all tables in host RAM as FP8: {_human(rep.fp8_host_bytes)}, {verdict} in the budget"
            + (" (no disk faults: every lookup a host-memory gather)" if rep.fp8_host_fits else "")
        )
    for n in rep.notes:
        print(f"note: {n}")
    return 0


# --- bench-io -----------------------------------------------------------------
def _cmd_bench_io(args: argparse.Namespace) -> int:
    from .tools.benchio import measure_io, profile_summary

    record = args.record_bytes
    if record is None:
        p = Path(args.path)
        if p.is_dir() and (p / "index.lmdb").exists():
            from .store import RowStore

            store = RowStore.open(p)
            try:
                record = store.tables[0].record_bytes
            finally:
                store.close()
        else:
            record = 512
    qds = [int(x) for x in args.queue_depths.split(",") if x.strip()]
    prof = measure_io(
        args.path,
        record_bytes=record,
        queue_depths=qds,
        seconds=args.seconds,
        direct=not args.buffered,
        progress=not args.no_progress,
    )
    if args.out:
        prof.save(args.out)
    if args.json:
        from dataclasses import asdict

        _emit(asdict(prof))
        return 0
    print(f"{prof.path}: {_human(prof.file_bytes)}, O_DIRECT {'on' if prof.direct else 'off'}")
    print(f"{'read':>8} {'qd':>4} {'reads/s':>12} {'MB/s':>9}")
    for row in profile_summary(prof):
        print(
            f"{row['read_bytes']:>8} {row['queue_depth']:>4} {row['reads_per_s']:>12,.0f} {row['MB_per_s']:>9.1f}"
        )
    print(f"sequential: {prof.sequential_bytes_per_s / 1e6:,.1f} MB/s")
    for n in prof.notes:
        print(f"note: {n}")
    if args.out:
        print(f"saved device profile: {args.out}")
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "trace",
        help="turn token streams into per-table row-id traces of a modelled server",
        description="Read requests (.npy token arrays split at EOS, .jsonl id lists, or text "
        "files/folders tokenized), schedule them on a server with --batch concurrent requests, "
        "chunked prefill and round-robin decode, and write the rows each table reads.",
    )
    p.add_argument("inputs", nargs="+", help="files or folders")
    p.add_argument("-o", "--out", required=True, help="trace directory to write")
    p.add_argument("--config", help="model config.json (default: LongCat-Flash-Lite dims)")
    p.add_argument("--tokenizer", default="words", help="words | bytes | path/to/tokenizer.json")
    p.add_argument("--batch", type=int, default=64, help="concurrent requests (default 64)")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk tokens (default 512)")
    p.add_argument(
        "--decode", type=int, default=256, help="decode tokens per request (default 256)"
    )
    p.add_argument("--max-request-tokens", type=int, default=8192)
    p.add_argument("--max-requests", type=int, default=0, help="stop after this many (0 = all)")
    p.add_argument("--chunk-positions", type=int, default=1 << 22, help="positions per chunk file")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_trace)

    p = subparsers.add_parser(
        "profile",
        help="fault-rate curves of a trace: table, PNG plot, JSON",
        description="Miss-ratio curves per table (the row cache's batch semantics: exact "
        "with --method exact), for one shared arena, and other policies on a sample.",
    )
    p.add_argument("trace", help="trace directory from `rowcache trace`")
    p.add_argument("--sizes", help="rows per table, comma separated (e.g. 64K,256K,1M)")
    p.add_argument("--method", choices=("exact", "shards"), default="exact")
    p.add_argument("--rate", type=float, default=None, help="SHARDS fixed rate (default 0.01)")
    p.add_argument("--sample-size", type=int, default=None, help="SHARDS fixed size (keys)")
    p.add_argument("--salts", type=int, default=1, help="SHARDS repetitions for error bars")
    p.add_argument("--per-access", action="store_true", help="per-access LRU instead of batches")
    p.add_argument("--no-shared", action="store_true", help="skip the shared-arena curve")
    p.add_argument("--policies", default="", help="also simulate: sieve,opt (on a sample)")
    p.add_argument("--policy-table", type=int, default=0)
    p.add_argument("--policy-rate", type=float, default=0.01)
    p.add_argument(
        "--workers", type=int, default=1, help="processes (SHARDS sampling; exact: per table)"
    )
    p.add_argument(
        "--heavy", type=int, default=0, help="SHARDS: keep each table's N hottest rows exactly"
    )
    p.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16")
    p.add_argument("--png", help="write a plot here")
    p.add_argument("--save", help="also write the JSON report to this file (for `rowcache tune`)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_profile)

    p = subparsers.add_parser(
        "tune",
        help="split a memory budget across table arenas from profiled curves",
        description="Greedy on marginal gain over each table's curve; expected faults/token and "
        "fault I/O time per token from a bench-io device profile.",
    )
    p.add_argument("profile", help="JSON from `rowcache profile --json` (or --save)")
    p.add_argument("--arena", help="arena budget, e.g. 20GiB")
    p.add_argument("--memory", help="machine memory, e.g. 121GiB (with --reserve)")
    p.add_argument("--reserve", help="memory kept for weights and KV cache, e.g. 70GiB")
    p.add_argument("--dtype", choices=("bf16", "fp8"), default=None)
    p.add_argument("--device", help="device profile JSON from `rowcache bench-io --out`")
    p.add_argument("--queue-depth", type=int, default=None)
    p.add_argument("--target-rate", type=float, default=None, help="faults per access to reach")
    p.add_argument("--target-seconds", type=float, default=None, help="fault s/token to reach")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_tune)

    p = subparsers.add_parser(
        "bench-io",
        help="measure random-read rate vs queue depth and sequential rate; save a device profile",
    )
    p.add_argument("path", help="a store directory or any large file on the disk to measure")
    p.add_argument("--record-bytes", type=int, default=None, help="row size (default: the store's)")
    p.add_argument("--queue-depths", default="1,4,16,32,64")
    p.add_argument("--seconds", type=float, default=1.0, help="per measured point")
    p.add_argument("--buffered", action="store_true", help="do not use O_DIRECT")
    p.add_argument("--out", help="save the device profile JSON here")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_bench_io)
