"""Fault steps of a shared arena against the disk's floor, measured in the same run.

A shared arena over ``--tables`` tables (25 % of their rows by default) takes steps of k
misses spread over the tables (one ``resolve`` after ``end_batch``, timed whole). The
floor is ``bench/floor.c`` (compiled here with gcc): the same kind of reads (the read plan
of another k random rows, so nothing is read twice) issued with no Python, by threads of
blocking ``pread`` and by io_uring at the same queue depth, the faster of the two per k.
Printed per k: ms per fault step (page checks on and off, and the Python engine),
the floor, the ratio and the excess. Cold = O_DIRECT; warm = buffered, page cache filled.
Targets (H200 machine): cold <= floor + 50 us for k <= 48, <= 1.25x floor for k >= 192;
warm <= 3 us a miss + 30 us a step; page checks cost <= 5 % at the floor.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rowcache
from bench._common import drop_cache, make_source, report, store_files
from rowcache.cache.parts import PartReader
from rowcache.io.checksum import page_crcs_of_file
from rowcache.io.reader import RowReader

HERE = os.path.dirname(os.path.abspath(__file__))


def build_floor(work: str) -> str:
    exe = os.path.join(work, "floor")
    subprocess.run(
        ["gcc", "-O2", "-pthread", os.path.join(HERE, "floor.c"), "-o", exe],
        check=True,
        capture_output=True,
    )
    return exe


def floor_us(
    exe: str,
    mode: str,
    n: int,
    files: list[str],
    steps: list[tuple],
    direct: bool,
    gap_us: int = 0,
) -> np.ndarray:
    """Microseconds of each step of reads ``(file ids, offsets, lengths)`` by the C floor
    (``gap_us``: it sleeps that long before each step, untimed)."""
    lines = [str(len(files)), *files, str(len(steps))]
    for f, off, ln in steps:
        lines.append(str(len(f)))
        lines += [f"{a} {b} {c}" for a, b, c in zip(f.tolist(), off.tolist(), ln.tolist())]
    out = subprocess.run(
        [exe, mode, str(n), "direct" if direct else "buffered", str(int(gap_us))],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return np.array([float(x) for x in out.split()])


def random_steps(rng, cache, k: int, steps: int) -> list[np.ndarray]:
    """``steps`` sets of k global rows, none resident now, none in another set."""
    row_slot, _ = cache.inspect().slot_map()
    need = k * steps
    pick = np.empty(0, dtype=np.int64)
    while pick.size < need:  # rejection sampling: the arena holds a minority of the rows
        cand = rng.integers(0, cache.rows, 2 * need + 16)
        cand = cand[row_slot[cand] < 0]
        pick = np.concatenate([pick, cand])
        _, first = np.unique(pick, return_index=True)
        pick = pick[np.sort(first)]
    pick = pick[:need]
    return [np.sort(pick[i * k : (i + 1) * k]) for i in range(steps)]


def parts_of(cache, rows: np.ndarray) -> list[tuple[int, np.ndarray]]:
    b = np.searchsorted(rows, cache.row_offsets)
    return [
        (t, rows[b[i] : b[i + 1]] - cache.row_offsets[i])
        for i, t in enumerate(cache.part_tables)
        if b[i] < b[i + 1]
    ]


class TimedReads(PartReader):
    """A cache's reads (``NgramRowCache.assemble(part_reader=TimedReads)``), timed:
    ``seconds`` sums the reader's calls."""

    def __init__(self, inner: PartReader) -> None:
        super().__init__(inner.store, inner.part_tables, inner.row_offsets, inner.reader)
        self.seconds = 0.0

    def read(self, rows, staging, reader=None):
        t0 = time.perf_counter()
        try:
            return super().read(rows, staging, reader)
        finally:
            self.seconds += time.perf_counter() - t0


def time_steps(cache, step_rows: list[np.ndarray], sync) -> tuple[np.ndarray, np.ndarray]:
    """Microseconds of each step's ``resolve`` and of the reader call inside it (``cache``:
    a cache and its :class:`TimedReads`)."""
    cache, reads = cache
    us, io_us = [], []
    for rows in step_rows:
        cache.end_step()
        reads.seconds = 0.0
        t0 = time.perf_counter()
        cache.resolve(rows)
        sync()
        us.append((time.perf_counter() - t0) * 1e6)
        io_us.append(reads.seconds * 1e6)
        assert cache.last_faults == rows.size
    return np.array(us), np.array(io_us)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tables", type=int, default=12)
    ap.add_argument("--rows", type=int, default=1_048_577, help="rows per table")
    ap.add_argument("--dim", type=int, default=256, help="bf16 values per row")
    ap.add_argument("--arena", type=float, default=0.25, help="arena slots / all rows")
    ap.add_argument("--ks", default="1,12,48,192,768,3072", help="misses per step")
    ap.add_argument("--queue-depth", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30, help="steps per k (fewer for large k)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dir", default=None, help="working directory (kept; default: a temp dir)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for the test suite")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.tables, args.rows, args.ks, args.steps = 3, 20_000, "1,12,48", 4
    work = args.dir or tempfile.mkdtemp(prefix="rowcache-bench-fault-")
    os.makedirs(work, exist_ok=True)
    exe = build_floor(work)
    srcs = [
        make_source(os.path.join(work, f"src{t}.npy"), args.rows, args.dim, seed=t)
        for t in range(args.tables)
    ]
    spath = os.path.join(work, "store")
    if not os.path.exists(os.path.join(spath, "index.lmdb")):
        rowcache.build_store(
            spath, {f"t{t}": s for t, s in enumerate(srcs)}, progress=False
        ).close()
    base = rowcache.RowStore.open(spath)
    files = store_files(base)
    crcs = [[page_crcs_of_file(os.path.join(spath, r.file)) for r in recs] for recs in base.shards]
    shard_files = [[r.file for r in recs] for recs in base.shards]
    names = [f"t{t}" for t in range(args.tables)]
    slots = int(args.arena * args.tables * args.rows)
    qd = args.queue_depth
    sync = lambda: None  # noqa: E731
    if args.device == "cuda":
        import cupy

        sync = cupy.cuda.get_current_stream().synchronize
    rng = np.random.default_rng(0)
    results = []

    def make_cache(direct: bool, **kw):
        base.reader = RowReader(
            spath, base.tables, shard_files, queue_depth=qd, direct=direct, page_crcs=crcs, **kw
        )
        made: list[TimedReads] = []

        def timed(reads: PartReader) -> TimedReads:
            made.append(TimedReads(reads))
            return made[-1]

        cache = rowcache.NgramRowCache.assemble(
            base, names, slots=slots, device=args.device, reader="posix", part_reader=timed
        )
        # one row of every shard first: the timed steps never pay a file's first open
        firsts = [
            (t, np.arange(info.shards, dtype=np.int64) * info.rows_per_shard)
            for t, info in enumerate(base.tables)
        ]
        made[0].reader.read_parts(firsts)
        per = slots // args.tables  # fill the arena with long runs (few, large reads)
        for k in range(args.tables):
            for a in range(0, per, 1 << 14):
                cache.resolve(cache.global_ids(k, np.arange(a, min(per, a + (1 << 14)))))
                cache.end_step()
        return cache, made[0]

    ks = [int(k) for k in args.ks.split(",")]
    caches = {
        "checked": make_cache(True),
        "unchecked": make_cache(True, verify_pages=False),
        "threads": make_cache(True, engine="threads"),
        "python": make_cache(True, engine="python"),
    }
    engine = caches["checked"][1].reader.engine
    for k in ks:
        steps = max(3, min(args.steps, 6 * 3072 // (k * 4) + 2))
        row = {"k": k, "steps": steps}
        for name, cache in caches.items():
            us, io_us = time_steps(cache, random_steps(rng, cache[0], k, steps + 1), sync)
            row[f"{name}_ms"] = float(np.median(us[1:])) / 1e3
            if name == "checked":
                row["read_ms"] = float(np.median(io_us[1:])) / 1e3
        # the floor: another k rows' read plan, by C, per step
        ref, ref_reads = caches["checked"]
        plans = [
            ref_reads.reader.plan_parts(parts_of(ref, r)) for r in random_steps(rng, ref, k, steps)
        ]
        reads = [(p.file, p.start, p.length) for p in plans]
        best = None
        for mode in ("threads", "uring"):
            us = floor_us(exe, mode, min(qd, max(len(p.file) for p in plans)), files, reads, True)
            row[f"floor_{mode}_ms"] = float(np.median(us)) / 1e3
            best = row[f"floor_{mode}_ms"] if best is None else min(best, row[f"floor_{mode}_ms"])
        row["reads_step"] = float(np.mean([len(p.file) for p in plans]))
        row["floor_ms"] = best
        row["ratio"] = row["checked_ms"] / best
        row["read_ratio"] = row["read_ms"] / best
        row["excess_us"] = (row["checked_ms"] - best) * 1e3
        row["check_cost"] = row["checked_ms"] / row["unchecked_ms"] - 1
        row["python_ratio"] = row["python_ms"] / best
        target = best + 0.05 if k <= 48 else 1.25 * best
        row["cold_target_ms"] = target
        row["cold_ok"] = "yes" if row["checked_ms"] <= target else "no"
        results.append(row)
    for _, reads in caches.values():
        reads.reader.close()
    # warm page cache: buffered reads, every shard file read once first
    warm = make_cache(False)
    warm_u = make_cache(False, verify_pages=False)
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass
    for row in results:
        k = row["k"]
        for name, cache in (("warm", warm), ("warm_unchecked", warm_u)):
            us, io_us = time_steps(cache, random_steps(rng, cache[0], k, row["steps"] + 1), sync)
            row[f"{name}_ms"] = float(np.median(us[1:])) / 1e3
            if name == "warm":
                row["warm_read_ms"] = float(np.median(io_us[1:])) / 1e3
        row["warm_target_ms"] = (3 * k + 30) / 1e3
        row["warm_ok"] = "yes" if row["warm_ms"] <= row["warm_target_ms"] else "no"
    report(
        "bench/fault.py: fault steps of a shared arena vs the disk's floor",
        results,
        args.json,
        {
            "tables": args.tables,
            "rows": args.rows,
            "dim": args.dim,
            "slots": slots,
            "queue_depth": qd,
            "device": args.device,
            "engine": engine,
            "store_GB": round(args.tables * args.rows * args.dim * 2 / 1e9, 2),
        },
    )
    drop_cache(files)
    base.close()
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
