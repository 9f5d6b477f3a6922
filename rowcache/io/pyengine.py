"""The Python engine of :class:`rowcache.io.reader.RowReader`, and what a failed batch says.

Owns the engine that runs a read plan (``rowcache.io.plan``) where the native
extension is not built or where ``engine="python"`` is asked (tests that inject faults
by replacing ``os.preadv`` ask for it, since it calls ``os.preadv`` at each read):
threads of ``os.preadv`` (its pool and per-thread buffers), the page checks by
``rowcache.io.checksum``, the records cut from the buffer; and the messages of a failed
read or page check, naming shard, offset, table and rows, which the native engines raise
too (:func:`raise_read`, :func:`raise_page`). The loops are over extents and threads,
never over rows.
"""

from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import NoReturn

import numpy as np

from rowcache.errors import ConfigError, CorruptDataError
from rowcache.io.checksum import page_crcs as _page_crcs
from rowcache.io.engine import ReadStats
from rowcache.io.files import ShardFiles
from rowcache.io.plan import ALIGN, Plan, ReadPlanner

SHORT = -1  # err code of a read that hit the end of file before the bytes it needed


def aligned_empty(nbytes: int, align: int = ALIGN) -> np.ndarray:
    """A uint8 buffer of ``nbytes`` whose address is a multiple of ``align`` (for O_DIRECT)."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    shift = (-raw.ctypes.data) % align
    return raw[shift : shift + nbytes]


class PythonEngine:
    """Reads a plan's extents on up to ``queue_depth`` Python threads of ``os.preadv``,
    checks their pages (unless ``verify_pages`` is False) and cuts the records (a
    :class:`rowcache.io.engine.ReadEngine`). A subclass reads the extents another way by
    overriding :meth:`read_extents` (``rowcache.io.kvikio_reader``)."""

    name = "python"

    def __init__(
        self,
        files: ShardFiles,
        planner: ReadPlanner,
        *,
        queue_depth: int,
        direct: bool,
        verify_pages: bool,
    ) -> None:
        self.files = files
        self.planner = planner
        self.queue_depth = queue_depth
        self.direct = direct
        self.verify_pages = verify_pages
        self._lock = threading.Lock()
        self._local = threading.local()
        self._pool: ThreadPoolExecutor | None = None

    # -- the ReadEngine interface ------------------------------------------
    def run(
        self,
        rows: np.ndarray,
        bounds: np.ndarray,
        tables: np.ndarray,
        bases: np.ndarray,
        out: np.ndarray,
    ) -> ReadStats:
        n = int(rows.size)
        if bounds[0] != 0 or bounds[-1] != n or bool((bounds[1:] < bounds[:-1]).any()):
            raise ConfigError(f"read_runs: bounds must rise from 0 to {n}, got {bounds.tolist()!r}")
        plan = self.planner.plan_runs(rows, bounds, tables, bases)
        fds = self.files.fds_of(plan.file)  # a missing shard raises here, before any read
        self.execute(plan, fds, out)
        return ReadStats(n, int(plan.file.size), plan.total)

    def run_clean(
        self,
        rows: np.ndarray,
        bounds: np.ndarray,
        tables: np.ndarray,
        bases: np.ndarray,
        out: np.ndarray,
    ) -> tuple[int, int, int] | None:
        return None  # every batch goes through the reader's checks

    def start(
        self,
        rows: np.ndarray,
        bounds: np.ndarray,
        tables: np.ndarray,
        bases: np.ndarray,
        out: np.ndarray,
        ctl: np.ndarray | None,
        seq: int,
    ) -> bool:
        return False  # no thread of its own to read on

    def join(self) -> tuple[int, int, int]:
        raise RuntimeError(f"the {self.name} engine starts no batch apart: nothing to join")

    @property
    def reading_apart(self) -> bool:
        return False

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    # -- resources ---------------------------------------------------------
    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self.queue_depth, thread_name_prefix="rowcache-read"
                )
            return self._pool

    def _buffer(self, nbytes: int) -> np.ndarray:
        """This thread's read buffer (page-aligned, grown as needed, reused: no page faults
        of a fresh allocation on every call)."""
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.size < nbytes:
            buf = aligned_empty(max(nbytes, 2 * (0 if buf is None else buf.size), 1 << 16))
            self._local.buf = buf
        return buf

    # -- reading -----------------------------------------------------------
    def execute(self, plan: Plan, fds: np.ndarray, out: np.ndarray) -> None:
        """Read the plan's extents, check their pages, cut the records into ``out``."""
        rec = out.shape[1]
        buf = self._buffer(plan.total)
        got = np.zeros(plan.file.size, dtype=np.int64)
        err = np.zeros(plan.file.size, dtype=np.int32)
        self.read_extents(plan, fds, buf, got, err)
        err[(err == 0) & (got < plan.need)] = SHORT
        failed = np.flatnonzero(err)
        if failed.size:
            e = int(failed[0])
            raise_read(self.files, plan, e, int(got[e]), int(err[e]), failed.size - 1)
        checks = self.planner.page_checks(plan) if self.verify_pages else None
        if checks is not None:
            page_pos, _, expect = checks
            npages = plan.length // ALIGN
            first_page = np.cumsum(npages) - npages
            first_bad, nbad = None, 0
            for e in range(plan.file.size):  # a loop over extents
                a, k = int(first_page[e]), int(npages[e])
                crc = _page_crcs(buf[plan.pos[e] : plan.pos[e] + got[e]])
                have = np.full(k, -1, dtype=np.int64)
                have[: min(k, crc.size)] = crc[:k]
                bad = np.flatnonzero(have != expect[a : a + k])
                if bad.size and first_bad is None:
                    first_bad = (e, a + int(bad[0]), int(max(have[bad[0]], 0)))
                nbad += bad.size
            if first_bad is not None:
                e, j, seen = first_bad
                at = int(plan.start[e] + page_pos[j] - plan.pos[e])
                raise_page(self.files, plan, e, at, seen, int(expect[j]), nbad - 1)
        windows = np.lib.stride_tricks.as_strided(
            buf, shape=(plan.total - rec + 1, rec), strides=(1, 1)
        )
        out[:] = windows[
            plan.src
        ]  # fancy indexing copies row by row; np.take would copy `windows` whole

    def read_extents(
        self, plan: Plan, fds: np.ndarray, buf: np.ndarray, got: np.ndarray, err: np.ndarray
    ) -> None:
        """Fill ``got``/``err`` (errno, 0 ok) of every extent, reading with ``os.preadv``
        on up to ``queue_depth`` threads."""
        mv = memoryview(buf.data)
        jobs = list(
            zip(
                range(plan.file.size),
                fds.tolist(),
                plan.start.tolist(),
                plan.length.tolist(),
                plan.pos.tolist(),
            )
        )

        def work(part: list[tuple[int, int, int, int, int]]) -> None:
            for e, fd, start, length, pos in part:
                n, code = 0, 0
                while n < length:
                    try:
                        k = os.preadv(fd, [mv[pos + n : pos + length]], start + n)
                    except InterruptedError:
                        continue
                    except OSError as ex:
                        code = ex.errno or errno.EIO
                        break
                    if k == 0:
                        break
                    n += k
                    if self.direct and n % 512:
                        break  # an O_DIRECT read ends off a sector only at end of file
                got[e], err[e] = n, code

        workers = min(self.queue_depth, len(jobs))
        if workers <= 1:
            work(jobs)
            return
        futures = [self._executor().submit(work, jobs[i::workers]) for i in range(workers)]
        for f in futures:
            f.result()


def raise_read(files: ShardFiles, plan: Plan, e: int, got: int, code: int, more: int) -> NoReturn:
    """Raise the error of extent ``e``'s failed read (``code``: its errno, or ``SHORT``)."""
    t, s, where = where_in(files, plan, e)
    name, start = files.shard_files[t][s], int(plan.start[e])
    if code == SHORT:
        msg = (
            f"short read of shard {name} at offset {start}: {got} of {int(plan.need[e])} "
            f"bytes ({where}); the shard is truncated, run `rowcache verify`"
        )
    else:
        msg = (
            f"read of shard {name} at offset {start} ({int(plan.length[e])} bytes, {where}) "
            f"failed: [Errno {code}] {os.strerror(code)}"
        )
    raise CorruptDataError(msg + (f" (and {more} more failed reads)" if more > 0 else ""))


def raise_page(
    files: ShardFiles, plan: Plan, e: int, at: int, seen: int, stored: int, more: int
) -> NoReturn:
    """Raise the error of a page of extent ``e`` (at file offset ``at``) whose crc32c is
    ``seen``, not the ``stored`` one."""
    t, s, where = where_in(files, plan, e, (at, at + ALIGN))
    raise CorruptDataError(
        f"page checksum mismatch in shard {files.shard_files[t][s]} at byte offset {at} "
        f"({where}): crc32c {seen:08x}, stored {stored:08x}; run `rowcache verify`"
        + (f" (and {more} more bad pages)" if more > 0 else "")
    )


def where_in(
    files: ShardFiles, plan: Plan, e: int, span: tuple[int, int] | None = None
) -> tuple[int, int, str]:
    """Table, shard and 'table NAME, rows ...' of extent ``e`` (or of its bytes ``span``)."""
    f = int(plan.file[e])
    t, s = int(files.file_table[f]), int(files.file_shard[f])
    info = files.tables[t]
    lo, hi = np.searchsorted(plan.row_ext, [e, e + 1])
    offs = plan.row_off[lo:hi]
    if span is not None:  # the requested rows on these bytes, else the rows stored there
        keep = (offs < span[1]) & (offs + info.record_bytes > span[0])
        offs = offs[keep] if keep.any() else np.array([span[0]], dtype=np.int64)
    page, slot = np.divmod(offs, info.page_bytes)
    rows = (
        s * info.rows_per_shard
        + page * info.rows_per_page
        + np.minimum(slot // info.record_bytes, info.rows_per_page - 1)
    )
    r = f"row {rows[0]}" if rows.size == 1 else f"rows {rows[0]}..{rows[-1]} ({rows.size} rows)"
    return t, s, f"table {info.name!r}, {r}"
