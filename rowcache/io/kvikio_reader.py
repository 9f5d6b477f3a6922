"""A row reader whose extent reads go through kvikio (``CuFile.pread``).

Owns only the I/O step; planning, coalescing and record extraction are the POSIX
``RowReader``'s. Reads land in host memory (the pinned staging buffer of the GPU
fault path): on machines without GPUDirect Storage, kvikio's small reads into
device memory bounce through the host one at a time (docs/platform.md: 15-18k/s),
while reads into host memory scale with kvikio's thread pool. With GDS present
kvikio uses it. kvikio needs the CUDA driver even for host buffers, so this reader
exists only on GPU machines.
"""

from __future__ import annotations

import errno
import os
from typing import Any

import numpy as np

from rowcache.errors import GpuUnavailableError
from rowcache.io.plan import Plan
from rowcache.io.reader import RowReader
from rowcache.kernels.loader import require_cupy
from rowcache.store import format as fmt


def kvikio_module() -> Any:
    """kvikio, or GpuUnavailableError saying how to get it."""
    require_cupy("the kvikio reader")
    try:
        import kvikio
        import kvikio.defaults  # a submodule: `import kvikio` alone does not load it
    except ImportError as e:
        raise GpuUnavailableError(
            "reader='kvikio' needs the kvikio package (pip install 'rowcache[gpu]'); "
            "use reader='posix'"
        ) from e
    return kvikio


def gds_available() -> bool:
    """True when kvikio reports GPUDirect Storage (nvidia-fs) on this machine."""
    try:
        import kvikio.cufile_driver

        return bool(kvikio.cufile_driver.properties.is_gds_available)
    except Exception:
        return False


class KvikioRowReader(RowReader):
    """``RowReader`` that issues every extent as a kvikio ``pread`` future.

    kvikio's ``num_threads`` is set to ``queue_depth`` and its ``gds_threshold`` to
    0 (process-wide kvikio settings: small reads would otherwise run one at a
    time in the calling thread).
    """

    def __init__(
        self, root: str, tables: list[fmt.TableInfo], shard_files: list[list[str]], **kw: Any
    ) -> None:
        super().__init__(root, tables, shard_files, **kw)
        self._kvikio = kvikio_module()
        self._kvikio.defaults.set("num_threads", self.queue_depth)
        self._kvikio.defaults.set("gds_threshold", 0)
        self._files: dict[tuple[int, int], Any] = {}

    def _cufile(self, t: int, s: int) -> Any:
        f = self._files.get((t, s))
        if f is None:
            path = os.path.join(self.root, self.shard_files[t][s])
            if not os.path.exists(path):
                raise self.missing_shard(t, s)
            f = self._kvikio.CuFile(path, "r")
            self._files[(t, s)] = f
        return f

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        super().close()

    def _read_extents(
        self, plan: Plan, fds: np.ndarray, buf: np.ndarray, got: np.ndarray, err: np.ndarray
    ) -> None:
        """Every extent as one kvikio ``pread`` future; page checks and the record cut are
        the base reader's (Python side)."""
        futures = []
        for e, f in enumerate(plan.file.tolist()):  # a loop over extents
            t, s = int(self._file_table[f]), int(self._file_shard[f])
            pos, length = int(plan.pos[e]), int(plan.length[e])
            futures.append(
                self._cufile(t, s).pread(buf[pos : pos + length], length, int(plan.start[e]))
            )
        for e, fut in enumerate(futures):
            try:
                got[e], err[e] = fut.get(), 0
            except RuntimeError:  # kvikio reports I/O errors as RuntimeError without an errno
                got[e], err[e] = 0, errno.EIO
