"""CLI subcommands of the sizing tools: ``tune`` and ``bench-io``.

Only parsing, checking flags (errors name the flag) and rendering; the work is in
``rowcache.tools.tune`` and ``rowcache.tools.benchio``. Reports print a table by default
and JSON with ``--json``. The shared flag helpers are ``rowcache.cli.tools``'.
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path
from typing import Any

from rowcache.cli.app import (
    add_deprecated,
    byte_size,
    fraction,
    inform,
    int_in,
    int_list_in,
    positive_byte_size,
    positive_float,
)
from rowcache.cli.store import human_bytes
from rowcache.cli.tools import (
    check_writable,
    emit_json,
    format_cell,
    output_flags,
    write_json,
)
from rowcache.errors import ConfigError
from rowcache.tools.benchio import MAX_QUEUE_DEPTH, MAX_SECONDS


def size_arg(n: int) -> str:
    """``n`` bytes as a size flag takes it, rounded up (``7.53KiB``: never less than ``n``)."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{math.ceil(n / (1 << shift) * 100) / 100:g}{unit}"
    return str(n)


def _goal(target: dict[str, float]) -> str:
    parts = []
    if "fault_rate" in target:
        parts.append(f"at most {target['fault_rate']:g} faults per access")
    if "fault_seconds_per_token" in target:
        parts.append(
            f"at most {target['fault_seconds_per_token'] * 1e6:g} µs of fault I/O per token"
        )
    return " and ".join(parts)


def advice(rep: Any) -> str | None:
    """Which of the report's answers to use, where it gives more than one (else None)."""
    if rep.fp8_host_fits:
        return (
            f"use: all tables in host RAM as FP8 ({human_bytes(rep.fp8_host_bytes)}, within "
            "the budget) if FP8 rows suit the model: no faults at all; otherwise the arena "
            "split above"
        )
    if not rep.target or rep.budget_from == "target":
        return None  # one answer: the split above
    need = rep.min_bytes_for_target
    if rep.meets_target:
        if need is not None and need < rep.used_bytes:
            return (
                "use: the split above: it meets the target within the budget; the target "
                f"alone needs only {human_bytes(need)} (tune with the target alone, or "
                f"--arena {size_arg(need)}, for that smaller split)"
            )
        return "use: the split above: it meets the target within the budget"
    if need is not None:
        return (
            f"use: a budget of {human_bytes(need)} (--arena {size_arg(need)}) to meet the "
            "target; the split above is the best within this budget "
            f"({rep.faults_per_access:.4g} faults per access)"
        )
    return (
        "use: the split above, the best within the budget (the note says why no size meets "
        "the target)"
    )


# --- tune ---------------------------------------------------------------------
def _cmd_tune(args: argparse.Namespace) -> int:
    from rowcache.tools.benchio import DeviceProfile
    from rowcache.tools.tune import load_profile, tune

    if args.arena is not None and (args.memory is not None or args.reserve is not None):
        raise ConfigError("give --arena, or --memory with --reserve, not both")
    if args.memory is not None and args.reserve is None:
        raise ConfigError(
            "--memory needs --reserve: the memory that weights and KV cache keep "
            "(--reserve 0 budgets all of it)"
        )
    if args.reserve is not None and args.memory is None:
        raise ConfigError("--reserve needs --memory")
    has_target = args.target_rate is not None or args.target_seconds is not None
    if args.arena is None and args.memory is None and not has_target:
        raise ConfigError(
            "give a budget (--arena SIZE, or --memory SIZE --reserve SIZE) or a target "
            "(--target-rate, --target-seconds)"
        )
    if args.memory is not None and args.memory <= args.reserve:
        raise ConfigError(
            f"--memory ({human_bytes(args.memory)}) must exceed --reserve ({human_bytes(args.reserve)})"
        )
    if args.target_seconds is not None and args.disk is None:
        raise ConfigError("--target-seconds needs --disk (a profile from bench-io -o)")
    if args.out:
        check_writable("-o/--out", args.out)
    prof = load_profile(args.profile)
    disk = None
    if args.disk:
        try:
            disk = DeviceProfile.load(args.disk)
        except ConfigError as e:
            raise ConfigError(f"--disk: {e}") from e
        if args.queue_depth is not None:
            have = {int(q) for row in disk.random.values() for q in row}
            if args.queue_depth not in have:
                raise ConfigError(
                    f"--queue-depth {args.queue_depth} was not measured in {args.disk}; "
                    f"have {sorted(have)}"
                )
    elif args.queue_depth is not None:
        raise ConfigError("--queue-depth needs --disk")
    rep = tune(
        prof,
        arena_bytes=args.arena,
        memory_bytes=args.memory,
        reserve_bytes=args.reserve,
        dtype=args.dtype,
        device=disk,
        queue_depth=args.queue_depth,
        target_fault_rate=args.target_rate,
        target_fault_seconds=args.target_seconds,
    )
    if args.out:
        write_json(args.out, rep.to_dict())
    if args.json:
        emit_json(rep.to_dict())
    else:
        _print_tune(rep)
    if args.out:
        inform(args, f"saved: {args.out}")
    return 0


def _print_tune(rep: Any) -> None:
    print(
        f"budget {human_bytes(rep.budget_bytes)} for {rep.dtype} arenas ({rep.record_bytes} B rows); "
        f"used {human_bytes(rep.used_bytes)}"
    )
    print(f"{'table':>8} {'rows':>14} {'bytes':>12} {'fault rate':>10}")
    for name, r in rep.rows.items():
        print(
            f"{name:>8} {r:>14,} {human_bytes(r * rep.record_bytes):>12} {rep.fault_rate[name]:>10.4f}"
        )
    print(f"expected faults/token: {rep.faults_per_token:.4f}")
    if rep.fault_seconds_per_token is not None:
        print(
            f"expected fault I/O per token: {rep.fault_seconds_per_token * 1e6:.1f} µs "
            f"(at {rep.reads_per_s:,.0f} reads/s, queue depth {rep.queue_depth})"
        )
    if rep.target:
        if rep.meets_target:
            state = "met"
        elif rep.target_reachable:
            need = human_bytes(rep.min_bytes_for_target)
            state = f"NOT met within this budget (the smallest arena meeting it: {need})"
        else:
            state = "NOT met: no profiled size meets it (see the note)"
        print(f"target {_goal(rep.target)}: {state}")
    if rep.fp8_host_fits is not None:
        verdict = "fits" if rep.fp8_host_fits else "does not fit"
        print(
            f"all tables in host RAM as FP8: {human_bytes(rep.fp8_host_bytes)}, {verdict} in the budget"
        )
    for n in rep.notes:
        print(f"note: {n}")
    use = advice(rep)
    if use:
        print(use)


# --- bench-io -----------------------------------------------------------------
# measure_io's arguments as the flags spell them, so that its errors name the flag
_BENCH_FLAG = {
    "record_bytes": "--record-bytes",
    "queue_depths": "--queue-depths",
    "seconds": "--seconds",
}
_BENCH_FLAGS = re.compile(r"\b(" + "|".join(_BENCH_FLAG) + r")=")


def seconds_arg(text: str) -> float:
    """An argparse type: seconds per measured point, > 0 and at most ``MAX_SECONDS``."""
    v = positive_float(text)
    if v > MAX_SECONDS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give a number of seconds > 0 and at most {MAX_SECONDS:,}"
        )
    return v


def _cmd_bench_io(args: argparse.Namespace) -> int:
    from rowcache.tools.benchio import measure_io, profile_summary

    if args.out:
        check_writable("-o/--out", args.out)
    record = args.record_bytes
    if record is None:
        p = Path(args.path)
        if p.is_dir() and (p / "index.lmdb").exists():
            from rowcache.store.handle import RowStore

            store = RowStore.open(p)
            try:
                record = store.tables[0].record_bytes
            finally:
                store.close()
        else:
            record = 512
    try:
        prof = measure_io(
            args.path,
            record_bytes=record,
            queue_depths=args.queue_depths,
            seconds=args.seconds,
            direct=not args.buffered,
            progress=not args.no_progress,
        )
    except ConfigError as e:  # name the flags, not measure_io's arguments
        raise ConfigError(_BENCH_FLAGS.sub(lambda m: _BENCH_FLAG[m.group(1)] + " ", str(e))) from e
    if args.out:
        prof.save(args.out)
    if args.json:
        emit_json(prof.to_dict())
        return 0
    print(f"{prof.path}: {human_bytes(prof.file_bytes)}, O_DIRECT {'on' if prof.direct else 'off'}")
    print(
        f"{'row B':>7} {'read B':>7} {'qd':>4} {'reads/s':>12} {'MB/s':>9} "
        f"{'p50 µs':>8} {'p99 µs':>8}"
    )
    for row in profile_summary(prof):
        print(
            f"{row['read_bytes']:>7} {row['bytes_per_read']:>7} {row['queue_depth']:>4} "
            f"{row['reads_per_s']:>12,.0f} {row['MB_per_s']:>9.1f} "
            f"{format_cell(row['p50_us'], ',.0f', 8)} {format_cell(row['p99_us'], ',.0f', 8)}"
        )
    print(
        f"sequential: {prof.sequential_bytes_per_s / 1e6:,.1f} MB/s "
        "(MB/s = 10^6 bytes/s of bytes actually read; latency per read)"
    )
    for n in prof.notes:
        print(f"note: {n}")
    if args.out:
        inform(args, f"saved disk profile: {args.out}")
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "tune",
        help="split a memory budget across table arenas from profiled curves",
        description="Greedy on marginal gain over each table's curve; expected faults/token and "
        "fault I/O time per token from a bench-io disk profile. Sizes take binary units: "
        "12G = 12GiB = 12 x 2^30 bytes, as the report prints (12GB is refused as ambiguous). "
        "With only a target, the budget is the smallest arena that meets it; with a budget and "
        "a target (or a --memory that holds every table as FP8), the last line says which "
        "answer to use.",
    )
    p.add_argument("profile", help="JSON from `rowcache profile -o` (or --json)")
    p.add_argument(
        "--arena",
        type=positive_byte_size,
        metavar="SIZE",
        help="arena budget for all tables, e.g. 20GiB",
    )
    p.add_argument(
        "--memory",
        type=positive_byte_size,
        metavar="SIZE",
        help="machine memory, e.g. 121GiB (needs --reserve)",
    )
    p.add_argument(
        "--reserve",
        type=byte_size,
        metavar="SIZE",
        help="memory kept for weights and KV cache, e.g. 70GiB (0: budget all of --memory)",
    )
    p.add_argument(
        "--dtype",
        choices=("bf16", "fp8", "fp8_block_e8m0"),
        default=None,
        help="row format of the arenas (default: the profile's)",
    )
    p.add_argument("--disk", metavar="FILE", help="disk profile JSON from `rowcache bench-io -o`")
    add_deprecated(p, "--device", "--disk", "disk")  # --device means cpu/cuda elsewhere
    p.add_argument(
        "--queue-depth",
        type=int_in(1, MAX_QUEUE_DEPTH),
        default=None,
        help="reads in flight to assume (default: the disk profile's fastest)",
    )
    p.add_argument(
        "--target-rate",
        type=fraction,
        default=None,
        help="faults per access (all tables) to reach, in (0, 1]",
    )
    p.add_argument(
        "--target-seconds",
        type=positive_float,
        default=None,
        help="fault I/O seconds per token to reach (needs --disk)",
    )
    p.add_argument(
        "-o",
        "--out",
        metavar="FILE",
        help="also write the JSON report here (for from_pretrained(tune=...) and "
        "load_pretrained(tune=...))",
    )
    output_flags(p, "the report", progress=False)
    p.set_defaults(func=_cmd_tune)

    p = subparsers.add_parser(
        "bench-io",
        help="measure random-read rate vs queue depth and sequential rate; save a disk profile",
        description="Random reads of the row size (a whole 4 KiB page each under O_DIRECT) and "
        "of 4 KiB from --queue-depths threads, then sequential 4 MiB reads, on a store's "
        "largest shard or a directory's largest file or a file. Prints reads/s, MB/s of "
        "the bytes actually read, and latency p50/p99; warns when the file is too small "
        "for a fair test.",
    )
    p.add_argument("path", help="a store directory, any directory or a large file on the disk")
    p.add_argument(
        "--record-bytes",
        type=int_in(1, 1 << 26),
        default=None,
        help="row size in bytes (default: the store's, else 512: a LongCat BF16 row)",
    )
    p.add_argument(
        "--queue-depths",
        type=int_list_in(1, MAX_QUEUE_DEPTH),
        default="1,4,16,32,64",
        help="reads in flight to measure, comma separated",
    )
    p.add_argument(
        "--seconds",
        type=seconds_arg,
        default=1.0,
        help=f"seconds per measured point, at most {MAX_SECONDS:,} (each reading thread stops "
        "after its read in flight at the deadline)",
    )
    p.add_argument("--buffered", action="store_true", help="do not use O_DIRECT")
    p.add_argument(
        "-o",
        "--out",
        metavar="FILE",
        help="also write the disk profile JSON here (for `rowcache tune --disk`)",
    )
    output_flags(p, "the profile")
    p.set_defaults(func=_cmd_bench_io)
