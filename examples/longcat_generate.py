"""Greedy generation with Hugging Face transformers and rowcache's n-gram embedding.

A tiny random LongCat-Flash-Lite-shaped checkpoint (real tensor names, sharded
safetensors + ``model.safetensors.index.json`` + ``config.json``) is written, its
n-gram embedding loaded as ``rowcache.embed.TorchNgramEmbedding`` twice (all tables resident;
all tables behind small row caches over a store built from the checkpoint), and
``transformers.LongcatFlashForCausalLM`` (the base architecture) decodes greedily
from ``inputs_embeds`` with a KV cache. Both runs give the same tokens. Tokens/s are timed
after a warm-up (a few untimed steps on another prompt: the first calls of torch and of
each module cost up to 80x a step).

It imports the installed ``rowcache`` (``pip install -e '.[torch]'`` in the checkout), never
the checkout's files ahead of it, and its first line says which copy it runs and whether
its native extensions are built.

    python examples/longcat_generate.py --steps 16
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import tempfile
import time
from typing import Any

import torch

try:  # the installed package, as a user's program imports it
    import rowcache
    from rowcache.embed import NgramDims, TorchNgramEmbedding
    from rowcache.kernels import extensions
except ImportError as e:
    sys.exit(f"{e}: install rowcache first: pip install -e '.[torch]' (in the checkout)")

WARMUP_STEPS = 2  # untimed steps of each run before tokens/s is measured

# The tiny base architecture (docs/platform.md: runs on the CPU) with LongCat-Flash-Lite's
# n-gram shape (orders 2..4, 4 splits: 12 tables of hidden/12 = 8 columns).
TINY = dict(
    hidden_size=96,
    num_layers=2,
    num_attention_heads=4,
    head_dim=8,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=8,
    zero_expert_num=4,
    moe_topk=2,
    ffn_hidden_size=64,
    expert_ffn_hidden_size=32,
    max_position_embeddings=1024,
    eos_token_id=2,
    bos_token_id=1,
)
NGRAM = dict(emb_neighbor_num=4, emb_split_num=4, ngram_vocab_size_ratio=3)


def write_tiny_checkpoint(path: str, *, vocab_size: int = 512, seed: int = 0) -> str:
    """A random LongCat n-gram checkpoint directory at ``path`` (two shards + index).

    The base model's weights are those of a random ``LongcatFlashForCausalLM``; the
    n-gram tables ``model.ngram_embeddings.embedders.{i}.weight`` and projections
    ``model.ngram_embeddings.post_projs.{i}.weight`` are random bf16. Returns ``path``.
    """
    import transformers
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    cfg = transformers.LongcatFlashConfig(vocab_size=vocab_size, **TINY)
    torch.manual_seed(seed)
    model = transformers.LongcatFlashForCausalLM(cfg).to(torch.bfloat16)
    base = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    dims = NgramDims.from_config({**cfg.to_dict(), **NGRAM})
    g = torch.Generator().manual_seed(seed + 1)
    T, d, D = dims.num_tables, dims.table_dim, dims.hidden_size
    ngram = {}
    for i in range(T):
        rows = dims.table_rows(i)
        table = torch.randn(rows, d, generator=g) * 0.5
        ngram[f"model.ngram_embeddings.embedders.{i}.weight"] = table.to(torch.bfloat16)
        proj = torch.randn(D, d, generator=g) / d**0.5
        ngram[f"model.ngram_embeddings.post_projs.{i}.weight"] = proj.to(torch.bfloat16)
    shards = {"model-00001-of-00002.safetensors": base, "model-00002-of-00002.safetensors": ngram}
    weight_map = {}
    for fn, tensors in shards.items():
        save_file(tensors, os.path.join(path, fn), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fn))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    config = {**cfg.to_dict(), **NGRAM, "model_type": "longcat_flash_ngram"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return path


def load_base_model(path: str) -> Any:
    """``LongcatFlashForCausalLM`` (float32) with the checkpoint's base weights."""
    import transformers
    from safetensors.torch import load_file

    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg = {k: v for k, v in cfg.items() if k not in ("model_type", *NGRAM)}
    model = transformers.LongcatFlashForCausalLM(transformers.LongcatFlashConfig(**cfg))
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    state = {}
    for fn in files:
        for k, v in load_file(os.path.join(path, fn)).items():
            if not k.startswith("model.ngram_embeddings."):
                state[k] = v
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"checkpoint mismatch: missing {missing}, unexpected {unexpected}")
    return model.eval()


def _cache_kwarg(model: Any) -> str:
    # transformers 5.24 renamed `past_key_values` to `cache`; older 5.x only has the former
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.no_grad()
def greedy(
    model: Any, module: TorchNgramEmbedding, prompt: torch.Tensor, steps: int
) -> torch.Tensor:
    """Greedy tokens ``[B, steps]``: prefill ``prompt`` [B, P], then one token per step.

    The n-gram context is kept as the reference ``NgramCache`` keeps it (the last
    ``max_ngram - 1`` tokens of every row); the KV cache is transformers' own.
    """
    from transformers import DynamicCache

    kv = DynamicCache(config=model.config)
    key, keep = _cache_kwarg(model), module.dims.max_ngram - 1
    ids, ctx = prompt, None
    out = []
    for _ in range(steps):
        embeds = module(ids, ctx).to(model.dtype)
        logits = model(inputs_embeds=embeds, use_cache=True, **{key: kv}).logits
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        ctx = (ids if ctx is None else torch.cat([ctx, ids], 1))[:, -keep:]
        ids = nxt
        out.append(nxt)
    return torch.cat(out, 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", help="checkpoint directory (default: a temporary one)")
    p.add_argument("--steps", type=int, default=16, help="tokens to generate")
    p.add_argument("--arena", default="4KiB", help="arena budget of the cached run")
    args = p.parse_args(argv)
    where = os.path.dirname(os.path.abspath(rowcache.__file__))
    print(f"rowcache {rowcache.__version__} from {where}; {extensions.summary()}")
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_checkpoint(args.dir or os.path.join(tmp, "ckpt"))
        model = load_base_model(path)
        resident = TorchNgramEmbedding.from_pretrained(path)
        cached = TorchNgramEmbedding.from_pretrained(path, cached="all", arena_bytes=args.arena)
        prompt = torch.tensor([[1, 17, 250, 31, 9, 400, 77, 5], [1, 88, 2, 300, 12, 12, 12, 6]])
        warm = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11], [1, 40, 41, 42, 43, 44, 45, 46]])
        runs = {}
        for name, mod in (("resident", resident), ("cached", cached)):
            greedy(model, mod, warm, WARMUP_STEPS)  # untimed: first calls, allocations
            for c in mod.emb.caches:
                c.stats(reset=True)  # the counts below are the timed run's
            t0 = time.perf_counter()
            runs[name] = greedy(model, mod, prompt, args.steps)
            dt = time.perf_counter() - t0
            print(
                f"{name:>8}: {runs[name].tolist()}  ({prompt.shape[0] * args.steps / dt:.1f} "
                f"tok/s after a {WARMUP_STEPS}-step warm-up)"
            )
        stats = [c.stats() for c in cached.emb.caches]
        print(
            f"cached tables: {sum(s.misses for s in stats)} faults, "
            f"{sum(s.evictions for s in stats)} evictions"
        )
        same = torch.equal(runs["resident"], runs["cached"])
        print("identical tokens" if same else "TOKENS DIFFER")
        return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
