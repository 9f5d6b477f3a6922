"""The row reader: one offset-sorted, page-granular read plan per call, one dispatch.

Owns running the reads of the rows of one or several tables (the parts of a shared
arena's fault) as one batch, and the reader's options and checks of its callers' arrays.
It composes three objects: its shard files (``rowcache.io.files``: numbering and
descriptors), its planner (``rowcache.io.plan``: rows located in their shard files,
widened to whole 4 KiB pages, sorted by (file, offset), nearby pages merged into one
extent) and ONE engine, chosen at construction, behind ``rowcache.io.engine.ReadEngine``:
``rowcache.io.native`` (``rowcache.io._rcio``: io_uring, or a pool of ``pread`` threads;
min(reads, queue_depth) in flight; the GIL released; the CRC32C of every page read checked
against the store's page checksums and the records cut into the caller's buffer), or,
where the extension is not built or ``engine="python"`` is asked, the same plan on Python
threads of ``os.preadv`` with the same results (``rowcache.io.pyengine``, which also words
a failed batch's errors), or kvikio's (``rowcache.io.kvikio_reader``). The loops here are
over parts and tables, never over rows.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from rowcache.errors import ConfigError, CorruptDataError
from rowcache.format import layout as fmt
from rowcache.io.engine import ReadEngine, ReadStats
from rowcache.io.files import ShardFiles
from rowcache.io.native import NATIVE_BUILT, NativeEngine
from rowcache.io.plan import ALIGN, Plan, ReadPlanner
from rowcache.io.pyengine import PythonEngine
from rowcache.kernels import extensions

DEFAULT_MERGE_GAP = 16 << 10
ENGINES = ("auto", "uring", "threads", "uring+threads", "python")


def _as(a: Any, dtype: np.dtype) -> np.ndarray:
    """``a`` as a C-contiguous 1-D array of ``dtype`` (no copy when it is one)."""
    if type(a) is np.ndarray and a.dtype is dtype and a.ndim == 1 and a.flags.c_contiguous:
        return a
    return np.ascontiguousarray(a, dtype=dtype).reshape(-1)


_I64, _I32 = np.dtype(np.int64), np.dtype(np.int32)
DEFAULT_SPIN_US = 100  # a cold NVMe read is 25-100 us; a longer wait sleeps


class RowReader:
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
        ``"uring"``, ``"threads"``, ``"uring+threads"`` (io_uring for a batch of at most
        ``queue_depth`` reads, the pread threads for a longer one: on the H100 VM's virtio
        disk threads read a 230-page batch 1.2-1.4x faster than io_uring from one thread,
        and io_uring a few pages ~1.7x faster; docs/qwen4.md, "The read engine") (these
        three need the extension) or ``"python"`` (Python threads of ``os.preadv``). Every
        engine gives the same records and the same errors. The choice is this parameter's
        alone: a test that injects faults by replacing ``os.preadv`` asks for
        ``engine="python"`` (the native engines never call it).
    page_crcs : ``page_crcs[t][s]`` is ``uint32[pages]``, the crc32c of each 4096-byte page
        of shard ``s`` of table ``t`` (``rowcache.io.checksum``). Given, every page read is
        checked and a mismatch raises ``CorruptDataError`` naming shard, offset, table and row.
    verify_pages : ``False`` skips the page checks even with ``page_crcs``: for benchmarks
        that measure what the checks cost, never for serving.
    spin_us : io_uring only, batches of at most ``queue_depth`` reads: wait for each
        completion by polling for up to this many microseconds before sleeping (0: always
        sleep). A caller that sleeps pays a wake-up per completion: on the H200 machine
        polling took one cold 4 KiB read from 37-39 to 34 us, on the dev machine from
        46-47 to 33-37 us (``docs/benchmarks.md``, "Figures the code cites"). Longer
        batches always sleep (polling read them slower). It costs the caller's core while
        it polls, so background readers (prefetch) keep 0.
    background : native engines only: this reader yields the disk to demand reads. While
        any other reader of the process that is not ``background`` runs a batch, this one
        submits no new read (its reads in flight finish), so a step's fault does not queue
        behind a prefetch's thousands of reads. The cache's prefetch reader sets it.
    store_path : the store's path as its user gave it, where ``root`` is another name of
        its directory (``RowStore`` gives ``/proc/self/fd/N``): errors name it, and a shard
        gone because the path names another store now is a ``StoreChangedError``.

    Attributes: the options above, ``root``, ``tables``, ``shard_files``, ``engine`` (the
    engine's name: ``"uring"``, ``"threads"``, ``"uring+threads"``, ``"python"``; ``"kvikio"`` for a
    ``KvikioRowReader``); and the reader's parts: ``files`` (``ShardFiles``), ``planner``
    (``ReadPlanner``) and ``read_engine`` (the ``ReadEngine`` it reads with).

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
        store_path: str | None = None,
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
        if engine in ("uring", "threads", "uring+threads") and not NATIVE_BUILT:
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
        self._rec_of: dict[bytes, int] = {}
        self.store_path = store_path
        self.files = ShardFiles(root, tables, shard_files, direct, store_path)
        self.planner = ReadPlanner(tables, self.files.file_base, merge_gap, max_extent, page_crcs)
        self.read_engine = self.new_engine(engine)
        self.engine: str = self.read_engine.name

    def new_engine(self, engine: str) -> ReadEngine:
        """The engine the constructor gives this reader for the asked ``engine`` (a
        subclass that reads another way gives its own: ``KvikioRowReader``). Called once,
        with ``files`` and ``planner`` made."""
        if engine == "python" or not NATIVE_BUILT:
            if engine != "python":  # asked for the native engine, which is not built here
                extensions.fallback("rowcache.io._rcio")
            return PythonEngine(
                self.files,
                self.planner,
                queue_depth=self.queue_depth,
                direct=self.direct,
                verify_pages=self.verify_pages,
            )
        return NativeEngine(
            self.files,
            self.planner,
            kind=engine,
            queue_depth=self.queue_depth,
            direct=self.direct,
            verify_pages=self.verify_pages,
            spin_us=self.spin_us,
            background=self.background,
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
            "store_path": self.store_path,
        }
        opts.update(changes)
        return opts

    # -- resources ---------------------------------------------------------
    def missing_shard(self, t: int, s: int) -> CorruptDataError:
        return self.files.missing_shard(t, s)

    def close(self) -> None:
        """Close the reader's files and threads (a later read opens them again)."""
        self.read_engine.close()
        self.files.close()

    # -- planning ----------------------------------------------------------
    def plan_parts(self, parts: Sequence[tuple[int, np.ndarray]]) -> Plan:
        """The read plan of ``parts`` (table, sorted unique rows), one batch for all of them."""
        return self.planner.plan_parts(parts)

    def plan(self, t: int, rows: np.ndarray) -> tuple[np.ndarray, ...]:
        """Extents for sorted unique ``rows`` of table ``t``: ``(ext_shard, ext_start,
        ext_len, row_ext, row_off)``, per extent its shard, file offset and length; per row
        its extent and byte offset in the file."""
        return self.planner.plan(t, rows)

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
        return out, self.read_engine.run(rows, bounds, tables, bases, out)

    def read_batch(
        self,
        rows: np.ndarray,
        bounds: np.ndarray,
        tables: np.ndarray,
        bases: np.ndarray,
        out: np.ndarray,
    ) -> tuple[int, int, int]:
        """:meth:`read_runs` for a caller whose arrays are in its form already (the row
        cache's fault path): ``rows`` and ``bounds`` int64, ``tables`` int32, ``bases``
        int64, ``out`` uint8 ``[n, record_bytes]`` C-contiguous. Returns (rows, bytes,
        read ops). A batch that reads cleanly is one native call with no Python checks;
        anything else (the Python engine, a shard not opened yet, a failed read or page
        check, a bad row) runs :meth:`read_runs`, which opens files or raises the named
        error. The same records, stats and errors as :meth:`read_runs`."""
        got = self.read_engine.run_clean(rows, bounds, tables, bases, out)
        if got is not None:
            return got
        _, rs = self.read_runs(rows, bounds, tables, bases, out=out)
        return rs.rows, rs.bytes_read, rs.read_ops

    def read_batch_start(
        self,
        rows: np.ndarray,
        bounds: np.ndarray,
        tables: np.ndarray,
        bases: np.ndarray,
        out: np.ndarray,
        ctl: np.ndarray | None,
        seq: int,
    ) -> bool:
        """Start :meth:`read_batch`'s batch on the native reader's own thread and return at
        once (True); False, having started nothing, where it cannot run there (the Python
        engine, another engine's reader, a shard file that cannot be opened, another
        caller's batch still apart, :attr:`reading_apart`: :meth:`read_batch` then, which
        waits for that one). When the batch ends the thread writes ``ctl`` (int32[2], e.g.
        pinned memory a GPU polls, or None): ``ctl[1] = seq`` if it read cleanly (else
        ``seq - 1``), then ``ctl[0] = seq``. The caller keeps ``out`` and the arrays alive
        until it calls :meth:`read_batch_join`."""
        return self.read_engine.start(rows, bounds, tables, bases, out, ctl, seq)

    def read_batch_join(self) -> tuple[int, int, int]:
        """Wait for the batch :meth:`read_batch_start` started; returns (rows, bytes, read
        ops), or raises the error :meth:`read_batch` would have raised (its ``ctl`` told
        the caller's GPU so already)."""
        return self.read_engine.join()

    @property
    def reading_apart(self) -> bool:
        """A batch :meth:`read_batch_start` started is not joined yet (one at a time)."""
        return self.read_engine.reading_apart
