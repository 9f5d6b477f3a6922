"""Gather kernels against fancy indexing: effective GB/s of batched_embed and batched_embed_fp8.

Claim: on the GPU, ``rowcache.kernels.batched_embed`` gathers bf16 rows at least as fast as
cupy's fancy index ``table[ids]`` measured in the same run, and ``batched_embed_fp8``
(codes + scale in, dequantized bf16 out) is compared with both ``codes[ids]`` and the
bf16 fancy index. Timing: CUDA events around each call, L2 flushed before each rep,
warmup, median. Without a GPU the script runs the NumPy references at a small size
and says so. Effective bytes = bytes read (rows, scales, ids) + bytes written.

    python -m bench.gather_kernels            # 10M-row table, batches of 768 and 24,576 rows
    python -m bench.gather_kernels --quick    # small and fast (the test suite runs this)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import rowcache.kernels
from rowcache.kernels.reference import BF16


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=None, help="table rows (GPU 10M, CPU 200k)")
    p.add_argument("--dim", type=int, default=256, help="row width in values (default 256)")
    p.add_argument(
        "--batch",
        type=int,
        action="append",
        default=None,
        help="rows gathered per call; repeatable (default 768 and 24576)",
    )
    p.add_argument("--reps", type=int, default=None, help="timed reps per case (GPU 50, CPU 10)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls first (default 5)")
    p.add_argument("--device", choices=("auto", "gpu", "cpu"), default="auto")
    p.add_argument("--quick", action="store_true", help="small table, few reps")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "gpu" if rowcache.kernels.gpu_available() else "cpu"
    gpu = args.device == "gpu"
    if args.rows is None:
        args.rows = (
            (1_000_000 if gpu else 20_000) if args.quick else (10_000_000 if gpu else 200_000)
        )
    if args.batch is None:
        args.batch = [768, 2048] if args.quick and not gpu else [768, 24_576]
    if args.reps is None:
        args.reps = (10 if gpu else 3) if args.quick else (50 if gpu else 10)
    if args.quick:
        args.warmup = min(args.warmup, 2)
    for name in ("rows", "dim", "reps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if any(b < 1 for b in args.batch):
        p.error(f"--batch must be at least 1, got {args.batch}")
    return args


def _bytes(n: int, d: int) -> dict[str, int]:
    ids = 8 * n
    return {
        "bf16": 2 * (2 * n * d) + ids,  # rows read + rows written
        "fp8": n * d + 4 * n + 2 * n * d + ids,  # codes + scales read, bf16 written
        "codes": 2 * n * d + ids,  # uint8 rows read + written
    }


def _report(rows: list[tuple[str, int, float, int, str, float, int]]) -> None:
    head = f"{'kernel':<20}{'batch':>8}{'ms':>10}{'GB/s':>9}   {'baseline':<22}{'ms':>10}{'GB/s':>9}{'speedup':>9}"
    print(head)
    print("-" * len(head))
    for name, n, ms, nbytes, base, base_ms, base_bytes in rows:
        gbs, base_gbs = nbytes / ms / 1e6, base_bytes / base_ms / 1e6
        print(
            f"{name:<20}{n:>8}{ms:>10.4f}{gbs:>9.1f}   {base:<22}{base_ms:>10.4f}{base_gbs:>9.1f}"
            f"{base_ms / ms:>8.2f}x"
        )


# --- GPU ------------------------------------------------------------------------------


def _gpu_timer(cp: Any, reps: int, warmup: int) -> Callable[[Callable[[], Any]], float]:
    flush = cp.empty(256 << 20, dtype=cp.uint8)  # larger than the H200's 50 MB L2

    def median_ms(fn: Callable[[], Any]) -> float:
        for _ in range(warmup):
            fn()
        times = []
        start, end = cp.cuda.Event(), cp.cuda.Event()
        for i in range(reps):
            flush.fill(i & 0xFF)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end))
        return float(np.median(times))

    return median_ms


def run_gpu(args: argparse.Namespace) -> None:
    import cupy as cp

    rows, d = args.rows, args.dim
    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())["name"]
    print(f"device: {name.decode() if isinstance(name, bytes) else name}")
    fill = cp.ElementwiseKernel(
        "uint64 seed",
        "T y",
        "y = (T)(((unsigned long long)i * 0x9E3779B97F4A7C15ull + seed) >> 40)",
    )
    table = cp.empty((rows, d), dtype=BF16)
    table_u16 = table.view(cp.uint16)  # same bytes; fancy indexing of plain integers
    fill(np.uint64(args.seed), table_u16)
    table_u16 &= 0x3FFF  # finite values: no NaN or inf bit patterns
    codes = cp.empty((rows, d), dtype=cp.uint8)
    fill(np.uint64(args.seed + 1), codes)
    codes &= 0xF7  # no NaN codes (0x7f, 0xff)
    gen = cp.random.RandomState(args.seed)
    scales = gen.random_sample(rows, dtype=np.float32) + np.float32(0.5)
    median_ms = _gpu_timer(cp, args.reps, args.warmup)
    results = []
    for n in args.batch:
        ids = gen.randint(0, rows, size=n, dtype=np.int64)
        out = cp.empty((n, d), dtype=BF16)
        rowcache.kernels.batched_embed(ids, table, out)
        if not bool(cp.array_equal(out.view(cp.uint16), table_u16[ids])):
            raise SystemExit("batched_embed disagrees with table[ids]: not timing a wrong kernel")
        nb = _bytes(n, d)
        t_bf16 = median_ms(lambda ids=ids, out=out: rowcache.kernels.batched_embed(ids, table, out))
        t_take = median_ms(lambda ids=ids: table_u16[ids])
        t_fp8 = median_ms(
            lambda ids=ids, out=out: rowcache.kernels.batched_embed_fp8(ids, codes, scales, out)
        )
        t_codes = median_ms(lambda ids=ids: codes[ids])
        results += [
            ("batched_embed", n, t_bf16, nb["bf16"], "table[ids] (bf16)", t_take, nb["bf16"]),
            ("batched_embed_fp8", n, t_fp8, nb["fp8"], "codes[ids] (uint8)", t_codes, nb["codes"]),
            ("batched_embed_fp8", n, t_fp8, nb["fp8"], "table[ids] (bf16)", t_take, nb["bf16"]),
        ]
    _report(results)
    print("speedup = baseline ms / kernel ms, same ids, same run; L2 flushed before each rep")


# --- CPU ------------------------------------------------------------------------------


def _cpu_median_ms(fn: Callable[[], Any], reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def run_cpu(args: argparse.Namespace) -> None:
    print("no GPU (or --device cpu): timing the NumPy references, the CPU path, at a small size")
    rng = np.random.default_rng(args.seed)
    rows, d = args.rows, args.dim
    table = (rng.integers(0, 0x3FFF, size=(rows, d), dtype=np.uint16)).view(BF16)
    codes = rng.integers(0, 0x7F, size=(rows, d), dtype=np.uint8)
    scales = rng.random(rows, dtype=np.float32) + np.float32(0.5)
    results = []
    for n in args.batch:
        ids = rng.integers(0, rows, size=n)
        out = np.empty((n, d), dtype=BF16)
        nb = _bytes(n, d)
        t_bf16 = _cpu_median_ms(
            lambda ids=ids, out=out: rowcache.kernels.batched_embed(ids, table, out),
            args.reps,
            args.warmup,
        )
        t_take = _cpu_median_ms(lambda ids=ids: table[ids], args.reps, args.warmup)
        t_fp8 = _cpu_median_ms(
            lambda ids=ids, out=out: rowcache.kernels.batched_embed_fp8(ids, codes, scales, out),
            args.reps,
            args.warmup,
        )
        t_codes = _cpu_median_ms(lambda ids=ids: codes[ids], args.reps, args.warmup)
        results += [
            ("batched_embed", n, t_bf16, nb["bf16"], "table[ids] (bf16)", t_take, nb["bf16"]),
            ("batched_embed_fp8", n, t_fp8, nb["fp8"], "codes[ids] (uint8)", t_codes, nb["codes"]),
        ]
    _report(results)
    print("speedup = baseline ms / reference ms (numpy fancy index), same ids, same run")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(
        f"bench.gather_kernels: device={args.device} rows={args.rows:,} dim={args.dim} "
        f"batches={args.batch} reps={args.reps} warmup={args.warmup}"
    )
    if args.device == "gpu":
        if not rowcache.kernels.gpu_available():
            print("--device gpu was asked for but no CUDA GPU is usable here", file=sys.stderr)
            return 2
        run_gpu(args)
    else:
        run_cpu(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
