"""Qwen4's n-gram table from its checkpoint as it ships (issue 49 items 2 and 3): the store
built from a tiny random ``Qwen4ExpForCausalLM`` saved by transformers (its table written as
``split_ngram_parts`` shard tensors over several files), ``TorchQwen4NgramEmbedding`` against
transformers' own module bit for bit through the model's cache, ``generate`` with the table
from an arena of an eighth of its rows, loading without the table, the FP8 release's codes
and scale, and damaged checkpoints refused in one line."""

from __future__ import annotations

import itertools
import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
M = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")
from safetensors.torch import save_file  # noqa: E402
from transformers import DynamicCache, Qwen4ExpForCausalLM, Qwen4ExpTextConfig  # noqa: E402
from transformers.monkey_patching import apply_patches  # noqa: E402

from rowcache.embed import (  # noqa: E402
    Qwen4NgramConfig,
    Qwen4NgramHash,
    TorchQwen4NgramEmbedding,
    build_qwen4_store,
)
from rowcache.embed.qwen4.checkpoint import TABLE_NAME  # noqa: E402
from rowcache.errors import ConfigError  # noqa: E402
from rowcache.store.handle import RowStore  # noqa: E402

EOS = 3
PARTS = 4
TABLE = "model.layers.1.ple.ple_embedding.ngram_embedding"
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _config(**kw):
    args = dict(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        eos_token_id=[EOS],
        pad_token_id=0,
        ple_layer_ids=[2],
        ple_embed_dim=64,
        ngram_vocab_size_base=100,
        split_ngram_parts=PARTS,
        make_ngram_vocab_size_divisible_by=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        hc_lowrank=8,
        linear_num_value_heads=2,
        linear_num_key_heads=1,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        layer_types=["linear_attention", "linear_attention", "indexed_attention"],
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=16,
        indexer_budget=8,
        indexer_compress_ratio=4,
        dtype="bfloat16",
    )
    args.update(kw)
    return Qwen4ExpTextConfig(**args)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny random model saved by transformers: several safetensors files and an index,
    the n-gram table written as its ``split_ngram_parts`` shard tensors (transformers'
    reverse of its conversion mapping, as the release ships them)."""
    torch.manual_seed(0)
    model = Qwen4ExpForCausalLM(_config()).to(torch.bfloat16)
    with torch.no_grad():  # rows of distinct values, so a wrong row shows
        model.get_submodule(TABLE).weight.normal_()
    path = tmp_path_factory.mktemp("qwen4") / "ckpt"
    model.save_pretrained(path, max_shard_size="20KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    shards = [k for k in index if ".ngram_embedding.shard_" in k]
    assert len(shards) == PARTS and f"{TABLE}.weight" not in index
    assert len(set(index.values())) > 2
    return path


def _ids(B: int, T: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 256, (B, T), generator=g)
    ids[:, T // 3] = EOS  # EOS inside: a new segment
    ids[0, T // 3 + 1] = EOS
    return ids


def test_qwen4_store_from_sharded_checkpoint_rows_verbatim(ckpt, tmp_path):
    ref = Qwen4ExpForCausalLM.from_pretrained(ckpt)
    want = ref.get_submodule(TABLE).weight.detach()
    st = build_qwen4_store(ckpt, tmp_path / "st", progress=False)
    (info,) = st.tables
    h = Qwen4NgramHash(Qwen4NgramConfig.from_config(ckpt))
    assert (info.name, info.rows, info.dim, info.dtype) == (TABLE_NAME, h.table_rows(), 4, "bf16")
    rows = np.arange(h.table_rows())
    got = st.read_rows(TABLE_NAME, rows)
    assert np.array_equal(got.view(np.uint16), want.view(torch.int16).numpy().view(np.uint16))


def test_qwen4_store_from_one_unsharded_file_multimodal_prefix(ckpt, tmp_path):
    """One ``model.safetensors`` holding the table unsharded, under the multimodal release's
    ``model.language_model.`` prefix, with a full config (its ``text_config``)."""
    ref = Qwen4ExpForCausalLM.from_pretrained(ckpt)
    want = ref.get_submodule(TABLE).weight.detach().contiguous()
    one = tmp_path / "one"
    one.mkdir()
    text = json.loads((ckpt / "config.json").read_text())
    (one / "config.json").write_text(json.dumps({"text_config": text}))
    name = "model.language_model.layers.1.ple.ple_embedding.ngram_embedding.weight"
    other = {"model.language_model.embed_tokens.weight": torch.zeros(4, 4, dtype=torch.bfloat16)}
    save_file({name: want, **other}, str(one / "model.safetensors"))
    st = build_qwen4_store(one, tmp_path / "st", progress=False)
    got = st.read_rows(TABLE_NAME, np.arange(want.shape[0]))
    assert np.array_equal(got.view(np.uint16), want.view(torch.int16).numpy().view(np.uint16))


def test_qwen4_module_matches_reference_bit_for_bit_through_the_cache(ckpt, tmp_path):
    """Prefill chunks and decode steps through two caches of the model: the module and
    transformers' module give the same bits and leave the same context in the cache; a
    first input shorter than the context (EOS-padded) and no cache at all included."""
    ref_model = Qwen4ExpForCausalLM.from_pretrained(ckpt)
    ref = ref_model.get_submodule("model.layers.1.ple.ple_embedding")
    emb = TorchQwen4NgramEmbedding.from_pretrained(
        ckpt, store=tmp_path / "st", arena=0.125, progress=False
    )
    assert emb.layer_idx == ref.layer_idx == 1
    ids = _ids(2, 24, 1)
    with torch.no_grad():
        assert torch.equal(emb(ids, None), ref(ids, None))
        for cuts in ([0, 1, 9, 10, 11, 24], [0, 7, 8, 16, 17, 24]):
            c_ref, c_emb = (
                DynamicCache(config=ref_model.config),
                DynamicCache(config=ref_model.config),
            )
            for a, b in itertools.pairwise(cuts):
                want = ref(ids[:, a:b], c_ref)
                got = emb(ids[:, a:b], c_emb)
                assert got.dtype == torch.bfloat16 and got.shape == (2, b - a, 64)
                assert torch.equal(got, want), (a, b)
                assert torch.equal(c_emb.get_conv_state(1, 2), c_ref.get_conv_state(1, 2))


def test_qwen4_generate_same_tokens_from_an_eighth_of_the_rows(ckpt, tmp_path):
    ids = _ids(2, 12, 2)
    resident = Qwen4ExpForCausalLM.from_pretrained(ckpt)
    want = resident.generate(ids, max_new_tokens=10, do_sample=False)
    rows = Qwen4NgramHash(Qwen4NgramConfig.from_config(ckpt)).table_rows()
    model = Qwen4ExpForCausalLM.from_pretrained(ckpt)
    emb = TorchQwen4NgramEmbedding.from_pretrained(
        ckpt, store=tmp_path / "st", slots=rows // 8, progress=False
    )
    assert emb.memory.table.cache.num_slots == rows // 8
    model.model.layers[1].ple.ple_embedding = emb
    got = model.generate(ids, max_new_tokens=10, do_sample=False)
    assert torch.equal(got, want)
    assert emb.memory.table.cache.stats().misses > 0


def test_qwen4_engine_reaches_the_cache_on_build_and_on_open_and_a_bad_one_builds_nothing(
    ckpt, tmp_path
):
    """engine= is the cache's reader's, whether the store was just built or opened; the
    module still gives the reference's bits; an unknown engine is refused before a build."""
    ref = Qwen4ExpForCausalLM.from_pretrained(ckpt).get_submodule(
        "model.layers.1.ple.ple_embedding"
    )
    ids = _ids(2, 9, 4)
    for _ in ("built", "opened"):
        emb = TorchQwen4NgramEmbedding.from_pretrained(
            ckpt, store=tmp_path / "st", arena=0.125, progress=False, engine="threads"
        )
        cache = emb.memory.table.cache
        assert cache.store.reader.engine == "threads"
        with torch.no_grad():
            assert torch.equal(emb(ids, None), ref(ids, None))
        cache.close()
    with pytest.raises(ConfigError, match=r"engine='disk' is not supported; allowed: auto"):
        TorchQwen4NgramEmbedding.from_pretrained(
            ckpt, store=tmp_path / "other", progress=False, engine="disk"
        )
    assert not (tmp_path / "other").exists()


def test_qwen4_load_without_the_table_patch_mapping(ckpt, tmp_path):
    """transformers builds the model with the module in place of its own (monkey_patching's
    apply_patches): the table's tensors are never loaded, the tokens are the same."""
    ids = _ids(1, 10, 3)
    want = Qwen4ExpForCausalLM.from_pretrained(ckpt).generate(
        ids, max_new_tokens=8, do_sample=False
    )
    patch = TorchQwen4NgramEmbedding.patch_mapping(
        ckpt, store=tmp_path / "st", arena=0.125, progress=False
    )
    with apply_patches(patch):
        model, info = Qwen4ExpForCausalLM.from_pretrained(ckpt, output_loading_info=True)
    emb = model.model.layers[1].ple.ple_embedding
    assert isinstance(emb, TorchQwen4NgramEmbedding)
    assert info["unexpected_keys"] == {f"{TABLE}.weight"}
    assert not any("ngram" in k for k in info["missing_keys"])
    assert torch.equal(emb.ngram_heads_offsets, torch.tensor(emb.head_offsets))
    assert emb.layer_multipliers.tolist() == emb.memory.hash.multipliers.tolist()
    assert not any(p.numel() > 1000 for p in model.parameters() if p.dim() == 2 and p.shape[1] == 4)
    got = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want)


def test_qwen4_long_prompt_outnumbering_the_arena_is_served(ckpt, tmp_path):
    ref_model = Qwen4ExpForCausalLM.from_pretrained(ckpt)
    ref = ref_model.get_submodule("model.layers.1.ple.ple_embedding")
    emb = TorchQwen4NgramEmbedding.from_pretrained(
        ckpt, store=tmp_path / "st", slots=40, progress=False
    )
    ids = _ids(2, 50, 4)  # 2 x 50 x 16 = 1,600 rows through 40 slots
    c_ref, c_emb = DynamicCache(config=ref_model.config), DynamicCache(config=ref_model.config)
    with torch.no_grad():
        assert torch.equal(emb(ids, c_emb), ref(ids, c_ref))
        assert torch.equal(emb(ids[:, :3], c_emb), ref(ids[:, :3], c_ref))


def _fp8_checkpoint(src: pathlib.Path, dst: pathlib.Path, scale: float, prefix: str = "model."):
    """``src``'s config and an FP8 table as the FP8 release ships it: ``F8_E4M3`` shard
    tensors (under ``prefix``) and one BF16 ``weight_scale``, over two files and an index."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    h = Qwen4NgramHash(Qwen4NgramConfig.from_config(src))
    rows = h.table_rows()
    g = np.random.default_rng(5)
    codes = g.integers(0, 256, (rows, 4), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # no NaN codes
    base = f"{prefix}layers.1.ple.ple_embedding.ngram_embedding."
    per = rows // PARTS
    files: dict[str, dict[str, torch.Tensor]] = {"a.safetensors": {}, "b.safetensors": {}}
    weight_map = {}
    for k in range(PARTS):
        fn = "a.safetensors" if k < 2 else "b.safetensors"
        t = torch.from_numpy(codes[k * per : (k + 1) * per].copy()).view(torch.float8_e4m3fn)
        files[fn][f"{base}shard_{k}.weight"] = t
        weight_map[f"{base}shard_{k}.weight"] = fn
    files["b.safetensors"][f"{base}weight_scale"] = torch.tensor([scale], dtype=torch.bfloat16)
    weight_map[f"{base}weight_scale"] = "b.safetensors"
    for fn, tensors in files.items():
        save_file(tensors, str(dst / fn))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return codes


def test_qwen4_fp8_checkpoint_codes_and_scale_verbatim(ckpt, tmp_path):
    fp8 = tmp_path / "fp8"
    codes = _fp8_checkpoint(ckpt, fp8, 0.01171875, prefix="model.language_model.")
    st = build_qwen4_store(fp8, tmp_path / "st", progress=False)
    (info,) = st.tables
    assert info.dtype == "fp8_table_scale" and info.record_bytes == 4  # one byte a value
    scale = torch.tensor(0.01171875, dtype=torch.bfloat16)
    table = torch.from_numpy(codes).view(torch.float8_e4m3fn).to(torch.bfloat16) * scale
    emb = TorchQwen4NgramEmbedding.from_pretrained(
        fp8, store=tmp_path / "st", arena=0.125, progress=False
    )
    ids = _ids(2, 9, 6)
    rows = torch.from_numpy(emb.memory.hash.hash(ids.numpy()))
    want = table[rows].flatten(-2)
    assert torch.equal(emb(ids, None), want)
    # the whole table read back from disk: the checkpoint's codes, verbatim
    got = RowStore.open(tmp_path / "st").read_rows(TABLE_NAME, np.arange(info.rows))
    assert np.array_equal(np.asarray(got).view(np.uint8), codes)


def test_qwen4_store_of_another_config_refused(ckpt, tmp_path):
    build_qwen4_store(ckpt, tmp_path / "st", progress=False)
    other = tmp_path / "other"
    shutil.copytree(ckpt, other)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["ngram_vocab_size_base"] = 200
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"does not hold 'qwen4\.ngram'"):
        TorchQwen4NgramEmbedding.from_pretrained(other, store=tmp_path / "st", progress=False)
    with pytest.raises(ConfigError, match=r"give slots= or arena="):
        TorchQwen4NgramEmbedding.from_pretrained(ckpt, store=tmp_path / "st", slots=4, arena=0.5)
    with pytest.raises(ConfigError, match=r"arena=2\.0"):
        TorchQwen4NgramEmbedding.from_pretrained(ckpt, store=tmp_path / "st", arena=2.0)


CHILD = """
import json, os, shutil, sys
import torch
from safetensors.torch import load_file, save_file
from rowcache.embed import build_qwen4_store
from rowcache.errors import RowCacheError
src, tmp = sys.argv[1], sys.argv[2]
T = "model.layers.1.ple.ple_embedding.ngram_embedding."

def copy(name):
    d = os.path.join(tmp, name)
    shutil.copytree(src, d)
    return d

def index(d):
    p = os.path.join(d, "model.safetensors.index.json")
    return p, json.load(open(p))

def rewrite(d, key, fn):
    p, idx = index(d)
    f = os.path.join(d, idx["weight_map"][key])
    t = load_file(f)
    fn(t)
    save_file(t, f)

cases = {}
d = copy("missing_shard"); p, idx = index(d); del idx["weight_map"][T + "shard_2.weight"]
json.dump(idx, open(p, "w")); cases["missing_shard"] = d
d = copy("shard_file_gone"); p, idx = index(d); os.remove(os.path.join(d, idx["weight_map"][T + "shard_1.weight"]))
cases["shard_file_gone"] = d
d = copy("f32_part"); rewrite(d, T + "shard_1.weight", lambda t: t.__setitem__(T + "shard_1.weight", t[T + "shard_1.weight"].float()))
cases["f32_part"] = d
d = copy("short_part"); rewrite(d, T + "shard_3.weight", lambda t: t.__setitem__(T + "shard_3.weight", t[T + "shard_3.weight"][:-8].clone()))
cases["short_part"] = d
d = copy("bad_index"); open(os.path.join(d, "model.safetensors.index.json"), "w").write("{not json")
cases["bad_index"] = d
d = copy("no_table"); p, idx = index(d)
idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if "ngram_embedding.shard" not in k}
json.dump(idx, open(p, "w")); cases["no_table"] = d
d = copy("truncated"); p, idx = index(d); f = os.path.join(d, idx["weight_map"][T + "shard_0.weight"])
os.truncate(f, 100); cases["truncated"] = d
d = copy("fp8_no_scale")
def to_fp8(t):
    for k in list(t):
        if "ngram_embedding.shard" in k:
            t[k] = torch.zeros(t[k].shape, dtype=torch.uint8).view(torch.float8_e4m3fn)
_, idx = index(d)
for f in sorted({v for k, v in idx["weight_map"].items() if "ngram_embedding.shard" in k}):
    t = load_file(os.path.join(d, f)); to_fp8(t); save_file(t, os.path.join(d, f))
cases["fp8_no_scale"] = d
for name, d in cases.items():
    try:
        build_qwen4_store(d, os.path.join(tmp, name + "-store"), progress=False)
        print(name, "BUILT")
    except RowCacheError as e:
        print(name, type(e).__name__, str(e).replace(chr(10), "\\\\n"))
"""


def test_qwen4_bad_checkpoints_refused_in_one_line_in_a_child(ckpt, tmp_path):
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(ckpt), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 0, f"rc {r.returncode}: {r.stderr[-3000:]}"
    out = dict(line.split(" ", 1) for line in r.stdout.strip().splitlines())
    expect = {
        "missing_shard": "shard_0 .. shard_3 (missing [2])",
        "shard_file_gone": "which does not exist",
        "f32_part": "is F32; the n-gram table's rows are BF16 or F8_E4M3",
        "short_part": "need one dtype and shape",
        "bad_index": "not JSON",
        "no_table": "has no n-gram table of decoder layer 1",
        "truncated": "truncated",
        "fp8_no_scale": "weight_scale",
    }
    assert set(out) == set(expect)
    for name, text in expect.items():
        assert "BUILT" not in out[name] and "\\n" not in out[name], (name, out[name])
        assert text in out[name], (name, out[name])
