"""The cached tables of an ``NgramEmbedding``: grouped by cache, resolved once per step.

Owns the mixin :class:`CachedGroups`: the groups of cached tables sharing one cache
(``_groups``, ``_group_ids``), the host resolve of a step's rows (``_resolve``,
``_resolve_host``), the check after a device-map gather (``_verify_cached``) and its
order against the device part (``_verified``), the
stream order between a step and its caches' faults (``_after_caches``,
``_end_batches``) and each cached table's device map (``_map_of``). Does not gather.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from rowcache.embed.ngram.batch import NgramBatch
from rowcache.embed.tables import CachedTable

# An eager fused step of at most this many tokens checks before its device part whether
# its resolve would fault (hash + scan: a few µs at decode sizes), and then resolves
# first. Larger steps would delay the device by their host hash (~60 µs at 2,048 tokens).
CHECK_TOKENS = 256


class CachedGroups:
    """Cached-table orchestration of :class:`rowcache.embed.layer.NgramEmbedding` (a mixin over
    its ``tables``, ``word``, ``device_lookup`` and array module ``_xp``)."""

    tables: list[Any]
    word: Any
    device_lookup: bool
    defer_reads: bool
    _xp: Any
    _resolve_first: bool  # set by the layer (False): the last larger device-map step faulted

    def _group_caches(self) -> None:
        """Group the cached tables by cache: one resolve per cache and step.

        ``self._groups``: ``(cache, members, offsets, pos)`` where ``members`` are
        table indices (-1 for the word table, always last), ``offsets`` int64 each
        member's ``row_offsets[part]`` and ``pos`` the n-gram members' rows among the
        cached tables (``self._cached_list`` order). ``self._cached_index`` selects
        the cached tables' rows of a ``[T, n]`` id array (a slice when contiguous).
        """
        entries = [(i, t) for i, t in enumerate(self.tables) if isinstance(t, CachedTable)]
        self._cached_rows = np.array([i for i, _ in entries], dtype=np.int64)
        # the host hash's table selection: None when every n-gram table is cached
        self._hashed_tables = None if len(entries) == len(self.tables) else self._cached_rows
        self._cached_list = [i for i, _ in entries]
        self._cached_pos = {i: k for k, (i, _) in enumerate(entries)}
        rows = self._cached_list
        self._cached_index: Any = (
            slice(rows[0], rows[0] + len(rows))
            if rows and rows == list(range(rows[0], rows[0] + len(rows)))
            else self._xp.asarray(self._cached_rows)
        )
        if isinstance(self.word, CachedTable):
            entries.append((-1, self.word))
        by_cache: dict[int, list[tuple[int, CachedTable]]] = {}
        for i, t in entries:
            by_cache.setdefault(id(t.cache), []).append((i, t))
        self._groups: list[tuple[Any, list[int], np.ndarray, np.ndarray]] = []
        for group in by_cache.values():
            members = [i for i, _ in group]
            offsets = np.array([t.offset for _, t in group], dtype=np.int64)
            pos = np.array([self._cached_pos[i] for i in members if i >= 0], dtype=np.int64)
            self._groups.append((group[0][1].cache, members, offsets, pos))

    def _map_of(self, table: Any) -> tuple[Any, int] | None:
        """``(device map, row offset)`` of a cached table read through its cache's
        device map (``device_lookup``), else None."""
        if not isinstance(table, CachedTable) or not self.device_lookup:
            return None
        return table.cache.device_map(), table.offset

    def _after_caches(self) -> None:
        """Order the current stream after every cache's stream (their faults' writes),
        with finished prefetches committed first (their rows in the device maps)."""
        cur = self._xp.cuda.get_current_stream()
        for cache, *_ in self._groups:
            cache.poll()
        for cache, *_ in self._groups:
            if cache.stream is not None and cache.stream.ptr != cur.ptr:
                cur.wait_event(cache.stream.record())

    def _end_batches(self) -> None:
        """End every cache's batch. A later fault rewrites slots on the cache's stream:
        where that is not the current stream, it first waits for this step's gathers
        (stream order, no host sync)."""
        if not self._groups:
            return
        if self._xp is not np:
            cur = self._xp.cuda.get_current_stream()
            done = None
            for cache, *_ in self._groups:
                if cache.stream is not None and cache.stream.ptr != cur.ptr:
                    done = done or cur.record()
                    cache.stream.wait_event(done)
        for cache, *_ in self._groups:
            cache.end_batch()

    def _verified(
        self, batch: NgramBatch, device_part: Callable[[], None], check: bool = False
    ) -> None:
        """Run ``device_part`` (a step's launches, reading cached tables through their
        device maps) with ``batch``'s cached rows resolved on the host.

        ``check`` (the eager step, whose launches cost the host ~0.3 ms) and a step of at
        most ``CHECK_TOKENS`` tokens: the step hashes its rows first and asks its caches
        whether a resolve would fault (``NgramRowCache.holds_all``, a few µs); if so it
        resolves first and runs its device part once, in stream order after the
        faults; if not, the device part goes first and the resolve (pins, LRU) runs
        while the device works. Otherwise (a graph replay, which costs the host about
        what the check does, or a larger step, whose host hash would delay the device)
        the device part goes first and runs again after a resolve that faulted, and the
        step after one that faulted resolves first (a faulting step is usually followed
        by another) until one does not. Either way the rows are hashed once."""
        groups = None
        check = check and batch.n <= CHECK_TOKENS
        first = self._resolve_first
        if not first and check and self._groups:
            groups = list(self._group_ids(batch, None))
            first = not all(cache.holds_all(gid.ravel()) for cache, _, gid, _ in groups)
        if first:
            self._resolve_first = self._verify_cached(batch, groups) and not check
            self._after_caches()
            device_part()
            return
        if self._groups:
            self._after_caches()
        device_part()
        if self._verify_cached(batch, groups):  # a cached row was not resident: run again
            self._resolve_first = not check
            self._after_caches()
            device_part()

    def _verify_cached(self, batch: NgramBatch, groups: list[Any] | None = None) -> bool:
        """Resolve the step's cached rows on the host (pins them, keeps the LRU exact)
        after the device gathered them through the caches' device maps. True when a
        resolve faulted rows in: the device part must run again (in stream order after
        the faults' writes and the maps' updates). ``groups``: the batch's
        ``_group_ids`` when already hashed."""
        if not self._groups:
            return False
        faulted = False
        for cache, _, gid, _ in groups or self._group_ids(batch, None):
            if self.defer_reads:  # the read goes on behind the device part (in stream order)
                cache.resolve_deferred(gid.ravel())
            else:
                cache.resolve_host(gid.ravel())
            faulted = faulted or cache.last_faults > 0
        return faulted

    def settle(self) -> None:
        """Commit the step's reads still running (``defer_reads``): wait for them; raises
        a failed read's ``CorruptDataError`` (the caches as before the step, whose
        output is invalid). A no-op otherwise. Call it after queuing the rest of the
        step's work, before using its results. Every cache is settled, the first
        error raised after: no cache is left with a failed read pending."""
        first: BaseException | None = None
        for cache, *_ in self._groups:
            try:
                cache.settle()
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first

    def _resolve(self, batch: NgramBatch, ids: Any, host_ids: Any) -> Any:
        """Arena slots replace the cached tables' rows of ``ids`` (in place). Returns
        the word table's slots when it is cached, else None."""
        xp = self._xp
        slots, word_slots = self._resolve_host(batch, host_ids)
        if slots.shape[0]:
            ids[self._cached_index] = slots if xp is np else xp.asarray(slots)
        if word_slots is None or xp is np:
            return word_slots
        return xp.asarray(word_slots)

    def _resolve_host(
        self, batch: NgramBatch, host_ids: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """One ``resolve_host`` per cache: the cached n-gram tables' slots (int64
        ``[len(cached_list), n]``, from their host ids ``host_ids`` in that order) and
        the word table's slots (int32[n], or None when it is resident)."""
        n = batch.n
        out = np.empty((len(self._cached_list), n), dtype=np.int64)
        word_slots = None
        for cache, members, gid, pos in self._group_ids(batch, host_ids):
            slots = cache.resolve_host(gid.ravel()).reshape(len(members), n)
            if pos.size:
                out[pos] = slots[: pos.size]
            if members[-1] < 0:
                word_slots = slots[-1]
        return out, word_slots

    def _group_ids(
        self, batch: NgramBatch, host_ids: np.ndarray | None
    ) -> Iterator[tuple[Any, list[int], np.ndarray, np.ndarray]]:
        """Per cache: ``(cache, members, global ids int64[len(members), n], pos)`` of a
        batch whose cached n-gram tables' host ids are ``host_ids`` (hashed here
        when None; host tokens)."""
        host_word = None
        for cache, members, offsets, pos in self._groups:
            if members == self._cached_list:  # one cache holds every cached n-gram table
                if host_ids is None:  # hashed straight into global ids: one C pass
                    gid = batch.host_ids(self._hashed_tables, offsets)
                else:
                    gid = host_ids + offsets[:, None]
            else:
                if host_ids is None and max(members) >= 0:  # not the word table's cache alone
                    host_ids = batch.host_ids(self._hashed_tables)
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
                gid = np.stack(parts).astype(np.int64, copy=False) + offsets[:, None]
            yield cache, members, gid, pos
