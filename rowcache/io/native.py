"""The native engine of :class:`rowcache.io.reader.RowReader`: ``rowcache.io._rcio``.

Owns the process's ``_rcio.Reader`` (made on first use and again after ``fork``, given
the reader's layout once: tables, shard files, page checksums, options) and a batch read
in one call of it: locate, plan, read (io_uring, or ``pread`` threads), check pages, cut
the records (mixin :class:`NativeEngine`; ``RowReader.read_runs`` and the row cache's
fault path, ``read_batch``, come here). A failed batch's error is worded by the Python
engine's messages (``rowcache.io.pyengine``), on the same read plan.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from rowcache.errors import ConfigError, CorruptDataError, RowRangeError
from rowcache.io.pyengine import PythonEngine
from rowcache.store import format as fmt

try:
    from rowcache.io import _rcio  # type: ignore[attr-defined]
except ImportError:  # built by setup.py; without a compiler the Python engine runs
    _rcio = None

#: whether the C engine (``rowcache.io._rcio``) is built here
NATIVE_BUILT = _rcio is not None


PREADV = os.preadv  # as imported: a test that replaces os.preadv (faults) gets the Python engine
_LEAKED: list[
    Any
] = []  # buffers a failed io_uring may still write into, native readers of a parent process


@dataclass(frozen=True)
class ReadStats:
    """What one ``read_records``/``read_parts`` call did."""

    rows: int
    read_ops: int
    bytes_read: int


class NativeEngine:
    """The native engine of a :class:`rowcache.io.reader.RowReader` (a mixin over its tables,
    files, options and page checksums)."""

    tables: list[fmt.TableInfo]
    queue_depth: int
    direct: bool
    merge_gap: int
    max_extent: int
    verify_pages: bool
    spin_us: int
    background: bool
    _engine_asked: str
    _native: Any
    _native_pid: int
    _opened_all: bool
    _started: Any
    _file_base: np.ndarray
    _file_table: np.ndarray
    _file_shard: np.ndarray
    _fd_arr: np.ndarray
    _fd: Any
    _crc: np.ndarray | None
    # the Python engine's (RowReader's other base): the plan and the named errors it raises
    plan_parts: Callable[..., Any]
    read_runs: Callable[..., Any]
    _raise_read: Callable[..., NoReturn]
    _raise_page: Callable[..., NoReturn]
    _read_extents: Callable[..., Any]
    _crc_base: np.ndarray

    def _native_reader(self) -> Any:
        """The process's ``_rcio.Reader`` (a new one after ``fork``: the parent's ring and
        threads are not the child's; the old object is kept, never torn down, in the child)."""
        pid = os.getpid()
        if self._native is None or self._native_pid != pid:
            if self._native is not None:
                _LEAKED.append(self._native)
            kind = "auto" if self._engine_asked in ("auto", "python") else self._engine_asked
            try:
                native = _rcio.Reader(self.queue_depth, kind, self.spin_us, self.background)
            except OSError as e:
                raise ConfigError(
                    f"engine={self._engine_asked!r}: io_uring is unavailable here ({e})"
                ) from e
            tabs = self.tables
            col = lambda f: np.array([f(t) for t in tabs], dtype=np.int64)  # noqa: E731
            native.set_layout(
                col(lambda t: t.rows),
                col(lambda t: t.rows_per_page),
                col(lambda t: t.pages_per_shard),
                col(lambda t: t.page_bytes),
                col(lambda t: t.record_bytes),
                self._file_base,
                self._fd_arr,
                self._crc,
                None if self._crc is None else self._crc_base,
                self.merge_gap,
                self.max_extent,
                self.direct,
            )
            self._native, self._native_pid = native, pid
        return self._native

    def read_batch(
        self, rows: np.ndarray, bounds: np.ndarray, tables: np.ndarray, bases: np.ndarray,
        out: np.ndarray,
    ) -> tuple[int, int, int]:  # fmt: skip
        """:meth:`read_runs` for a caller whose arrays are in its form already (the row
        cache's fault path): ``rows`` and ``bounds`` int64, ``tables`` int32, ``bases``
        int64, ``out`` uint8 ``[n, record_bytes]`` C-contiguous. Returns (rows, bytes,
        read ops). A batch that reads cleanly is one native call with no Python checks;
        anything else (the Python engine, a shard not opened yet, a failed read or page
        check, a bad row) runs :meth:`read_runs`, which opens files or raises the named
        error. The same records, stats and errors as :meth:`read_runs`."""
        native = self._native
        if (
            native is not None
            and self._native_pid == os.getpid()
            and os.preadv is PREADV
            and self._native_path
        ):
            st, reads, nbytes = native.read_runs(rows, bounds, tables, bases, out,
                                                 self.verify_pages)[:3]  # fmt: skip
            if st == 0:
                return rows.size, nbytes, reads
        _, rs = self.read_runs(rows, bounds, tables, bases, out=out)
        return rs.rows, rs.bytes_read, rs.read_ops

    def read_batch_start(
        self, rows: np.ndarray, bounds: np.ndarray, tables: np.ndarray, bases: np.ndarray,
        out: np.ndarray, ctl: np.ndarray | None, seq: int,
    ) -> bool:  # fmt: skip
        """Start :meth:`read_batch`'s batch on the native reader's own thread and return at
        once (True); False, having started nothing, where it cannot run there (the Python
        engine, another engine's reader, a shard file that cannot be opened, another
        caller's batch still apart: :meth:`read_batch` then, which waits for that one).
        When the batch ends the thread writes ``ctl`` (int32[2], e.g. pinned memory a GPU
        polls, or None): ``ctl[1] = seq`` if it read cleanly (else ``seq - 1``), then
        ``ctl[0] = seq``. The caller keeps ``out`` and the arrays alive until it calls
        :meth:`read_batch_join`."""
        native = self._native
        if (
            native is None
            or self._started is not None  # one batch apart at a time (another cache's)
            or self._native_pid != os.getpid()
            or os.preadv is not PREADV
            or not self._native_path
            or not self._all_open()
        ):
            return False
        native.read_runs_start(rows, bounds, tables, bases, out, self.verify_pages, ctl, seq)
        self._started = (rows, bounds, tables, bases)
        return True

    def read_batch_join(self) -> tuple[int, int, int]:
        """Wait for the batch :meth:`read_batch_start` started; returns (rows, bytes, read
        ops), or raises the error :meth:`read_batch` would have raised (its ``ctl`` told
        the caller's GPU so already)."""
        rows, bounds, tables, bases = self._started
        self._started = None
        try:
            res = self._native.read_runs_join()
        except OSError as ex:  # io_uring_enter failed: later batches use threads
            raise CorruptDataError(f"a read batch of {rows.size} rows failed: {ex}") from ex
        if res[0] == 0:
            return rows.size, res[2], res[1]
        self._raise_status(rows, bounds, tables, bases, res)

    def _all_open(self) -> bool:
        """Every shard file of the store is open (a native batch then never stops for
        one): opened here the first time (False if one cannot be: a batch that needs it
        raises its error)."""
        if not self._opened_all:
            try:
                for f in np.flatnonzero(self._fd_arr < 0).tolist():  # once a file, once
                    self._fd(int(self._file_table[f]), int(self._file_shard[f]))
            except (OSError, CorruptDataError, ConfigError):
                return False
            self._opened_all = True
        return True

    def _read_native(
        self,
        rows: np.ndarray,
        bounds: np.ndarray,
        tables: np.ndarray,
        bases: np.ndarray,
        out: np.ndarray,
    ) -> ReadStats:
        """One ``_rcio`` call: locate, plan, read, check pages, cut (the GIL released)."""
        native = self._native if self._native_pid == os.getpid() else self._native_reader()
        verify = self.verify_pages
        for _ in range(len(self._fd_arr) + 1):
            try:
                st, reads, nbytes, a, b, c, d, e, f = native.read_runs(
                    rows, bounds, tables, bases, out, verify
                )
            except ValueError as ex:  # bounds not rising from 0 to n, say
                raise ConfigError(f"{ex}: bounds must rise from 0 to {rows.size}") from ex
            except OSError as ex:  # io_uring_enter failed: the engine falls back to threads
                raise CorruptDataError(f"a read batch of {rows.size} rows failed: {ex}") from ex
            if st != 3:
                break
            self._fd(int(self._file_table[b]), int(self._file_shard[b]))  # opens or raises
        if st == 0:
            return ReadStats(int(rows.size), reads, nbytes)
        self._raise_status(rows, bounds, tables, bases, (st, reads, nbytes, a, b, c, d, e, f))

    def _raise_status(
        self, rows: np.ndarray, bounds: np.ndarray, tables: np.ndarray, bases: np.ndarray,
        res: tuple[int, ...],
    ) -> NoReturn:  # fmt: skip
        """Raise the named error of a native batch's failed result ``res``."""
        st, reads, _, a, b, c, d, e, f = res
        if st == 3:  # (a batch started apart checks that every file is open first)
            t, sh = int(self._file_table[b]), int(self._file_shard[b])
            raise CorruptDataError(f"table {self.tables[t].name!r}: shard {sh} was not open")
        if st == 4:
            k = int(np.searchsorted(bounds, a, side="right")) - 1
            info = self.tables[int(tables[k])]
            raise RowRangeError(
                f"row {b} of table {info.name!r} is out of range (the table has {info.rows} rows)"
            )
        parts = [
            (int(t), rows[bounds[k] : bounds[k + 1]] - bases[k])
            for k, t in enumerate(tables.tolist())
            if bounds[k] < bounds[k + 1]
        ]
        plan = self.plan_parts(parts)  # the same plan as C's: names the rows of extent a
        if st == 1:
            self._raise_read(plan, a, d, f, reads - 1)
        self._raise_page(plan, a, c, d, e, f - 1)

    @property
    def _native_path(self) -> bool:
        """False for a reader whose extents another engine reads (``KvikioRowReader``)."""
        return type(self)._read_extents is PythonEngine._read_extents
