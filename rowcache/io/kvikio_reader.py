"""A row reader whose extent reads go through kvikio (``CuFile.pread``).

Owns the kvikio engine (:class:`KvikioEngine`: only the I/O step, with the ``CuFile`` of
every shard file it opened; planning, coalescing, page checks and record extraction are
the Python engine's) and :class:`KvikioRowReader`, a ``RowReader`` made with that engine.
Reads land in host memory (the pinned staging buffer of the GPU
fault path): on machines without GPUDirect Storage, kvikio's small reads into
device memory bounce through the host one at a time (docs/platform.md: 15-18k/s),
while reads into host memory scale with kvikio's thread pool. With GDS present
kvikio uses it. kvikio needs the CUDA driver even for host buffers, so this reader
exists only on GPU machines.

kvikio opens files by path. So that it reads the file the store's checks opened, and never
what a path names later (a link, a FIFO, a file renamed over the shard), each shard is
opened by ``ShardFiles.fd`` (relative to the store's directory, ``O_NOFOLLOW``, a regular
file) and kvikio is handed that descriptor's ``/proc/self/fd/N``, which opens the same
file whatever its path holds now.
"""

from __future__ import annotations

import errno
from typing import Any

import numpy as np

from rowcache.errors import GpuUnavailableError
from rowcache.io.engine import ReadEngine
from rowcache.io.files import ShardFiles
from rowcache.io.plan import Plan, ReadPlanner
from rowcache.io.pyengine import PythonEngine
from rowcache.io.reader import RowReader
from rowcache.kernels.loader import require_cupy


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


class KvikioEngine(PythonEngine):
    """The Python engine with every extent read as a kvikio ``pread`` future (a
    :class:`rowcache.io.engine.ReadEngine`; it reads no batch apart).

    kvikio's ``num_threads`` is set to ``queue_depth`` and its ``gds_threshold`` to
    0 (process-wide kvikio settings: small reads would otherwise run one at a
    time in the calling thread).
    """

    name = "kvikio"

    def __init__(
        self,
        files: ShardFiles,
        planner: ReadPlanner,
        *,
        queue_depth: int,
        direct: bool,
        verify_pages: bool,
    ) -> None:
        super().__init__(
            files, planner, queue_depth=queue_depth, direct=direct, verify_pages=verify_pages
        )
        self._kvikio = kvikio_module()
        self._kvikio.defaults.set("num_threads", self.queue_depth)
        self._kvikio.defaults.set("gds_threshold", 0)
        self._cufiles: dict[tuple[int, int], Any] = {}

    def _cufile(self, t: int, s: int) -> Any:
        f = self._cufiles.get((t, s))
        if f is None:
            fd = self.files.fd(t, s)  # checked, and named as the shard in its errors
            f = self._kvikio.CuFile(f"/proc/self/fd/{fd}", "r")
            self._cufiles[(t, s)] = f
        return f

    def close(self) -> None:
        for f in self._cufiles.values():
            f.close()
        self._cufiles.clear()
        super().close()

    def read_extents(
        self, plan: Plan, fds: np.ndarray, buf: np.ndarray, got: np.ndarray, err: np.ndarray
    ) -> None:
        """Every extent as one kvikio ``pread`` future; page checks and the record cut are
        the Python engine's."""
        futures = []
        files = self.files
        for e, f in enumerate(plan.file.tolist()):  # a loop over extents
            t, s = int(files.file_table[f]), int(files.file_shard[f])
            pos, length = int(plan.pos[e]), int(plan.length[e])
            futures.append(
                self._cufile(t, s).pread(buf[pos : pos + length], length, int(plan.start[e]))
            )
        for e, fut in enumerate(futures):
            try:
                got[e], err[e] = fut.get(), 0
            except RuntimeError:  # kvikio reports I/O errors as RuntimeError without an errno
                got[e], err[e] = 0, errno.EIO


class KvikioRowReader(RowReader):
    """``RowReader`` that reads with :class:`KvikioEngine`: every extent a kvikio
    ``pread`` future (its ``engine`` is ``"kvikio"``; the options are ``RowReader``'s)."""

    def new_engine(self, engine: str) -> ReadEngine:
        return KvikioEngine(
            self.files,
            self.planner,
            queue_depth=self.queue_depth,
            direct=self.direct,
            verify_pages=self.verify_pages,
        )
