"""What a row cache is made of: its tables and arena shape, checked, and its pieces' settings.

Owns :class:`CacheLayout` (the listed tables, their global row offsets, the arena's slots,
device and kind, validated where the user's arguments enter: ``ConfigError`` naming the
argument, the value and what is allowed) and :class:`Tuning` (settings of the pieces that
the public constructor leaves at their defaults: ``NgramRowCache.assemble``). Builds nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rowcache.cache.lru import DEFER_MIN
from rowcache.cache.prefetcher import PIECE_ROWS
from rowcache.cache.row_map import KINDS as ROW_MAP_KINDS
from rowcache.errors import ConfigError
from rowcache.format.layout import TableInfo
from rowcache.store.handle import RowStore

POLICIES = ("lru",)
DEVICES = ("cpu", "cuda")
ARENAS = ("device", "host")
READERS = ("auto", "posix", "kvikio")


@dataclass(frozen=True, kw_only=True)
class Tuning:
    """Settings of the cache's pieces (tests and benchmarks: ``NgramRowCache.assemble``).
    ``defer_min``: ids from which an all-hits call defers its touch (the LRU's).
    ``piece_rows``: rows a prefetch piece. ``merge_in_flight``: a native resolve reads rows
    in flight in its own demand read (False: apart, before it). ``native``: the native host
    kernels where built (False: the Python reference paths). ``log_slack``: the LRU log's
    entries beyond the slots (None: its default; fewer compact more often). ``row_map``: the
    host row map's kind, ``"auto"`` (``rowcache.cache.row_map.row_map_kind``'s rule),
    ``"dense"`` or ``"hash"``."""

    defer_min: int = DEFER_MIN
    piece_rows: int = PIECE_ROWS
    merge_in_flight: bool = True
    native: bool = True
    log_slack: int | None = None
    row_map: str = "auto"

    def __post_init__(self) -> None:
        for name in ("defer_min", "piece_rows"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name}={v!r}: give an int >= 1")
        if self.row_map not in ROW_MAP_KINDS:
            raise ConfigError(
                f"row_map={self.row_map!r}: give one of {', '.join(map(repr, ROW_MAP_KINDS))}"
            )


@dataclass(frozen=True)
class CacheLayout:
    """The tables of ``store`` a cache serves (``parts``, at ``part_tables``; their global
    rows start at ``row_offsets[k]``, ``rows`` in all), their width and record size, the
    cache's ``name``, and its arena: ``num_slots`` slots on ``device`` (``arena_kind``:
    ``"device"`` or ``"host"``), ``policy``. Made by :meth:`of`, which checks them."""

    part_tables: list[int]
    parts: list[TableInfo]
    row_offsets: np.ndarray
    rows: int
    dim: int
    record_bytes: int
    dtype: str
    name: str
    num_slots: int
    device: str
    arena_kind: str
    policy: str

    @classmethod
    def of(
        cls,
        store: Any,
        table: str | int | Sequence[str | int],
        slots: Any,
        device: str,
        policy: str,
        reader: str,
        arena: str,
    ) -> CacheLayout:
        """The layout of ``NgramRowCache(store, table, slots=..., ...)``; raises
        ``ConfigError`` for an argument that does not fit."""
        if not isinstance(store, RowStore):
            raise ConfigError(f"store must be a RowStore, got {type(store).__name__}")
        names: list[Any] = list(table) if isinstance(table, (list, tuple)) else [table]
        if not names:
            raise ConfigError(
                "table=[]: give a table, or a non-empty list of tables to share the arena"
            )
        part_tables = [store.table_index(t) for t in names]
        if len(set(part_tables)) != len(part_tables):
            raise ConfigError(f"table={table!r} names a table twice")
        parts = [store.tables[i] for i in part_tables]
        first = parts[0]
        for p in parts[1:]:
            if p.dim != first.dim:
                raise ConfigError(
                    f"table={table!r}: tables sharing an arena need one width; "
                    f"{first.name!r} has dim {first.dim}, {p.name!r} has {p.dim}"
                )
            if p.record_bytes != first.record_bytes:  # a block-scaled codec's other blocks
                raise ConfigError(
                    f"table={table!r}: tables sharing an arena need one record size; "
                    f"{first.name!r} has {first.record_bytes} bytes a row ({first.params}), "
                    f"{p.name!r} {p.record_bytes} ({p.params})"
                )
        counts = np.array([p.rows for p in parts], dtype=np.int64)
        row_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        rows = int(row_offsets[-1])
        if rows >= 2**31:
            raise ConfigError(
                f"table={table!r} has {rows} rows; one cache maps fewer than 2**31 "
                "(its maps are int32): split the tables over several caches"
            )
        name = "+".join(p.name for p in parts)
        for arg, value, allowed in (
            ("device", device, DEVICES),
            ("reader", reader, READERS),
            ("arena", arena, ARENAS),
        ):
            if value not in allowed:
                raise ConfigError(
                    f"{arg}={value!r} is not supported; allowed: {', '.join(allowed)}"
                )
        if policy not in POLICIES:
            raise ConfigError(
                f"policy={policy!r} is not supported; allowed: {', '.join(POLICIES)} "
                "(compare others offline with rowcache.tools.miss_ratio_curve)"
            )
        if (
            isinstance(slots, bool)
            or not isinstance(slots, (int, np.integer))
            or not 1 <= slots <= rows
        ):
            raise ConfigError(
                f"slots={slots!r}: give an integer in 1..{rows} (the rows of {name!r})"
            )
        return cls(
            part_tables,
            parts,
            row_offsets,
            rows,
            first.dim,
            first.record_bytes,
            store.dtype,
            name,
            int(slots),
            device,
            arena if device == "cuda" else "host",
            policy,
        )
