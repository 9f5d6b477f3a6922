"""Where a cached step's host time goes: cProfile of hot (100 %-hit) steps, cached vs resident.

Not a claim of its own: the profile behind bench/embed.py's cached/resident ratios. Builds
a small store (``--rows`` per table), one shared arena holding every row, warms it, then
profiles ``--steps`` synchronized steps per shape and prints the top functions by own time.
``--quick`` runs tiny sizes on the CPU.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rowcache
from rowcache.embed.ngram.batch import NgramBatch
from rowcache.embed.ngram.dims import NgramDims
from rowcache.embed.layer import NgramEmbedding
from rowcache.embed.tables import CachedTable
from rowcache.kernels.reference import BF16


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--rows", type=int, default=262_145)
    p.add_argument("--hidden", type=int, default=3072)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--graphs", action="store_true", help="cuda_graphs=True")
    p.add_argument("--top", type=int, default=18)
    p.add_argument(
        "--faults",
        type=int,
        default=0,
        metavar="K",
        help="profile fault steps of K misses of a 25%% shared arena instead",
    )
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    if a.quick:
        a.device, a.rows, a.hidden, a.steps = "cpu", 4099, 96, 20
    V = 131072
    dims = NgramDims(vocab_size=V, hidden_size=a.hidden, max_ngram=4, splits=4,
                     ratio=(a.rows - 1) / V, eos_token_id=2)  # fmt: skip
    T, d, D = dims.num_tables, dims.table_dim, dims.hidden_size
    rng = np.random.default_rng(0)
    tabs = {f"t{i}": (rng.standard_normal((dims.table_rows(i), d), dtype=np.float32) * 0.02)
            .astype(BF16) for i in range(T)}  # fmt: skip
    work = tempfile.mkdtemp(prefix="rowcache-profile-")
    store = rowcache.build_store(os.path.join(work, "s"), tabs, progress=False)
    shared = rowcache.NgramRowCache(store, list(tabs), slots=sum(t.shape[0] for t in tabs.values()),
                                    device=a.device)  # fmt: skip
    word = (rng.standard_normal((V, D), dtype=np.float32) * 0.02).astype(BF16)
    projs = [(rng.standard_normal((D, d), dtype=np.float32) * 0.06).astype(BF16) for _ in range(T)]
    xp = np
    resident_tabs: list = list(tabs.values())
    if a.device == "cuda":
        import cupy as xp  # type: ignore[no-redef]

        word_dev = xp.asarray(word)
        resident_tabs = [xp.asarray(t) for t in tabs.values()]
    else:
        word_dev = word
    if a.faults:
        return profile_faults(a, store, list(tabs), sum(t.shape[0] for t in tabs.values()))
    kw = {"cuda_graphs": a.graphs}
    cached = NgramEmbedding(dims, word_dev, [CachedTable(shared, k) for k in range(T)], projs, **kw)
    resident = NgramEmbedding(dims, word_dev, resident_tabs, projs, **kw)

    def sync() -> None:
        if xp is not np:
            xp.cuda.get_current_stream().synchronize()

    for name, S, L in (("decode x1", 1, 1), ("decode x64", 64, 1), ("prefill 2048", 1, 2048)):
        toks = rng.integers(3, V, S * (L + 3)).astype(np.int64)
        args = (toks, np.full(S, L + 3), np.full(S, L))
        for label, emb in (("resident", resident), ("cached", cached)):
            for _ in range(3):
                emb.embed_packed(NgramBatch(dims, *args))
            sync()
            t0 = time.perf_counter()
            for _ in range(a.steps):
                emb.embed_packed(NgramBatch(dims, *args))
                sync()
            ms = (time.perf_counter() - t0) / a.steps * 1e3
            print(f"{name:13s} {label:8s} {ms:.3f} ms/step")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.steps):
            cached.embed_packed(NgramBatch(dims, *args))
            sync()
        prof.disable()
        print(f"--- cached {name}: top {a.top} by own time ({a.steps} steps)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(a.top)
    store.close()
    return 0


def profile_faults(a: argparse.Namespace, store: Any, names: list[str], rows: int) -> int:
    """cProfile of ``resolve`` steps that each fault ``a.faults`` cold rows (O_DIRECT)."""
    st = rowcache.RowStore.open(store.path, direct=True)
    cache = rowcache.NgramRowCache(st, names, slots=rows // 4, device=a.device)
    if a.device == "cuda":
        cache.device_map()  # as the fused embedding step uses it
    rng = np.random.default_rng(1)
    for lo in range(0, rows // 4, 1 << 14):
        cache.resolve(np.arange(lo, min(rows // 4, lo + (1 << 14))))
        cache.end_batch()
    sync = (lambda: cache.stream.synchronize()) if a.device == "cuda" else (lambda: None)
    steps = [np.sort(rng.choice(np.arange(rows // 4, rows), a.faults, replace=False))
             for _ in range(2 * a.steps)]  # fmt: skip
    times = []
    prof = cProfile.Profile()
    for i, ids in enumerate(steps):
        if i == a.steps:
            prof.enable()
        t0 = time.perf_counter()
        cache.resolve(ids)
        sync()
        times.append(time.perf_counter() - t0)
        cache.end_batch()
    prof.disable()
    print(f"fault step of {a.faults} rows: median {np.median(times[: a.steps]) * 1e3:.3f} ms "
          f"(unprofiled), reads {cache.stats().read_ops}")  # fmt: skip
    pstats.Stats(prof).sort_stats("tottime").print_stats(a.top)
    pstats.Stats(prof).sort_stats("cumtime").print_stats(a.top)
    st.close()
    store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
