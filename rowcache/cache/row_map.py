"""The row -> slot map of ``NgramRowCache``: dense, or a hash bounded by the arena.

Owns :class:`DenseRowMap` (an int32 a table row: one load a look-up) and
:class:`HashRowMap` (``rowcache.kernels._host.RowHash``, ``csrc/row_map.h``: open addressing
over at least twice as many (row, slot) pairs as the arena has slots: 16-32 bytes an arena
slot, whatever the table's rows), the rule that picks one (:func:`row_map_kind`) and their
costs. The slot table (``rowcache.cache.slots``) holds one and is the only writer of it in
Python; the LRU's C reads and writes the same map (``LruState``). Both kinds answer the
same calls with the same results; the reference of both is a dict of row -> slot
(``tests/cache/test_row_map.py``).

The rule: a dense map costs 4 bytes a table row, i.e. ``4 / record_bytes`` of the tables'
bytes (1.5 % of a 264-byte FP8 row of the reported V4.1 Engram, 3.1 % of the demo's 128-byte
BF16 row, 0.8 % of LongCat's 512-byte rows). Above :data:`MAP_SHARE` of the tables' bytes, and
where the hash is smaller, the cache maps rows in a hash. The device map
(``NgramRowCache.device_map``, made only by the GPU embedding's fused gathers) stays dense.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rowcache.errors import ConfigError

MAP_SHARE = 0.02
"""A dense map above this share of the tables' bytes is replaced by a hash: the bookkeeping
of a table of hundreds of millions of small rows stays bounded by the arena, not the table
(``bench/row_map.py`` measures both maps)."""

KINDS = ("auto", "dense", "hash")


def hash_capacity(slots: int) -> int:
    """Pairs of a hash map for an arena of ``slots``: the power of two at least twice the
    slots (load at most one half: short probes, and always an empty pair)."""
    return 1 << max(1, (2 * slots - 1).bit_length())


def dense_bytes(rows: int) -> int:
    """Bytes of a dense map of ``rows`` rows."""
    return 4 * rows


def hash_bytes(slots: int) -> int:
    """Bytes of a hash map for an arena of ``slots``."""
    return 8 * hash_capacity(slots)


def row_map_kind(rows: int, slots: int, record_bytes: int, native: Any, kind: str = "auto") -> str:
    """``"dense"`` or ``"hash"`` for a cache of ``rows`` rows of ``record_bytes`` (stored)
    bytes over ``slots`` slots: ``kind`` where given, else a hash where a dense map would
    exceed :data:`MAP_SHARE` of the tables' bytes and the hash is smaller. Without the native
    module (``native`` None) always dense."""
    if kind not in KINDS:
        raise ConfigError(f"row_map={kind!r}: give one of {', '.join(map(repr, KINDS))}")
    if native is None:
        if kind == "hash":
            raise ConfigError("row_map='hash' needs the native module (rowcache.kernels._host)")
        return "dense"
    if kind != "auto":
        return kind
    big = dense_bytes(rows) > MAP_SHARE * rows * record_bytes
    return "hash" if big and hash_bytes(slots) < dense_bytes(rows) else "dense"


class DenseRowMap:
    """Row -> slot as ``array`` int32[rows] (-1: not mapped)."""

    kind = "dense"

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.array = np.full(rows, -1, dtype=np.int32)

    @property
    def native_arg(self) -> Any:
        """What ``LruState`` takes as its ``row_map``."""
        return self.array

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    def get(self, ids: np.ndarray) -> np.ndarray:
        """int32 slots of ``ids`` (checked rows), -1 where not mapped."""
        return self.array[ids]

    def set(self, rows: np.ndarray, slots: np.ndarray) -> None:
        """Map ``rows`` (distinct) to ``slots``."""
        self.array[rows] = slots

    def unset(self, rows: np.ndarray) -> None:
        """Unmap ``rows``."""
        self.array[rows] = -1

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """``(rows int64 ascending, slots int32)`` of the mapped rows."""
        rows = np.flatnonzero(self.array >= 0)
        return rows, self.array[rows]

    def to_dense(self) -> np.ndarray:
        """The map as int32[rows] (this map's own array: do not write it)."""
        return self.array

    def check(self) -> list[str]:
        """Broken invariants of the map itself (none for an array)."""
        return []


class HashRowMap:
    """Row -> slot in a native hash of :func:`hash_capacity` pairs (``RowHash``)."""

    kind = "hash"

    def __init__(self, rows: int, slots: int, native: Any) -> None:
        self.rows = rows
        self._h = native.RowHash(rows, hash_capacity(slots))

    @property
    def native_arg(self) -> Any:
        return self._h

    @property
    def nbytes(self) -> int:
        return int(self._h.nbytes)

    @property
    def count(self) -> int:
        """Rows mapped."""
        return int(self._h.count)

    def get(self, ids: np.ndarray) -> np.ndarray:
        out = np.empty(np.shape(ids), dtype=np.int32)
        self._h.get(np.ascontiguousarray(ids, dtype=np.int64).reshape(-1), out.reshape(-1))
        return out

    def set(self, rows: np.ndarray, slots: np.ndarray) -> None:
        self._h.set(
            np.ascontiguousarray(rows, dtype=np.int64).reshape(-1),
            np.ascontiguousarray(slots, dtype=np.int32).reshape(-1),
        )

    def unset(self, rows: np.ndarray) -> None:
        self._h.unset(np.ascontiguousarray(rows, dtype=np.int64).reshape(-1))

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        rows, slots = self._h.items()
        return np.frombuffer(rows, dtype=np.int64), np.frombuffer(slots, dtype=np.int32)

    def to_dense(self) -> np.ndarray:
        """The map as a new int32[rows] (4 bytes a row: for checks and the device map)."""
        out = np.empty(self.rows, dtype=np.int32)
        self._h.fill(out)
        return out

    def check(self) -> list[str]:
        """The hash's broken invariants (``RowHash.check``), one sentence each."""
        return [str(s) for s in self._h.check()]


RowMap = DenseRowMap | HashRowMap


def make_row_map(
    rows: int, slots: int, record_bytes: int, native: Any, kind: str = "auto"
) -> RowMap:
    """The map :func:`row_map_kind` picks, empty."""
    if row_map_kind(rows, slots, record_bytes, native, kind) == "hash":
        return HashRowMap(rows, slots, native)
    return DenseRowMap(rows)
