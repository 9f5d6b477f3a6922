"""The miss plan: what a resolve with misses will do, passed from planning to committing.

Owns :class:`MissPlan`, the frozen result of the LRU's plan (``Lru.plan``, C
``plan`` of ``csrc/lru_miss.c``): the call's ids, its distinct rows and their slots, the
missing rows, their victims and the rows those evict, the new log head and the status.
The faulter reads the missing rows into the victims and hands the plan back to
``Lru.commit``; nothing in it changes in between. And :class:`LruStatus`, what the LRU's C
calls (and their Python references) found: ``csrc/lru_status.h``'s codes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np


class LruStatus(IntEnum):
    """What a call of the LRU's C found (``LruState.hits``, ``scan``, ``plan``, a touch's
    wait; ``csrc/lru_status.h``, whose values the module exports as ``LRU_OK`` ..
    ``LRU_EXHAUSTED``), or its Python reference: one code a meaning, whichever call."""

    OK = 0
    """hits, scan: every row resident; plan: a plan to read and commit; a touch: done."""
    MISS = 1
    """hits, scan: a row is not resident (nothing changed)."""
    BAD_ID = 2
    """An id outside the table (``RowRangeError``; nothing changed)."""
    LOG_FULL = 3
    """hits, a touch: no room at the log's tail (compact first); plan: the log ended before
    enough victims (cannot happen after the exhaustion test)."""
    IN_FLIGHT = 4
    """plan: a row of the call is being read by a prefetch piece: settle or claim it first."""
    EXHAUSTED = 5
    """plan: more misses than slots free or unpinned (``ArenaExhaustedError``, or wait for
    prefetches)."""


@dataclass(frozen=True)
class MissPlan:
    """A planned resolve with misses (planning changes nothing).

    ``ids``: int64[n] as passed. ``work``: int32[5n], ``[uniq | slots | missing | victims |
    evicted]``. ``n_u`` distinct rows (ascending, ``work[:n_u]``; their slots, -1 where
    missing, ``work[n:n + n_u]``), ``n_miss`` missing (``missing``, ascending; ``victims``,
    their slots to be), ``n_ev`` rows evicted (``evicted``). ``fresh_hits``: hit slots not
    yet pinned in this batch. ``head``: the log head after the commit. ``end``: the log
    position just past the last victim. ``passed_reserved``: the victims' scan passed a slot
    a prefetch piece in flight holds. ``status``: a :class:`LruStatus` (``OK``: planned) or why not. ``batch``:
    the batch the plan was made in (its commit pins only while that batch lasts).
    ``missing``, ``victims``, ``evicted``: int32 views of ``work``.
    """

    ids: np.ndarray
    work: np.ndarray
    status: int
    n_u: int
    n_miss: int
    fresh_hits: int
    n_ev: int
    head: int
    end: int
    passed_reserved: bool
    batch: int
    missing: np.ndarray
    victims: np.ndarray
    evicted: np.ndarray

    @classmethod
    def of(cls, ids: np.ndarray, work: np.ndarray, planned: tuple, batch: int) -> MissPlan:
        """The plan of ``ids`` from the native plan's result ``planned`` (status, n_u,
        n_miss, fresh_hits, n_ev, head, end, passed) over ``work``, made in ``batch``.
        (Filled without the frozen ``__init__``'s per-field ``object.__setattr__``: this is
        on every fault's path; the value is as frozen.)"""
        status, n_u, n_miss, fresh_hits, n_ev, head, end, passed = planned
        n = ids.size
        plan = object.__new__(cls)
        plan.__dict__.update(
            ids=ids,
            work=work,
            status=status,
            n_u=n_u,
            n_miss=n_miss,
            fresh_hits=fresh_hits,
            n_ev=n_ev,
            head=head,
            end=end,
            passed_reserved=bool(passed),
            batch=batch,
            missing=work[2 * n : 2 * n + n_miss],
            victims=work[3 * n : 3 * n + n_miss],
            evicted=work[4 * n : 4 * n + n_ev],
        )
        return plan

    @property
    def n(self) -> int:
        """Ids of the call."""
        return int(self.ids.size)
