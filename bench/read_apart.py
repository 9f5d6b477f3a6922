"""What reading a fault's rows on the reader's own thread costs against reading them in the
caller's (``RowReader.read_batch_start`` / ``read_batch_join`` against ``read_batch``).

Not a claim of its own: the cost behind ``NgramRowCache.resolve_deferred`` (a deferred step's
read starts on the native reader's thread, and is joined later). A fresh store of two tables;
batches of random rows (page cache warm after the first pass, so the figures are the two paths'
CPU and hand-off costs, not the disk's); medians of ``--reps`` batches a size, the two paths
alternating. ``start`` is the caller's time to start a batch apart (it goes on meanwhile).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rowcache
from rowcache.store.sources import BF16


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, default=200_000, help="rows a table (two tables)")
    p.add_argument("--sizes", default="1,12,111,768", help="rows a batch, comma-separated")
    p.add_argument("--reps", type=int, default=400)
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    if a.quick:
        a.rows, a.reps = 20_000, 30
    try:
        sizes = [int(x) for x in a.sizes.split(",")]
    except ValueError:
        sizes = [0]
    if min(sizes) < 1 or max(sizes) > 2 * a.rows:
        p.error(f"--sizes {a.sizes!r}: give row counts 1..{2 * a.rows}, e.g. 1,12,111")
    rng = np.random.default_rng(0)
    tabs = {
        f"t{k}": rng.standard_normal((a.rows, 128), dtype=np.float32).astype(BF16) for k in range(2)
    }
    with tempfile.TemporaryDirectory(prefix="rowcache-apart-") as work:
        store = rowcache.build_store(os.path.join(work, "s"), tabs, progress=False)
        r = store.reader
        if r.engine == "python":
            p.error("the native reader is not built here (rowcache.io._rcio): nothing to compare")
        tables = np.arange(2, dtype=np.int32)
        bases = np.array([0, a.rows], dtype=np.int64)
        edges = np.array([0, a.rows, 2 * a.rows], dtype=np.int64)
        out = np.zeros((max(sizes), store.tables[0].record_bytes), np.uint8)
        ctl = np.zeros(2, np.int32)

        def batch(n: int) -> tuple[np.ndarray, np.ndarray]:
            rows = np.sort(rng.choice(2 * a.rows, n, replace=False)).astype(np.int64)
            return rows, rows.searchsorted(edges).astype(np.int64)

        r.read_batch(*batch(8), tables, bases, out[:8])  # opens the shard files
        results = []
        for n in sizes:
            inline, apart, start = [], [], []
            for rep in range(a.reps):
                rows, bounds = batch(n)
                t0 = time.perf_counter()
                r.read_batch(rows, bounds, tables, bases, out[:n])
                inline.append(time.perf_counter() - t0)
                rows, bounds = batch(n)
                t0 = time.perf_counter()
                if not r.read_batch_start(rows, bounds, tables, bases, out[:n], ctl, rep + 1):
                    p.error("the reader cannot read apart here")
                t1 = time.perf_counter()
                r.read_batch_join()
                apart.append(time.perf_counter() - t0)
                start.append(t1 - t0)
            res = {
                "rows": n,
                "inline_us": 1e6 * float(np.median(inline)),
                "apart_us": 1e6 * float(np.median(apart)),
                "start_us": 1e6 * float(np.median(start)),
            }
            res["apart_over_inline"] = res["apart_us"] / res["inline_us"]
            results.append(res)
        store.close()
    if a.json:
        print(json.dumps({"settings": vars(a), "results": results}, indent=2))
        return 0
    print(f"# bench/read_apart.py: medians of {a.reps} batches, page cache warm, µs a batch")
    print("rows  read_batch  start+join  (start)  ratio")
    for r_ in results:
        print(
            f"{r_['rows']:4d}  {r_['inline_us']:10.1f}  {r_['apart_us']:10.1f}  "
            f"{r_['start_us']:7.1f}  {r_['apart_over_inline']:5.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
