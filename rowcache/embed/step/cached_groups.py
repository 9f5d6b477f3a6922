"""The cached tables of an ``NgramEmbedding``: grouped by cache, resolved once per step.

Owns :class:`CachedGroups`, an object the embedding makes once from its tables: the
groups of cached tables sharing one cache, the host resolve of a step's rows (resolve
first: :meth:`CachedGroups.resolve`; or beside the device part, in the one order
:meth:`CachedGroups.ordered` chooses), the prefetch of a coming step's rows, the stream
order between a step and its caches' faults, the end of every cache's batch and
:meth:`CachedGroups.settle`. Does not gather, hash on the device or hold buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from rowcache.cache.prefetch import PrefetchHandle
from rowcache.embed.ngram.batch import NgramBatch
from rowcache.embed.tables import CachedTable

# A step of at most this many tokens asks its caches before its device part whether its
# resolve would fault (host hash + scan: a few µs at decode sizes) and, if so, resolves
# first. A larger step would delay the device by its host hash (~60 µs at 2,048 tokens),
# so it runs its device part first and again after a resolve that faulted.
CHECK_TOKENS = 256


class _Group:
    """The cached tables of one cache: ``members`` (table indices, -1 for the word
    table, always last), ``offsets`` (int64, each member's ``row_offsets[part]``) and
    ``pos`` (the n-gram members' rows among the cached n-gram tables)."""

    __slots__ = ("cache", "members", "offsets", "pos")

    def __init__(self, cache: Any, members: list[int], offsets: np.ndarray, pos: np.ndarray):
        self.cache, self.members, self.offsets, self.pos = cache, members, offsets, pos


class CachedGroups:
    """The cached tables of one embedding, grouped by cache: one resolve per cache and step.

    Parameters
    ----------
    word : the embedding's word table; tables : its ``num_tables`` n-gram tables.
    xp : the embedding's array module (numpy or cupy).
    defer_reads : bool
        Resolve beside the device part with ``NgramRowCache.resolve_deferred`` (the read
        goes on behind the step's launches, committed at the next call or
        :meth:`settle`) instead of ``resolve_host``.

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
        self._cached_list = [i for i, _ in entries]
        self._cached_pos = {i: k for k, (i, _) in enumerate(entries)}
        rows = self._cached_list
        self._index: Any = (
            slice(rows[0], rows[0] + len(rows))
            if rows and rows == list(range(rows[0], rows[0] + len(rows)))
            else xp.asarray(self.cached_rows)
        )
        if isinstance(word, CachedTable):
            entries.append((-1, word))
        by_cache: dict[int, list[tuple[int, CachedTable]]] = {}
        for i, t in entries:
            by_cache.setdefault(id(t.cache), []).append((i, t))
        self._groups: list[_Group] = []
        for group in by_cache.values():
            members = [i for i, _ in group]
            offsets = np.array([t.offset for _, t in group], dtype=np.int64)
            pos = np.array([self._cached_pos[i] for i in members if i >= 0], dtype=np.int64)
            self._groups.append(_Group(group[0][1].cache, members, offsets, pos))

    def __bool__(self) -> bool:
        """Whether any table is cached."""
        return bool(self._groups)

    @property
    def caches(self) -> list[Any]:
        """The distinct row caches (a shared cache once)."""
        return [g.cache for g in self._groups]

    # --- resolve first ----------------------------------------------------------------
    def resolve(self, batch: NgramBatch, ids: Any, host_ids: np.ndarray) -> Any:
        """Resolve the step's cached rows on the host before its gathers: arena slots
        replace the cached tables' rows of ``ids`` (int64[T, n], in place, on the
        embedding's device) from their host ids ``host_ids`` (int64[len(cached_rows),
        n]); on the GPU the current stream then waits for the caches' faults. Returns
        the word table's slots when it is cached (on the embedding's device), else None."""
        xp = self._xp
        n = batch.n
        slots = np.empty((len(self._cached_list), n), dtype=np.int64)
        word_slots = None
        for g, gid in self._group_ids(batch, host_ids):
            got = g.cache.resolve_host(gid.ravel()).reshape(len(g.members), n)
            if g.pos.size:
                slots[g.pos] = got[: g.pos.size]
            if g.members[-1] < 0:
                word_slots = got[-1]
        if slots.shape[0]:
            ids[self._index] = slots if xp is np else xp.asarray(slots)
        if xp is not np:
            self.after_caches()
            if word_slots is not None:
                return xp.asarray(word_slots)
        return word_slots

    # --- resolve beside the device part ------------------------------------------------
    def ordered(self, batch: NgramBatch, device_part: Callable[[], None]) -> None:
        """Run ``device_part`` (a GPU step's launches, reading cached tables through
        their caches' device maps) with ``batch``'s cached rows resolved on the host.

        The one order policy, decided by the call: a step of at most
        :data:`CHECK_TOKENS` tokens hashes its rows on the host and asks its caches
        whether a resolve would fault (``NgramRowCache.holds_all``: no state change);
        if it would, the step resolves first and runs its device part once, in stream
        order after the faults; if not, the device part goes first and the resolve
        (pins, LRU) runs while the device works. A larger step runs its device part
        first and resolves meanwhile; when that resolve faulted, its device part runs
        again after the faults. Either way the rows are hashed once. Without cached
        tables the device part just runs."""
        if not self._groups:
            device_part()
            return
        groups = None
        if batch.n <= CHECK_TOKENS:
            groups = list(self._group_ids(batch, None))
            if not all(g.cache.holds_all(gid.ravel()) for g, gid in groups):
                self._resolve_beside(batch, groups)
                self.after_caches()
                device_part()
                return
        self.after_caches()
        device_part()
        if self._resolve_beside(batch, groups):  # a row was not resident: run again
            self.after_caches()
            device_part()

    def _resolve_beside(self, batch: NgramBatch, groups: list[Any] | None) -> bool:
        """Resolve the step's cached rows on the host (pins them, keeps the LRU exact);
        True when a resolve faulted rows in. ``groups``: the batch's ``_group_ids``
        when already hashed."""
        faulted = False
        for g, gid in groups or self._group_ids(batch, None):
            if self.defer_reads:  # the read goes on behind the device part (stream order)
                g.cache.resolve_deferred(gid.ravel())
            else:
                g.cache.resolve_host(gid.ravel())
            faulted = faulted or g.cache.last_faults > 0
        return faulted

    # --- prefetch -----------------------------------------------------------------------
    def prefetch(self, dims: Any, batch: NgramBatch) -> PrefetchHandle:
        """Start the cached rows of a coming step (``batch``) reading, one
        ``NgramRowCache.prefetch`` per cache; never blocks. Resident tables need
        nothing (an empty handle)."""
        if not self._groups or batch.n == 0:
            return PrefetchHandle([], 0, 0)
        if batch.on_device:
            batch = NgramBatch(dims, batch.tokens.get(), batch.ctx_lens, batch.seq_lens)
        return PrefetchHandle.merge(
            [g.cache.prefetch(gid.ravel()) for g, gid in self._group_ids(batch, None)]
        )

    # --- the caches' streams and batches ------------------------------------------------
    def after_caches(self) -> None:
        """Order the current stream after every cache's stream (their faults' writes),
        with finished prefetches committed first (their rows in the device maps). A
        no-op on the CPU, where every write is done when its call returns."""
        if self._xp is np:
            return
        cur = self._xp.cuda.get_current_stream()
        for g in self._groups:
            g.cache.poll()
        for g in self._groups:
            stream = g.cache.stream
            if stream is not None and stream.ptr != cur.ptr:
                cur.wait_event(stream.record())

    def end_batches(self) -> None:
        """End every cache's batch. A later fault rewrites slots on the cache's stream:
        where that is not the current stream, it first waits for this step's gathers
        (stream order, no host sync)."""
        if not self._groups:
            return
        if self._xp is not np:
            cur = self._xp.cuda.get_current_stream()
            done = None
            for g in self._groups:
                stream = g.cache.stream
                if stream is not None and stream.ptr != cur.ptr:
                    done = done or cur.record()
                    stream.wait_event(done)
        for g in self._groups:
            g.cache.end_batch()

    def settle(self) -> None:
        """Commit every cache's reads still running (``defer_reads``); raises the first
        failed read's ``CorruptDataError`` after every cache was settled."""
        first: BaseException | None = None
        for g in self._groups:
            try:
                g.cache.settle()
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first

    # --- ids ----------------------------------------------------------------------------
    def _group_ids(
        self, batch: NgramBatch, host_ids: np.ndarray | None
    ) -> Iterator[tuple[_Group, np.ndarray]]:
        """Per cache: ``(group, global ids int64[len(members), n])`` of a batch whose
        cached n-gram tables' host ids are ``host_ids`` (hashed here when None: host
        tokens)."""
        host_word = None
        for g in self._groups:
            members = g.members
            if members == self._cached_list:  # one cache holds every cached n-gram table
                if host_ids is None:  # hashed straight into global ids: one C pass
                    gid = batch.host_ids(self._hashed, g.offsets)
                else:
                    gid = host_ids + g.offsets[:, None]
            else:
                if host_ids is None and max(members) >= 0:  # not the word table's cache alone
                    host_ids = batch.host_ids(self._hashed)
                parts = []
                for m in members:  # members of one cache (<= T + 1), vectorized over rows
                    if m < 0:
                        if host_word is None:  # host tokens: no copy back from the device
                            w = batch.word_ids
                            host_word = w.get() if batch.on_device else np.asarray(w)
                        parts.append(host_word)
                    else:
                        assert host_ids is not None  # hashed above: a member m >= 0
                        parts.append(host_ids[self._cached_pos[m]])
                gid = np.stack(parts).astype(np.int64, copy=False) + g.offsets[:, None]
            yield g, gid
