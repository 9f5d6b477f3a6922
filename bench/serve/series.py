"""The serving judge's series: one embedding (resident, cached, with lookahead...) run over a
server's steps, each step = the embedding + the rest of the model, timed.

Owns :func:`prefetcher` (the lookahead API of this tree), :class:`Series` (a series whose
steps run in blocks, its state kept between them) and :func:`interleave` (every series of a
server advanced turn by turn, in an order that rotates: a shared VM's drift over the
minutes of a run lands on every series alike, not on whichever runs last; :func:`turn_ends`
puts the turns' ends where no prefetch is in flight).
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
    thread, ``perf_counter`` at its start, seconds of its prefetch calls, its demand faults'
    phases (plan, read, commit, launch: ``NgramRowCache.fault_phases``), seconds of a turn's
    end charged to it: in its seconds, not in its latency, see :meth:`run`). ``issued``: per
    prefetch call of a timed step ``(step it was issued at, step it is for, handle)``
    (:func:`prefetch_timeline`). ``lookahead``: 0, or how many steps ahead prefill chunks
    are prefetched (a server knows the prompts it has admitted and queued: step t
    prefetches the chunks of steps t+1..t+lookahead not prefetched yet). ``graphs``: the
    embedding
    (``cuda_graphs=True``, same tables) of the steps without a prefill chunk, as a server
    that captures its decode step. ``record``: the rows each timed step will fault (a
    bench-only peek, untimed). ``check``: ``(every, list)``, every ``every``-th step's output
    appended as ``(step, output)``. ``profile``: a ``cProfile.Profile`` enabled
    during each step's host work (the embedding call and the prefetch calls, not the rest of
    the model) of the timed steps of kind ``profile_kind`` ("decode", "prefill"; None: every step).
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
        profile: Any = None,
        profile_kind: str | None = None,
    ) -> None:
        self.emb, self.steps, self.warm, self.rest = emb, steps, warm, rest
        self.work, self.sync, self.cache, self.lookahead = work, sync, cache, lookahead
        self.record, self.check, self.graphs = record, check, graphs
        self.profile, self.profile_kind = profile, profile_kind
        # A server queues its step's GPU work, then prepares what comes next while it runs:
        # on the GPU the rest of the model (a queued kernel) goes before the prefetch calls'
        # host work; on the CPU the rest blocks the host thread, so the prefetches go first.
        self.queued_work = getattr(work, "queued", False)
        # prefetch through the embedding that ran the step (its deferred reads are its own
        # to settle first: a cache refuses another's prefetch while they are pending)
        self.prefetch = prefetcher(emb, cache) if lookahead else None
        self.prefetch_graphs = (
            prefetcher(graphs, cache) if lookahead and graphs is not None else None
        )
        self.handles: collections.deque = collections.deque()  # (step, handle), oldest first
        self.ahead = 1  # the next step whose chunks are not prefetched yet
        self.out: list[tuple] = []
        self.issued: list[tuple[int, int, Any]] = []
        self.reread = 0  # rows the timed steps' resolves read beside pieces being read
        self.taken = 0  # rows the timed steps' resolves took over from pieces not started
        self.held = False  # the cache's prefetch queue held between turns (_hold)

    def run(self, lo: int, hi: int, settle: bool = False) -> None:
        """Steps ``lo .. hi - 1`` (in order, after the steps before ``lo``). ``settle``:
        another series runs next, and its time must neither read this one's rows nor be
        slowed by them: hold the prefetches not started until this series runs again,
        wait for those being read, and add the wait to the last step's time."""
        self._release()
        for k in range(lo, min(hi, len(self.steps))):
            self._step(k)
        if settle and self.handles:
            t0 = time.perf_counter()
            self._hold()
            if self.out and hi - 1 >= self.warm:  # (and apart: not a step's latency)
                x = time.perf_counter() - t0
                dt, *more, charged = self.out[-1]
                self.out[-1] = (dt + x, *more, charged + x)

    def _step(self, k: int) -> None:
        st, cache, steps = self.steps[k], self.cache, self.steps
        timed = k >= self.warm
        if self.record is not None and timed:  # the rows this step will fault (a peek)
            g = np.unique((st.batch.host_ids() + cache.row_offsets[:-1, None]).ravel())
            self.record.append(g[~cache.inspect().is_resident(g)])
        s0 = cache.stats() if cache is not None else None
        taken0 = getattr(cache, "rows_taken", 0)
        p0 = cache.inspect().fault_phases if cache is not None else None
        t0 = time.perf_counter()
        emb = self.emb if self.graphs is None or st.prefill is not None else self.graphs
        prof = self.profile if timed and self.profile_kind in (None, st.kind) else None
        if prof is not None:
            prof.enable()
        y = emb.embed_packed(st.batch)
        t_embed = time.perf_counter() - t0
        handles = self.handles
        while handles and handles[0][0] <= k:
            handles.popleft()[1].wait()  # done by now (this embed needed them); errors surface
        if timed and self.queued_work:  # the GPU's rest of the model is queued before the
            self.work(self.rest.seconds(st.tokens, st.prefill_tokens))  # prefetch calls
        t_pf = time.perf_counter()
        prefetch = self.prefetch if emb is self.emb else self.prefetch_graphs
        if prefetch is not None:
            for j in range(max(self.ahead, k + 1), min(k + self.lookahead, len(steps) - 1) + 1):
                if steps[j].prefill is not None:
                    handles.append((j, prefetch(steps[j].prefill)))  # read during the rest
                    if timed:
                        self.issued.append((k, j, handles[-1][1]))
            self.ahead = max(self.ahead, k + self.lookahead + 1)
        t_pf = time.perf_counter() - t_pf
        if getattr(emb, "defer_reads", False):  # the step's reads, joined and committed
            emb.settle()
        if prof is not None:
            prof.disable()
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
                self.reread += getattr(s1, "rows_reread", 0) - getattr(s0, "rows_reread", 0)
                self.taken += getattr(cache, "rows_taken", 0) - taken0
                f = (
                    s1.hits - s0.hits,
                    s1.misses - s0.misses,
                    s1.fault_seconds - s0.fault_seconds,
                    s1.prefetch_wait_seconds - s0.prefetch_wait_seconds,
                )
            ph = tuple(cache.inspect().fault_phases - p0) if cache is not None else (0.0,) * 4
            self.out.append((dt, st.tokens, st.kind, *f, t_embed, t0, t_pf, ph, 0.0))

    def _hold(self) -> None:
        """At a turn's end: no prefetch piece starts until this series runs again, and the
        pieces being read finish now (the caller charges the wait to the turn's last step).
        (``NgramRowCache.pause_prefetch``: while other series run, this one's reads neither
        slow them nor advance)."""
        cache = self.cache
        if cache is None or not hasattr(cache, "pause_prefetch"):
            self.finish()
            return
        cache.pause_prefetch()
        self.held = True

    def _release(self) -> None:
        if self.held:
            self.held = False
            self.cache.resume_prefetch()

    def finish(self) -> list[tuple]:
        """Wait for the prefetches still in flight; returns :attr:`out`."""
        self._release()
        while self.handles:
            self.handles.popleft()[1].wait()
        return self.out


def prefetch_timeline(s: Series) -> dict[str, Any]:
    """What a lookahead series' prefetch thread did (its jobs' ``times``): pieces and rows
    read (and rows that resolves took over from pieces not started, or read again beside
    pieces being read: the timed steps'), ms a piece reading and writing the arena, rows/s
    while reading, how long pieces queued, the thread's busy share of the series' timed steps, and per prefill step how much of its own prefetch
    was still unread at its start and how late its last piece landed (ms after the step's
    start; <= 0: on time)."""
    own = [j for _, _, h in s.issued for j in h.pieces(taken=False)]
    jobs = [j for j in own if j.times[1] and j.rows.size]
    if not jobs:
        return {}
    t = np.array([j.times for j in jobs])
    rows = np.array([j.rows.size for j in jobs])
    start = {k: r[8] for k, r in zip(range(s.warm, s.warm + len(s.out)), s.out, strict=True)}
    busy = float((t[:, 3] - t[:, 1]).sum())
    timed = float(sum(r[0] for r in s.out))
    late, unread = [], []
    for _, j, h in s.issued:
        js = [x for x in h.pieces() if x.times[1]]
        if j not in start or not js:
            continue
        late.append(1e3 * (max(x.times[3] for x in js) - start[j]))
        unread.append(sum(x.rows.size for x in js if x.times[3] > start[j]) / max(h.rows, 1))
    late_a = np.array(late)
    return {
        "pieces": len(jobs),
        "rows": int(rows.sum()),
        "rows_taken_over": s.taken,
        "rows_reread": s.reread,
        "read_ms_per_piece": float(1e3 * (t[:, 2] - t[:, 1]).mean()),
        "write_ms_per_piece": float(1e3 * (t[:, 3] - t[:, 2]).mean()),
        "rows_per_s_reading": float(rows.sum() / (t[:, 2] - t[:, 1]).sum()),
        "queued_ms_median": float(1e3 * np.median(t[:, 1] - t[:, 0])),
        "busy_share": busy / timed if timed else None,
        "prefill_steps": len(late),
        "late_steps": int((late_a > 0).sum()) if late else 0,
        "late_ms_median_of_late": float(np.median(late_a[late_a > 0]))
        if (late_a > 0).any()
        else 0.0,
        "unread_share_at_start": float(np.mean(unread)) if unread else 0.0,
        "prefetch_calls_ms_per_step": float(1e3 * np.mean([r[9] for r in s.out])),
    }


def turn_ends(n_steps: int, block: int, quiet: Any = None) -> list[int]:
    """Where the turns of :func:`interleave` end: every ``block`` steps, or, given ``quiet``
    (``quiet[k]``: no lookahead series has a prefetch in flight before step ``k``, i.e. no
    prefill step within its depth), at the first quiet step from there on, up to a second
    ``block`` later (a turn that ends there costs a lookahead series nothing)."""
    ends, lo = [], 0
    while lo < n_steps:
        hi = min(lo + max(1, block), n_steps)
        if quiet is not None and hi < n_steps:
            ok = np.flatnonzero(np.asarray(quiet[hi : min(hi + block, n_steps)]))
            hi += int(ok[0]) if ok.size else 0
        ends.append(hi)
        lo = hi
    return ends


def interleave(
    series: dict[str, Series], n_steps: int, block: int, quiet: Any = None
) -> dict[str, list[tuple]]:
    """Run every series over ``n_steps`` steps, a turn of about ``block`` steps of one series
    at a time (``block`` >= ``n_steps``: one series after the other, in order; ``quiet``:
    :func:`turn_ends`), the series' order rotating by one each turn. At a turn's end a series
    with prefetches in flight holds those not started until its next turn and waits for
    those being read, and its last step pays the wait (``Series.run``): it never gains reads
    done in another's time. Returns each series' timed steps."""
    names = list(series)
    lo = 0
    for b, hi in enumerate(turn_ends(n_steps, block, quiet)):
        r = b % len(names)
        for name in names[r:] + names[:r]:
            series[name].run(lo, hi, settle=hi < n_steps)
        lo = hi
    return {name: s.finish() for name, s in series.items()}
