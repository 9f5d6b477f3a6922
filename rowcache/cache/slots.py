"""The slot table of ``NgramRowCache``: which row each slot holds, and in what state.

Owns :class:`SlotState` (one enum for a slot: free, resident, being read by a prefetch
piece, read again by a resolve; its values are the native module's ``SLOT_*`` constants,
``csrc/lru_slots.h``) and :class:`SlotTable`, the only writer of row -> slot, slot -> row
and the slots' states (the native commit, ``LruState.commit`` in ``csrc/lru_miss.c``, is
its C: it maps a plan's misses into their victims in the same arrays), with
:meth:`SlotTable.check`. Decides no recency and no victims (``rowcache.cache.lru``).
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np

from rowcache.cache.row_map import DenseRowMap, RowMap


class SlotState(IntEnum):
    """The state of one slot (``SlotTable.state[slot]``, uint8; the same values in C)."""

    FREE = 0
    """Holds no row (at the start, and after a failed prefetch piece freed it)."""
    RESIDENT = 1
    """Holds its row (``slot_row[slot]``); a victim when neither pinned nor a call's hit."""
    READING = 2
    """Reserved by a prefetch piece in flight whose row is still being read: mapped, but
    no hit (a resolve reads it itself or waits) and no victim until the piece is reaped."""
    READ = 3
    """Reserved by a prefetch piece in flight whose row a resolve has read into the slot
    already: a hit (the piece writes the same bytes again) and no victim until reaped."""


FREE, RESIDENT, READING, READ = (int(s) for s in SlotState)


class SlotTable:
    """Row -> slot, slot -> row and the slot states of an arena of ``slots`` slots over
    ``rows`` (global) rows: arrays and a native hash, never a Python object per row.

    Attributes (read them; only the methods below and the native commit write them)
    ----------
    row_map : row -> slot (``rowcache.cache.row_map``: dense, or a hash bounded by the
        arena; default dense), -1 where the row is not mapped.
    slot_row : int32[slots], -1 where the slot holds no row.
    state : uint8[slots], :class:`SlotState` values.
    reserved : slots READING or READ (reserved by prefetch pieces in flight).
    """

    def __init__(self, rows: int, slots: int, row_map: RowMap | None = None) -> None:
        self.rows = rows
        self.num_slots = slots
        self.row_map: RowMap = DenseRowMap(rows) if row_map is None else row_map
        self.slot_row = np.full(slots, -1, dtype=np.int32)
        self.state = np.zeros(slots, dtype=np.uint8)  # SlotState.FREE
        self.reserved = 0

    @property
    def resident(self) -> int:
        """Slots holding a row (being read or not)."""
        return int(np.count_nonzero(self.slot_row >= 0))

    def map(self, rows: np.ndarray, slots: np.ndarray, evicted: np.ndarray) -> None:
        """A fault's commit: unmap the ``evicted`` rows (held by some of ``slots``), map
        ``rows`` into ``slots`` (the Python path's mirror of ``LruState.commit``)."""
        self.row_map.unset(evicted)
        self.row_map.set(rows, slots)
        self.slot_row[slots] = rows
        self.state[slots] = RESIDENT

    def reserve(self, rows: np.ndarray, slots: np.ndarray, evicted: np.ndarray) -> None:
        """A prefetch's reservation: unmap ``evicted``, map ``rows`` into ``slots``, each
        being read (``READING``) until its piece is reaped."""
        self.row_map.unset(evicted)
        self.row_map.set(rows, slots)
        self.slot_row[slots] = rows
        self.state[slots] = READING
        self.reserved += int(slots.size)

    def mark_read(self, slots: np.ndarray) -> None:
        """A resolve read these reserved slots' rows itself (or claims them for its read)."""
        self.state[slots] = READ

    def mark_reading(self, slots: np.ndarray) -> None:
        """A claim undone: these slots' rows are being read by their pieces only."""
        self.state[slots] = READING

    def release(self, slots: np.ndarray) -> None:
        """Reserved slots whose rows landed (a reaped piece, or rows taken over): resident."""
        self.state[slots] = RESIDENT
        self.reserved -= int(slots.size)

    def free(self, rows: np.ndarray, slots: np.ndarray, kept: np.ndarray) -> None:
        """A failed piece: its ``rows`` unmapped and their reserved ``slots`` freed; the
        reserved slots ``kept`` (rows a resolve read itself) stay mapped, resident."""
        self.row_map.unset(rows)
        self.slot_row[slots] = -1
        self.state[slots] = FREE
        self.state[kept] = RESIDENT
        self.reserved -= int(slots.size + kept.size)

    def slots_of(self, ids: np.ndarray) -> np.ndarray:
        """int32 slots of ``ids`` (checked rows), -1 where not mapped."""
        return self.row_map.get(ids)

    def holds(self, ids: np.ndarray) -> bool:
        """Every row of ``ids`` (checked) is mapped and none is reserved by a prefetch piece
        not yet reaped."""
        s = self.row_map.get(ids)
        if s.size and int(s.min()) < 0:
            return False
        return not (self.reserved and bool((self.state[s] >= READING).any()))

    def reading_slots(self, ids: np.ndarray) -> np.ndarray:
        """The slots (sorted, unique) of the rows of ``ids`` still being read by pieces."""
        s = self.row_map.get(ids)
        s = s[s >= 0]
        return np.unique(s[self.state[s] == READING])

    def check(self) -> list[str]:
        """Every broken invariant of the table, one sentence each (empty when sound):
        the two maps invert each other, a slot is free exactly when it holds no row, the
        states are :class:`SlotState` values and ``reserved`` counts the reserved slots."""
        bad: list[str] = list(self.row_map.check())
        slots = self.slot_row
        mapped = np.flatnonzero(slots >= 0)
        if mapped.size and int(slots[mapped].max()) >= self.rows:
            bad.append("slot_row holds a row outside the table")
        elif not np.array_equal(self.row_map.get(slots[mapped]), mapped):
            bad.append("slot -> row -> slot is not the identity")
        held, held_slots = self.row_map.items()
        if held_slots.size and int(held_slots.max()) >= self.num_slots:
            bad.append("the row map holds a slot outside the arena")
        elif not np.array_equal(slots[held_slots], held):
            bad.append("row -> slot -> row is not the identity")
        if int(self.state.max(initial=0)) > max(SlotState):
            bad.append(f"a slot state outside SlotState: {int(self.state.max())}")
        free = self.state == FREE
        if not np.array_equal(free, slots < 0):
            n = int(np.count_nonzero(free != (slots < 0)))
            bad.append(f"{n} slots are free without being empty, or empty without being free")
        n_res = int(np.count_nonzero(self.state >= READING))
        if n_res != self.reserved:
            bad.append(f"reserved is {self.reserved} but {n_res} slots are READING or READ")
        return bad
