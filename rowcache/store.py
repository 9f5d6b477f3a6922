"""``RowStore``: a read-only view of a built store, its row reads and its self-check.

Owns opening a store (validating the meta record and every shard record up front,
then closing the LMDB environment: everything it holds is a few KB, so no LMDB
handle outlives ``open`` and stores survive ``fork``), validating row ids, and
``read_rows`` (the ground truth the cache is tested against). The I/O itself is
``rowcache.reader``; the layout arithmetic is ``rowcache.format``.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, field
from typing import Any

import lmdb
import numpy as np

from . import format as fmt
from .errors import ConfigError, FormatError, RowRangeError
from .reader import DEFAULT_MERGE_GAP, ReadStats, RowReader


@dataclass(frozen=True)
class VerifyReport:
    """Result of ``RowStore.verify()``: ``ok`` is true when ``problems`` is empty."""

    path: str
    shards_checked: int
    bytes_checked: int
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def check_row_ids(row_ids: Any, rows: int, name: str = "row_ids") -> np.ndarray:
    """``row_ids`` as int64 [n]; ConfigError/ValueError for bad types, RowRangeError for range."""
    if type(row_ids).__module__.startswith("cupy"):
        row_ids = row_ids.get()
    ids = np.asarray(row_ids)
    if ids.dtype.kind not in "iu" or ids.dtype == np.bool_:
        if ids.size == 0 and ids.dtype.kind == "f":
            ids = ids.astype(np.int64)
        else:
            raise ConfigError(f"{name} must be an integer array, got dtype {ids.dtype}")
    if ids.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(ids.shape)}")
    ids = ids.astype(np.int64, copy=False)
    # One pass: as unsigned, a negative id is huge, so a single compare catches both ends.
    if ids.size and int(ids.view(np.uint64).max()) >= rows:
        bad = int(np.flatnonzero((ids < 0) | (ids >= rows))[0])
        raise RowRangeError(
            f"{name}[{bad}] = {int(ids[bad])} is outside the table's rows [0, {rows})"
        )
    return ids


class RowStore:
    """A store opened read-only. Use :meth:`open`; see ``rowcache.build_store``.

    Thread safety: ``read_rows``/``read_records`` may be called from several
    threads at once (the reader owns per-call buffers).
    """

    def __init__(
        self,
        path: str,
        dtype: str,
        tables: list[fmt.TableInfo],
        shards: list[list[fmt.ShardRecord]],
        meta: dict[str, Any],
        reader: RowReader,
    ) -> None:
        self.path = path
        self.dtype = dtype
        self.tables = tables
        self.shards = shards
        self.meta = meta
        self.reader = reader

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        queue_depth: int = 32,
        direct: bool = False,
        merge_gap: int = DEFAULT_MERGE_GAP,
    ) -> RowStore:
        """Open the store at ``path``; FormatError naming the field if anything is off.

        ``queue_depth``, ``direct`` and ``merge_gap`` configure the row reader
        (see ``rowcache.reader.RowReader``).
        """
        path = os.path.abspath(os.fspath(path))
        index = os.path.join(path, fmt.INDEX_NAME)
        if not os.path.isdir(index):
            raise FormatError(
                f"{path}: no {fmt.INDEX_NAME}; this is not a rowcache store "
                "(or its build did not finish)"
            )
        try:
            env = lmdb.open(index, readonly=True, lock=False, subdir=True, max_readers=8)
        except lmdb.Error as e:
            raise FormatError(f"{path}: cannot open {fmt.INDEX_NAME}: {e}") from e
        try:
            with env.begin(buffers=False) as txn:
                dtype, tables, meta = fmt.parse_meta(txn.get(fmt.META_KEY), path)
                shards: list[list[fmt.ShardRecord]] = []
                for t, info in enumerate(tables):
                    recs = []
                    for s in range(info.shards):
                        raw = txn.get(fmt.shard_key(t, s))
                        if raw is None:
                            raise FormatError(
                                f"{path}: shard record (table {t}, shard {s}) is missing"
                            )
                        r = fmt.ShardRecord.from_bytes(raw)
                        first, count = info.shard_rows(s)
                        for fname, want in (
                            ("first_row", first),
                            ("rows", count),
                            ("length", info.shard_bytes(s)),
                        ):
                            if getattr(r, fname) != want:
                                raise FormatError(
                                    f"{path}: shard record (table {t}, shard {s}) field {fname!r} "
                                    f"is {getattr(r, fname)}, the layout says {want}"
                                )
                        recs.append(r)
                    shards.append(recs)
        finally:
            env.close()
        reader = RowReader(
            path,
            tables,
            [[r.file for r in recs] for recs in shards],
            queue_depth=queue_depth,
            direct=direct,
            merge_gap=merge_gap,
        )
        return cls(path, dtype, tables, shards, meta, reader)

    # -- tables ------------------------------------------------------------
    def table_index(self, table: str | int) -> int:
        """Index of ``table`` given by name or index; ConfigError listing the tables."""
        if isinstance(table, (int, np.integer)) and not isinstance(table, bool):
            if 0 <= int(table) < len(self.tables):
                return int(table)
        elif isinstance(table, str):
            for i, t in enumerate(self.tables):
                if t.name == table:
                    return i
        names = [t.name for t in self.tables]
        shown = names if len(names) <= 16 else [*names[:16], "..."]
        raise ConfigError(
            f"table={table!r} is not in this store; it has {len(names)} tables: {shown} "
            f"(or an index 0..{len(names) - 1})"
        )

    def table_info(self, table: str | int) -> fmt.TableInfo:
        return self.tables[self.table_index(table)]

    # -- reads -------------------------------------------------------------
    def read_records(
        self, table: str | int, rows: np.ndarray, out: np.ndarray | None = None
    ) -> tuple[np.ndarray, ReadStats]:
        """Raw records of **sorted unique, in-range** ``rows`` (the cache's fault path)."""
        return self.reader.read_records(self.table_index(table), rows, out)

    def read_rows(self, table: str | int, row_ids: Any) -> Any:
        """Rows ``row_ids`` of ``table``, straight from disk, in request order.

        Parameters
        ----------
        table : name or index.
        row_ids : int[n], any order, duplicates allowed.

        Returns
        -------
        bfloat16[n, dim] for a BF16 store, or ``(codes uint8[n, dim], scales float32[n])``
        for an FP8 store.
        """
        t = self.table_index(table)
        info = self.tables[t]
        ids = check_row_ids(row_ids, info.rows)
        uniq, inverse = np.unique(ids, return_inverse=True)
        records, _ = self.reader.read_records(t, uniq)
        decoded = fmt.decode_records(self.dtype, info.dim, records)
        if self.dtype == "bf16":
            assert isinstance(decoded, np.ndarray)
            return decoded[inverse]
        codes, scales = decoded
        return codes[inverse], scales[inverse]

    # -- checks ------------------------------------------------------------
    def verify(self, *, progress: bool = False) -> VerifyReport:
        """Check every shard file: present, of the right length, CRC32 as recorded."""
        problems: list[str] = []
        total = sum(r.length for recs in self.shards for r in recs)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=total, unit="B", unit_scale=True, desc="verify", leave=False)
        checked = 0
        nshards = 0
        try:
            for recs in self.shards:
                for r in recs:
                    nshards += 1
                    p = os.path.join(self.path, r.file)
                    try:
                        size = os.path.getsize(p)
                    except OSError:
                        problems.append(f"{r.file}: missing (table {r.table}, shard {r.shard})")
                        continue
                    if size != r.length:
                        problems.append(f"{r.file}: {size} bytes, expected {r.length}")
                        continue
                    crc = 0
                    with open(p, "rb", buffering=0) as f:
                        while chunk := f.read(16 << 20):
                            crc = zlib.crc32(chunk, crc)
                            checked += len(chunk)
                            if bar is not None:
                                bar.update(len(chunk))
                    if crc != r.crc32:
                        problems.append(
                            f"{r.file}: CRC32 {crc:08x} != recorded {r.crc32:08x} "
                            f"(table {r.table}, shard {r.shard}): the shard is corrupt"
                        )
        finally:
            if bar is not None:
                bar.close()
        return VerifyReport(self.path, nshards, checked, problems)

    def close(self) -> None:
        self.reader.close()

    def __enter__(self) -> RowStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RowStore({self.path!r}, dtype={self.dtype!r}, tables={len(self.tables)})"
