"""The interface between :class:`rowcache.io.reader.RowReader` and the engine it owns.

Owns :class:`ReadEngine`, what every engine offers (the native engines of
``rowcache.io.native``, the Python engine of ``rowcache.io.pyengine``, kvikio's of
``rowcache.io.kvikio_reader``), and :class:`ReadStats`, what a batch did. The reader checks
its callers' arrays and hands an engine runs that are already in its form; an engine never
calls back into the reader.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class ReadStats:
    """What one ``read_records``/``read_parts`` call did."""

    rows: int
    read_ops: int
    bytes_read: int


class ReadEngine(Protocol):
    """Runs batches of row reads for one reader: its runs are ``rows[bounds[k]:bounds[k +
    1]] - bases[k]`` of table ``tables[k]`` (``rows``, ``bounds``, ``bases`` int64,
    ``tables`` int32, as ``RowReader.read_runs`` takes them), its records land in ``out``
    (uint8 ``[n, record_bytes]``, C-contiguous). Every engine reads the same records with
    the same read plan and raises the same named errors."""

    #: ``"uring"``, ``"threads"``, ``"uring+threads"``, ``"python"`` or ``"kvikio"``: what
    #: ``RowReader.engine`` says
    name: str

    def run(
        self,
        rows: np.ndarray,
        bounds: np.ndarray,
        tables: np.ndarray,
        bases: np.ndarray,
        out: np.ndarray,
    ) -> ReadStats:
        """Read a batch of ``n >= 1`` rows whose tables and ``out`` the reader checked;
        checks the rest (bounds, row ranges, files) and raises the named error."""
        ...

    def run_clean(
        self,
        rows: np.ndarray,
        bounds: np.ndarray,
        tables: np.ndarray,
        bases: np.ndarray,
        out: np.ndarray,
    ) -> tuple[int, int, int] | None:
        """A batch that reads cleanly, in one native call with no Python checks: (rows,
        bytes, read ops); None where it did not (or cannot) run so: the reader then runs
        the batch through its checks and :meth:`run`."""
        ...

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
        """Start a batch on the engine's own thread (``RowReader.read_batch_start``);
        False, having started nothing, where it cannot."""
        ...

    def join(self) -> tuple[int, int, int]:
        """Wait for the batch :meth:`start` started (``RowReader.read_batch_join``)."""
        ...

    @property
    def reading_apart(self) -> bool:
        """A batch :meth:`start` started is not joined yet."""
        ...

    def close(self) -> None:
        """Release what the engine holds (threads, files of its own); it may read again."""
        ...
