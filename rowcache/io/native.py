"""The native engines of :class:`rowcache.io.reader.RowReader`: ``rowcache.io._rcio``.

Owns :class:`NativeEngine`: the process's ``_rcio.Reader`` (io_uring, or ``pread``
threads; made at construction and again after ``fork``, given the reader's layout once:
tables, shard files' descriptor table, page checksums, options), a batch read in one call
of it (locate, plan, read, check pages, cut the records: the row cache's fault path,
``RowReader.read_batch``, comes here), a batch read apart on the native reader's own
thread, and :class:`ReadStatus`, the statuses of a batch's result (``_rcio.BatchResult``,
named fields; both are ``csrc/rcio_status.h``'s). A failed batch's error is worded by the
Python engine's messages (``rowcache.io.pyengine``), on the same read plan. Which engine
a reader runs is its ``engine=`` (``RowReader``), never a property of the process.
"""

from __future__ import annotations

import os
from enum import IntEnum
from typing import Any, NoReturn

import numpy as np

from rowcache.errors import ConfigError, CorruptDataError, RowRangeError
from rowcache.io.engine import ReadStats
from rowcache.io.files import ShardFiles
from rowcache.io.plan import ReadPlanner
from rowcache.io.pyengine import raise_page, raise_read
from rowcache.kernels import extensions

# built by setup.py; without a compiler the Python engine runs (and warns once: the reader)
_rcio: Any = extensions.load("rowcache.io._rcio")

#: whether the C engine (``rowcache.io._rcio``) is built here
NATIVE_BUILT = _rcio is not None

_LEAKED: list[Any] = []  # buffers a failed io_uring may still write into; a parent's readers


class ReadStatus(IntEnum):
    """The status of a native batch (``BatchResult.status``; ``csrc/rcio_status.h``, whose
    values the module exports as ``READ_OK`` .. ``READ_BAD_ROW``). A ``BatchResult``'s other
    fields: ``reads``, ``nbytes`` (the plan's read ops and bytes), and by status ``at``,
    ``file``, ``offset``, ``got``, ``want``, ``code``, ``row`` (the header says which)."""

    OK = 0
    """Every row read, every page checked, the records cut into ``out``."""
    FAILED = 1
    """A read failed or was short: extent ``at`` of ``file`` at ``offset``, ``got`` of
    ``want`` bytes, ``code`` its errno (-1: short); ``reads`` failed in all."""
    BAD_PAGE = 2
    """A page's CRC32C differs: extent ``at`` of ``file``, the page at ``offset``, its
    CRC32C ``got``, the store's ``want``; ``code`` bad pages in all."""
    NOT_OPEN = 3
    """``file`` is not open: nothing was read (the reader opens it, or raises)."""
    BAD_ROW = 4
    """``rows[at]`` is ``row`` of its table, outside it."""


OK, NOT_OPEN, FAILED = ReadStatus.OK, ReadStatus.NOT_OPEN, ReadStatus.FAILED


class NativeEngine:
    """The ``"uring"``, ``"threads"`` or ``"uring+threads"`` engine (``kind``: one of
    them, or ``"auto"``: io_uring where the kernel allows it) of one reader (a
    :class:`rowcache.io.engine.ReadEngine`). ``ConfigError`` where io_uring is asked and
    unavailable. Its ``name`` is the kind the native reader chose."""

    def __init__(
        self,
        files: ShardFiles,
        planner: ReadPlanner,
        *,
        kind: str,
        queue_depth: int,
        direct: bool,
        verify_pages: bool,
        spin_us: int,
        background: bool,
    ) -> None:
        self.files = files
        self.planner = planner
        self.kind = kind
        self.queue_depth = queue_depth
        self.direct = direct
        self.verify_pages = verify_pages
        self.spin_us = spin_us
        self.background = background
        self._native: Any = None
        self._native_pid = 0
        self._started: Any = None  # the arrays of a batch started apart, until joined
        self.name: str = self.native.engine

    @property
    def native(self) -> Any:
        """The process's ``_rcio.Reader`` (a new one after ``fork``: the parent's ring and
        threads are not the child's; the old object is kept, never torn down, in the child)."""
        pid = os.getpid()
        if self._native is None or self._native_pid != pid:
            if self._native is not None:
                _LEAKED.append(self._native)
            try:
                native = _rcio.Reader(self.queue_depth, self.kind, self.spin_us, self.background)
            except OSError as e:
                raise ConfigError(
                    f"engine={self.kind!r}: io_uring is unavailable here ({e})"
                ) from e
            tabs = self.planner.tables
            col = lambda f: np.array([f(t) for t in tabs], dtype=np.int64)  # noqa: E731
            native.set_layout(
                col(lambda t: t.rows),
                col(lambda t: t.rows_per_page),
                col(lambda t: t.pages_per_shard),
                col(lambda t: t.page_bytes),
                col(lambda t: t.record_bytes),
                self.files.file_base,
                self.files.fds,
                self.planner.crc,
                None if self.planner.crc is None else self.planner.crc_base,
                self.planner.merge_gap,
                self.planner.max_extent,
                self.direct,
            )
            self._native, self._native_pid = native, pid
        return self._native

    def run_clean(
        self,
        rows: np.ndarray,
        bounds: np.ndarray,
        tables: np.ndarray,
        bases: np.ndarray,
        out: np.ndarray,
    ) -> tuple[int, int, int] | None:
        """A batch that reads cleanly is one native call with no Python checks; None for
        anything else (a new process, a shard not opened yet, a failed read or page check, a
        bad row): the reader's checks and :meth:`run` then open files or raise the named
        error."""
        native = self._native
        if native is not None and self._native_pid == os.getpid():
            res = native.read_runs(rows, bounds, tables, bases, out, self.verify_pages)
            if res.status == OK:
                return rows.size, res.nbytes, res.reads
        return None

    def run(
        self,
        rows: np.ndarray,
        bounds: np.ndarray,
        tables: np.ndarray,
        bases: np.ndarray,
        out: np.ndarray,
    ) -> ReadStats:
        """One ``_rcio`` call: locate, plan, read, check pages, cut (the GIL released); C
        checks the bounds and the rows."""
        native = self._native
        if native is None or self._native_pid != os.getpid():
            native = self.native
        verify = self.verify_pages
        files = self.files
        for _ in range(len(files.fds) + 1):
            try:
                res = native.read_runs(rows, bounds, tables, bases, out, verify)
            except ValueError as ex:  # bounds not rising from 0 to n, say
                raise ConfigError(f"{ex}: bounds must rise from 0 to {rows.size}") from ex
            except OSError as ex:  # io_uring_enter failed: the engine falls back to threads
                raise CorruptDataError(f"a read batch of {rows.size} rows failed: {ex}") from ex
            if res.status != NOT_OPEN:
                break
            files.fd_of(res.file)  # opens or raises
        if res.status == OK:
            return ReadStats(int(rows.size), res.reads, res.nbytes)
        self._raise_status(rows, bounds, tables, bases, res)

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
        """Start the batch on the native reader's own thread (``RowReader.read_batch_start``);
        False, having started nothing, where it cannot run there (a new process, a shard
        file that cannot be opened, another caller's batch still apart)."""
        native = self._native
        if (
            native is None
            or self._started is not None  # one batch apart at a time (another cache's)
            or self._native_pid != os.getpid()
            or not self.files.open_all()
        ):
            return False
        native.read_runs_start(rows, bounds, tables, bases, out, self.verify_pages, ctl, seq)
        self._started = (rows, bounds, tables, bases)
        return True

    def join(self) -> tuple[int, int, int]:
        """Wait for the batch :meth:`start` started; (rows, bytes, read ops), or the error
        ``RowReader.read_batch`` would have raised."""
        rows, bounds, tables, bases = self._started
        self._started = None
        try:
            res = self._native.read_runs_join()
        except OSError as ex:  # io_uring_enter failed: later batches use threads
            raise CorruptDataError(f"a read batch of {rows.size} rows failed: {ex}") from ex
        if res.status == OK:
            return rows.size, res.nbytes, res.reads
        self._raise_status(rows, bounds, tables, bases, res)

    @property
    def reading_apart(self) -> bool:
        return self._started is not None

    def close(self) -> None:
        """Release the native reader (its io_uring ring, its threads and their descriptor:
        freed with the object) unless a batch started apart is still to be joined; a later
        batch makes a new one."""
        if self._started is None and self._native_pid == os.getpid():
            self._native = None

    def _raise_status(
        self,
        rows: np.ndarray,
        bounds: np.ndarray,
        tables: np.ndarray,
        bases: np.ndarray,
        res: Any,
    ) -> NoReturn:
        """Raise the named error of a native batch's failed result ``res`` (a
        ``_rcio.BatchResult``: fields as :class:`ReadStatus` tells)."""
        status = ReadStatus(res.status)
        files, info_of = self.files, self.planner.tables
        if status == NOT_OPEN:  # (a batch started apart checks that every file is open first)
            t, sh = int(files.file_table[res.file]), int(files.file_shard[res.file])
            raise CorruptDataError(f"table {info_of[t].name!r}: shard {sh} was not open")
        if status == ReadStatus.BAD_ROW:
            k = int(np.searchsorted(bounds, res.at, side="right")) - 1
            info = info_of[int(tables[k])]
            raise RowRangeError(
                f"row {res.row} of table {info.name!r} is out of range (the table has "
                f"{info.rows} rows)"
            )
        if status == OK:
            raise AssertionError("a clean batch's result taken for a failed one")
        plan = self.planner.plan_runs(rows, bounds, tables, bases)  # the same plan as C's
        if status == FAILED:
            raise_read(files, plan, res.at, res.got, res.code, res.reads - 1)
        raise_page(files, plan, res.at, res.offset, res.got, res.want, res.code - 1)
