"""A demand batch's read while a prefetch reader keeps the disk busy (ms a batch, median).

Why a step's own faults cost more beside prefetches than alone (bench/serve.py: a chunked
prefill step's decode tokens with lookahead, 3.2 ms against 2.3 ms for the same ~111 rows
in the cached series, bench/RESULTS.md). Builds one table's store (``--rows`` 512-byte BF16
rows, one row read a 4 KiB page), then for each background setting times ``--batches``
demand batches of ``--demand`` fresh pages, one every ``--gap-ms`` (the rest of a decode
step), read by a reader as the cache's demand path makes it (queue depth ``--queue-depth``,
O_DIRECT), while a thread reads batches of ``--bg-rows`` fresh pages back to back with a
reader as the cache's prefetch thread makes it. ``--bg``: the settings, in turns (blocks of
``--block`` demand batches, the order rotating): ``none`` (no background), ``D`` (the
background reader at queue depth D, yielding to demand batches:
``RowReader(background=True)``), ``Dn`` (the same without yielding).

Prints per setting the demand batch's median and p90 and the background reader's rows/s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rowcache
from rowcache.kernels.reference import BF16


def parse_bg(text: str) -> list[tuple[str, int, bool]]:
    """``none,64,16n`` -> [(label, queue depth (0: none), yields)]."""
    out = []
    for x in text.split(","):
        x = x.strip()
        if x == "none":
            out.append((x, 0, False))
            continue
        yields = not x.endswith("n")
        try:
            d = int(x[:-1] if not yields else x)
        except ValueError:
            d = 0
        if not 1 <= d <= 1024:
            raise ValueError(f"--bg entry {x!r}: give none, a queue depth 1..1024, or one with n")
        out.append((x, d, yields))
    return out


class Background:
    """A thread reading batches of fresh pages back to back until stopped."""

    def __init__(self, reader: rowcache.RowReader, pages: np.ndarray, rows_per_page: int, n: int):
        self.reader, self.pages, self.rpp, self.n = reader, pages, rows_per_page, n
        self.stop = threading.Event()
        self.rows = 0
        self.seconds = 0.0
        self.next = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0 = time.perf_counter()
        while not self.stop.is_set():
            i = self.next % (self.pages.size - self.n)
            self.next += self.n
            rows = np.sort(self.pages[i : i + self.n]) * self.rpp
            self.reader.read_records(0, rows)
            self.rows += rows.size
        self.seconds = time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=4_000_000, help="rows of the store's table")
    p.add_argument("--demand", type=int, default=111, help="pages a demand batch")
    p.add_argument("--gap-ms", type=float, default=9.0, help="sleep before each demand batch")
    p.add_argument("--batches", type=int, default=120, help="demand batches a setting")
    p.add_argument("--block", type=int, default=20, help="demand batches a turn")
    p.add_argument("--bg", default="none,64,64n,16,16n", help="background settings (above)")
    p.add_argument("--bg-rows", type=int, default=1024, help="pages a background batch")
    p.add_argument("--queue-depth", type=int, default=64, help="the demand reader's")
    p.add_argument("--dir", default=None, help="keep (and reuse) the store here")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for the test suite")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    try:
        settings = parse_bg(a.bg)
    except ValueError as e:
        p.error(str(e))
    for name in ("rows", "demand", "batches", "block", "bg_rows", "queue_depth"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)}: give an integer >= 1")
    if a.gap_ms < 0:
        p.error(f"--gap-ms {a.gap_ms}: give a duration >= 0")
    if a.quick:
        a.rows, a.batches, a.block, a.gap_ms, a.bg_rows = 40_000, 6, 3, 1.0, 64
    own = a.dir is None
    work = a.dir or tempfile.mkdtemp(prefix="rowcache-contention-")
    os.makedirs(work, exist_ok=True)
    path = os.path.join(work, "store")
    try:
        try:
            store = rowcache.RowStore.open(path)
            if store.tables[0].rows != a.rows:
                store.close()
                raise FileNotFoundError(path)
        except Exception:
            base = np.random.default_rng(0).standard_normal(a.rows + 256, dtype=np.float32)
            u16 = (base * 0.02).astype(BF16).view(np.uint16)
            src = np.lib.stride_tricks.as_strided(u16, shape=(a.rows, 256), strides=(2, 2))
            store = rowcache.build_store(
                path, {"t": src.view(BF16)}, overwrite=True, progress=False
            )
        rpp = 4096 // 512
        pages = np.random.default_rng(1).permutation(a.rows // rpp).astype(np.int64)
        demand = store.new_reader(queue_depth=a.queue_depth, direct=True)
        bgr = {
            label: store.new_reader(queue_depth=d, direct=True, spin_us=0, background=y)
            for label, d, y in settings
            if d
        }
        got: dict[str, list[float]] = {label: [] for label, _, _ in settings}
        bg_rate: dict[str, list[float]] = {label: [] for label, d, _ in settings if d}
        d_next = 0
        bg_pages = pages[::-1]  # fresh pages for the background, from the other end
        bg_next = 0
        turns = -(-a.batches // a.block)
        for turn in range(turns):
            r = turn % len(settings)
            for label, d, _ in settings[r:] + settings[:r]:
                bg = None
                if d:
                    bg = Background(bgr[label], bg_pages, rpp, a.bg_rows)
                    bg.next = bg_next
                    bg.thread.start()
                    time.sleep(0.02)  # its queue full
                for _ in range(min(a.block, a.batches - turn * a.block)):
                    time.sleep(a.gap_ms / 1e3)
                    i = d_next % (pages.size // 2 - a.demand)
                    d_next += a.demand
                    rows = np.sort(pages[i : i + a.demand]) * rpp
                    t0 = time.perf_counter()
                    demand.read_records(0, rows)
                    got[label].append(time.perf_counter() - t0)
                if bg is not None:
                    bg.stop.set()
                    bg.thread.join()
                    bg_next = bg.next
                    bg_rate[label].append(bg.rows / bg.seconds)
        rep = {
            "bench": "contention",
            "settings": {
                "rows": a.rows,
                "demand_pages": a.demand,
                "gap_ms": a.gap_ms,
                "batches": a.batches,
                "bg_pages": a.bg_rows,
                "queue_depth": a.queue_depth,
                "engine": demand.engine,
            },
            "results": [
                {
                    "background": label,
                    "bg_queue_depth": d,
                    "bg_yields": y,
                    "demand_ms_median": 1e3 * float(np.median(got[label])),
                    "demand_ms_p90": 1e3 * float(np.percentile(got[label], 90)),
                    "bg_rows_per_s": float(np.mean(bg_rate[label])) if d else None,
                }
                for label, d, y in settings
            ],
        }
        store.close()
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)
    if a.json:
        print(json.dumps(rep, indent=1))
        return 0
    s = rep["settings"]
    print(
        f"# demand batches of {s['demand_pages']} fresh pages after {s['gap_ms']} ms idle, "
        f"queue depth {s['queue_depth']} ({s['engine']}), beside a background reader of "
        f"{s['bg_pages']}-page batches; {s['batches']} batches a setting, in turns"
    )
    print(f"{'background':>12} {'demand ms median':>17} {'p90':>7} {'background rows/s':>18}")
    for x in rep["results"]:
        bg = f"{x['bg_rows_per_s']:,.0f}" if x["bg_rows_per_s"] else "-"
        print(
            f"{x['background']:>12} {x['demand_ms_median']:>17.3f} "
            f"{x['demand_ms_p90']:>7.3f} {bg:>18}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
