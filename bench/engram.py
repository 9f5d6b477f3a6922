"""The judge of Engram served from disk: a modelled server step, cached against resident.

A step of a model with Engram memory at two layers (docs/engram-spec.md): at its start the
host hashes the step's tokens (``EngramHash``) and, for the cached series, starts every Engram
layer's reads (``EngramMemory.prefetch``); the GPU then runs the layers before the first
Engram layer (modelled: a kernel that spins for ``--layer-us`` plus ``--token-us`` per token a
layer), the first lookup, the layers up to the second Engram layer, its lookup, and the rest;
the step ends synchronized (a decode token is sampled from it). Tokens: real text (the
stdlib, DeepSeek's tokenizer), as 64 decode streams, one, or prefill chunks.

Series, in one run on the same tokens:
- ``resident``: the tables in GPU memory (``Bf16Table``/``Fp8Table``);
- ``host``: the tables in pinned host memory mapped into the device, gathered by the GPU
  (what the engines do by default);
- ``cached``: a store on disk (``build_store``) behind one ``NgramRowCache`` arena shared by
  both layers (``--arena-fraction`` of their rows), prefetched at the step's start;
- ``lookahead`` (prefill): the same, with the next chunk's rows prefetched a step ahead too
  (a prefill chunk's tokens are known before its step; a decode token is not).
For each: tokens/s, and for ``cached`` the ratio to resident, the hit rate, rows faulted a
token, the time a step still waited for reads after its window (``wait``), so the window it
would need (window + wait); and the disk's floor for the same number of 4 KiB reads (O_DIRECT
``pread`` at random offsets of the store's files, 16 threads) in the same run.

    python -m bench.engram --device cuda [--config demo|v41] [--rows-per-layer N] [--json]
    python -m bench.engram --quick          # a tiny CPU run (what the test runs)
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np

from bench._common import drop_cache, raw_direct_reads, report, store_files

MODES = {"decode x1": (1, 1), "decode x64": (64, 1), "prefill 512": (1, 512)}


def _spin_kernel(cp: Any) -> Any:
    return cp.RawKernel(
        r"""
extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}""",
        "spin",
    )


class Model:
    """The layers around the lookups, as time on the device (or the host on the CPU)."""

    def __init__(self, device: str, layer_us: float, token_us: float, layers: int) -> None:
        self.device, self.layer_us, self.token_us, self.layers = device, layer_us, token_us, layers
        self._cp: Any = None
        if device == "cuda":
            import cupy as cp

            self._cp = cp
            self._spin = _spin_kernel(cp)

    def run(self, layers: int, tokens: int) -> None:
        us = layers * (self.layer_us + self.token_us * tokens)
        if us <= 0:
            return
        if self._cp is None:
            end = time.perf_counter() + us * 1e-6
            while time.perf_counter() < end:
                pass
        else:
            self._spin((1,), (1,), (np.uint64(int(us * 1e3)),))

    def sync(self) -> None:
        if self._cp is not None:
            self._cp.cuda.get_current_stream().synchronize()


def _config(name: str, rows_per_layer: int | None) -> Any:
    from rowcache.embed.engram.config import EngramConfig

    if name == "demo":
        if rows_per_layer is None:
            return EngramConfig()
        per_head = max(2, rows_per_layer // 16)
        return EngramConfig(vocab_per_ngram=(per_head, per_head))
    # the reported V4.1 shape: 3 orders x 8 heads of 256 values, layers 1 and 14 of 43
    per_head = max(2, (rows_per_layer or 8_000_000) // 24)
    return EngramConfig(
        vocab_per_ngram=(per_head,) * 3,
        max_ngram=4,
        n_embed_per_ngram=2048,
        n_head_per_ngram=8,
        layer_ids=(1, 14),
    )


def _pinned_table(table: Any) -> Any:
    """The same table in pinned host memory mapped into the device (read over PCIe)."""
    import cupy as cp

    from rowcache.embed.tables import Bf16Table, Fp8Table

    def mapped(a: Any) -> Any:
        host = cp.asnumpy(a)
        mem = cp.cuda.PinnedMemory(max(host.nbytes, 1), cp.cuda.runtime.hostAllocMapped)
        view = np.frombuffer(cp.cuda.PinnedMemoryPointer(mem, 0), dtype=host.dtype, count=host.size)
        view[:] = host.reshape(-1)
        um = cp.cuda.UnownedMemory(mem.ptr, max(host.nbytes, 1), mem)
        return cp.ndarray(host.shape, dtype=host.dtype, memptr=cp.cuda.MemoryPointer(um, 0))

    if isinstance(table, Fp8Table):
        codes, scales = table.arrays
        return Fp8Table(mapped(codes), mapped(scales))
    return Bf16Table(mapped(table.array))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--config", choices=("demo", "v41"), default="demo")
    ap.add_argument("--rows-per-layer", type=int, default=None)
    ap.add_argument("--dtype", choices=("bf16", "fp8"), default=None, help="demo: bf16, v41: fp8")
    ap.add_argument("--arena-fraction", type=float, default=0.25)
    ap.add_argument("--tokens", type=int, default=60_000, help="tokens of text per mode")
    ap.add_argument("--warm", type=float, default=0.3, help="fraction of steps run untimed first")
    ap.add_argument("--layers", type=int, default=43, help="layers of the modelled model")
    ap.add_argument("--layer-us", type=float, default=60.0, help="modelled time a layer a step")
    ap.add_argument("--token-us", type=float, default=0.5, help="and per token of the step")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--quick", action="store_true", help="a tiny CPU run")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.rows_per_layer, args.tokens, args.layers = 20_000, 800, 20
        args.arena_fraction = 0.5  # a prefill step's 16,384 rows fit
        args.layer_us, args.token_us = 5.0, 0.1
    from rowcache import NgramRowCache, build_store
    from rowcache.embed.engram.hash import EngramHash
    from rowcache.embed.engram.memory import EngramMemory
    from rowcache.embed.engram.vocab import CompressedVocab
    from rowcache.embed.tables import Bf16Table, CachedTable, Fp8Table
    from rowcache.kernels.reference import BF16
    from rowcache.tools.demo import text_files, tokenize_text
    from rowcache.tools.tokens import tokenizer_json_path

    cfg = _config(args.config, args.rows_per_layer)
    dtype = args.dtype or ("bf16" if args.config == "demo" else "fp8")
    tok_path = tokenizer_json_path("deepseek")
    vocab = CompressedVocab.from_tokenizer(tok_path)
    h = EngramHash(cfg, vocab)
    layers = list(cfg.layer_ids)
    rows = [h.table_rows(layer) for layer in layers]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    need = max(MODES[m][0] * MODES[m][1] for m in modes) * 10
    text, _ = tokenize_text(text_files(None), tok_path, max(args.tokens, need), 1, 1 << 40)

    own = args.workdir is None
    workdir = tempfile.mkdtemp(prefix="rowcache-engram-") if own else args.workdir
    try:
        rng = np.random.default_rng(0)
        t0 = time.perf_counter()
        arrays = {}
        for layer, n in zip(layers, rows):  # random rows, bounded chunks
            a = np.empty((n, cfg.head_dim), dtype=BF16)
            for s in range(0, n, 1 << 20):
                e = min(n, s + (1 << 20))
                a[s:e] = rng.standard_normal((e - s, cfg.head_dim), dtype=np.float32) * 0.02
            arrays[f"engram.{layer}"] = a
        store = build_store(
            os.path.join(workdir, "store"), arrays, dtype=dtype, overwrite=True, progress=False
        )
        build_s = time.perf_counter() - t0
        store_bytes = sum(int(r.length) for recs in store.shards for r in recs)
        if args.device == "cuda":
            import cupy as cp

            xp: Any = cp
        else:
            xp = np
        res = {}
        for layer in layers:
            a = xp.asarray(arrays[f"engram.{layer}"])
            res[layer] = Fp8Table.quantize(a) if dtype == "fp8" else Bf16Table(a)
        del arrays
        series: dict[str, Any] = {"resident": lambda: EngramMemory(h, res)}
        if args.device == "cuda":
            series["host"] = lambda: EngramMemory(h, {k: _pinned_table(t) for k, t in res.items()})
        slots = max(1, int(args.arena_fraction * sum(rows)))

        def cached_memory() -> Any:
            cache = NgramRowCache(
                store, [f"engram.{layer}" for layer in layers], slots=slots, device=args.device
            )
            return EngramMemory(h, {layer: CachedTable(cache, i) for i, layer in enumerate(layers)})

        series["cached"] = cached_memory
        series["lookahead"] = cached_memory  # prefill: the next chunk's rows read a step ahead
        model = Model(args.device, args.layer_us, args.token_us, args.layers)
        first, second = cfg.layer_ids[0], cfg.layer_ids[1]
        results = []
        for mode in modes:
            B, T = MODES[mode]
            steps = min(len(text) // (B * T), max(20, args.tokens // (B * T)))
            toks = text[: steps * B * T].reshape(B, steps * T) if B > 1 else text[: steps * T][None]
            timed: dict[str, float] = {}
            extra: dict[str, Any] = {}
            for name, make in series.items():
                if name == "lookahead" and T == 1:
                    continue  # a decode step's next token is not known before it
                drop_cache(store_files(store))
                mem = make()
                cache = mem.tables[first].cache if name in ("cached", "lookahead") else None
                kept = np.full((B, h.keep), cfg.pad_id, dtype=np.int64)
                start = int(args.warm * steps)
                t_steps = 0.0
                waited = 0.0
                stats0 = None
                for s in range(steps):
                    if s == start:
                        model.sync()
                        stats0 = cache.stats() if cache is not None else None
                        t_steps = 0.0
                    piece = toks[:, s * T : (s + 1) * T]
                    t0 = time.perf_counter()
                    if cache is not None:
                        mem.prefetch(piece, kept)
                    if name == "lookahead" and s + 1 < steps:
                        after = np.concatenate([kept, piece], axis=1)[:, -h.keep :]
                        mem.prefetch(toks[:, (s + 1) * T : (s + 2) * T], after)
                    model.run(first, B * T)  # the layers before the first Engram layer
                    w0 = time.perf_counter()
                    mem.lookup(first, piece, kept)
                    w1 = time.perf_counter()
                    model.run(second - first, B * T)
                    w2 = time.perf_counter()
                    mem.lookup(second, piece, kept)
                    w3 = time.perf_counter()
                    model.run(args.layers - second, B * T)
                    model.sync()
                    mem.end_step()
                    t_steps += time.perf_counter() - t0
                    if s >= start:
                        waited += (w1 - w0) + (w3 - w2)
                    kept = np.concatenate([kept, piece], axis=1)[:, -h.keep :]
                n_tok = (steps - start) * B * T
                timed[name] = n_tok / t_steps
                if name == "lookahead":
                    extra["lookahead_wait_ms_step"] = 1e3 * waited / (steps - start)
                elif cache is not None and stats0 is not None:
                    st = cache.stats()
                    looked = (st.hits + st.misses) - (stats0.hits + stats0.misses)
                    hit = (st.hits - stats0.hits) / looked if looked else 0.0
                    reads = st.read_ops - stats0.read_ops
                    extra = {
                        "hit_rate": hit,
                        "faults_per_token": (st.misses - stats0.misses) / n_tok,
                        "prefetched_per_token": (st.prefetched - stats0.prefetched) / n_tok,
                        "lookup_wait_ms_step": 1e3 * waited / (steps - start),
                        "read_ops_step": reads / (steps - start),
                    }
                    if reads:
                        files = store_files(store)
                        sizes = [os.path.getsize(f) for f in files]
                        r = np.random.default_rng(1)
                        per = [
                            r.integers(0, max(1, sz // 4096), reads // len(files) + 1) * 4096
                            for sz in sizes
                        ]
                        drop_cache(files)
                        floor = raw_direct_reads(files, per, 16)
                        extra["floor_ms_step"] = 1e3 * floor / (steps - start)
                del mem
            window_ms = first * (args.layer_us + args.token_us * B * T) / 1e3
            row = {"mode": mode}
            row.update({f"{k} tok/s": v for k, v in timed.items()})
            row["cached/resident"] = timed["cached"] / timed["resident"]
            if "lookahead" in timed:
                row["lookahead/resident"] = timed["lookahead"] / timed["resident"]
            if "host" in timed:
                row["host/resident"] = timed["host"] / timed["resident"]
            row["window_ms"] = window_ms
            row.update(extra)
            results.append(row)
        settings = {
            "config": args.config,
            "device": args.device,
            "dtype": dtype,
            "rows_per_layer": rows,
            "row_bytes": store.tables[0].record_bytes,
            "store_bytes": store_bytes,
            "build_s": round(build_s, 1),
            "arena_slots": slots,
            "layers": args.layers,
            "engram_layers": layers,
            "layer_us": args.layer_us,
            "token_us": args.token_us,
        }
        report("bench.engram", results, args.json, settings)
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
