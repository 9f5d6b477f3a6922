"""Build (and verify) a full-size LongCat store from ONE reused source, measuring memory.

The 12 LongCat tables (10,223,617 + 2i rows x 256) are 62.8 GB in BF16: no disk here
holds a source that size beside the store, so every table is a memory-mapped slice
``[:rows_i]`` of one random bf16 source of the largest table's rows (written once, or
given with ``--source``). The builder must stream: the figure that proves it is the
peak anonymous memory of this process (``RssAnon`` of /proc/self/status, sampled every
20 ms in a thread; a memory-mapped source shows in ``RssFile``/``RssShmem``, not there),
compared with the machine's RAM. Baseline in the same run: a plain sequential write of
the first table's bytes (``bench/build.py``'s ``plain_write``), for the throughput ratio.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rowcache
from bench._common import make_source, report
from bench.build import plain_write
from rowcache.format import layout as fmt
from rowcache.store import builder

LONGCAT_ROWS = 10_223_617  # 78 * 131072 + 1: table i has LONGCAT_ROWS + 2 i rows
LONGCAT_DIM = 256


def status_kib(field: str) -> int:
    """A ``kB`` field of /proc/self/status (``RssAnon``, ``RssFile``, ``VmHWM``...)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


class PeakSampler:
    """Peak of /proc/self/status fields, sampled in a daemon thread."""

    def __init__(self, fields: tuple[str, ...] = ("RssAnon", "RssFile", "RssShmem"), dt=0.02):
        self.fields, self.dt = fields, dt
        self.peak = {f: status_kib(f) for f in fields}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.dt):
            for f in self.fields:
                self.peak[f] = max(self.peak[f], status_kib(f))

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def mem_total_bytes() -> int:
    with open("/proc/meminfo") as f:
        return int(f.readline().split()[1]) * 1024


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--store", required=True, help="directory of the store to build")
    ap.add_argument("--source", default=None, help="bf16 .npy source [>= largest rows, dim]")
    ap.add_argument("--tables", type=int, default=12, help="number of tables (12: LongCat)")
    ap.add_argument("--rows", type=int, default=LONGCAT_ROWS, help="rows of table 0")
    ap.add_argument("--dim", type=int, default=LONGCAT_DIM)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp8"))
    ap.add_argument("--verify", action="store_true", help="run store.verify() after the build")
    ap.add_argument("--keep-free-gb", type=float, default=4.0, help="refuse below this")
    ap.add_argument("--no-baseline", action="store_true", help="skip the plain-write baseline")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for the test suite")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.tables, args.rows, args.dim = 3, 5_000, 64
    rows = [args.rows + 2 * i for i in range(args.tables)]
    work = os.path.dirname(os.path.abspath(args.store))
    os.makedirs(work, exist_ok=True)
    src = args.source or os.path.join(work, "fullsize-src.npy")
    src = make_source(src, rows[-1], args.dim, seed=14) if not os.path.exists(src) else src
    base = np.load(src, mmap_mode="r")
    if base.shape[0] < rows[-1] or base.shape[1] != args.dim:
        raise SystemExit(
            f"--source {src}: shape {base.shape}, need at least [{rows[-1]}, {args.dim}]"
        )
    rpp, page_bytes = fmt.page_packing(fmt.record_bytes(args.dim, args.dtype))
    out_bytes = sum(-(-r // rpp) * page_bytes for r in rows)
    free = shutil.disk_usage(work).free
    if free - out_bytes < args.keep_free_gb * 1e9:
        raise SystemExit(
            f"{work}: {free / 1e9:.1f} GB free, the store needs about {out_bytes / 1e9:.1f} GB "
            f"and --keep-free-gb is {args.keep_free_gb}; build fewer --tables"
        )
    plain_gbs = None
    if not args.no_baseline:  # the source's bytes (one table), plain sequential write + fsync
        tmp = os.path.join(work, "fullsize-plain.bin")
        plain_gbs = base.nbytes / plain_write(src, tmp) / 1e9
        os.unlink(tmp)
    tables = {str(i): base[:r] for i, r in enumerate(rows)}
    anon0 = status_kib("RssAnon")
    t0 = time.perf_counter()
    with PeakSampler() as peak:
        store = rowcache.build_store(args.store, tables, dtype=args.dtype, overwrite=True)
    build_s = time.perf_counter() - t0
    disk = sum(
        os.path.getsize(os.path.join(args.store, f))
        for f in os.listdir(args.store)
        if f.endswith(".bin")
    )
    src_bytes = sum(rows) * args.dim * 2
    row = {
        "dtype": args.dtype,
        "fp8_engine": builder.fp8_engine() if args.dtype == "fp8" else "-",
        "tables": args.tables,
        "rows": f"{rows[0]:,}..{rows[-1]:,}",
        "store_GB": disk / 1e9,
        "build_s": build_s,
        "source_GB_s": src_bytes / build_s / 1e9,
        "written_GB_s": disk / build_s / 1e9,
        "peak_RssAnon_MB": peak.peak["RssAnon"] / 1024,
        "RssAnon_before_MB": anon0 / 1024,
        "peak_RssFile_MB": peak.peak["RssFile"] / 1024,
        "peak_RssShmem_MB": peak.peak["RssShmem"] / 1024,
        "RAM_GB": mem_total_bytes() / 1e9,
        "store_over_RAM": disk / mem_total_bytes(),
    }
    if plain_gbs is not None:
        row["plain_write_GB_s"] = plain_gbs
        row["ratio_vs_plain"] = row["source_GB_s"] / row["plain_write_GB_s"]
    if args.verify:
        t0 = time.perf_counter()
        rep = store.verify()
        row["verify_s"] = time.perf_counter() - t0
        row["verify_ok"] = bool(getattr(rep, "ok", rep))
    store.close()
    report(
        "bench/fullsize.py: full-size store from one reused source",
        [row],
        args.json,
        {"store": args.store, "source": src},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
