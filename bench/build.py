"""Builder throughput vs writing the same bytes sequentially with plain file writes.

Target: build_store (bf16) >= 0.7x the plain-write rate. Both include fsync; the
source is a bf16 .npy read through the page cache by both.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rowcache
from bench._common import make_source, report


def plain_write(src: str, dst: str, chunk: int = 32 << 20) -> float:
    a = np.load(src, mmap_mode="r")
    flat = a.reshape(-1).view(np.uint8)
    t0 = time.perf_counter()
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for start in range(0, flat.size, chunk):
            mv = memoryview(np.ascontiguousarray(flat[start : start + chunk]).data)
            while mv:
                mv = mv[os.write(fd, mv) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=4_000_000, help="rows of the table (dim 256, bf16)")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--dir", default=None, help="working directory (default: a temp dir)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for the test suite")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.rows, args.repeat = 20_000, 1
    work = args.dir or tempfile.mkdtemp(prefix="rowcache-bench-build-")
    os.makedirs(work, exist_ok=True)
    src = make_source(os.path.join(work, "src.npy"), args.rows, args.dim)
    nbytes = args.rows * args.dim * 2
    np.load(src, mmap_mode="r").sum(
        dtype=np.float64
    )  # warm the source into the page cache for both
    rows = []
    for dtype in ("bf16", "fp8"):
        t_build, t_plain = [], []
        for _ in range(args.repeat):
            t_plain.append(plain_write(src, os.path.join(work, "plain.bin")))
            t0 = time.perf_counter()
            rowcache.build_store(
                os.path.join(work, "store"), [src], dtype=dtype, overwrite=True, progress=False
            )
            t_build.append(time.perf_counter() - t0)
        b, p = float(np.median(t_build)), float(np.median(t_plain))
        rows.append(
            {
                "dtype": dtype,
                "source_MB": nbytes / 1e6,
                "build_GB_s": nbytes / b / 1e9,
                "plain_write_GB_s": nbytes / p / 1e9,
                "ratio": p / b,
                "target": ">=0.7" if dtype == "bf16" else "-",
            }
        )
    report(
        "bench/build.py: builder vs plain sequential write",
        rows,
        args.json,
        {"rows": args.rows, "dim": args.dim, "repeat": args.repeat},
    )
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
