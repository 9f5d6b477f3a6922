"""bench/serve.py's floor: the pages a cached run faulted, re-read by the native reader.

Owns turning each step's missed rows (global ids of a shared ``NgramRowCache``) into the
store pages that hold them, compiling ``bench/_floor.c`` with gcc into a temporary
directory, and running it (threads of blocking ``pread``, io_uring at a queue depth) on
those pages step by step. Returns seconds per step.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import tempfile
from typing import Any

import numpy as np

PAGE = 4096
SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_floor.c")


class Floor:
    """The native reader over one store's shard files (compiled on construction)."""

    def __init__(self, store: Any, direct: bool) -> None:
        if shutil.which("gcc") is None:
            raise RuntimeError("bench/serve.py needs gcc to build its native floor reader")
        self.tmp = tempfile.mkdtemp(prefix="serve-floor-")
        self.exe = os.path.join(self.tmp, "floor")
        subprocess.run(
            ["gcc", "-O2", "-pthread", "-o", self.exe, SRC], check=True, capture_output=True
        )
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
        jobs = os.path.join(self.tmp, "jobs.bin")
        with open(jobs, "wb") as f:
            f.write(struct.pack("<q", len(steps)))
            for p in steps:
                f.write(struct.pack("<q", p.shape[0]))
                f.write(np.ascontiguousarray(p, dtype="<i8").tobytes())
        proc = subprocess.run(
            [self.exe, mode, str(n), jobs, str(PAGE), str(int(self.direct)), *self.files],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"bench/_floor.c {mode} {n} failed: {proc.stderr.strip()}")
        lines = proc.stdout.split("\n")
        return np.array([int(x) for x in lines[: len(steps)]], dtype=np.float64) / 1e9

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
