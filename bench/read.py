"""Cold random reads of 512-byte rows: ``read_rows`` vs a long-lived np.memmap and vs raw
4 KiB O_DIRECT reads from the same number of threads (the disk's ceiling from Python).

The page cache is dropped (fsync + POSIX_FADV_DONTNEED) before every timed run. Targets
on the GPU machine's disk (16 cores): read_rows >= 2.5x memmap and >= 0.8x the raw ceiling.
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
from bench._common import drop_cache, make_source, raw_direct_reads, report, store_files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--rows",
        type=int,
        default=10_223_617,
        help="table rows (LongCat table 0: 10,223,617 x 256 bf16 = 5.2 GB)",
    )
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument(
        "--threads", type=int, default=16, help="queue depth of read_rows and of the raw reads"
    )
    ap.add_argument(
        "--batches",
        type=int,
        default=4,
        help="batches of the largest size (smaller sizes: as many rows)",
    )
    ap.add_argument("--sizes", default="768,24576", help="batch sizes")
    ap.add_argument("--dir", default=None, help="working directory (default: a temp dir)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for the test suite")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.rows, args.batches, args.sizes, args.threads = 20_000, 1, "768", 4
    work = args.dir or tempfile.mkdtemp(prefix="rowcache-bench-read-")
    os.makedirs(work, exist_ok=True)
    src = make_source(os.path.join(work, "src.npy"), args.rows, args.dim)
    spath = os.path.join(work, "store")
    store = rowcache.build_store(spath, [src], overwrite=True, progress=False)
    files = store_files(store)
    stores = {
        "read_rows": rowcache.RowStore.open(spath, queue_depth=args.threads),
        "read_rows_direct": rowcache.RowStore.open(spath, queue_depth=args.threads, direct=True),
    }
    mm = np.load(src, mmap_mode="r")  # the long-lived memmap baseline
    info = store.tables[0]
    rng = np.random.default_rng(1)
    results = []
    for size in [int(s) for s in args.sizes.split(",")]:
        # at least ~24k rows per size, so small batches are not timed on a handful of reads
        nb = (
            max(args.batches, -(-args.batches * 24576 // (4 * size)))
            if not args.quick
            else args.batches
        )
        batches = [np.unique(rng.integers(0, args.rows, size)) for _ in range(nb)]
        nrows = sum(b.size for b in batches)
        timings: dict[str, float] = {}
        for name, st in stores.items():
            drop_cache(files)
            t0 = time.perf_counter()
            for b in batches:
                st.read_rows(0, b)
            timings[name] = time.perf_counter() - t0
        drop_cache([src])
        t0 = time.perf_counter()
        for b in batches:
            np.asarray(mm[b])
        timings["memmap"] = time.perf_counter() - t0
        shard_files = [files[s] for s in range(info.shards)]

        def raw(rows: np.ndarray, shard_files: list[str] = shard_files) -> float:
            shard, off = info.locate(rows)
            return raw_direct_reads(
                shard_files, [off[shard == s] for s in range(info.shards)], args.threads
            )

        drop_cache(files)
        timings["raw_4k_direct"] = raw(np.concatenate(batches))
        # The same raw reads with a barrier after each batch, as any batched reader has:
        # the threads idle while the batch's slowest reads finish.
        drop_cache(files)
        timings["raw_4k_direct_batched"] = sum(raw(b) for b in batches)
        best = min(timings["read_rows"], timings["read_rows_direct"])
        results.append(
            {
                "batch": size,
                **{f"{k}_rows_s": nrows / v for k, v in timings.items()},
                "vs_memmap": timings["memmap"] / best,
                "vs_raw": timings["raw_4k_direct"] / best,
                "vs_raw_batched": timings["raw_4k_direct_batched"] / best,
            }
        )
    report(
        "bench/read.py: cold random 512 B rows",
        results,
        args.json,
        {
            "rows": args.rows,
            "dim": args.dim,
            "threads": args.threads,
            "batches": args.batches,
            "store_GB": round(args.rows * args.dim * 2 / 1e9, 2),
        },
    )
    for st in (store, *stores.values()):
        st.close()
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
