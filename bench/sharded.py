"""The judge of the n-gram tables spread over the ranks of a torch.distributed group.

For each group size (1, 2, 4, 8 ranks: one process a rank, spawned; gloo on the CPU, NCCL
on GPUs, one GPU a rank, NVLink multicast off) and each series, in one run on the same
decode-shaped steps (``--seqs`` sequences of one new token after their look-back):

- ``resident``: every rank holds its tables' pieces (``ShardedNgramEmbedding.from_arrays``);
- ``cached``: every rank serves its pieces from its own ``NgramRowCache`` (``--arena-fraction``
  of its rows) over one store on the node's disk, each step's rows prefetched at its start;

tokens/s of the whole group (every rank embeds every token: the step's time is the slowest
rank's), the bytes each rank holds (``resident_bytes``), the ``all_reduce`` of the step's
float32 ``[n + 1, hidden]`` buffer alone, timed in the same processes (its share of the
step), and the largest difference from the single-process ``NgramEmbedding`` over every
timed step, in bf16 ulps of the larger magnitude floored near zero
(``rowcache.embed.sharded.max_ulps``: the stated tolerance is <= 1). The single-process
figure (``NgramEmbedding`` of all the tables, in the parent process) is measured in the same
run: ``vs single`` is the ratio of tokens/s.

    python -m bench.sharded --device cuda --ranks 1,2,4,8 [--json]
    python -m bench.sharded --quick          # a tiny CPU run with gloo (what the test runs)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np

from bench._common import report


def _dims(args: argparse.Namespace) -> Any:
    from rowcache.embed.ngram.dims import NgramDims

    return NgramDims(vocab_size=args.vocab, hidden_size=args.hidden, max_ngram=4, splits=4,
                     ratio=args.ratio, eos_token_id=2)  # fmt: skip


def _weights(dims: Any) -> tuple[Any, list[Any], Any]:
    """The same random weights in every process (seeded)."""
    from rowcache.kernels.reference import BF16

    rng = np.random.default_rng(0)
    T, d, D = dims.num_tables, dims.table_dim, dims.hidden_size
    word = (rng.standard_normal((dims.vocab_size, D), dtype=np.float32) * 0.02).astype(BF16)
    tables = [
        (rng.standard_normal((dims.table_rows(i), d), dtype=np.float32) * 0.05).astype(BF16)
        for i in range(T)
    ]
    projs = (rng.standard_normal((T, D, d), dtype=np.float32) / np.sqrt(d)).astype(BF16)
    return word, tables, projs


def _steps(dims: Any, args: argparse.Namespace) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Decode steps of ``--seqs`` streams of Zipf-like tokens: (tokens, ctx_lens, seq_lens)."""
    rng = np.random.default_rng(1)
    c = dims.max_ngram - 1
    stream = (rng.zipf(1.2, size=(args.seqs, args.steps + c)) % dims.vocab_size).astype(np.int64)
    out = []
    for s in range(args.steps):
        tokens = stream[:, s : s + c + 1].reshape(-1)
        out.append((tokens, np.full(args.seqs, c + 1), np.ones(args.seqs, dtype=np.int64)))
    return out


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _time_steps(emb: Any, steps: list[Any], warm: int, device: str, prefetch: bool) -> tuple:
    """Seconds of the timed steps (after ``warm`` untimed) and the outputs' bits."""
    outs = []
    t0 = 0.0
    for k, step in enumerate(steps):
        if k == warm:
            _sync(device)
            t0 = time.perf_counter()
        if prefetch:
            emb.prefetch_packed(*step)
        out = emb.embed_packed(*step)
        if k >= warm:
            outs.append(out)
    _sync(device)
    secs = time.perf_counter() - t0
    host = [o.get() if hasattr(o, "get") else o for o in outs]
    return secs, np.concatenate(host).view(np.uint16)


def _worker(rank: int, world: int, args: argparse.Namespace, where: str) -> None:
    import torch
    import torch.distributed as dist

    from rowcache.embed.sharded import ShardedNgramEmbedding
    from rowcache.store.handle import RowStore

    if args.device == "cuda":
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        torch.cuda.set_device(rank)
        import cupy as cp

        cp.cuda.Device(rank).use()
    else:
        torch.set_num_threads(1)
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{where}/rdv{world}", rank=rank,
                            world_size=world)  # fmt: skip
    try:
        dims = _dims(args)
        word, tables, projs = _weights(dims)
        steps = _steps(dims, args)
        warm = max(1, args.steps // 5)
        n = args.seqs
        rows: dict[str, Any] = {}
        resident = ShardedNgramEmbedding.from_arrays(dims, word, tables, projs,
                                                     device=args.device)  # fmt: skip
        secs, bits = _time_steps(resident, steps, warm, args.device, False)
        rows["resident"] = (secs, resident.resident_bytes(), bits)
        mine = sum(dims.table_rows(p.table) for p in resident.pieces)
        del resident
        store = RowStore.open(os.path.join(where, "store"))
        cached = ShardedNgramEmbedding.from_store(
            dims, word if rank == 0 else None, store, projs,
            slots=max(1024, int(args.arena_fraction * max(mine, 1))), device=args.device,
        )  # fmt: skip
        secs, bits = _time_steps(cached, steps, warm, args.device, True)
        rows["cached"] = (secs, cached.resident_bytes(), bits)
        # the all_reduce of one step's buffer alone, as many times as the timed steps
        buf = torch.zeros((n + 1, dims.hidden_size), dtype=torch.float32, device=args.device)
        for _ in range(warm):
            dist.all_reduce(buf)
        _sync(args.device)
        t0 = time.perf_counter()
        for _ in range(args.steps - warm):
            dist.all_reduce(buf)
        _sync(args.device)
        reduce_s = time.perf_counter() - t0
        res = {
            name: {"secs": s, "bytes": b, "reduce_s": reduce_s} for name, (s, b, _) in rows.items()
        }
        with open(os.path.join(where, f"w{world}r{rank}.json"), "w") as f:
            json.dump(res, f)
        if rank == 0:
            np.savez(os.path.join(where, f"w{world}.npz"), **{k: v[2] for k, v in rows.items()})
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--ranks", default="1,2,4,8", help="group sizes, comma-separated")
    ap.add_argument("--vocab", type=int, default=131072)
    ap.add_argument("--hidden", type=int, default=3072)
    ap.add_argument("--ratio", type=float, default=4.0, help="table rows = ratio * vocab")
    ap.add_argument("--seqs", type=int, default=64, help="sequences a decode step")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--arena-fraction", type=float, default=0.25)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--quick", action="store_true", help="a tiny CPU run with gloo")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.device, args.ranks = "cpu", "1,2"
        args.vocab, args.hidden, args.ratio, args.seqs, args.steps = 2048, 192, 2.0, 16, 20
    import torch.multiprocessing as mp

    from rowcache.embed.layer import NgramEmbedding
    from rowcache.embed.sharded import max_ulps
    from rowcache.embed.tables import Bf16Table
    from rowcache.store.builder import build_store

    ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
    if args.device == "cuda":
        import torch

        have = torch.cuda.device_count()
        ranks = [r for r in ranks if r <= have]
    dims = _dims(args)
    word, tables, projs = _weights(dims)
    steps = _steps(dims, args)
    warm = max(1, args.steps // 5)
    own = args.workdir is None
    where = tempfile.mkdtemp(prefix="rowcache-sharded-") if own else args.workdir
    try:
        build_store(os.path.join(where, "store"), {f"t{i}": t for i, t in enumerate(tables)},
                    overwrite=True, progress=False)  # fmt: skip
        # the single-process figure, in this process
        if args.device == "cuda":
            single = NgramEmbedding(dims, Bf16Table(word).to("cuda"),
                                    [Bf16Table(t).to("cuda") for t in tables], projs)  # fmt: skip
        else:
            single = NgramEmbedding(dims, word, tables, projs)
        single_s, single_bits = _time_steps(single, steps, warm, args.device, False)
        tokens = args.seqs * (args.steps - warm)
        single_tps = tokens / single_s
        results: list[dict[str, Any]] = [
            {"ranks": "single", "series": "resident", "tok/s": single_tps, "vs single": 1.0,
             "MB/rank": single.resident_bytes() / 1e6, "reduce share": 0.0, "max ulp": 0.0}
        ]  # fmt: skip
        del single
        for world in ranks:
            mp.spawn(_worker, args=(world, args, where), nprocs=world, join=True)
            per = []
            for r in range(world):
                with open(os.path.join(where, f"w{world}r{r}.json")) as f:
                    per.append(json.load(f))
            with np.load(os.path.join(where, f"w{world}.npz")) as z:
                bits = {k: z[k] for k in z.files}
            for series in ("resident", "cached"):
                secs = max(p[series]["secs"] for p in per)
                reduce_s = max(p[series]["reduce_s"] for p in per)
                tps = tokens / secs
                results.append({
                    "ranks": world, "series": series, "tok/s": tps, "vs single": tps / single_tps,
                    "MB/rank": max(p[series]["bytes"] for p in per) / 1e6,
                    "reduce share": reduce_s / secs,
                    "max ulp": max_ulps(bits[series], single_bits),
                })  # fmt: skip
        settings = {
            "device": args.device, "backend": "nccl" if args.device == "cuda" else "gloo",
            "vocab": args.vocab, "hidden": args.hidden, "tables": dims.num_tables,
            "table_rows": dims.table_rows(0), "seqs": args.seqs, "timed_steps": args.steps - warm,
            "arena_fraction": args.arena_fraction, "NCCL_NVLS_ENABLE": "0",
        }  # fmt: skip
        report("sharded n-gram embedding", results, args.json, settings)
    finally:
        if own:
            shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    main()
