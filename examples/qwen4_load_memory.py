"""Loading Qwen4ExpForCausalLM with and without its n-gram table: the loading process's peak
memory (RSS high-water mark), and the same greedy tokens.

A small random ``Qwen4ExpForCausalLM`` whose n-gram table dominates (``--base`` sets the head
primes: 16 heads x ~base rows x ``--ple-dim``/16 bf16 values) is saved by transformers
(sharded safetensors, the table as ``split_ngram_parts`` shard tensors, as the release ships
it). Then, each in a fresh child process that reports ``getrusage(RUSAGE_SELF).ru_maxrss``:

- ``import``: python with torch, transformers and rowcache imported (the floor);
- ``resident``: ``Qwen4ExpForCausalLM.from_pretrained(ckpt)`` (the table joined in memory);
- ``store``: ``build_qwen4_store`` (streams the shards into a store);
- ``cached``: ``from_pretrained`` inside ``transformers.monkey_patching.apply_patches`` of
  ``TorchQwen4NgramEmbedding.patch_mapping(ckpt, store=..., arena=...)``.

The resident and cached children generate greedily from one prompt; the tokens must match
(exit 1 if not).

    python examples/qwen4_load_memory.py --base 200000 --ple-dim 1024
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

# rowcache is the installed package (pip install -e '.[torch]' in the checkout), as a user's
# program imports it: never the checkout's files put ahead of it on sys.path


def tiny_config(base: int, ple_dim: int, parts: int) -> dict:
    return dict(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        eos_token_id=[3],
        pad_token_id=0,
        ple_layer_ids=[2],
        ple_embed_dim=ple_dim,
        ngram_vocab_size_base=base,
        split_ngram_parts=parts,
        make_ngram_vocab_size_divisible_by=128,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        hc_lowrank=8,
        linear_num_value_heads=2,
        linear_num_key_heads=1,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        layer_types=["linear_attention", "linear_attention", "indexed_attention"],
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=32,
        indexer_budget=8,
        indexer_compress_ratio=4,
        dtype="bfloat16",
    )


def write_checkpoint(path: str, base: int, ple_dim: int, parts: int) -> None:
    import torch
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    torch.manual_seed(0)
    model = Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**tiny_config(base, ple_dim, parts)))
    model = model.to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size="100MB")


def child(mode: str, ckpt: str, store: str, arena: str) -> dict:
    import torch
    import transformers  # noqa: F401
    from transformers import Qwen4ExpForCausalLM
    from transformers.monkey_patching import apply_patches

    from rowcache.embed import TorchQwen4NgramEmbedding, build_qwen4_store

    torch.set_num_threads(1)
    out: dict = {"mode": mode}
    if mode == "store":
        build_qwen4_store(ckpt, store, overwrite=True, progress=False)
    elif mode in ("resident", "cached"):
        if mode == "cached":
            patch = TorchQwen4NgramEmbedding.patch_mapping(
                ckpt, store=store, arena=arena, progress=False
            )
            with apply_patches(patch):
                model = Qwen4ExpForCausalLM.from_pretrained(ckpt)
        else:
            model = Qwen4ExpForCausalLM.from_pretrained(ckpt)
        out["load_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        ids = torch.tensor([[5, 17, 3, 99, 400, 3, 12, 900, 31, 7]])
        out["tokens"] = model.generate(ids, max_new_tokens=12, do_sample=False)[0].tolist()
    out["maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=int, default=200_000, help="ngram_vocab_size_base")
    ap.add_argument("--ple-dim", type=int, default=1024, help="ple_embed_dim (16 heads)")
    ap.add_argument("--parts", type=int, default=16, help="split_ngram_parts")
    ap.add_argument("--arena", default="16MiB", help="the cached table's arena")
    ap.add_argument("--dir", default=None, help="working directory (default: a temporary one)")
    ap.add_argument(
        "--child", nargs=4, metavar=("MODE", "CKPT", "STORE", "ARENA"), help=argparse.SUPPRESS
    )
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    work = args.dir or tempfile.mkdtemp(prefix="qwen4-load-")
    ckpt, store = os.path.join(work, "ckpt"), os.path.join(work, "store")
    if not os.path.exists(ckpt):  # in a child: Linux keeps a parent's ru_maxrss across exec
        make = (
            f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
            f"from qwen4_load_memory import write_checkpoint; "
            f"write_checkpoint({ckpt!r}, {args.base}, {args.ple_dim}, {args.parts})"
        )
        subprocess.run([sys.executable, "-c", make], check=True, capture_output=True)
    table = sum(
        os.path.getsize(os.path.join(ckpt, f))
        for f in os.listdir(ckpt)
        if f.endswith(".safetensors")
    )
    print(f"checkpoint {ckpt}: {table / 2**20:.0f} MiB of safetensors; arena {args.arena}")
    results = {}
    for mode in ("import", "resident", "store", "cached"):
        r = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--child", mode, ckpt, store, args.arena],
            capture_output=True,
            text=True,
            check=False,
        )
        if r.returncode != 0:
            print(r.stderr[-3000:], file=sys.stderr)
            return 2
        results[mode] = json.loads(r.stdout.strip().splitlines()[-1])
        res = results[mode]
        load = (
            f", after loading {res['load_maxrss'] / 2**20:.0f} MiB" if "load_maxrss" in res else ""
        )
        print(f"{mode:>9}: peak RSS {res['maxrss'] / 2**20:.0f} MiB{load}")
    same = results["resident"]["tokens"] == results["cached"]["tokens"]
    print(f"tokens identical: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
