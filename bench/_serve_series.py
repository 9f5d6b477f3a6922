"""bench/serve.py's series: one embedding (resident, cached, with lookahead...) run over a
server's steps, each step = the embedding + the rest of the model, timed.

Owns :func:`prefetcher` (the lookahead API of this tree), :class:`Series` (a series whose
steps run in blocks, its state kept between them) and :func:`interleave` (every series of a
server advanced block by block, in an order that rotates: a shared VM's drift over the
minutes of a run lands on every series alike, not on whichever runs last).
"""

from __future__ import annotations

import collections
import time
from typing import Any

import numpy as np


def prefetcher(emb: Any, cache: Any) -> Any:
    """``start(batch) -> handle``: the lookahead API of this tree, or None without one."""
    if hasattr(emb, "prefetch_packed"):
        return emb.prefetch_packed
    if cache is not None and hasattr(cache, "prefetch"):  # the cache's API; ids hashed here
        return lambda b: cache.prefetch((b.host_ids() + cache.row_offsets[:-1, None]).ravel())
    return None


class Series:
    """One series over ``steps``; :meth:`run` runs a block of them, :meth:`finish` ends it.

    ``out``, per timed step: (seconds, tokens, kind, hits, misses, fault seconds, seconds
    its resolves waited for prefetches in flight, seconds the embedding call held the host
    thread). ``lookahead``: 0, or how many steps ahead prefill chunks are prefetched (a
    server knows the prompts it has admitted and queued: step t prefetches the chunks of
    steps t+1..t+lookahead not prefetched yet). ``graphs``: the embedding
    (``cuda_graphs=True``, same tables) of the steps without a prefill chunk, as a server
    that captures its decode step. ``record``: the rows each timed step will fault (a
    bench-only peek, untimed). ``check``: ``(every, list)``, every ``every``-th step's output
    appended as ``(step, output)``. ``check_tokens``: ``embed.cached_groups.CHECK_TOKENS``
    while this series runs (None: unchanged). ``profile``: a ``cProfile.Profile`` enabled
    while this series runs.
    """

    def __init__(
        self,
        emb: Any,
        steps: list[Any],
        warm: int,
        rest: Any,
        work: Any,
        sync: Any,
        cache: Any = None,
        lookahead: int = 0,
        *,
        record: list[np.ndarray] | None = None,
        check: tuple[int, list[Any]] | None = None,
        graphs: Any = None,
        check_tokens: int | None = None,
        profile: Any = None,
    ) -> None:
        self.emb, self.steps, self.warm, self.rest = emb, steps, warm, rest
        self.work, self.sync, self.cache, self.lookahead = work, sync, cache, lookahead
        self.record, self.check, self.graphs = record, check, graphs
        self.check_tokens, self.profile = check_tokens, profile
        # A server queues its step's GPU work, then prepares what comes next while it runs:
        # on the GPU the rest of the model (a queued kernel) goes before the prefetch calls'
        # host work; on the CPU the rest blocks the host thread, so the prefetches go first.
        self.queued_work = getattr(work, "queued", False)
        self.prefetch = prefetcher(emb, cache) if lookahead else None
        self.handles: collections.deque = collections.deque()  # (step, handle), oldest first
        self.ahead = 1  # the next step whose chunks are not prefetched yet
        self.out: list[tuple] = []

    def run(self, lo: int, hi: int, settle: bool = False) -> None:
        """Steps ``lo .. hi - 1`` (in order, after the steps before ``lo``). ``settle``:
        then wait for the prefetches in flight and add the wait to the last step's time
        (another series runs next: its time must not read this one's rows)."""
        if self.check_tokens is not None:  # (imported here: bench/embed.py shadows the
            import embed.cached_groups as cached_groups  # package where bench/ is on the path)

            saved = cached_groups.CHECK_TOKENS
            cached_groups.CHECK_TOKENS = self.check_tokens
        if self.profile is not None:
            self.profile.enable()
        try:
            for k in range(lo, min(hi, len(self.steps))):
                self._step(k)
            if settle and self.handles:
                t0 = time.perf_counter()
                self.finish()
                if self.out and hi - 1 >= self.warm:
                    dt, *more = self.out[-1]
                    self.out[-1] = (dt + time.perf_counter() - t0, *more)
        finally:
            if self.profile is not None:
                self.profile.disable()
            if self.check_tokens is not None:
                cached_groups.CHECK_TOKENS = saved

    def _step(self, k: int) -> None:
        st, cache, steps = self.steps[k], self.cache, self.steps
        timed = k >= self.warm
        if self.record is not None and timed:  # the rows this step will fault (a peek)
            g = np.unique((st.batch.host_ids() + cache.row_offsets[:-1, None]).ravel())
            self.record.append(g[cache._row_slot[g] < 0])
        s0 = cache.stats() if cache is not None else None
        t0 = time.perf_counter()
        emb = self.emb if self.graphs is None or st.prefill is not None else self.graphs
        y = emb.embed_packed(st.batch)
        t_embed = time.perf_counter() - t0
        handles = self.handles
        while handles and handles[0][0] <= k:
            handles.popleft()[1].wait()  # done by now (this embed needed them); errors surface
        if timed and self.queued_work:  # the GPU's rest of the model is queued before the
            self.work(self.rest.seconds(st.tokens, st.prefill_tokens))  # prefetch calls
        if self.prefetch is not None:
            for j in range(max(self.ahead, k + 1), min(k + self.lookahead, len(steps) - 1) + 1):
                if steps[j].prefill is not None:
                    handles.append((j, self.prefetch(steps[j].prefill)))  # read during the rest
            self.ahead = max(self.ahead, k + self.lookahead + 1)
        if timed and not self.queued_work:  # the host's rest of the model blocks its thread
            self.work(self.rest.seconds(st.tokens, st.prefill_tokens))
        self.sync()
        dt = time.perf_counter() - t0
        if self.check is not None and k % self.check[0] == 0:
            self.check[1].append((k, y))
        if timed:
            f = (0, 0, 0.0, 0.0)
            if s0 is not None:
                s1 = cache.stats()
                f = (
                    s1.hits - s0.hits,
                    s1.misses - s0.misses,
                    s1.fault_seconds - s0.fault_seconds,
                    s1.prefetch_wait_seconds - s0.prefetch_wait_seconds,
                )
            self.out.append((dt, st.tokens, st.kind, *f, t_embed))

    def finish(self) -> list[tuple]:
        """Wait for the prefetches still in flight; returns :attr:`out`."""
        while self.handles:
            self.handles.popleft()[1].wait()
        return self.out


def interleave(series: dict[str, Series], n_steps: int, block: int) -> dict[str, list[tuple]]:
    """Run every series over ``n_steps`` steps, ``block`` steps of one series at a time
    (``block`` >= ``n_steps``: one series after the other, in order), the series' order
    rotating by one each block. At a block's end a series with prefetches in flight waits
    for them, and its last step pays the wait: interleaved, a lookahead series loses the
    overlap across each block's end, and never gains reads done in another's time.
    Returns each series' timed steps."""
    names = list(series)
    block = max(1, block)
    for b, lo in enumerate(range(0, n_steps, block)):
        r = b % len(names)
        for name in names[r:] + names[:r]:
            series[name].run(lo, lo + block, settle=lo + block < n_steps)
    return {name: s.finish() for name, s in series.items()}
