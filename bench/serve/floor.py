"""The serving judge's floor: the pages a cached run faulted, re-read by the native reader.

Owns turning each step's missed rows (global ids of a shared ``NgramRowCache``) into the
store pages that hold them, and running ``bench/floor.c`` (bench/fault.py's native reader,
compiled with gcc into a temporary directory: threads of blocking ``pread``, or io_uring at
a queue depth, one batch a step) on those pages. Returns seconds per step.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import numpy as np

from bench.fault import build_floor, floor_us

PAGE = 4096


class Floor:
    """The native reader over one store's shard files (compiled on construction), or over
    ``files`` (``store=None``: any files, read by :meth:`run` at the offsets given)."""

    def __init__(self, store: Any, direct: bool, files: list[str] | None = None) -> None:
        if shutil.which("gcc") is None:
            raise RuntimeError("bench.serve needs gcc to build its native floor reader")
        self.tmp = tempfile.mkdtemp(prefix="serve-floor-")
        self.exe = build_floor(self.tmp)
        self.store = store
        self.direct = direct
        if store is None:
            self.files = list(files or [])
            self.first_file = np.zeros(1, np.int64)
            return
        shard_files = store.reader.shard_files
        self.files = [os.path.join(store.path, f) for fs in shard_files for f in fs]
        self.first_file = np.cumsum([0] + [len(fs) for fs in shard_files])

    def pages(self, layout: tuple[np.ndarray, list[int]], global_rows: np.ndarray) -> np.ndarray:
        """int64[k, 2] (file index, page offset) of the distinct pages of ``global_rows``
        (global ids of a shared cache whose ``(row_offsets, part_tables)`` is ``layout``)."""
        offsets, tables = layout
        out = []
        part = np.searchsorted(offsets, global_rows, side="right") - 1
        for k in np.unique(part):
            t = tables[k]
            local = global_rows[part == k] - offsets[k]
            shard, off = self.store.tables[t].locate(local)
            out.append(np.stack([self.first_file[t] + shard, off - off % PAGE], axis=1))
        if not out:
            return np.zeros((0, 2), np.int64)
        return np.unique(np.concatenate(out), axis=0).astype(np.int64)

    def run(self, steps: list[np.ndarray], mode: str, n: int, gap_us: float = 0) -> np.ndarray:
        """Seconds of each step's pages read as one batch (``mode`` threads|uring, ``n``);
        ``gap_us``: the reader sleeps that long before each batch, as a server's disk
        idles during the rest of its step (untimed)."""
        plan = [(p[:, 0], p[:, 1], np.full(p.shape[0], PAGE, np.int64)) for p in steps]
        return floor_us(self.exe, mode, n, self.files, plan, self.direct, gap_us=int(gap_us)) / 1e6

    def engines(self, steps: list[np.ndarray], qd: int, log: Any) -> dict[str, np.ndarray]:
        """Seconds of each step's pages (:meth:`pages`' ``[k, 2]``) by each native engine at
        ``qd``: ``"uring"`` (one thread's ring) and ``"threads"`` (``qd`` threads of
        ``pread``); an engine that cannot run here (io_uring refused by a container's
        seccomp, say) is left out, ``log`` saying why."""
        out = {}
        for how in ("uring", "threads"):
            try:
                out[how] = np.asarray(self.run(steps, how, qd))
            except Exception as e:  # the reader's exit status, with its message
                log(f"floor: {how} failed ({str(e).strip()[:200]})")
        return out

    def measure(self, steps: list[np.ndarray], qd: int, log: Any) -> np.ndarray | None:
        """Seconds of each step's pages by the engine faster over all of them (:meth:`engines`:
        on the H100 VMs threads of ``pread`` read a 230-page step 1.2-1.4x faster than
        io_uring, on the dev VM io_uring is as fast or faster); None where neither runs."""
        return faster(self.engines(steps, qd, log))

    def reread_check(self, steps: list[np.ndarray], qd: int, seed: int = 0) -> dict[str, float]:
        """Whether this disk serves re-reads faster than first reads (a VM whose virtual
        disk caches beneath the guest: O_DIRECT does not bypass that). ``steps``: pages
        (``pages()``'s) that this run has read already; the same count of other pages a
        step, drawn from the same files and never read in this run, are read first, then
        ``steps`` again (io_uring at ``qd``). Medians of ms a step."""
        rng = np.random.default_rng(seed)
        pages = [os.path.getsize(f) // PAGE for f in self.files]
        weight = np.asarray(pages, np.float64) / sum(pages)
        seen = np.concatenate(steps) if steps else np.zeros((0, 2), np.int64)
        seen_key = np.unique(seen[:, 0] * (1 << 40) + seen[:, 1])
        fresh = []
        for p in steps:
            f = rng.choice(len(self.files), p.shape[0], p=weight)
            off = (rng.random(p.shape[0]) * np.asarray(pages)[f]).astype(np.int64) * PAGE
            keep = ~np.isin(f * (1 << 40) + off, seen_key)
            q = np.unique(np.stack([f[keep], off[keep]], axis=1), axis=0).astype(np.int64)
            fresh.append(q)
        n_fresh = [q.shape[0] for q in fresh]
        if not steps or min(n_fresh) == 0:  # a store this run read whole: nothing fresh
            return {"steps": 0}
        first = self.run(fresh, "uring", qd)
        again = self.run(steps, "uring", qd)
        return {
            "steps": len(steps),
            "pages_per_step": float(np.mean([p.shape[0] for p in steps])),
            "fresh_pages_per_step": float(np.mean(n_fresh)),
            "fresh_ms_per_step": 1e3 * float(np.median(first)),
            "reread_ms_per_step": 1e3 * float(np.median(again)),
        }

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def faster(by_engine: dict[str, np.ndarray]) -> np.ndarray | None:
    """The seconds a step of the engine faster over all steps (a per-step minimum of two
    noisy runs would read lower than either engine does); None for none."""
    if not by_engine:
        return None
    return min(by_engine.values(), key=lambda f: float(np.mean(f)))
