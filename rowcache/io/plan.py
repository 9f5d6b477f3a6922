"""The read plan of :class:`rowcache.io.reader.RowReader`: rows to whole-page extents.

Owns :class:`Plan` (one call's reads) and :class:`ReadPlanner`: the rows of one or
several tables located in their shard files, widened to whole 4 KiB pages (records never
straddle a page), sorted by (file, offset) once, pages within ``merge_gap`` bytes merged
into one extent of at most ``max_extent`` bytes; and the store's page checksums laid out
per file for the engines that check them. It neither opens nor reads a file. Vectorized
over rows; the loops are over tables and shards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from rowcache.errors import ConfigError
from rowcache.format import layout as fmt

ALIGN = fmt.PAGE


class Plan(NamedTuple):
    """One call's reads. Per extent: file id, offset, length (whole pages), bytes needed,
    buffer offset. Per row in (file, offset) order: its extent, file offset, and its
    index in the caller's order; ``src[i]``: buffer offset of the caller's row ``i``."""

    file: np.ndarray
    start: np.ndarray
    length: np.ndarray
    need: np.ndarray
    pos: np.ndarray
    total: int
    row_ext: np.ndarray
    row_off: np.ndarray
    order: np.ndarray
    src: np.ndarray


class ReadPlanner:
    """Read plans of one reader's tables, and its page checksums laid out per file.

    ``file_base[t] + s`` numbers shard ``s`` of table ``t`` (``rowcache.io.files``).
    ``page_crcs[t][s]`` (optional) is ``uint32[pages]``, checked against the tables here
    (``ConfigError`` naming the first that does not fit); ``crc`` is then every file's
    page checksums one after the other, file ``f``'s at ``crc[crc_base[f]:crc_base[f + 1]]``
    (``crc`` None without them).
    """

    def __init__(
        self,
        tables: list[fmt.TableInfo],
        file_base: np.ndarray,
        merge_gap: int,
        max_extent: int,
        page_crcs: list[list[np.ndarray]] | None = None,
    ) -> None:
        self.tables = tables
        self.file_base = file_base
        self.merge_gap = merge_gap
        self.max_extent = max_extent
        self.crc: np.ndarray | None = None
        self.crc_base = np.zeros(0, dtype=np.int64)
        if page_crcs is not None:
            self.crc, self.crc_base = self._lay_out(page_crcs)

    def _lay_out(self, page_crcs: list[list[np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
        flat, base = [], [0]
        if len(page_crcs) != len(self.tables):
            raise ConfigError(
                f"page_crcs has {len(page_crcs)} tables, the store {len(self.tables)}"
            )
        for t, info in enumerate(self.tables):
            if len(page_crcs[t]) != info.shards:
                raise ConfigError(
                    f"page_crcs[{t}] has {len(page_crcs[t])} shards, table {info.name!r} has {info.shards}"
                )
            for s, c in enumerate(page_crcs[t]):
                c = np.asarray(c)
                pages = -(-info.shard_bytes(s) // ALIGN)
                if c.dtype != np.uint32 or c.shape != (pages,):
                    raise ConfigError(
                        f"page_crcs[{t}][{s}] is {c.dtype}{list(c.shape)}; shard {s} of table "
                        f"{info.name!r} needs uint32[{pages}] (one crc32c per 4096-byte page)"
                    )
                flat.append(c)
                base.append(base[-1] + pages)
        crc = np.concatenate(flat) if flat else np.zeros(0, dtype=np.uint32)
        return crc, np.array(base, dtype=np.int64)  # file f: crc[base[f]:base[f + 1]]

    def plan_parts(self, parts: Sequence[tuple[int, np.ndarray]]) -> Plan:
        """The read plan of ``parts`` (table, sorted unique rows), one batch for all of them."""
        rec = self.tables[parts[0][0]].record_bytes
        files, offs = [], []
        for t, rows in parts:
            shard, off = self.tables[t].locate(rows)
            files.append(shard + self.file_base[t])
            offs.append(off)
        file = np.concatenate(files) if len(files) > 1 else files[0]
        off = np.concatenate(offs) if len(offs) > 1 else offs[0]
        n = file.size
        key = file * (1 << 40) + off
        if n > 1 and bool((key[1:] < key[:-1]).any()):  # parts out of file order: sort once
            order = np.argsort(key, kind="stable")
            file, off = file[order], off[order]
        else:
            order = np.arange(n)
        start = off - off % ALIGN
        end = -(-(off + rec) // ALIGN) * ALIGN
        new = np.ones(n, dtype=bool)
        if n > 1:
            gap = start[1:] - end[:-1]
            joined = (file[1:] == file[:-1]) & (gap <= self.merge_gap)
            # Cap extents: a new read starts whenever the max_extent window changes.
            joined &= (end[1:] - 1) // self.max_extent == start[:-1] // self.max_extent
            new[1:] = ~joined
        first = np.flatnonzero(new)
        last = np.append(first[1:], n) - 1
        row_ext = np.cumsum(new) - 1
        ext_start = start[first]
        ext_len = end[last] - ext_start  # sorted by offset: the last row ends last
        pos = np.zeros(first.size, dtype=np.int64)
        np.cumsum(ext_len[:-1], out=pos[1:])
        total = int(pos[-1] + ext_len[-1]) if n else 0
        need = off[last] + rec - ext_start
        src = np.empty(n, dtype=np.int64)
        src[order] = pos[row_ext] + (off - ext_start[row_ext])
        return Plan(file[first], ext_start, ext_len, need, pos, total, row_ext, off, order, src)

    def plan_runs(
        self, rows: np.ndarray, bounds: np.ndarray, tables: np.ndarray, bases: np.ndarray
    ) -> Plan:
        """The read plan of runs in ``RowReader.read_runs``' form (bounds already checked)."""
        parts = [
            (int(t), rows[bounds[k] : bounds[k + 1]] - bases[k])
            for k, t in enumerate(tables.tolist())
            if bounds[k] < bounds[k + 1]
        ]
        return self.plan_parts(parts)

    def page_checks(self, plan: Plan) -> tuple[np.ndarray, ...] | None:
        """Per page ``plan`` reads: its buffer offset, its read, the expected crc32c (None:
        no page checksums)."""
        if self.crc is None:
            return None
        npages = plan.length // ALIGN
        page_read = np.repeat(np.arange(npages.size, dtype=np.int32), npages)
        j = np.arange(page_read.size, dtype=np.int64) - np.repeat(
            np.cumsum(npages) - npages, npages
        )
        page_pos = plan.pos[page_read] + j * ALIGN
        file_page = plan.start[page_read] // ALIGN + j
        expect = self.crc[self.crc_base[plan.file[page_read]] + file_page]
        return page_pos, page_read, expect

    def plan(self, t: int, rows: np.ndarray) -> tuple[np.ndarray, ...]:
        """Extents for sorted unique ``rows`` of table ``t``: ``(ext_shard, ext_start,
        ext_len, row_ext, row_off)``, per extent its shard, file offset and length; per row
        its extent and byte offset in the file."""
        p = self.plan_parts([(t, np.asarray(rows, dtype=np.int64))])
        return p.file - self.file_base[t], p.start, p.length, p.row_ext, p.row_off
