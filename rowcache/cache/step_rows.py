"""One step's rows over its caches: the one owner of the protocol every embedding shares.

Owns :class:`StepRows`, made once from the tables a step reads (``(cache, part)`` pairs,
in the caller's order: its *members*): it groups them by the row cache they share, starts
one prefetch per cache, resolves one call per cache (in the members' order, the same for
every call), orders streams (the caller gets events, or one call that makes its stream wait
for them: never a cache's stream), commits its deferred resolves, and ends the step once per
cache (also as a context manager). LongCat's ``CachedGroups``, Engram's ``EngramMemory`` and
``ShardedNgramEmbedding`` each hold one. Does not hash, gather or hold buffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rowcache.cache.deferred import DeferredResolve
from rowcache.cache.prefetch import PrefetchHandle
from rowcache.errors import ConfigError

Ids = np.ndarray | Sequence[np.ndarray]
"""A step's ids: int ``[members, n]`` (every member ``n`` rows), or one int vector a member
(any lengths; an empty vector for a member the step does not read)."""


class StepIds:
    """A step's ids as each cache's global ids (:meth:`StepRows.global_ids`): computed once
    and handed to :meth:`StepRows.holds_all`, :meth:`StepRows.resolve` and
    :meth:`StepRows.prefetch` of the same step, which then skip the work."""

    __slots__ = ("ids", "per_group")

    def __init__(self, ids: Ids, per_group: list[np.ndarray]) -> None:
        self.ids = ids
        self.per_group = per_group


class _Group:
    """The members of one cache: their indices among the members (``rows``: a slice where
    they are consecutive, else an index array), each member's first global row
    (``offsets``, int64[len(members)])."""

    __slots__ = ("cache", "members", "offsets", "rows")

    def __init__(self, cache: Any, members: list[int], offsets: np.ndarray) -> None:
        self.cache = cache
        self.members = members
        self.offsets = offsets
        consecutive = members == list(range(members[0], members[0] + len(members)))
        self.rows: Any = (
            slice(members[0], members[0] + len(members))
            if consecutive
            else np.asarray(members, dtype=np.int64)
        )


class StepRows:
    """The rows a step reads from its row caches, one protocol for every embedding.

    Parameters
    ----------
    members : ``[(cache, part), ...]``: the ``NgramRowCache`` and the index of its listed
        table for each table the step reads, in the caller's order. Members may share a
        cache (its tables' rows are then read and pinned by one call per step).

    A step: :meth:`prefetch` at its start (optional), :meth:`resolve` (or
    :meth:`resolve_member` for one table at a time), gathers after :meth:`wait_ready` (GPU),
    then :meth:`end_step` once: also ``with step_rows: ...``. Every method takes ``ids`` as
    described by :data:`Ids`: local row ids of each member's table.

    Deferred resolves (``resolve(..., defer=True)``) are committed by this object, never by
    a cache's later call: by :meth:`settle`, or first thing in the next :meth:`prefetch`,
    :meth:`holds_all` or :meth:`resolve` (the step's own order), which raise a failed
    read's ``CorruptDataError`` there.

    Examples
    --------
    >>> rows = StepRows([(cache, 0), (cache, 1), (other_cache, 0)])
    >>> rows.prefetch(ids)                 # at the step's start: one prefetch per cache
    >>> with rows:                         # ends the step once per cache at the block's end
    ...     slots = rows.resolve(ids)      # one resolve per cache: int32 [3, n] slots
    ...     rows.wait_ready()              # GPU: the current stream after the caches' writes
    ...     gather(slots)
    """

    def __init__(self, members: Sequence[tuple[Any, int]]) -> None:
        by_cache: dict[int, list[int]] = {}
        caches: dict[int, Any] = {}
        for k, m in enumerate(members):
            if not (isinstance(m, tuple) and len(m) == 2):
                raise ConfigError(f"members[{k}]: give a (cache, part) pair, got {m!r}")
            cache, part = m
            if not hasattr(cache, "resolve") or not hasattr(cache, "row_offsets"):
                raise ConfigError(
                    f"members[{k}]: give an NgramRowCache, got {type(cache).__name__}"
                )
            if isinstance(part, bool) or not isinstance(part, (int, np.integer)):
                raise ConfigError(f"members[{k}]: part must be an int, got {part!r}")
            if not 0 <= int(part) < len(cache.parts):
                raise ConfigError(
                    f"members[{k}]: part={part} is out of range: the cache holds "
                    f"{len(cache.parts)} table(s), allowed 0..{len(cache.parts) - 1}"
                )
            by_cache.setdefault(id(cache), []).append(k)
            caches[id(cache)] = cache
        self._members = [(c, int(p)) for c, p in members]
        self._groups = [
            _Group(
                caches[key],
                ks,
                np.array([caches[key].row_offsets[self._members[k][1]] for k in ks], np.int64),
            )
            for key, ks in by_cache.items()
        ]
        self._gpu = any(g.cache.device == "cuda" for g in self._groups)
        self._cp: Any = None
        if self._gpu:  # (a GPU cache was made: cupy imports)
            import cupy

            self._cp = cupy
        self._maps: list[Any] = [None] * len(self._groups)  # GPU: device maps, once asked
        self._pending: list[DeferredResolve] = []
        self._faults = 0
        #: each member's first global row in its cache (``row_offsets[part]``), int64
        self.offsets = np.array([c.row_offsets[p] for c, p in self._members], dtype=np.int64)
        self.offsets.setflags(write=False)
        # one cache holding every member in order: a step's ids are that cache's ids as
        # they are, and its slots are the result as they are (no gather or scatter)
        whole = slice(0, len(self._members))
        self._whole = (
            len(self._groups) == 1
            and isinstance(self._groups[0].rows, slice)
            and self._groups[0].rows == whole
        )
        self._after: Any = None  # GPU: the event end_step records (made once, re-recorded)

    # --- what it holds --------------------------------------------------------------------
    def __len__(self) -> int:
        """The number of members."""
        return len(self._members)

    def __bool__(self) -> bool:
        """Whether the step reads any cached table."""
        return bool(self._members)

    @property
    def caches(self) -> list[Any]:
        """The distinct row caches, in the order of their first member."""
        return [g.cache for g in self._groups]

    @property
    def faults(self) -> int:
        """Rows the last :meth:`resolve` or :meth:`resolve_member` faulted in, or whose
        prefetch it waited for (the caches' ``last_faults`` summed; 0: every row was
        resident and shown in the device maps before it)."""
        return self._faults

    # --- ids ------------------------------------------------------------------------------
    def global_ids(self, ids: Ids | StepIds, *, offset: bool = True) -> StepIds:
        """``ids`` (:data:`Ids`) as each cache's global ids, computed once for the step's
        calls. ``offset=False``: ``ids`` are global already (each member's row plus its
        :attr:`offsets` entry, e.g. added by the caller's hash as it wrote them), and are
        only split among the caches."""
        if isinstance(ids, StepIds):  # isinstance, which mypy narrows (no subclass exists)
            return ids
        if (  # a step's global ids of one cache as they are: a view, no copy
            self._whole
            and not offset
            and type(ids) is np.ndarray
            and ids.dtype == np.int64
            and ids.ndim == 2
            and ids.shape[0] == len(self._members)
            and ids.flags.c_contiguous
        ):
            return StepIds(ids, [ids.ravel()])
        return StepIds(ids, [self._group_ids(g, ids, offset) for g in self._groups])

    def _group_ids(self, g: _Group, ids: Ids, offset: bool) -> np.ndarray:
        """The global ids (int64, contiguous) of group ``g``'s members' rows, member after
        member (``offset``: add each member's offset)."""
        if isinstance(ids, np.ndarray):
            if ids.ndim != 2 or ids.shape[0] != len(self._members):
                raise ConfigError(
                    f"ids: give int [{len(self._members)}, n] (a row a member), got shape "
                    f"{ids.shape}"
                )
            part = ids if self._whole else ids[g.rows]
            if offset:
                part = part + g.offsets[:, None]
            return np.ascontiguousarray(part, dtype=np.int64).ravel()
        if len(ids) != len(self._members):
            raise ConfigError(
                f"ids: give one id vector a member ({len(self._members)}), got {len(ids)}"
            )
        offs = g.offsets if offset else np.zeros(len(g.members), np.int64)
        return np.concatenate(
            [np.asarray(ids[k], dtype=np.int64).ravel() + off for k, off in zip(g.members, offs)]
        )

    # --- a step ---------------------------------------------------------------------------
    def prefetch(self, ids: Ids | StepIds) -> PrefetchHandle:
        """Start reading the rows of a coming step, one ``prefetch`` per cache; never blocks
        on I/O (rows beyond the free or unpinned slots are dropped: ``handle.dropped``)."""
        if self._pending:
            self.settle()
        return PrefetchHandle.merge(
            [g.cache.prefetch(gid) for g, gid in zip(self._groups, self.global_ids(ids).per_group)]
        )

    def holds_all(self, ids: Ids | StepIds) -> bool:
        """Whether a :meth:`resolve` of ``ids`` would fault, wait or commit nothing (every
        row resident and shown in the device maps); changes nothing in the caches."""
        if self._pending:
            self.settle()
        step = ids if type(ids) is StepIds else self.global_ids(ids)
        for g, gid in zip(self._groups, step.per_group):
            if not g.cache.holds_all(gid):
                return False
        return True

    def resolve(self, ids: Ids | StepIds, *, host: bool = False, defer: bool = False) -> Any:
        """Arena slots of every member's rows, one ``resolve`` per cache (a shared cache
        reads its misses in one read), pinned until :meth:`end_step`.

        Parameters
        ----------
        ids : as :data:`Ids`.
        host : leave the slots on the host (int32 numpy) on a GPU cache.
        defer : the reads go on behind the caller (``NgramRowCache.resolve(defer=True)``);
            committed by :meth:`settle` or the next call. Slots on the host are then not
            known at the call: None is returned, and a GPU caller reads the rows through
            :meth:`device_maps` in stream order after :meth:`wait_ready`.

        Returns
        -------
        int32 ``[members, n]`` (2-D ``ids``) or a list of int32 vectors, a member each
        (numpy with ``host`` or on the CPU, else cupy); None with ``defer``.
        """
        if self._pending:
            self.settle()
        faults = 0
        got: list[Any] = []
        step = ids if type(ids) is StepIds else self.global_ids(ids)
        for i, (g, gid) in enumerate(zip(self._groups, step.per_group)):
            if defer:
                if self._maps[i] is None and g.cache.device == "cuda":
                    self._maps[i] = g.cache.device_map()  # (made before its resolve is pending)
                h = g.cache.resolve(gid, defer=True)
                if not h.committed:
                    self._pending.append(h)
                faults += h.faults
            else:
                got.append(g.cache.resolve(gid, host=host))
                faults += g.cache.last_faults
        self._faults = faults
        if defer:
            return None
        if self._whole and type(step.ids) is np.ndarray:
            return got[0].reshape(step.ids.shape)
        return self._scatter(step.ids, got)

    def resolve_member(self, k: int, ids: np.ndarray, *, host: bool = False) -> Any:
        """Slots of member ``k``'s rows ``ids`` alone (a layer's lookup of a step whose
        members are read at different layers), pinned until :meth:`end_step`; on the GPU
        (not ``host``) the current stream then waits for that cache's writes."""
        self.settle()
        cache, part = self._members[k]
        gid = cache.global_ids(part, ids) if len(cache.parts) > 1 else ids
        out = cache.resolve(gid, host=host)
        self._faults = cache.last_faults
        if not host and self._gpu:  # gathers by these slots: no landed prefetch to commit
            e = cache.ready_event(landed=False)
            if e is not None:
                self._cp.cuda.get_current_stream().wait_event(e)
        return out

    def _scatter(self, ids: Ids, got: list[Any]) -> Any:
        """Each group's slots back into the members' order."""
        if isinstance(ids, np.ndarray):
            n = ids.shape[1]
            if self._whole:
                return got[0].reshape(len(self._members), n)
            xp = _xp_of(got[0]) if got else np
            out = xp.empty((len(self._members), n), dtype=np.int32)
            for g, s in zip(self._groups, got):
                out[g.rows] = s.reshape(len(g.members), n)
            return out
        res: list[Any] = [None] * len(self._members)
        for g, s in zip(self._groups, got):
            start = 0
            for k in g.members:
                size = int(np.asarray(ids[k]).size)
                res[k] = s[start : start + size]
                start += size
        return res

    def device_maps(self) -> list[Any]:
        """Each member's cache's device map (GPU; cupy int32[rows of the cache], -1: not
        resident), indexed by the member's global ids (``row_offsets[part] + id``)."""
        by_member: list[Any] = [None] * len(self._members)
        for i, g in enumerate(self._groups):
            if self._maps[i] is None:
                self.settle()
                self._maps[i] = g.cache.device_map()
            for k in g.members:
                by_member[k] = self._maps[i]
        return by_member

    # --- streams --------------------------------------------------------------------------
    def ready_events(self, *, landed: bool = True) -> list[Any]:
        """(GPU) one event a cache whose arena writes run on a stream other than the current
        one; gathers that wait for them read every row resolved so far. With ``landed``,
        every cache's landed prefetches are committed first (their rows in the device maps,
        for gathers through :meth:`device_maps`). Empty on the CPU."""
        events = [g.cache.ready_event(landed=landed) for g in self._groups]
        return [e for e in events if e is not None]

    def wait_ready(self, stream: Any = None, *, landed: bool = True) -> None:
        """Make ``stream`` (default: the current cupy stream) wait for :meth:`ready_events`."""
        events = self.ready_events(landed=landed)
        if not events:
            return
        if stream is None:
            stream = self._cp.cuda.get_current_stream()
        for e in events:
            stream.wait_event(e)

    # --- the step's end -------------------------------------------------------------------
    def end_step(self) -> None:
        """End the step in every cache once: unpin its rows. On the GPU one event on the
        current stream, after the step's gathers, is handed to each cache whose writes run
        on another stream, so the next step's faults never overwrite a row still being read
        (stream order, no host sync). Deferred resolves stay pending (:meth:`settle`)."""
        if not self._gpu:
            for g in self._groups:
                g.cache.end_step()
            return
        cur = self._cp.cuda.get_current_stream()
        recorded = False
        for g in self._groups:
            s = g.cache.stream
            if s is not None and s.ptr != cur.ptr:
                if not recorded:  # one event a step, re-recorded (each cache waits at once)
                    if self._after is None:
                        self._after = self._cp.cuda.Event(block=False, disable_timing=True)
                    self._after.record(cur)
                    recorded = True
                g.cache.end_step(after=self._after)
            else:
                g.cache.end_step()

    def settle(self) -> None:
        """Commit the deferred resolves (join their reads); raises the first failed read's
        ``CorruptDataError`` after every one was waited for (a failed one commits nothing)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        first: BaseException | None = None
        for h in pending:
            try:
                h.wait()
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first

    @property
    def pending(self) -> bool:
        """Deferred resolves not yet committed."""
        return bool(self._pending)

    def __enter__(self) -> StepRows:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end_step()

    def __repr__(self) -> str:
        return f"StepRows(members={len(self._members)}, caches={len(self._groups)})"


def _xp_of(a: Any) -> Any:
    """The array module of ``a`` (numpy, or cupy for a device array)."""
    if isinstance(a, np.ndarray):
        return np
    import cupy

    return cupy


__all__ = ["Ids", "StepIds", "StepRows"]
