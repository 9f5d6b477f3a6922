"""Reading a cache's rows: global row ids of its parts, through the store's readers.

Owns :class:`PartReader`: the choice of the cache's demand reader (the store's, or a sibling
with other options, or kvikio's: :meth:`PartReader.demand_reader`) and its use, the prefetch thread's reader (its own, yielding the disk) and a
reader for reads apart (where another cache reads apart on the shared reader), and the
translation of global rows into one read plan over the parts. Touches no cache state, so
the prefetch thread calls it too. Tests and benchmarks wrap it (a reader that delays or
fails) and hand it to ``NgramRowCache.assemble``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rowcache.io.reader import RowReader
from rowcache.store.handle import RowStore


class PartReader:
    """Reads global rows of the tables ``part_tables`` of ``store`` (their first global
    rows ``row_offsets[:-1]``) with ``reader``, a :class:`RowReader` (the demand reader)."""

    def __init__(
        self, store: RowStore, part_tables: list[int], row_offsets: np.ndarray, reader: RowReader
    ) -> None:
        self.store = store
        self.part_tables = list(part_tables)
        self.row_offsets = row_offsets
        self.reader = reader
        self._parts = np.asarray(part_tables, dtype=np.int32)
        self._bases = np.ascontiguousarray(row_offsets[:-1])  # each part's first row
        self._apart: RowReader | None = None

    def read(
        self, rows: np.ndarray, staging: np.ndarray, reader: RowReader | None = None
    ) -> tuple[int, int, int]:
        """Records of global ``rows`` (sorted, unique) into ``staging[:n]`` with ``reader``
        (default: the demand reader); returns (rows, bytes, read ops) read. Global rows
        are sorted, so each part's rows are one run of them and the parts in order are the
        staging order: one read plan and one dispatch for all."""
        reader = reader or self.reader
        rows = rows if rows.dtype == np.int64 else rows.astype(np.int64)  # a plan's int32
        bounds = rows.searchsorted(self.row_offsets)
        return reader.read_batch(rows, bounds, self._parts, self._bases, staging[: rows.size])

    def start(
        self, rows: np.ndarray, staging: np.ndarray, ctl: Any, seq: int
    ) -> tuple[RowReader, tuple[np.ndarray, np.ndarray]] | None:
        """Start reading ``rows`` (sorted, unique) into ``staging`` on a reader's own thread
        (``RowReader.read_batch_start``; ``ctl``: a pinned int32[2] the GPU polls, or None);
        returns the reader to join and the arrays the read holds, or None where the reader
        cannot read apart (nothing started)."""
        reader = self.reader
        if reader.reading_apart:  # another cache's read apart on the store's reader
            if self._apart is None:  # a sibling of its own (same files and checks)
                self._apart = self.store.new_reader(**reader.options())
            reader = self._apart
        rows64 = rows.astype(np.int64)
        bounds = rows64.searchsorted(self.row_offsets)
        if not reader.read_batch_start(
            rows64, bounds, self._parts, self._bases, staging[: rows.size], ctl, seq
        ):
            return None
        return reader, (rows64, bounds)

    def close(self) -> None:
        """Close the readers this object made (the sibling for reads apart, a demand reader
        of its own): their descriptors and threads. The store's own reader stays open."""
        own = [self._apart] + ([self.reader] if self.reader is not self.store.reader else [])
        self._apart = None
        for r in own:
            if r is not None:
                r.close()

    @property
    def reads_apart_alone(self) -> bool:
        """A reader of its own was made for reads apart (the shared one was busy)."""
        return self._apart is not None

    @staticmethod
    def demand_reader(
        store: RowStore, device: str, reader: str, queue_depth: int | None, direct: bool | None
    ) -> tuple[RowReader, str]:
        """A cache's demand reader and its kind: the store's reader where the options are
        its own, else a sibling (the same pinned files and page checks) with
        ``queue_depth``/``direct``; ``"kvikio"`` a kvikio reader; ``"auto"`` kvikio only on
        the GPU where GPUDirect Storage is available."""
        base = store.reader
        qd = base.queue_depth if queue_depth is None else queue_depth
        use_direct = base.direct if direct is None else direct
        if reader == "auto":
            from rowcache.io.kvikio_reader import gds_available

            reader = "kvikio" if device == "cuda" and gds_available() else "posix"
        if reader == "kvikio":
            from rowcache.io.kvikio_reader import KvikioRowReader

            opts = base.options(queue_depth=qd, direct=False)
            return store.new_reader(KvikioRowReader, **opts), "kvikio"
        if qd == base.queue_depth and use_direct == base.direct:
            return base, "posix"
        return store.new_reader(**base.options(queue_depth=qd, direct=use_direct)), "posix"

    def prefetch_reader(self) -> RowReader:
        """The reader prefetch pieces use: a POSIX reader of their own (its own ring and
        buffers: a native batch runs one at a time per reader, so a demand fault never
        waits for a prefetch's batch; ``background``: it submits no read while a demand
        fault reads; it sleeps on its reads, ``spin_us=0``); kvikio's reader is shared."""
        r = self.reader
        if type(r) is RowReader:
            return self.store.new_reader(**r.options(spin_us=0, background=True))
        return r
