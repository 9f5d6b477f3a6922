"""Replay of a batched key trace through a slot arena with the row cache's exact rules.

Owns the per-size simulation that batch-mode curves fall back to where the one-pass
bounds of ``stack.batch_stack_bounds`` leave the outcome to slot order. The rules
mirror ``rowcache.NgramRowCache``: a batch's unique rows are looked up; resident
rows hit and are pinned; misses take free slots (lowest first), then victims: the
unpinned slots of smallest last-used batch, ties by lower slot index; misses are
placed in ascending key order into the free-then-victim slots in that order; every
row of the batch gets the batch as its recency. Loops per batch, never per row.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from ..errors import ArenaExhaustedError


@dataclass(frozen=True)
class BatchReplay:
    """Counts of one replay: unique-row ``lookups``, ``hits``, ``misses``, ``evictions``."""

    slots: int
    lookups: int
    hits: int
    misses: int
    evictions: int


def replay_batches(ukeys: np.ndarray, ubatch: np.ndarray, slots: int) -> BatchReplay:
    """Replay deduplicated batches through an arena of ``slots`` rows.

    Parameters
    ----------
    ukeys : int64[u]
        Unique keys of each batch, batch after batch, ascending within a batch
        (``stack.dedup_batches``).
    ubatch : int64[u]
        Batch index ``0..nb-1`` of each entry, non-decreasing.
    slots : int

    Raises
    ------
    ArenaExhaustedError
        A batch has more unique rows than ``slots``.
    """
    u = int(ukeys.size)
    if u == 0:
        return BatchReplay(slots, 0, 0, 0, 0)
    dense_keys, compact = np.unique(ukeys, return_inverse=True)
    compact = compact.reshape(-1).astype(np.int64)
    row_slot = np.full(dense_keys.size, -1, dtype=np.int64)
    slot_row = np.full(slots, -1, dtype=np.int64)
    slot_last = np.full(slots, -1, dtype=np.int64)
    bounds = np.flatnonzero(np.diff(ubatch)) + 1
    starts = np.concatenate(([0], bounds))
    ends = np.concatenate((bounds, [u]))
    # LRU order as groups: (batch, slots last used in that batch, ascending). An
    # entry is live while slot_last[slot] still equals its group's batch.
    groups: deque[tuple[int, np.ndarray]] = deque()
    used = 0
    hits = misses = evictions = 0
    for s, e in zip(starts.tolist(), ends.tolist()):
        b = int(ubatch[s])
        rows = compact[s:e]
        if rows.size > slots:
            raise ArenaExhaustedError(
                f"batch {b} has {rows.size} unique rows but the arena has {slots} slots"
            )
        cur = row_slot[rows]
        hit = cur >= 0
        nh = int(hit.sum())
        hits += nh
        slot_last[cur[hit]] = b  # pins the hits: they leave their old groups
        miss_rows = rows[~hit]
        k = int(miss_rows.size)
        misses += k
        if k:
            take_free = min(k, slots - used)
            parts = [np.arange(used, used + take_free, dtype=np.int64)]
            used += take_free
            need = k - take_free
            while need > 0:
                gb, g = groups[0]
                live = g[slot_last[g] == gb]
                if live.size <= need:
                    groups.popleft()
                    parts.append(live)
                    need -= int(live.size)
                else:
                    parts.append(live[:need])
                    groups[0] = (gb, live[need:])
                    need = 0
            new_slots = np.concatenate(parts)
            old = slot_row[new_slots]
            ev = old >= 0
            evictions += int(ev.sum())
            row_slot[old[ev]] = -1
            slot_row[new_slots] = miss_rows
            row_slot[miss_rows] = new_slots
            slot_last[new_slots] = b
        batch_slots = row_slot[rows]
        batch_slots.sort()
        groups.append((b, batch_slots))
    return BatchReplay(slots, u, hits, misses, evictions)
