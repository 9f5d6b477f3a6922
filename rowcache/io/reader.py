"""The row reader: one offset-sorted, page-granular read plan per call, one dispatch.

Owns running the reads of the rows of one or several tables (the parts of a shared
arena's fault) as one batch: the plan (``rowcache.io.plan``: rows located in their
shard files, widened to whole 4 KiB pages, sorted by (file, offset), nearby pages merged
into one extent) runs in ``rowcache.io._rcio`` (``rowcache.io.native``: io_uring, or a
pool of ``pread`` threads;
min(reads, queue_depth) in flight; the GIL released), which also checks the CRC32C of
every page read against the store's page checksums and cuts the records into the
caller's buffer; and the reader's files, buffers and options. Where the extension is not
built, the same plan runs on Python threads of ``os.preadv`` with the same results
(``rowcache.io.pyengine``, which also words a failed batch's errors). The loops here are
over extents, files and threads, never over rows.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from rowcache.errors import ConfigError, CorruptDataError
from rowcache.io.native import NATIVE_BUILT, PREADV, NativeEngine, ReadStats
from rowcache.io.plan import ALIGN, ReadPlanner
from rowcache.io.pyengine import PythonEngine
from rowcache.store import format as fmt

DEFAULT_MERGE_GAP = 16 << 10
ENGINES = ("auto", "uring", "threads", "python")


def _as(a: Any, dtype: np.dtype) -> np.ndarray:
    """``a`` as a C-contiguous 1-D array of ``dtype`` (no copy when it is one)."""
    if type(a) is np.ndarray and a.dtype is dtype and a.ndim == 1 and a.flags.c_contiguous:
        return a
    return np.ascontiguousarray(a, dtype=dtype).reshape(-1)


_I64, _I32 = np.dtype(np.int64), np.dtype(np.int32)
DEFAULT_SPIN_US = 100  # a cold NVMe read is 25-100 us; a longer wait sleeps


def aligned_empty(nbytes: int, align: int = ALIGN) -> np.ndarray:
    """A uint8 buffer of ``nbytes`` whose address is a multiple of ``align`` (for O_DIRECT)."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    shift = (-raw.ctypes.data) % align
    return raw[shift : shift + nbytes]


class RowReader(ReadPlanner, PythonEngine, NativeEngine):
    """Reads store records of many rows, of one or several tables, at once.

    Parameters
    ----------
    root : the store directory.
    tables : the store's tables (``TableInfo``), indexed by table number.
    shard_files : ``shard_files[t][s]`` is the file name of shard ``s`` of table ``t``.
    queue_depth : reads in flight, 1..1024.
    direct : open shard files with ``O_DIRECT`` (no page cache).
    merge_gap : pages whose byte gap is at most this many bytes share one read. The
        default, 16 KiB, is where reading the gap costs about what a second read costs on
        the measured disks (one random read ~13 us at 78k/s against 16 KiB at 1.3 GB/s).
    max_extent : no merged read grows past this many bytes.
    engine : ``"auto"`` (io_uring where the kernel allows it, else the pread threads of
        ``rowcache.io._rcio``; the Python engine where the extension is not built),
        ``"uring"``, ``"threads"`` (both need the extension) or ``"python"`` (Python
        threads of ``os.preadv``). Every engine gives the same records and the same errors.
        Tests that replace ``os.preadv`` (fault injection) get the Python engine.
    page_crcs : ``page_crcs[t][s]`` is ``uint32[pages]``, the crc32c of each 4096-byte page
        of shard ``s`` of table ``t`` (``rowcache.io.checksum``). Given, every page read is
        checked and a mismatch raises ``CorruptDataError`` naming shard, offset, table and row.
    verify_pages : ``False`` skips the page checks even with ``page_crcs``: for benchmarks
        that measure what the checks cost, never for serving.
    spin_us : io_uring only, batches of at most ``queue_depth`` reads: wait for each
        completion by polling for up to this many microseconds before sleeping (0: always
        sleep). A caller that sleeps pays a wake-up per completion: on the H200 machine
        polling took one cold 4 KiB read from 37-39 to 34 us, on the dev machine from
        46-47 to 33-37 us (``docs/results/2026-12-01-sixth-session.md``, measured by
        the since retired ``bench/read_latency.py``). Longer batches always sleep (polling read them slower). It costs the
        caller's core while it polls, so background readers (prefetch) keep 0.
    background : native engines only: this reader yields the disk to demand reads. While
        any other reader of the process that is not ``background`` runs a batch, this one
        submits no new read (its reads in flight finish), so a step's fault does not queue
        behind a prefetch's thousands of reads. The cache's prefetch reader sets it.

    Thread safety: one reader may be used from several threads; each thread has its own
    read buffer, native batches run one at a time, file descriptors are opened under a lock.
    """

    def __init__(
        self,
        root: str,
        tables: list[fmt.TableInfo],
        shard_files: list[list[str]],
        *,
        queue_depth: int = 32,
        direct: bool = False,
        merge_gap: int = DEFAULT_MERGE_GAP,
        max_extent: int = 1 << 20,
        engine: str = "auto",
        page_crcs: list[list[np.ndarray]] | None = None,
        verify_pages: bool = True,
        spin_us: int = DEFAULT_SPIN_US,
        background: bool = False,
    ) -> None:
        if (
            isinstance(queue_depth, bool)
            or not isinstance(queue_depth, int)
            or not 1 <= queue_depth <= 1024
        ):
            raise ConfigError(f"queue_depth={queue_depth!r}: give an integer in 1..1024")
        if direct and not hasattr(os, "O_DIRECT"):
            raise ConfigError("direct=True: this platform has no O_DIRECT; use direct=False")
        if not isinstance(merge_gap, int) or merge_gap < 0:
            raise ConfigError(f"merge_gap={merge_gap!r}: give a byte count >= 0")
        if max_extent < ALIGN:
            raise ConfigError(f"max_extent={max_extent!r}: give at least {ALIGN} bytes")
        if engine not in ENGINES:
            raise ConfigError(f"engine={engine!r} is not supported; allowed: {', '.join(ENGINES)}")
        if isinstance(spin_us, bool) or not isinstance(spin_us, int) or not 0 <= spin_us <= 100_000:
            raise ConfigError(
                f"spin_us={spin_us!r}: give an integer number of microseconds in 0..100000"
            )
        if engine in ("uring", "threads") and not NATIVE_BUILT:
            raise ConfigError(
                f"engine={engine!r} needs the native extension rowcache.io._rcio, which is not "
                "built here (reinstall with a C compiler: pip install -e .); use engine='python'"
            )
        self.root = root
        self.tables = tables
        self.shard_files = shard_files
        self.queue_depth = queue_depth
        self.direct = direct
        self.merge_gap = merge_gap
        self.max_extent = max_extent
        self.verify_pages = verify_pages
        self.spin_us = spin_us
        self.background = bool(background)
        self.page_crcs = page_crcs
        self._engine_asked = engine
        counts = np.array([len(f) for f in shard_files], dtype=np.int64)
        self._file_base = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._file_table = np.repeat(np.arange(len(shard_files)), counts)
        self._file_shard = np.arange(int(counts.sum())) - self._file_base[self._file_table]
        self._fd_arr = np.full(int(counts.sum()), -1, dtype=np.int32)
        self._fds: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._rec_of: dict[bytes, int] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._crc: np.ndarray | None = None
        self._crc_base = np.zeros(0, dtype=np.int64)
        if page_crcs is not None:
            self._set_page_crcs(page_crcs)
        self._native: Any = None
        self._native_pid = 0
        self._opened_all = False  # every shard file open (read_native's batches apart)
        self._started: Any = None  # the arrays of a batch started apart, until joined
        self.engine = (
            "python" if engine == "python" or not NATIVE_BUILT else self._native_reader().engine
        )

    def options(self, **changes: Any) -> dict[str, Any]:
        """This reader's keyword settings with ``changes`` applied: a sibling reader is
        ``RowReader(root, tables, shard_files, **reader.options(queue_depth=64))``."""
        opts = {
            "queue_depth": self.queue_depth,
            "direct": self.direct,
            "merge_gap": self.merge_gap,
            "max_extent": self.max_extent,
            "engine": self._engine_asked,
            "page_crcs": self.page_crcs,
            "verify_pages": self.verify_pages,
            "spin_us": self.spin_us,
            "background": self.background,
        }
        opts.update(changes)
        return opts

    # -- resources ---------------------------------------------------------
    def missing_shard(self, t: int, s: int) -> CorruptDataError:
        return CorruptDataError(
            f"shard file {self.shard_files[t][s]} (table {self.tables[t].name!r}, "
            f"shard {s}) is missing from {self.root}; run `rowcache verify`"
        )

    def _fd(self, t: int, s: int) -> int:
        key = (t, s)
        fd = self._fds.get(key)
        if fd is not None:
            return fd
        with self._lock:
            fd = self._fds.get(key)
            if fd is None:
                path = os.path.join(self.root, self.shard_files[t][s])
                flags = os.O_RDONLY | (os.O_DIRECT if self.direct else 0)
                try:
                    fd = os.open(path, flags)
                except FileNotFoundError as e:
                    raise self.missing_shard(t, s) from e
                except OSError as e:
                    if self.direct and e.errno == errno.EINVAL:
                        raise ConfigError(
                            f"direct=True: the file system of {self.root} refuses O_DIRECT; "
                            "use direct=False"
                        ) from e
                    raise
                if not self.direct:
                    # Row reads are random: kernel readahead would only read pages nobody asked for.
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                self._fds[key] = fd
                self._fd_arr[self._file_base[t] + s] = fd
            return fd

    def _fds_of(self, files: np.ndarray) -> np.ndarray:
        fds = self._fd_arr[files]
        if int(fds.min()) < 0:
            for f in np.unique(files[fds < 0]).tolist():  # a loop over files, once each
                self._fd(int(self._file_table[f]), int(self._file_shard[f]))
            fds = self._fd_arr[files]
        return fds

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

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            self._fd_arr[:] = -1
            self._opened_all = False
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    # -- planning ----------------------------------------------------------
    # -- reading -----------------------------------------------------------
    def read_records(
        self, t: int, rows: np.ndarray, out: np.ndarray | None = None
    ) -> tuple[np.ndarray, ReadStats]:
        """Records ``uint8 [n, record_bytes]`` of sorted unique ``rows`` of table ``t``.

        ``out`` (optional) is a C-contiguous uint8 ``[>= n, record_bytes]`` buffer (a
        pinned staging buffer, say); the records land in its first ``n`` rows.
        Raises ``CorruptDataError`` naming shard and offset on a short read, a
        missing shard file, an I/O error or a page checksum mismatch.
        """
        return self.read_parts([(t, rows)], out)

    def read_parts(
        self, parts: Sequence[tuple[int, np.ndarray]], out: np.ndarray | None = None
    ) -> tuple[np.ndarray, ReadStats]:
        """Records of several tables' rows in one batch of reads.

        Parameters
        ----------
        parts : ``(table index, rows int64[n_k])`` pairs, rows sorted and unique within a
            part; every table must have one record size.
        out : optional C-contiguous uint8 ``[>= sum n_k, record_bytes]``.

        Returns
        -------
        records : uint8 ``[sum n_k, record_bytes]``, part after part, each in its rows' order.
        stats : rows, reads and bytes of the whole batch.

        On any failure (``CorruptDataError`` naming shard file, offset, table and row) no
        record is written to ``out``.
        """
        if not parts:
            raise ConfigError("read_parts: parts=[]: give at least one (table, rows) pair")
        arrs = []
        for k, (t, r) in enumerate(parts):
            a = np.asarray(r)
            if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
                raise ConfigError(
                    f"parts[{k}]: rows of table {t} must be a 1-D integer array, "
                    f"got {a.dtype}{list(a.shape)}"
                )
            a = a.astype(np.int64, copy=False)
            if a.size > 1 and not bool((a[1:] > a[:-1]).all()):
                raise ConfigError(
                    f"parts[{k}]: rows of table {t} must be sorted and unique "
                    "(np.unique(rows) gives that); RowStore.read_rows takes any order"
                )
            arrs.append(a)
        sizes = [a.size for a in arrs]
        rows = np.concatenate(arrs) if len(arrs) > 1 else arrs[0]
        bounds = np.zeros(len(arrs) + 1, dtype=np.int64)
        np.cumsum(sizes, out=bounds[1:])
        tables = np.array([int(t) for t, _ in parts], dtype=np.int32)
        return self.read_runs(rows, bounds, tables, np.zeros(len(arrs), dtype=np.int64), out)

    def read_runs(
        self,
        rows: np.ndarray,
        bounds: np.ndarray,
        tables: np.ndarray,
        bases: np.ndarray,
        out: np.ndarray | None = None,
    ) -> tuple[np.ndarray, ReadStats]:
        """``read_parts`` with the parts as runs of one array (the fault path's form).

        ``rows[bounds[k]:bounds[k + 1]] - bases[k]`` (int64) are the sorted unique rows of
        table ``tables[k]`` (int32[P]); ``bounds`` is int64[P + 1], ``bases`` int64[P].
        """
        rows, bounds, tables, bases = (
            _as(rows, _I64),
            _as(bounds, _I64),
            _as(tables, _I32),
            _as(bases, _I64),
        )
        P = tables.size
        if bounds.size != P + 1 or bases.size != P:  # their values are checked in C
            raise ConfigError(
                f"read_runs: bounds must be int64[{P + 1}] and bases int64[{P}] for {P} "
                f"tables, got {bounds.size} and {bases.size}"
            )
        key = tables.tobytes()
        rec = self._rec_of.get(key)
        if rec is None:  # checked once per table list
            ts = tables.tolist()
            if P == 0 or any(not 0 <= t < len(self.tables) for t in ts):
                raise ConfigError(f"tables={ts!r}: give table indices in 0..{len(self.tables) - 1}")
            recs = {self.tables[t].record_bytes for t in ts}
            if len(recs) > 1:
                raise ConfigError(
                    f"tables={ts!r} have records of {sorted(recs)} bytes: one batch needs one "
                    "record size"
                )
            rec = self._rec_of[key] = recs.pop()
        n = int(rows.size)
        if out is None:
            out = np.empty((n, rec), dtype=np.uint8)
        elif (
            out.dtype != np.uint8
            or out.ndim != 2
            or out.shape[1] != rec
            or out.shape[0] < n
            or not out.flags.c_contiguous
        ):
            raise ConfigError(
                f"out must be uint8 [>= {n}, {rec}] (C-contiguous), got {out.dtype}{list(out.shape)}"
            )
        if n == 0:
            return out[:0], ReadStats(0, 0, 0)
        out = out[:n]
        if self.engine != "python" and os.preadv is PREADV and self._native_path:
            return out, self._read_native(rows, bounds, tables, bases, out)  # C checks bounds
        if bounds[0] != 0 or bounds[-1] != n or bool((bounds[1:] < bounds[:-1]).any()):
            raise ConfigError(f"read_runs: bounds must rise from 0 to {n}, got {bounds.tolist()!r}")
        parts = [
            (int(t), rows[bounds[k] : bounds[k + 1]] - bases[k])
            for k, t in enumerate(tables.tolist())
            if bounds[k] < bounds[k + 1]
        ]
        plan = self.plan_parts(parts)
        fds = self._fds_of(plan.file)  # a missing shard raises here, before any read
        self._execute(plan, fds, out, rec)
        return out, ReadStats(n, int(plan.file.size), plan.total)
