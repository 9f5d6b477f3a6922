"""The host time of a cached LongCat step's protocol over its caches, on the CPU.

What a GPU step's host does around its launches when every row is resident (hot replay):
``CachedGroups.ordered`` (hash the step's rows straight into the shared cache's global ids,
``holds_all``, the stream waits, the resolve that pins and touches them) and the step's end
(``end_step``), with an empty device part, over one ``NgramRowCache`` shared by the 12
tables (as ``bench/embed_step.py`` serves them). The baseline, measured in the same run: the
host hash alone (``NgramBatch.host_ids``, one C pass), the part of the protocol no cache
can save. Printed per shape: µs a step (best of ``--repeats`` means of ``--steps`` steps),
the hash's µs and their ratio. Run it in two trees to compare a change's host cost (a GPU
step at decode sizes is host-bound, so this is what its cached/resident ratio moves with).

    python -m bench.step_host [--steps 200] [--repeats 7] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np

from rowcache.cache.row_cache import NgramRowCache
from rowcache.embed.ngram.batch import NgramBatch
from rowcache.embed.ngram.dims import NgramDims
from rowcache.embed.step.cached_groups import CachedGroups
from rowcache.embed.tables import CachedTable
from rowcache.store.builder import build_store

SHAPES = (("decode x1", 1), ("decode x64", 64), ("decode x256", 256), ("prefill 2048", 2048))


def _batch(dims: NgramDims, tokens: np.ndarray, n: int) -> NgramBatch:
    keep = dims.max_ngram - 1
    if n > 256:  # one sequence of n new tokens after its look-back
        c = tokens[: n + keep]
        return NgramBatch(dims, c, np.array([c.size]), np.array([n]))
    ctx = tokens[: n * (keep + 1)]  # n sequences, one new token each
    return NgramBatch(dims, ctx, np.full(n, keep + 1), np.ones(n, dtype=np.int64))


def _best(fn, steps: int, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        best = min(best, (time.perf_counter() - t0) / steps)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="steps a timed repeat")
    ap.add_argument("--repeats", type=int, default=7, help="timed repeats (the best is kept)")
    ap.add_argument("--vocab", type=int, default=4096, help="vocabulary (rows scale with it)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    for flag in ("steps", "repeats", "vocab"):
        if not 1 <= getattr(args, flag) <= 10**7:
            ap.error(f"--{flag}={getattr(args, flag)}: give 1..10,000,000")
    dims = NgramDims(
        vocab_size=args.vocab, hidden_size=96, max_ngram=4, splits=4, ratio=2.0, eos_token_id=2
    )
    T = dims.num_tables
    rng = np.random.default_rng(0)
    work = tempfile.mkdtemp(prefix="bench-step-host-")
    rows = []
    try:
        tabs = {
            str(i): rng.standard_normal((dims.table_rows(i), dims.table_dim)).astype(np.float32)
            for i in range(T)
        }
        with build_store(os.path.join(work, "s"), tabs, progress=False) as store:
            total = sum(dims.table_rows(i) for i in range(T))
            cache = NgramRowCache(store, [str(i) for i in range(T)], slots=total)
            tables = [CachedTable(cache, i) for i in range(T)]
            groups = CachedGroups(None, tables, np, defer_reads=False)
            tokens = rng.integers(3, args.vocab, 4 * 2048 + 16)
            for name, n in SHAPES:
                batch = _batch(dims, tokens, n)

                def step(batch: NgramBatch = batch) -> None:
                    groups.ordered(batch, lambda: None)
                    groups.end_step()

                s = _best(step, args.steps, args.repeats)
                h = _best(lambda batch=batch: batch.host_ids(), args.steps, args.repeats)
                rows.append({"shape": name, "step_us": s * 1e6, "hash_us": h * 1e6, "ratio": s / h})
            cache.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps({"results": rows}, indent=2))
        return 0
    print("shape         | step µs | hash µs | step / hash")
    for r in rows:
        print(f"{r['shape']:<13} | {r['step_us']:7.1f} | {r['hash_us']:7.1f} | {r['ratio']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
