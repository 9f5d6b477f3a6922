"""NgramRowCache: hit-path cost, fault-path read rate, and bookkeeping memory.

- Hit path: host time of ``resolve`` for a decode batch (64 x 12 = 768 ids) and a prefill
  chunk (2,048 x 12 = 24,576 ids), all resident (targets: <= 100 us and <= 2 ms on the CPU),
  with ``np.unique`` of the same ids as the floor; on the GPU, resolve + gather from the
  cached table vs the gather from a fully resident device table (target <= 1.5x).
- Fault path: rows/s at 0% hits with the page cache dropped, vs raw 4 KiB O_DIRECT random
  reads at the same queue depth in the same run (target >= 0.8x), per arena and reader.
- Memory: per-slot bookkeeping bytes vs row bytes (target <= 5%).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rowcache
import rowcache.kernels
from bench._common import (
    drop_cache,
    make_source,
    median_time,
    raw_direct_reads,
    report,
    store_files,
)


def hit_path(store, device: str, arena: str, sizes: list[int], repeat: int) -> list[dict]:
    info = store.tables[0]
    rng = np.random.default_rng(2)
    out = []
    for n in sizes:
        ids = rng.integers(0, info.rows, n)
        cache = rowcache.NgramRowCache(store, 0, slots=max(2 * n, 1024), device=device, arena=arena)
        cache.resolve(ids)
        cache.end_step()

        def resolve_only(cache=cache, ids=ids):
            cache.resolve(ids)
            cache.end_step()

        row = {"device": device, "arena": arena if device == "cuda" else "-", "ids": n}
        row["resolve_us"] = median_time(resolve_only, repeat) * 1e6
        row["np_unique_us"] = (
            median_time(lambda ids=ids: np.unique(ids, return_inverse=True), repeat) * 1e6
        )
        if device == "cuda":
            import cupy as cp

            resident = cp.asarray(store.read_rows(0, np.arange(min(info.rows, 1 << 22))))
            ids_dev = cp.asarray(ids % resident.shape[0])
            outbuf = cp.empty((n, info.dim), dtype=resident.dtype)

            def resident_gather(ids_dev=ids_dev, resident=resident, outbuf=outbuf):
                rowcache.kernels.batched_embed(ids_dev, resident, outbuf)
                cp.cuda.get_current_stream().synchronize()

            def cached_gather(cache=cache, ids=ids, outbuf=outbuf):
                slots = cache.resolve(ids)
                rowcache.kernels.batched_embed(slots, cache.table, outbuf)
                cp.cuda.get_current_stream().synchronize()
                cache.end_step()

            for f in (resident_gather, cached_gather):
                f()
            row["resident_gather_us"] = median_time(resident_gather, repeat) * 1e6
            row["resolve+gather_us"] = median_time(cached_gather, repeat) * 1e6
            row["ratio"] = row["resolve+gather_us"] / row["resident_gather_us"]
        out.append(row)
    return out


def fault_path(
    spath: str, configs: list[tuple[str, str, str, bool]], batch: int, nbatches: int, qd: int
) -> list[dict]:
    store = rowcache.RowStore.open(spath, queue_depth=qd)
    info = store.tables[0]
    files = store_files(store)
    rng = np.random.default_rng(3)
    perm = rng.permutation(info.rows)[: batch * nbatches * (len(configs) + 1)]
    chunks = perm.reshape(-1, batch)
    out = []
    k = 0
    for device, arena, reader, direct in configs:
        try:
            cache = rowcache.NgramRowCache(
                store,
                0,
                slots=batch,
                device=device,
                arena=arena,
                reader=reader,
                direct=direct,
                queue_depth=qd,
            )
        except rowcache.RowCacheError as e:
            out.append(
                {
                    "device": device,
                    "arena": arena,
                    "reader": reader,
                    "direct": direct,
                    "error": str(e)[:60],
                }
            )
            continue
        batches = chunks[k * nbatches : (k + 1) * nbatches]
        k += 1
        drop_cache(files)
        t0 = time.perf_counter()
        for b in batches:
            cache.resolve(b)
            cache.end_step()
        if device == "cuda":
            import cupy as cp

            cp.cuda.get_current_stream().synchronize()
        dt = time.perf_counter() - t0
        rows = int(batches.size)
        shard, off = info.locate(np.sort(batches.reshape(-1)))
        drop_cache(files)
        raw = raw_direct_reads(
            [files[s] for s in range(info.shards)],
            [off[shard == s] for s in range(info.shards)],
            qd,
        )
        s = cache.stats()
        assert s.misses == rows and s.hits == 0
        out.append(
            {
                "device": device,
                "arena": cache.arena_kind,
                "reader": cache.reader_kind,
                "direct": direct,
                "rows_s": rows / dt,
                "raw_4k_rows_s": rows / raw,
                "ratio": raw / dt,
                "read_ops": s.read_ops,
            }
        )
    store.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--threads", type=int, default=16, help="queue depth")
    ap.add_argument("--fault-batch", type=int, default=24576)
    ap.add_argument("--fault-batches", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.rows, args.repeat, args.fault_batch, args.fault_batches, args.threads = (
            50_000,
            3,
            768,
            2,
            4,
        )
    work = args.dir or tempfile.mkdtemp(prefix="rowcache-bench-cache-")
    os.makedirs(work, exist_ok=True)
    src = make_source(os.path.join(work, "src.npy"), args.rows, args.dim)
    spath = os.path.join(work, "store")
    if not os.path.exists(os.path.join(spath, "index.lmdb")):
        rowcache.build_store(spath, [src], progress=False)
    store = rowcache.RowStore.open(spath)
    gpu = rowcache.kernels.gpu_available()
    settings = {"rows": args.rows, "dim": args.dim, "queue_depth": args.threads, "gpu": gpu}

    hits = hit_path(store, "cpu", "host", [768, 24576], args.repeat)
    if gpu:
        for arena in ("device", "host"):
            hits += hit_path(store, "cuda", arena, [768, 24576], args.repeat)
    report("bench/cache.py: hit path (all resident)", hits, args.json, settings)

    configs = [("cpu", "host", "posix", False), ("cpu", "host", "posix", True)]
    if gpu:
        configs += [
            ("cuda", "device", "posix", True),
            ("cuda", "host", "posix", True),
            ("cuda", "device", "kvikio", False),
            ("cuda", "host", "kvikio", False),
        ]
    faults = fault_path(spath, configs, args.fault_batch, args.fault_batches, args.threads)
    report("bench/cache.py: fault path (0% hits, page cache dropped)", faults, args.json, settings)

    cache = rowcache.NgramRowCache(store, 0, slots=min(args.rows, 100_000))
    ov = cache.inspect().overhead_bytes()
    row_bytes = store.tables[0].record_bytes
    mem = [
        {
            "slots": cache.num_slots,
            "per_slot_bytes": ov["per_slot_arrays"] / cache.num_slots,
            "row_bytes": row_bytes,
            "overhead_pct": 100 * ov["per_slot_arrays"] / cache.num_slots / row_bytes,
            "row_map_MB_per_table": ov["row_map"] / 1e6,
        }
    ]
    report("bench/cache.py: bookkeeping memory", mem, args.json, settings)
    store.close()
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
