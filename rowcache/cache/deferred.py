"""The handle of a deferred resolve: ``NgramRowCache.resolve(ids, defer=True)``.

Owns :class:`DeferredResolve`, a future in the manner of KvikIO's ``IOFuture``: the
resolve's read runs on a reader's own thread while the caller goes on, and the host's side
(pins, LRU order, maps, stats) is committed when the handle's owner calls :meth:`wait`,
never implicitly by a later call on the cache. The cache makes the handle and holds what it
commits; the handle holds only the call that commits it and what that call returned.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from rowcache.errors import PendingResolveError


def refuse_pending(name: str, pending: bool) -> None:
    """Raise ``PendingResolveError`` for a call on cache ``name`` that would read or change
    its books while a deferred resolve's handle was not waited for (``pending``)."""
    if pending:
        raise PendingResolveError(
            f"table {name!r}: a deferred resolve (resolve(ids, defer=True)) has not been "
            "waited for; call its handle's wait() first (StepRows.settle() for a step)"
        )


class DeferredResolve:
    """A resolve whose read may outlive its call.

    ``faults``: rows whose device-map entries the resolve changes (its ``last_faults``),
    known at the call. :meth:`wait` joins the read and commits (pins, LRU order, maps,
    stats); it returns the slots (int32[n], host) and raises the read's
    ``CorruptDataError`` (the cache then as before the call: what a GPU computed from these
    rows is invalid). :meth:`done` asks without blocking or committing.

    On the GPU the cache's stream holds until the read ends and one launch then writes the
    rows and the device map's update, so gathers in stream order after the cache's writes
    (``StepRows.wait_ready``) read the rows before :meth:`wait` is called.
    """

    __slots__ = ("_commit", "_error", "_lock", "_read_done", "_slots", "faults")

    def __init__(
        self,
        faults: int,
        *,
        slots: np.ndarray | None = None,
        commit: Callable[[], np.ndarray] | None = None,
        read_done: Callable[[], bool] | None = None,
    ) -> None:
        self.faults = int(faults)
        self._slots = slots
        self._commit = commit
        self._read_done = read_done
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    @classmethod
    def finished(cls, slots: np.ndarray, faults: int) -> DeferredResolve:
        """A resolve that read nothing apart (every row resident, or a reader that cannot
        read apart): committed at its call."""
        return cls(faults, slots=slots)

    @property
    def committed(self) -> bool:
        """Whether :meth:`wait` has committed the resolve (or it committed at its call)."""
        return self._commit is None

    def done(self) -> bool:
        """True once committed, or once the read is known to have finished (where the
        reader can tell without joining); never blocks, never commits."""
        if self._commit is None:
            return True
        return self._read_done is not None and bool(self._read_done())

    def wait(self) -> np.ndarray:
        """Join the read and commit the resolve; returns its slots (int32[n], host, input
        order). Idempotent: a second call returns the same slots, or raises the same
        error."""
        with self._lock:
            if self._commit is not None:
                commit, self._commit = self._commit, None
                try:
                    self._slots = commit()
                except BaseException as e:
                    self._error = e
                    raise
            if self._error is not None:
                raise self._error
            assert self._slots is not None
            return self._slots

    def __repr__(self) -> str:
        state = "committed" if self.committed else ("read" if self.done() else "reading")
        return f"DeferredResolve(faults={self.faults}, {state})"


__all__ = ["DeferredResolve", "refuse_pending"]
