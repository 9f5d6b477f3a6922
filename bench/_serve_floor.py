"""bench/serve.py's floor: the pages a cached run faulted, re-read by the native reader.

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
    """The native reader over one store's shard files (compiled on construction)."""

    def __init__(self, store: Any, direct: bool) -> None:
        if shutil.which("gcc") is None:
            raise RuntimeError("bench/serve.py needs gcc to build its native floor reader")
        self.tmp = tempfile.mkdtemp(prefix="serve-floor-")
        self.exe = build_floor(self.tmp)
        self.store = store
        self.direct = direct
        files = store.reader.shard_files
        self.files = [os.path.join(store.path, f) for fs in files for f in fs]
        self.first_file = np.cumsum([0] + [len(fs) for fs in files])

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

    def run(self, steps: list[np.ndarray], mode: str, n: int) -> np.ndarray:
        """Seconds of each step's pages read as one batch (``mode`` threads|uring, ``n``)."""
        plan = [(p[:, 0], p[:, 1], np.full(p.shape[0], PAGE, np.int64)) for p in steps]
        return floor_us(self.exe, mode, n, self.files, plan, self.direct) / 1e6

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
