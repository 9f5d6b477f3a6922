"""One cold 4 KiB read, four ways, in one process and in blocks that alternate (µs, median).

Not a claim of its own: whether a k = 1 fault's read costs more than the disk's floor
because of rowcache's reader or because of where it runs. Builds one table's store
(``--rows`` 512-byte rows, O_DIRECT reads of fresh pages each time), then times blocks
of ``--reads`` single-row reads by: the native reader's ``read_runs`` (``rowcache.io._rcio``,
io_uring), ``RowReader.read_runs`` (its Python wrapper; both with ``--spin-us``), ``os.preadv`` of the page, and
``bench/floor.c`` (io_uring and a pread thread, its own process, same kind of pages).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rowcache
from bench._common import make_source, store_files
from bench.fault import build_floor, floor_us
from rowcache.io.reader import RowReader


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--reads", type=int, default=300)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--dir", default=None)
    p.add_argument(
        "--spin-us", type=int, default=None, help="the reader's spin_us (default: its own)"
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes, for the test suite")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.quick:
        a.rows, a.reads, a.blocks = 20_000, 20, 2
    work = a.dir or tempfile.mkdtemp(prefix="rowcache-readlat-")
    os.makedirs(work, exist_ok=True)
    spath = os.path.join(work, "store")
    if not os.path.exists(os.path.join(spath, "index.lmdb")):
        src = make_source(os.path.join(work, "src.npy"), a.rows, 256, seed=0)
        rowcache.build_store(spath, {"t": src}, progress=False).close()
    store = rowcache.RowStore.open(spath)
    files = store_files(store)
    shard_files = [[r.file for r in recs] for recs in store.shards]
    spin = {} if a.spin_us is None else {"spin_us": a.spin_us}
    reader = RowReader(spath, store.tables, shard_files, queue_depth=64, direct=True,
                       verify_pages=False, engine="uring", **spin)  # fmt: skip
    reader.read_parts([(0, np.arange(store.tables[0].shards, dtype=np.int64)
                        * store.tables[0].rows_per_shard)])  # fmt: skip
    native = reader._native
    rng = np.random.default_rng(0)
    pages = a.rows * 512 // 4096
    fresh = iter(rng.permutation(pages))  # each page once: never a device-cache hit
    bounds, tabs, bases = np.array([0, 1]), np.array([0], np.int32), np.array([0])
    out = np.empty((1, 512), np.uint8)
    exe = build_floor(work)
    fd = os.open(files[0], os.O_RDONLY | os.O_DIRECT)
    import mmap

    buf = mmap.mmap(-1, 4096)
    per_file = store.tables[0].rows_per_shard * 512 // 4096

    def rows_of(n):
        return [np.array([int(next(fresh)) * 8], np.int64) for _ in range(n)]

    res: dict[str, list[float]] = {k: [] for k in ("native", "read_runs", "preadv", "floor_uring",
                                                   "floor_threads")}  # fmt: skip
    for _ in range(a.blocks):
        ts = []
        for r in rows_of(a.reads):
            t0 = time.perf_counter()
            native.read_runs(r, bounds, tabs, bases, out, False)
            ts.append(time.perf_counter() - t0)
        res["native"].append(float(np.median(ts)) * 1e6)
        ts = []
        for r in rows_of(a.reads):
            t0 = time.perf_counter()
            reader.read_runs(r, bounds, tabs, bases, out=out)
            ts.append(time.perf_counter() - t0)
        res["read_runs"].append(float(np.median(ts)) * 1e6)
        ts = []
        for r in rows_of(a.reads):
            pg = int(r[0]) // 8
            if pg >= per_file:  # preadv on the first shard file only
                continue
            t0 = time.perf_counter()
            os.preadv(fd, [buf], pg * 4096)
            ts.append(time.perf_counter() - t0)
        res["preadv"].append(float(np.median(ts)) * 1e6)
        plans = [reader.plan_parts([(0, r)]) for r in rows_of(a.reads)]
        steps = [(pl.file, pl.start, pl.length) for pl in plans]
        for mode in ("uring", "threads"):
            res[f"floor_{mode}"].append(
                float(np.median(floor_us(exe, mode, 1, files, steps, True)))
            )
    os.close(fd)
    reader.close()
    store.close()
    if not a.dir:
        shutil.rmtree(work, ignore_errors=True)
    summary = {k: {"blocks": [round(x, 1) for x in v], "median": round(float(np.median(v)), 1)}
               for k, v in res.items()}  # fmt: skip
    print(
        json.dumps(summary)
        if a.json
        else "\n".join(
            f"{k:14s} {v['median']:7.1f} us  blocks {v['blocks']}" for k, v in summary.items()
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
