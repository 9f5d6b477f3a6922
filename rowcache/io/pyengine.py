"""The Python engine of :class:`rowcache.io.reader.RowReader`, and what a failed batch says.

Owns the engine that runs a read plan (``rowcache.io.plan``) where the native
extension is not built or ``os.preadv`` is replaced (fault injection): threads of
``os.preadv``, the page checks by ``rowcache.io.checksum``, the records cut from the
buffer; and the messages of a failed read or page check, naming shard, offset, table
and rows, which the native engines raise too (mixin :class:`PythonEngine`). The loops
are over extents and threads, never over rows.
"""

from __future__ import annotations

import errno
import os
from typing import Any, NoReturn

import numpy as np

from rowcache.errors import CorruptDataError
from rowcache.io.checksum import page_crcs as _page_crcs
from rowcache.io.plan import ALIGN, Plan
from rowcache.store import format as fmt

SHORT = -1  # err code of a read that hit the end of file before the bytes it needed


class PythonEngine:
    """The Python engine and the failure messages of a :class:`rowcache.io.reader.RowReader`
    (a mixin over its tables, files, page checksums, buffers and thread pool)."""

    tables: list[fmt.TableInfo]
    shard_files: list[list[str]]
    queue_depth: int
    direct: bool
    verify_pages: bool
    _crc: np.ndarray | None
    _crc_base: np.ndarray
    _file_table: np.ndarray
    _file_shard: np.ndarray

    def _buffer(self, nbytes: int) -> np.ndarray:
        raise NotImplementedError

    def _executor(self) -> Any:
        raise NotImplementedError

    def _checks(self, plan: Plan) -> tuple[np.ndarray, ...] | None:
        """Per page read: buffer offset, its read, the expected crc32c (or None: no checks)."""
        if self._crc is None or not self.verify_pages:
            return None
        npages = plan.length // ALIGN
        page_read = np.repeat(np.arange(npages.size, dtype=np.int32), npages)
        j = np.arange(page_read.size, dtype=np.int64) - np.repeat(
            np.cumsum(npages) - npages, npages
        )
        page_pos = plan.pos[page_read] + j * ALIGN
        file_page = plan.start[page_read] // ALIGN + j
        expect = self._crc[self._crc_base[plan.file[page_read]] + file_page]
        return page_pos, page_read, expect

    def _execute(self, plan: Plan, fds: np.ndarray, out: np.ndarray, rec: int) -> None:
        """The Python engine: read the plan's extents, check their pages, cut the records."""
        buf = self._buffer(plan.total)
        got = np.zeros(plan.file.size, dtype=np.int64)
        err = np.zeros(plan.file.size, dtype=np.int32)
        self._read_extents(plan, fds, buf, got, err)
        err[(err == 0) & (got < plan.need)] = SHORT
        failed = np.flatnonzero(err)
        if failed.size:
            e = int(failed[0])
            self._raise_read(plan, e, int(got[e]), int(err[e]), failed.size - 1)
        checks = self._checks(plan)
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
                self._raise_page(plan, e, at, seen, int(expect[j]), nbad - 1)
        windows = np.lib.stride_tricks.as_strided(
            buf, shape=(plan.total - rec + 1, rec), strides=(1, 1)
        )
        out[:] = windows[
            plan.src
        ]  # fancy indexing copies row by row; np.take would copy `windows` whole

    def _read_extents(
        self, plan: Plan, fds: np.ndarray, buf: np.ndarray, got: np.ndarray, err: np.ndarray
    ) -> None:
        """The Python engine: fill ``got``/``err`` (errno, 0 ok) of every extent, reading
        with ``os.preadv`` on up to ``queue_depth`` threads."""
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

    def _raise_read(self, plan: Plan, e: int, got: int, code: int, more: int) -> NoReturn:
        t, s, where = self._where(plan, e)
        name, start = self.shard_files[t][s], int(plan.start[e])
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

    def _raise_page(
        self, plan: Plan, e: int, at: int, seen: int, stored: int, more: int
    ) -> NoReturn:
        t, s, where = self._where(plan, e, (at, at + ALIGN))
        raise CorruptDataError(
            f"page checksum mismatch in shard {self.shard_files[t][s]} at byte offset {at} "
            f"({where}): crc32c {seen:08x}, stored {stored:08x}; run `rowcache verify`"
            + (f" (and {more} more bad pages)" if more > 0 else "")
        )

    def _where(
        self, plan: Plan, e: int, span: tuple[int, int] | None = None
    ) -> tuple[int, int, str]:
        """Table, shard and 'table NAME, rows ...' of extent ``e`` (or of its bytes ``span``)."""
        f = int(plan.file[e])
        t, s = int(self._file_table[f]), int(self._file_shard[f])
        info = self.tables[t]
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
