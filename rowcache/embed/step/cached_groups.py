"""The cached tables of an ``NgramEmbedding``: LongCat's step over its ``StepRows``.

Owns :class:`CachedGroups`, an object the embedding makes once from its tables: which
n-gram tables (and the word table) are cached, their rows of a step from an
``NgramBatch`` (hashed on the host), and the one order of a GPU step's host resolve and its
device part (:meth:`CachedGroups.ordered`). The protocol over the caches (one prefetch and
one resolve per cache, stream order, deferred commits, the step's end) is its
:class:`rowcache.cache.StepRows`'. Does not gather, hash on the device or hold buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from rowcache.cache.prefetch import PrefetchHandle
from rowcache.cache.step_rows import StepIds, StepRows
from rowcache.embed.ngram.batch import NgramBatch
from rowcache.embed.tables import CachedTable

# A step of at most this many tokens asks its caches before its device part whether its
# resolve would fault (host hash + scan: a few µs at decode sizes) and, if so, resolves
# first. A larger step would delay the device by its host hash (~60 µs at 2,048 tokens),
# so it runs its device part first and again after a resolve that faulted.
CHECK_TOKENS = 256


class CachedGroups:
    """The cached tables of one embedding over one :class:`StepRows`.

    Parameters
    ----------
    word : the embedding's word table; tables : its ``num_tables`` n-gram tables.
    xp : the embedding's array module (numpy or cupy).
    defer_reads : bool
        Resolve beside the device part with deferred reads (``StepRows.resolve(...,
        defer=True)``: the read goes on behind the step's launches, committed at the next
        step or :meth:`settle`) instead of on the host before it returns.

    The order of a GPU step's host resolve and its device part is one policy, a function
    of the call alone (:meth:`ordered`): the same call always orders them the same way.
    """

    def __init__(self, word: Any, tables: list[Any], xp: Any, *, defer_reads: bool) -> None:
        self._xp = xp
        self.defer_reads = bool(defer_reads)
        entries = [(i, t) for i, t in enumerate(tables) if isinstance(t, CachedTable)]
        #: the cached n-gram tables' indices (int64), in the order of a resolve's slots
        self.cached_rows = np.array([i for i, _ in entries], dtype=np.int64)
        # the host hash's table selection: None when every n-gram table is cached
        self._hashed = None if len(entries) == len(tables) else self.cached_rows
        rows = [i for i, _ in entries]
        self._index: Any = (
            slice(rows[0], rows[0] + len(rows))
            if rows and rows == list(range(rows[0], rows[0] + len(rows)))
            else xp.asarray(self.cached_rows)
        )
        self._word = isinstance(word, CachedTable)  # the last member when cached
        members = [(t.cache, t.part) for _, t in entries]
        if self._word:
            members.append((word.cache, word.part))
        self.rows = StepRows(members)

    def __bool__(self) -> bool:
        """Whether any table is cached."""
        return bool(self.rows)

    @property
    def caches(self) -> list[Any]:
        """The distinct row caches (a shared cache once)."""
        return self.rows.caches

    # --- ids ----------------------------------------------------------------------------
    def _ids(self, batch: NgramBatch, host_ids: np.ndarray | None) -> StepIds:
        """The step's global ids over its ``StepRows``: the cached n-gram tables' rows (from
        their host ids ``host_ids`` int64[len(cached_rows), n], or hashed here straight
        into global ids, one C pass, when None), then the word ids when the word table is
        cached."""
        rows = self.rows
        c = self.cached_rows.size
        if host_ids is None:
            gids = (
                batch.host_ids(self._hashed, rows.offsets[:c])
                if c
                else np.empty((0, batch.n), dtype=np.int64)
            )
        else:
            gids = host_ids + rows.offsets[:c, None]
        if not self._word:
            return rows.global_ids(gids, offset=False)
        w = batch.word_ids  # host tokens: no copy back from the device
        word = (w.get() if batch.on_device else np.asarray(w)).astype(np.int64) + rows.offsets[c]
        return rows.global_ids([*gids, word], offset=False)

    # --- resolve first ----------------------------------------------------------------
    def resolve(self, batch: NgramBatch, ids: Any, host_ids: np.ndarray) -> Any:
        """Resolve the step's cached rows on the host before its gathers: arena slots
        replace the cached tables' rows of ``ids`` (int64[T, n], in place, on the
        embedding's device) from their host ids ``host_ids`` (int64[len(cached_rows),
        n]); on the GPU the current stream then waits for the caches' writes. Returns
        the word table's slots when it is cached (on the embedding's device), else None."""
        xp = self._xp
        got = self.rows.resolve(self._ids(batch, host_ids), host=True)
        c = self.cached_rows.size
        if c:
            slots = got[:c] if not self._word else np.stack(got[:c])
            ids[self._index] = slots if xp is np else xp.asarray(slots)
        word_slots = got[-1] if self._word else None
        if xp is not np:
            self.rows.wait_ready()
            if word_slots is not None:
                return xp.asarray(word_slots)
        return word_slots

    # --- resolve beside the device part ------------------------------------------------
    def ordered(self, batch: NgramBatch, device_part: Callable[[], None]) -> None:
        """Run ``device_part`` (a GPU step's launches, reading cached tables through
        their caches' device maps) with ``batch``'s cached rows resolved on the host.

        The one order policy, decided by the call: a step of at most
        :data:`CHECK_TOKENS` tokens hashes its rows on the host and asks its caches
        whether a resolve would fault (``StepRows.holds_all``: no state change);
        if it would, the step resolves first and runs its device part once, in stream
        order after the faults; if not, the device part goes first and the resolve
        (pins, LRU) runs while the device works. A larger step runs its device part
        first and resolves meanwhile; when that resolve faulted, its device part runs
        again after the faults. Either way the rows are hashed once. Without cached
        tables the device part just runs."""
        rows = self.rows
        if not rows:
            device_part()
            return
        ids = None
        if batch.n <= CHECK_TOKENS:
            ids = self._ids(batch, None)  # (once for both calls)
            if not rows.holds_all(ids):
                rows.resolve(ids, host=True, defer=self.defer_reads)
                rows.wait_ready()
                device_part()
                return
        rows.wait_ready()
        device_part()
        if ids is None:
            ids = self._ids(batch, None)
        rows.resolve(ids, host=True, defer=self.defer_reads)
        if rows.faults:  # a row was not resident: run again
            rows.wait_ready()
            device_part()

    # --- prefetch -----------------------------------------------------------------------
    def prefetch(self, dims: Any, batch: NgramBatch) -> PrefetchHandle:
        """Start the cached rows of a coming step (``batch``) reading, one
        ``NgramRowCache.prefetch`` per cache; never blocks. Resident tables need
        nothing (an empty handle)."""
        if not self.rows or batch.n == 0:
            return PrefetchHandle([], 0, 0)
        if batch.on_device:
            batch = NgramBatch(dims, batch.tokens.get(), batch.ctx_lens, batch.seq_lens)
        return self.rows.prefetch(self._ids(batch, None))

    # --- the step's end -----------------------------------------------------------------
    def end_step(self) -> None:
        """End the step in every cache once (``StepRows.end_step``: stream order, no host
        sync)."""
        if self.rows:
            self.rows.end_step()

    def settle(self) -> None:
        """Commit the step's deferred reads (``defer_reads``); raises the first failed
        read's ``CorruptDataError`` after every cache was settled."""
        self.rows.settle()
