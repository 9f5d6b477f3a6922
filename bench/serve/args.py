"""The serving judge's command line: its options and their checks (``--quick``'s sizes,
the device when not given, the profile's target), and the series each server runs
(:func:`series_depths`).

Every series is a configuration of the library's public options (``NgramEmbedding``'s
``defer_reads`` and ``cuda_graphs``, the cache's ``queue_depth`` and ``direct``); none
reaches into the cache's private state."""

from __future__ import annotations

import argparse
import os

from bench.serve.model import REST_MODELS


def parse(argv: list[str] | None, doc: str) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The parser and the checked options (``args.lookahead_list``: the lookahead depths;
    ``args.servers_on``: the servers run); errors exit with status 2, naming the flag."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--device", choices=("cuda", "cpu"), default=None, help="default: cuda if usable"
    )
    p.add_argument("--rows", default="auto", help="rows per table, or auto (disk and memory)")
    p.add_argument("--dtype", choices=("bf16", "fp8"), default="fp8")
    p.add_argument("--tokens", type=int, default=400_000, help="stdlib tokens to serve")
    p.add_argument("--tokens-npy", default=None, help="token ids to serve (--write-tokens)")
    p.add_argument(
        "--write-tokens",
        default=None,
        help="tokenize --history + --tokens tokens of the text into this .npy and exit",
    )
    p.add_argument("--max-request", type=int, default=2048, help="tokens a request at most")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk tokens")
    p.add_argument("--decode", type=int, default=256, help="decode tokens a request")
    p.add_argument("--b1-requests", type=int, default=4, help="requests of the decode x1 server")
    p.add_argument(
        "--servers",
        default="x64,x1",
        help="which servers run: x64 (64 slots), x1 (one slot), or both (default)",
    )
    p.add_argument(
        "--warm", type=float, default=0.3, help="untimed fraction of each server's steps"
    )
    p.add_argument(
        "--history",
        type=int,
        default=0,
        help="tokens of the text before the trace whose rows fill the arena first, as a\n"
        "server that has been serving (untimed; 0: the server starts cold)",
    )
    p.add_argument(
        "--rest",
        choices=sorted(REST_MODELS),
        default=None,
        help="rest-of-model times (default: h200 on cuda, unified-121GB on cpu)",
    )
    p.add_argument("--rest-scale", type=float, default=1.0, help="multiply the rest-of-model times")
    p.add_argument("--memory", default="121e9", help="the machine the arena is tuned for")
    p.add_argument(
        "--reserve",
        default="62e9",
        help="its memory for the rest: FP8 weights 37 GB + KV cache (64 x 8k tokens)"
        " ~17 GB + runtime 8 GB",
    )
    p.add_argument("--arena-bytes", default=None, help="arena budget instead of tune's")
    p.add_argument("--queue-depth", type=int, default=32, help="the cache's reads in flight")
    p.add_argument(
        "--lookahead-steps",
        default="1,64",
        help="steps ahead whose prefill chunks the lookahead series prefetch, one series\n"
        "per entry (default 1,64: one step ahead, then 64; at full size on the H200\n"
        "chunked prefill gave 0.75-0.77 at 16, 0.83 at 32, 0.80-0.83 at 64, where no\n"
        "prefill step waited: bench/RESULTS.md, fifteenth session)",
    )
    p.add_argument("--no-direct", action="store_true", help="page-cached reads, not O_DIRECT")
    p.add_argument("--check-every", type=int, default=16, help="compare outputs every N steps")
    p.add_argument(
        "--reread-steps",
        type=int,
        default=64,
        help="x64 steps of the re-read check (fresh pages vs this run's pages read again)",
    )
    p.add_argument("--workdir", default=None, help="keep (and reuse) the store here")
    p.add_argument("--quick", action="store_true", help="tiny sizes (CPU unless --device)")
    p.add_argument(
        "--profile",
        nargs="?",
        const="x1:cached",
        metavar="SERVER:SERIES[:KIND]",
        help="cProfile one series' host work a step (the embedding and prefetch calls) to "
        "stderr, e.g. x64:lookahead:prefill (KIND: decode or prefill; default every step); "
        "alone: x1:cached",
    )
    p.add_argument(
        "--deferred",
        action="store_true",
        help="also run the first lookahead series with steps that return while their\n"
        "rows are read (NgramEmbedding(defer_reads=True); the step settles after its\n"
        "rest of the model and prefetches are queued): series 'deferred'",
    )
    p.add_argument(
        "--interleave",
        type=int,
        default=64,
        metavar="STEPS",
        help="run a server's series in turns of this many steps, the order rotating, so\n"
        "that a shared machine's drift lands on every series alike (0: one series after\n"
        "the other). A turn ends, within as many steps again, where no prefill step is\n"
        "in a lookahead series' reach; else that series' prefetches not started wait for\n"
        "its next turn, and it pays the wait for the pieces being read",
    )
    p.add_argument(
        "--repeat-cached",
        action="store_true",
        help="run the cached series once more (series 'again'): the same steps and pages,\n"
        "so its ratio against the first shows the noise between series",
    )
    p.add_argument(
        "--decode-graphs",
        action="store_true",
        help="every series embeds its steps without a prefill chunk through CUDA graphs\n"
        "(NgramEmbedding(cuda_graphs=True) over the same tables and cache), as a server\n"
        "that captures its decode step; prefill steps stay eager",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--save",
        default=None,
        help="also write the JSON report to this file, with every timed step's record:\n"
        "(s, tokens, kind, hits, misses, fault s, prefetch wait s, embed call s, start,\n"
        "prefetch calls s)",
    )
    args = p.parse_args(argv)
    try:
        depths = [int(x) for x in args.lookahead_steps.split(",")]
    except ValueError:
        depths = [0]
    if min(depths) < 1 or len(set(depths)) != len(depths):
        p.error(
            f"--lookahead-steps {args.lookahead_steps!r}: give distinct integers >= 1, e.g. 1,3"
        )
    args.lookahead_list = depths
    servers_on = args.servers.split(",")
    if not servers_on or set(servers_on) - {"x64", "x1"} or len(set(servers_on)) != len(servers_on):
        p.error(f"--servers {args.servers!r}: give x64, x1 or x64,x1")
    if args.history < 0:
        p.error(f"--history {args.history}: give a token count >= 0")
    if args.tokens_npy is not None and not os.path.isfile(args.tokens_npy):
        p.error(f"--tokens-npy {args.tokens_npy}: no such file (write one with --write-tokens)")
    if args.quick:
        args.device = args.device or "cpu"
        args.rows, args.tokens, args.b1_requests = "6000", 40_000, 2
        args.rest_scale, args.max_request, args.check_every = 0.02, 256, 4
        args.chunk, args.decode = 64, 32
        args.history = min(args.history, 20_000)
    if args.device is None:
        try:
            import cupy

            args.device = "cuda" if cupy.cuda.is_available() else "cpu"
        except ImportError:
            args.device = "cpu"
    if args.interleave < 0:
        p.error(f"--interleave {args.interleave}: give steps a turn, or 0 for none")
    if args.profile is not None:
        parts = args.profile.split(":")
        kinds = ([], ["decode"], ["prefill"])  # none: every step
        if len(parts) not in (2, 3) or parts[0] not in servers_on or parts[2:] not in kinds:
            p.error(
                f"--profile {args.profile!r}: give SERVER:SERIES[:KIND], SERVER one of "
                f"--servers ({args.servers}), KIND decode or prefill, e.g. x64:lookahead:prefill"
            )
        runs = series_depths(args, parts[0], depths)
        if parts[1] not in runs:
            p.error(
                f"--profile: server {parts[0]} runs no series {parts[1]!r}; its series: "
                + ", ".join(runs)
            )
        args.profile = (" " + parts[0], parts[1], parts[2] if len(parts) == 3 else None)
    if args.decode_graphs and args.device != "cuda":
        p.error(f"--decode-graphs needs --device cuda (CUDA graphs), not {args.device}")
    args.servers_on = servers_on
    return p, args


def series_depths(args: argparse.Namespace, server: str, depths: list[int]) -> dict[str, int]:
    """The cached series ``server`` ("x64" or "x1") runs beside the resident one, each with
    how many steps ahead it prefetches prefill chunks (0: none): cached, lookahead (the
    first depth), lookaheadD for each further depth (the 64-slot server only: the one-slot
    server's prefill steps are too few to matter), again (--repeat-cached) and deferred
    (--deferred: ``NgramEmbedding(defer_reads=True)``, the first depth)."""
    runs = {"cached": 0, "lookahead": depths[0]}
    if server == "x64":
        runs.update((f"lookahead{d}", d) for d in depths[1:])
    if args.repeat_cached:
        runs["again"] = 0
    if args.deferred:
        runs["deferred"] = depths[0]
    return runs
