"""Token-overlay cost on a decode step, against the LM-head GEMM of the same batch.

Claim (issue 5): on the GPU, with a decode batch of 64 rows routed over 4 adapters of
1,000 overridden rows each (embedding and LM head), vocab 131,072 and hidden 3,072,
``TokenOverlay.apply_embed`` + ``apply_lmhead`` take at most 5% of the bf16 LM-head
GEMM ``[64, 3072] x [3072, 131072]`` measured in the same run. Timing: CUDA events,
L2 flushed before each rep (by reading 256 MB: L2 then holds clean lines only, as after
the LM-head GEMM's weight reads; ``--flush write`` fills the buffer instead, which leaves
L2 full of dirty lines that every cold read must first write back, roughly doubling the
HBM traffic of a small kernel; the headline graph figure is given for both), warmup,
median. The three LM-head paths are timed ("warp":
the warp-per-(row, j) kernels, every tile; "gemm": one cuBLAS GEMM against all
adapters' packed rows + a routed scatter; "mma": one tensor-core kernel over the packed
rows, every config), checked against each other, and the overlay is timed called from
Python (eager: includes launch and validation overhead) and replayed from a CUDA graph
captured around both calls (how a decode step runs), per path; the ratio takes the
fastest graph. A sweep over smaller batches shows where each path wins.
Without a GPU the script runs the CPU path (NumPy references; float32 GEMM baseline,
NumPy has no bf16 GEMM) at a small size and says so.

    python -m bench.overlay            # the claim's sizes on a GPU
    python -m bench.overlay --quick    # small and fast (the test suite runs this)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rowcache.embed.overlay.overlay import TokenOverlay
from rowcache.kernels import gpu_available
from rowcache.kernels.overlay.routed import GEMM_MIN_ROWS, LMHEAD_TILES, MMA_CONFIGS
from rowcache.kernels.reference import BF16

TARGET = 0.05


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=None, help="decode rows (default 64)")
    p.add_argument("--adapters", type=int, default=None, help="adapters (default 4)")
    p.add_argument("--overrides", type=int, default=None, help="rows per adapter (default 1000)")
    p.add_argument("--vocab", type=int, default=None, help="GPU 131072, CPU 16384")
    p.add_argument("--hidden", type=int, default=None, help="GPU 3072, CPU 1024")
    p.add_argument("--logits", choices=("bf16", "f32"), default="bf16")
    p.add_argument("--reps", type=int, default=None, help="timed reps (GPU 50, CPU 5)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument(
        "--flush",
        choices=("read", "write", "none"),
        default="read",
        help="how L2 is flushed before each rep (GPU): read or fill a 256 MB buffer, or not",
    )
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--quick", action="store_true", help="small sizes, few reps")
    p.add_argument("--json", action="store_true", help="print the result as JSON too")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if gpu_available() else "cpu"
    gpu = args.device == "cuda"
    quick = args.quick
    defaults = {
        "batch": 8 if quick and not gpu else 64,
        "adapters": 2 if quick and not gpu else 4,
        "overrides": 20 if quick and not gpu else 1000,
        "vocab": (32_768 if quick else 131_072) if gpu else (2048 if quick else 16_384),
        "hidden": 3072 if gpu else (64 if quick else 1024),
        "reps": (10 if quick else 50) if gpu else (3 if quick else 5),
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.overrides > args.vocab:
        p.error(f"--overrides ({args.overrides}) cannot exceed --vocab ({args.vocab})")
    if quick:
        args.warmup = min(args.warmup, 2)
    return args


def _report(args: argparse.Namespace, res: dict[str, Any]) -> None:
    print(f"{'what':<54}{'ms':>10}")
    print("-" * 64)
    path = f", {res['lmhead_path']} path" if "lmhead_path" in res else ""
    for key, label in [
        ("embed_ms", "apply_embed (eager)"),
        ("lmhead_warp_ms", f"apply_lmhead warp kernels (eager, tile {res.get('lmhead_tile')})"),
        ("lmhead_gemm_ms", "apply_lmhead GEMM path (eager)"),
        ("lmhead_mma_ms", f"apply_lmhead mma path (eager, config {res.get('lmhead_mma_config')})"),
        ("lmhead_graph_warp_ms", "apply_lmhead alone (graph, warp)"),
        ("lmhead_graph_gemm_ms", "apply_lmhead alone (graph, GEMM)"),
        ("lmhead_graph_mma_ms", "apply_lmhead alone (graph, mma)"),
        ("lmhead_ms", f"apply_lmhead (eager{path})"),
        ("overlay_eager_ms", f"apply_embed + apply_lmhead (eager{path})"),
        ("overlay_graph_warp_ms", "apply_embed + apply_lmhead (graph, warp)"),
        ("overlay_graph_gemm_ms", "apply_embed + apply_lmhead (graph, GEMM)"),
        ("overlay_graph_mma_ms", "apply_embed + apply_lmhead (graph, mma)"),
        ("overlay_graph_ms", f"apply_embed + apply_lmhead (CUDA graph{path})"),
        ("gemm_ms", f"baseline: LM-head GEMM ({res['gemm_dtype']})"),
    ]:
        if res.get(key) is not None:
            print(f"{label:<54}{res[key]:>10.4f}")
    print(
        f"ratio = overlay / GEMM = {res['ratio']:.4f} ({res['ratio_basis']}); "
        f"target <= {TARGET:.2f}: {'met' if res['ratio'] <= TARGET else 'NOT met'}"
    )
    if res.get("ratio_eager") is not None:
        print(f"eager ratio = {res['ratio_eager']:.4f}")
    if res.get("ratio_by_path"):
        print("ratio by LM-head path (graph): " + ", ".join(
            f"{p} {r:.4f}" for p, r in res["ratio_by_path"].items()))  # fmt: skip
    if args.json:
        print(json.dumps(res, sort_keys=True))


def _adapter_rows(rng: np.random.Generator, args: argparse.Namespace) -> list[np.ndarray]:
    return [
        np.sort(rng.choice(args.vocab, size=args.overrides, replace=False))
        for _ in range(args.adapters)
    ]


def _decode_inputs(
    rng: np.random.Generator, args: argparse.Namespace, changed: list[np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """Per row: its adapter (round robin) and a token id, half of them overridden ones."""
    slots = (np.arange(args.batch) % args.adapters).astype(np.int32)
    ids = rng.integers(0, args.vocab, size=args.batch)
    pick = rng.random(args.batch) < 0.5
    ids[pick] = [rng.choice(changed[s]) for s in slots[pick]]
    return ids, slots


# --- GPU ------------------------------------------------------------------------------
def run_gpu(args: argparse.Namespace) -> dict[str, Any]:
    import cupy as cp

    print(f"device: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    rng = np.random.default_rng(args.seed)
    V, H, B = args.vocab, args.hidden, args.batch
    fill = cp.ElementwiseKernel(
        "uint64 seed",
        "T y",
        "y = (T)(((unsigned long long)i * 0x9E3779B97F4A7C15ull + seed) >> 40)",
    )

    def random_bf16(shape: tuple[int, ...], seed: int) -> Any:
        a = cp.empty(shape, dtype=BF16)
        u = a.view(cp.uint16)
        fill(np.uint64(seed), u)
        u &= 0xBFFF  # |x| < 2, no NaN or inf bit patterns
        return a

    served_embed = random_bf16((V, H), args.seed * 10 + 1)
    served_head = random_bf16((V, H), args.seed * 10 + 2)
    ov = TokenOverlay(V, H, args.adapters, device="cuda")
    changed = _adapter_rows(rng, args)
    for s, rows in enumerate(changed):
        d_rows = cp.asarray(rows)
        ae = served_embed.view(cp.uint16).copy()  # copies of plain integers (bit copies)
        ae[d_rows] ^= 1  # flip a mantissa bit of each overridden row
        ah = served_head.view(cp.uint16).copy()
        ah[d_rows] ^= 1
        info = ov.set_adapter(
            s, embed_weight=ae.view(BF16), lm_head_weight=ah.view(BF16),
            served_embed=served_embed, served_lm_head=served_head,
        )  # fmt: skip
        assert info.embed_ids.size == info.lm_head_ids.size == args.overrides
        del ae, ah
    head_t = cp.ascontiguousarray(served_head.view(cp.uint16).T).view(BF16)  # [H, V]
    ids_h, slots_h = _decode_inputs(rng, args, changed)
    ids, slots = cp.asarray(ids_h), cp.asarray(slots_h)
    hidden = random_bf16((B, H), args.seed * 10 + 3)
    word_rows = served_embed.view(cp.uint16)[ids].view(BF16)
    rows = word_rows.view(cp.uint16).copy().view(BF16)
    logit_dtype = BF16 if args.logits == "bf16" else np.float32
    logits = cp.zeros((B, V), dtype=logit_dtype)
    # The overlay must change exactly the rows whose id its adapter overrides.
    ov.apply_embed(ids, rows, seq_slot=slots)
    n_changed = int((rows.view(cp.uint16) != word_rows.view(cp.uint16)).any(axis=1).sum())
    n_expected = int(
        sum(np.isin(ids_h[slots_h == s], changed[s]).sum() for s in range(args.adapters))
    )
    if n_changed != n_expected:
        raise SystemExit(f"apply_embed changed {n_changed} rows, expected {n_expected}")

    flush = cp.ones(256 << 20, dtype=cp.uint8)  # larger than the H200's 50 MB L2
    flush_words = flush.view(cp.uint64)
    sink = cp.zeros((), dtype=cp.uint64)
    stream = cp.cuda.Stream(non_blocking=True)

    def median_ms(fn: Callable[[], Any], flush_mode: str | None = None) -> float:
        mode = flush_mode or args.flush
        with stream:
            for _ in range(args.warmup):
                fn()
            times = []
            start, end = cp.cuda.Event(), cp.cuda.Event()
            for i in range(args.reps):
                if mode == "write":
                    flush.fill(i & 0xFF)
                elif mode == "read":
                    cp.sum(flush_words, out=sink)
                start.record(stream)
                fn()
                end.record(stream)
                end.synchronize()
                times.append(cp.cuda.get_elapsed_time(start, end))
        return float(np.median(times))

    def step() -> None:
        ov.apply_embed(ids, rows, seq_slot=slots)
        ov.apply_lmhead(hidden, logits, seq_slot=slots)

    def capture(fn: Callable[[], Any]) -> Any:
        with stream:
            stream.begin_capture()
            try:
                fn()
            except BaseException:
                with contextlib.suppress(Exception):
                    stream.end_capture()  # leave capture mode before reporting the error
                raise
            return stream.end_capture()

    def graph_ms(fn: Callable[[], Any]) -> float:
        with stream:
            fn()  # eagerly once first (allocations, cuBLAS's kernel choice)
        graph = capture(fn)
        return median_ms(functools.partial(graph.launch, stream))

    res: dict[str, Any] = {"gemm_dtype": "bf16 cuBLAS"}
    res["embed_ms"] = median_ms(lambda: ov.apply_embed(ids, rows, seq_slot=slots))
    # LM-head tile sweep: every tile must give the same bits; the fastest is kept.
    ov.lmhead_path = "warp"
    tiles: dict[str, float] = {}
    first = None
    for tile in LMHEAD_TILES:
        ov.lmhead_tile = tile
        logits.view(cp.uint8).fill(0)
        ov.apply_lmhead(hidden, logits, seq_slot=slots)
        bits = logits.view(cp.uint8)
        if first is None:
            first = bits.copy()
        elif not bool(cp.array_equal(bits, first)):
            raise SystemExit(f"LM-head tile {tile} disagrees with tile {LMHEAD_TILES[0]}")
        tiles[f"{tile[0]}x{tile[1]}"] = median_ms(
            lambda: ov.apply_lmhead(hidden, logits, seq_slot=slots)
        )
    best = min(tiles, key=tiles.__getitem__)
    ov.lmhead_tile = LMHEAD_TILES[list(tiles).index(best)]
    res["lmhead_tiles_ms"], res["lmhead_tile"] = tiles, best
    print("apply_lmhead by tile (overrides x rows per warp): "
          + ", ".join(f"{k} {v:.4f} ms" for k, v in tiles.items()))  # fmt: skip
    res["lmhead_warp_ms"] = tiles[best]
    assert first is not None

    def as_f32(a: Any) -> Any:  # bit-exact widening, without relying on cupy's bf16 casts
        if a.dtype == np.float32:
            return a.copy()
        return (a.view(cp.uint16).astype(cp.uint32) << 16).view(cp.float32)

    warp_logits = as_f32(first.view(logit_dtype))
    # The GEMM path: same logits to float32 rounding of the sums (then one bf16 step).
    ov.lmhead_path = "gemm"
    logits.view(cp.uint8).fill(0)
    ov.apply_lmhead(hidden, logits, seq_slot=slots)
    got = as_f32(logits)
    bound = 2.0**-7 * cp.abs(warp_logits) + 4.0 * H * 2.0**-16  # |h|, |w| < 2
    bad = int((cp.abs(got - warp_logits) > bound).sum())
    if bad:
        raise SystemExit(f"the GEMM path disagrees with the warp kernels on {bad} logits")
    res["lmhead_gemm_ms"] = median_ms(lambda: ov.apply_lmhead(hidden, logits, seq_slot=slots))
    print(f"apply_lmhead GEMM path: {res['lmhead_gemm_ms']:.4f} ms "
          f"(packed table {ov.lmhead_capacity[0]} rows)")  # fmt: skip
    # The mma path: every config checked against the warp kernels, the fastest kept.
    ov.lmhead_path = "mma"
    configs: dict[str, float] = {}
    for config in MMA_CONFIGS:
        ov.lmhead_mma_config = config
        logits.view(cp.uint8).fill(0)
        ov.apply_lmhead(hidden, logits, seq_slot=slots)
        bad = int((cp.abs(as_f32(logits) - warp_logits) > bound).sum())
        if bad:
            raise SystemExit(
                f"the mma path {config} disagrees with the warp kernels on {bad} logits"
            )
        # replayed from a graph: the kernel's time, without Python's launch overhead
        configs[str(config)] = graph_ms(lambda: ov.apply_lmhead(hidden, logits, seq_slot=slots))
    best_mma = min(configs, key=configs.__getitem__)
    ov.lmhead_mma_config = MMA_CONFIGS[list(configs).index(best_mma)]
    res["lmhead_mma_configs_graph_ms"], res["lmhead_mma_config"] = configs, best_mma
    res["lmhead_mma_ms"] = median_ms(lambda: ov.apply_lmhead(hidden, logits, seq_slot=slots))
    print("apply_lmhead mma path by config (tiles, warps, stages; graph): "
          + ", ".join(f"{k} {v:.4f} ms" for k, v in configs.items()))  # fmt: skip
    paths = {
        "warp": res["lmhead_warp_ms"],
        "gemm": res["lmhead_gemm_ms"],
        "mma": res["lmhead_mma_ms"],
    }
    res["lmhead_path"] = min(paths, key=paths.__getitem__)
    res["lmhead_ms"] = paths[res["lmhead_path"]]
    ov.lmhead_path = res["lmhead_path"]
    res["overlay_eager_ms"] = median_ms(step)
    graphs: dict[str, float] = {}
    for path in ("warp", "gemm", "mma"):
        ov.lmhead_path = path
        step()  # eager once on this path before capturing it
        try:
            graph = capture(step)
            graphs[path] = median_ms(functools.partial(graph.launch, stream))
            res[f"overlay_graph_{path}_ms"] = graphs[path]
            res[f"lmhead_graph_{path}_ms"] = graph_ms(
                lambda: ov.apply_lmhead(hidden, logits, seq_slot=slots)
            )
        except Exception as exc:  # a failed capture leaves the eager figure as the claim's
            print(f"CUDA graph capture of the {path} path failed ({type(exc).__name__}: {exc})")
    # Floors to read those figures against: a graph of one tiny kernel (what timing a
    # replay costs), the mma path with no row routed (launch and routing only), and a
    # device copy of as many bytes as the routed adapters' rows (HBM read + write).
    res["graph_floor_ms"] = graph_ms(lambda: sink.fill(0))
    unrouted = cp.full(B, -1, dtype=cp.int32)
    ov.lmhead_path = "mma"
    res["lmhead_graph_mma_unrouted_ms"] = graph_ms(
        lambda: ov.apply_lmhead(hidden, logits, seq_slot=unrouted)
    )
    nbytes = len(set(slots_h.tolist())) * args.overrides * H * 2
    src, dst = cp.ones(nbytes, dtype=cp.uint8), cp.empty(nbytes, dtype=cp.uint8)
    res["copy_rows_ms"] = graph_ms(lambda: cp.copyto(dst, src))
    print(f"floors (graph): one tiny kernel {res['graph_floor_ms']:.4f} ms, mma path with no "
          f"row routed {res['lmhead_graph_mma_unrouted_ms']:.4f} ms, copy of "
          f"{nbytes / 1e6:.1f} MB {res['copy_rows_ms']:.4f} ms")  # fmt: skip
    res["overlay_graph_ms"] = None
    if graphs:
        res["lmhead_path"] = min(graphs, key=graphs.__getitem__)
        res["overlay_graph_ms"] = graphs[res["lmhead_path"]]
        res["lmhead_ms"] = paths[res["lmhead_path"]]
    # Where each path wins: apply_lmhead over smaller batches (same rows' prefix), eager
    # and replayed from a graph (the kernels' own time).
    sweep: dict[str, dict[str, float]] = {}
    sweep_graph: dict[str, dict[str, float | None]] = {}
    paths3 = ("warp", "gemm", "mma")
    for b in sorted({1, 2, 4, 8, GEMM_MIN_ROWS, 16, 32, B} & set(range(1, B + 1))):
        h_b, l_b, s_b = hidden[:b], logits[:b], slots[:b]
        sweep[str(b)], sweep_graph[str(b)] = {}, {}
        for path in paths3:
            ov.lmhead_path = path
            fn = functools.partial(ov.apply_lmhead, h_b, l_b, seq_slot=s_b)
            sweep[str(b)][path] = median_ms(fn)
            try:
                sweep_graph[str(b)][path] = graph_ms(fn)
            except Exception:
                sweep_graph[str(b)][path] = None
    res["lmhead_batch_sweep_ms"] = sweep
    res["lmhead_batch_sweep_graph_ms"] = sweep_graph

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.4f}"

    for name, table in (("eager", sweep), ("graph", sweep_graph)):
        print(f"apply_lmhead by batch ({name}; warp | GEMM | mma, ms): " + ", ".join(
            f"{b}: " + " | ".join(fmt(v[p]) for p in paths3)
            for b, v in table.items()))  # fmt: skip
    if res.get("lmhead_graph_mma_ms"):
        routed = len(set(slots_h.tolist()))
        mb = routed * args.overrides * H * 2 / 1e6
        res["mma_read_tb_s"] = mb / 1e6 / (res["lmhead_graph_mma_ms"] / 1e3)
        print(f"mma path: {mb:.1f} MB of override rows in {res['lmhead_graph_mma_ms']:.4f} ms "
              f"(graph) = {res['mma_read_tb_s']:.2f} TB/s")  # fmt: skip
    ov.lmhead_path = "auto"
    res["gemm_ms"] = median_ms(lambda: hidden @ head_t)
    # The headline figures under the other flush too (see the module docstring).
    other = "read" if args.flush == "write" else "write"
    if res["overlay_graph_ms"] is not None:
        ov.lmhead_path = res["lmhead_path"]
        graph = capture(step)
        o_ms = median_ms(functools.partial(graph.launch, stream), other)
        g_ms = median_ms(lambda: hidden @ head_t, other)
        res[f"{other}_flush"] = {"overlay_graph_ms": o_ms, "gemm_ms": g_ms, "ratio": o_ms / g_ms}
        print(f"with the {other} flush: overlay (graph, {res['lmhead_path']}) {o_ms:.4f} ms, "
              f"GEMM {g_ms:.4f} ms, ratio {o_ms / g_ms:.4f}")  # fmt: skip
        ov.lmhead_path = "auto"
    return res


# --- CPU ------------------------------------------------------------------------------
def run_cpu(args: argparse.Namespace) -> dict[str, Any]:
    print("no GPU (or --device cpu): timing the CPU path (NumPy references) at a small size")
    rng = np.random.default_rng(args.seed)
    V, H, B = args.vocab, args.hidden, args.batch

    def random_bf16(shape: tuple[int, ...]) -> np.ndarray:
        return (rng.integers(0, 1 << 16, size=shape, dtype=np.uint16) & 0xBFFF).view(BF16)

    served_embed, served_head = random_bf16((V, H)), random_bf16((V, H))
    ov = TokenOverlay(V, H, args.adapters)
    changed = _adapter_rows(rng, args)
    for s, rows in enumerate(changed):
        ae, ah = served_embed.copy(), served_head.copy()
        ae.view(np.uint16)[rows] ^= 1
        ah.view(np.uint16)[rows] ^= 1
        ov.set_adapter(
            s, embed_weight=ae, lm_head_weight=ah, served_embed=served_embed,
            served_lm_head=served_head,
        )  # fmt: skip
    ids, slots = _decode_inputs(rng, args, changed)
    hidden = random_bf16((B, H))
    rows = served_embed[ids]
    logits = np.zeros((B, V), dtype=BF16 if args.logits == "bf16" else np.float32)
    hidden32, head32_t = hidden.astype(np.float32), served_head.astype(np.float32).T.copy()

    def median_ms(fn: Callable[[], Any]) -> float:
        for _ in range(args.warmup):
            fn()
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return float(np.median(times))

    res: dict[str, Any] = {"gemm_dtype": "float32 NumPy"}
    res["embed_ms"] = median_ms(lambda: ov.apply_embed(ids, rows, seq_slot=slots))
    res["lmhead_ms"] = median_ms(lambda: ov.apply_lmhead(hidden, logits, seq_slot=slots))
    res["overlay_eager_ms"] = median_ms(
        lambda: (
            ov.apply_embed(ids, rows, seq_slot=slots),
            ov.apply_lmhead(hidden, logits, seq_slot=slots),
        )
    )
    res["gemm_ms"] = median_ms(lambda: hidden32 @ head32_t)
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns the figures (ms), the ratio and the settings."""
    args = parse_args(argv)
    print(
        f"bench/overlay.py: device={args.device} batch={args.batch} adapters={args.adapters} "
        f"overrides={args.overrides}/adapter vocab={args.vocab:,} hidden={args.hidden} "
        f"logits={args.logits} reps={args.reps} warmup={args.warmup} flush={args.flush}"
    )
    if args.device == "cuda":
        if not gpu_available():
            raise SystemExit("--device cuda was asked for but no CUDA GPU is usable here")
        res = run_gpu(args)
    else:
        res = run_cpu(args)
    overlay = res.get("overlay_graph_ms") or res["overlay_eager_ms"]
    path = f", {res['lmhead_path']} LM-head path" if "lmhead_path" in res else ""
    res["ratio_basis"] = ("CUDA graph" if res.get("overlay_graph_ms") else "eager") + path
    res["ratio"] = overlay / res["gemm_ms"]
    res["ratio_by_path"] = {
        p: res[f"overlay_graph_{p}_ms"] / res["gemm_ms"]
        for p in ("warp", "gemm", "mma")
        if res.get(f"overlay_graph_{p}_ms")
    }
    res["ratio_eager"] = res["overlay_eager_ms"] / res["gemm_ms"]
    res["overlay_s"] = overlay / 1e3
    res["settings"] = {k: v for k, v in vars(args).items() if k != "json"}
    _report(args, res)
    return res


if __name__ == "__main__":
    main()
    sys.exit(0)
