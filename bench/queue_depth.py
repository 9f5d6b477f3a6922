"""The disk's floor against the queue depth, for step-sized batches of random 4 KiB reads.

Which queue depth should the row cache fault and prefetch with? A step's batch of random
pages (a decode x64 step faults ~100, a prefill step of ~2,000 tokens ~4,000) is read by
``bench/floor.c`` (compiled here with gcc; no Python in the loop) from a file of
``--gb`` GB written here, by io_uring at queue depth N and by N threads of blocking
``pread``. Every batch reads pages that no earlier batch of this run read, so a virtual
disk that caches re-reads beneath the guest (bench/RESULTS.md, ninth session) cannot make a
setting look fast. Printed per (batch size, N): the median µs a batch and the reads/s.
``--gaps`` adds idle time before each batch (a server faults after the rest of its step,
not back to back): does a disk read slower after it idled? A negative gap spins the
reader's CPU for as long instead of sleeping: the disk idles, the CPU does not.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench._common import drop_cache, report
from bench.fault import build_floor, floor_us

PAGE = 4096


def write_file(path: str, nbytes: int, chunk: int = 64 << 20) -> None:
    """``nbytes`` of non-repeating data (a random block, each copy offset by its index)."""
    if os.path.exists(path) and os.path.getsize(path) == nbytes:
        return
    block = np.random.default_rng(0).integers(0, 1 << 63, chunk // 8, dtype=np.uint64)
    with open(path + ".part", "wb") as f:
        for i in range(-(-nbytes // chunk)):
            n = min(chunk, nbytes - i * chunk)
            f.write((block + np.uint64(i)).view(np.uint8)[:n].tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".part", path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gb", type=float, default=16.0, help="size of the file read (GB)")
    ap.add_argument("--batches", default="111,1024,4096", help="pages a batch")
    ap.add_argument("--depths", default="16,32,64,128,256", help="queue depths / thread counts")
    ap.add_argument(
        "--gaps",
        default="0",
        help="µs idle before each batch, one sweep each (< 0: the reader spins that long)",
    )
    ap.add_argument("--pages", type=int, default=8192, help="pages read per (batch, depth, mode)")
    ap.add_argument("--dir", default=None, help="working directory (kept; default: a temp dir)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for the test suite")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.quick:
        a.gb, a.batches, a.depths, a.pages, a.gaps = 0.02, "16,64", "4,16", 128, "0,100"
    try:
        batches = [int(x) for x in a.batches.split(",")]
        depths = [int(x) for x in a.depths.split(",")]
        gaps = [int(x) for x in a.gaps.split(",")]
    except ValueError:
        ap.error(
            f"--batches {a.batches!r} / --depths {a.depths!r} / --gaps {a.gaps!r}: "
            "give comma-separated integers"
        )
    if min(batches + depths) < 1:
        ap.error("--batches and --depths: every entry must be >= 1")
    if shutil.which("gcc") is None:
        ap.error("this bench needs gcc (it compiles bench/floor.c)")
    work = a.dir or tempfile.mkdtemp(prefix="rowcache-qd-")
    os.makedirs(work, exist_ok=True)
    path = os.path.join(work, "pages.bin")
    write_file(path, int(a.gb * 1e9) // PAGE * PAGE)
    drop_cache([path])
    exe = build_floor(work)
    n_pages = os.path.getsize(path) // PAGE
    plans = [
        (b, n, mode, g)
        for g in gaps
        for b in batches
        for n in depths
        for mode in ("uring", "threads")
    ]
    need = sum(max(1, a.pages // b) * b for b, *_ in plans)
    if need > n_pages:
        ap.error(f"--gb {a.gb}: {n_pages:,} pages, and the sweep reads {need:,} fresh ones")
    order = np.random.default_rng(1).permutation(n_pages)  # every page read at most once
    rows, used = [], 0
    for b, n, mode, g in plans:
        steps = []
        for _ in range(max(1, a.pages // b)):
            pg = np.sort(order[used : used + b]).astype(np.int64)
            used += b
            steps.append((np.zeros(b, np.int64), pg * PAGE, np.full(b, PAGE, np.int64)))
        us = floor_us(exe, mode, n, [path], steps, direct=True, gap_us=g)
        med = float(np.median(us))
        rows.append({"batch": b, "depth": n, "mode": mode, "gap_us": g, "us_per_batch": med,
                     "reads_per_s": b / med * 1e6, "batches": len(steps)})  # fmt: skip
    if a.json:
        report("queue_depth", rows, True, {"file_bytes": os.path.getsize(path), "direct": True})
    else:
        print(f"{os.path.getsize(path) / 1e9:.1f} GB file, O_DIRECT 4 KiB reads, fresh pages")
        print(f"{'gap us':>7} {'batch':>6} {'depth':>6} {'uring us':>10} {'reads/s':>9} "
              f"{'threads us':>11} {'reads/s':>9}")  # fmt: skip
        for g in gaps:
            for b in batches:
                for n in depths:
                    u, t = (next(r for r in rows if (r["batch"], r["depth"], r["mode"], r["gap_us"])
                                 == (b, n, m, g)) for m in ("uring", "threads"))  # fmt: skip
                    print(f"{g:>7} {b:>6} {n:>6} {u['us_per_batch']:>10.0f} {u['reads_per_s']:>9.0f} "
                          f"{t['us_per_batch']:>11.0f} {t['reads_per_s']:>9.0f}")  # fmt: skip
    if a.dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
