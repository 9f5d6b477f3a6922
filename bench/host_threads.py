"""The host kernels of a cached prefill step on 1 to 8 threads (kernels/_pool.h's workers).

Not a claim of its own: where bench/embed.py's cached prefill step spends its host time.
At one prefill step's size (``--tokens`` positions x 12 tables of ``--rows`` rows, one
shared arena holding every row, its LRU log twice the arena) it times, per thread count,
``hash_packed`` (the step's global ids) and ``lru_hits`` (the exact-LRU touch of those
ids), the deferred touch (the caller's part: ``lru_scan`` + ``lru_touch_start``; and with
the touch waited for at once), a modelled graph prefill step (hash, scan, touch start, and
``--gpu-us`` of device work) whose scan waits for the previous step's touch or queues its
touch behind it (median and mean: the mean includes the compactions its touches ran), and
``lru_compact`` (the log's compaction on as many threads: a prefill step needs one about
every ``12 * rows / (12 * tokens)`` steps).
One thread is the serial C code: the baseline of the same run.

    python bench/host_threads.py             # the H200 host: 2,048 tokens, 262,145 rows
    python bench/host_threads.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rowcache.kernels.host import HOST_THREADS, native


def _median_us(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e6


def _time_threads(
    k: int,
    tokens: np.ndarray,
    lens: np.ndarray,
    mult: np.ndarray,
    rows: np.ndarray,
    offsets: np.ndarray,
    row_slot: np.ndarray,
    N: int,
    reps: int,
    gpu_us: float,
) -> dict:
    """Median us of the hash and the touch on ``k`` threads (the touch repeated on one
    arena, compacting its log whenever it is full), and of those compactions."""
    T, n, S = rows.size, tokens.size, row_slot.size
    gids = np.empty((T, n), dtype=np.int64)
    hash_us = _median_us(
        lambda: native.hash_packed(tokens, lens, lens, mult, rows, N, offsets, 2, gids, k), reps
    )
    ids = gids.ravel().copy()
    last_used = np.zeros(S, dtype=np.int64)
    log = np.empty(2 * S, dtype=np.int32)
    log[:S] = np.arange(S, dtype=np.int32)
    log_pos = np.arange(S, dtype=np.int32)
    out = np.empty(ids.size, dtype=np.int32)
    scratch = np.empty(2 * ids.size, dtype=np.int32)
    state = {"tail": S, "batch": 0}
    compact_us: list[float] = []

    def compact() -> None:
        t0 = time.perf_counter()
        state["tail"] = native.lru_compact(log, log_pos, 0, state["tail"], k)
        compact_us.append((time.perf_counter() - t0) * 1e6)

    def hits() -> int:
        status, _, tail = native.lru_hits(ids, S, row_slot, last_used, log, log_pos,
                                          state["tail"], state["batch"], out, scratch, k)  # fmt: skip
        if status == 0:
            state["tail"] = tail
        return status

    def touch() -> None:
        state["batch"] += 1
        if hits() == 3:  # the log is full: compact (timed apart), then again
            compact()
            assert hits() == 0

    hits_us = _median_us(touch, reps)
    pending: list[int] = []

    def deferred() -> None:  # the caller's part of a deferred touch: the scan and the start
        state["batch"] += 1
        status, _ = native.lru_scan(ids, S, row_slot, out, scratch, k)
        assert status == 0
        if state["tail"] + ids.size > log.size:
            compact()
        pending.append(native.lru_touch_start(row_slot, last_used, log, log_pos, scratch,
                                               ids.size, 0, state["tail"], state["batch"], k))  # fmt: skip

    def finish() -> None:  # wait for the touch; take in the log's new tail
        h = pending.pop()
        state["tail"] = (h if type(h) is tuple else native.lru_touch_wait(h))[3]

    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        deferred()
        ts.append(time.perf_counter() - t0)
        while time.perf_counter() - t0 < 2e-3:  # the step's other work: the touch runs
            pass
        finish()

    def touch_now() -> None:  # the same, the touch waited for at once: the whole work
        deferred()
        finish()

    whole_us = _median_us(touch_now, reps)
    compact()
    scratches = [scratch, np.empty_like(scratch)]
    chain: list[int] = []

    def settle(keep: int) -> None:  # wait for the oldest touches, all but `keep`
        while len(chain) > keep:
            h = chain.pop(0)
            state["tail"] = (h if type(h) is tuple else native.lru_touch_wait(h))[3]

    def step(queued: bool, r: int) -> float:  # one graph-replayed prefill step, us
        t0 = time.perf_counter()
        native.hash_packed(tokens, lens, lens, mult, rows, N, offsets, 2, gids, k)
        settle(1 if queued and chain and type(chain[-1]) is not tuple else 0)
        s = scratches[r % 2]  # the pending touch holds the other one
        assert native.lru_scan(ids, S, row_slot, out, s, k)[0] == 0
        state["batch"] += 1
        if not chain and state["tail"] + ids.size > log.size:
            compact()  # a chained touch compacts by itself
        after = chain[-1] if chain else -1
        chain.append(native.lru_touch_start(row_slot, last_used, log, log_pos, s, ids.size,
                                            0, state["tail"], state["batch"], k, after))  # fmt: skip
        while time.perf_counter() - t0 < gpu_us * 1e-6:  # the device part it waits for
            pass
        return (time.perf_counter() - t0) * 1e6

    piped, piped_mean = {}, {}
    for queued in (False, True):
        times = [step(queued, r) for r in range(reps)]
        piped[queued], piped_mean[queued] = float(np.median(times)), float(np.mean(times))
        settle(0)
    return {"threads": k, "hash_us": hash_us, "lru_hits_us": hits_us,
            "deferred_us": float(np.median(ts)) * 1e6, "deferred_whole_us": whole_us,
            "step_waiting_us": piped[False], "step_queued_us": piped[True],
            "step_queued_mean_us": piped_mean[True],
            "lru_compact_us": float(np.median(compact_us))}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--rows", type=int, default=262_145, help="rows per table (12 tables)")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--threads", default="1,2,4,8", help="comma list of thread counts")
    p.add_argument(
        "--gpu-us", type=float, default=125.0,
        help="the device part of a modelled graph prefill step (the H200's, ~125 us)",
    )  # fmt: skip
    p.add_argument("--quick", action="store_true", help="small sizes (the test runs this)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.quick:
        a.tokens, a.rows, a.reps = 1024, 20_000, 5
    try:
        counts = [int(x) for x in a.threads.split(",")]
    except ValueError:
        p.error(f"--threads {a.threads!r}: give a comma list of integers in 1..16")
    if not counts or any(not 1 <= k <= 16 for k in counts):
        p.error(f"--threads {a.threads!r}: give a comma list of integers in 1..16")
    if native is None:
        print("rowcache.kernels._host is not built: nothing to time (pip install -e .)", file=sys.stderr)
        return 1
    rng = np.random.default_rng(0)
    T, N, n = 12, 3, a.tokens
    mult = rng.integers(1, 1 << 20, (T, N)).astype(np.int64)
    rows = np.full(T, a.rows, dtype=np.int64)
    offsets = (np.arange(T) * a.rows).astype(np.int64)
    tokens = rng.integers(3, 131_072, n).astype(np.int64)
    lens = np.array([n], dtype=np.int64)
    S = T * a.rows
    row_slot = rng.permutation(S).astype(np.int32)  # every row mapped, slots shuffled
    args = (tokens, lens, mult, rows, offsets, row_slot, N, a.reps, a.gpu_us)
    results = [_time_threads(k, *args) for k in counts]
    if a.json:
        print(json.dumps({"tokens": n, "tables": T, "rows": a.rows, "results": results}))
        return 0
    base = results[0]
    print(f"{n} tokens x {T} tables of {a.rows:,} rows, one arena of {S:,} slots; "
          f"HOST_THREADS here {HOST_THREADS}; medians of {a.reps} (us)")  # fmt: skip
    every = S // (T * n)  # steps between compactions: the log's spare room / a step's touch
    print(f"{'threads':>7} {'hash_packed':>12} {'lru_hits':>10} {'deferred':>9} {'+ wait':>8}"
          f" {'step, waits':>12} {'queued':>7} {'mean':>7} {'compact':>8}"
          f"   against {base['threads']} thread{'s' * (base['threads'] > 1)}")  # fmt: skip
    for r in results:
        print(f"{r['threads']:>7} {r['hash_us']:>12.1f} {r['lru_hits_us']:>10.1f} "
              f"{r['deferred_us']:>9.1f} {r['deferred_whole_us']:>8.1f} "
              f"{r['step_waiting_us']:>12.1f} {r['step_queued_us']:>7.1f} "
              f"{r['step_queued_mean_us']:>7.1f} {r['lru_compact_us']:>8.0f}   "
              f"x{base['hash_us'] / r['hash_us']:.2f} hash, "
              f"x{base['lru_hits_us'] / r['lru_hits_us']:.2f} touch")  # fmt: skip
    print(f"compact: lru_compact of the full log on as many threads, needed every ~{every} "
          "steps (the queued step's mean includes the compactions its touches ran)")
    print(f"(step: a modelled graph prefill step: the hash, the scan and the touch's start, and "
          f"{a.gpu_us:.0f} us of device work from its start; 'waits': the scan first waits for "
          "the previous step's touch; 'queued': it queues its touch behind it)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
