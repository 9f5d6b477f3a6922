"""Inputs the embedding layers refuse in one line, and one rule for resident and cached
tables (issue 51, item 7), each case in a child process (``tests.store.refusals``):

- a meta-device, nested or sparse tensor given to a torch module (LongCat's, Engram's,
  Qwen4's) is a ``ConfigError`` naming the argument, not torch's internal error;
- a bad ``table_pattern`` (not a regex, not one group) is a ``ConfigError`` naming it,
  before the checkpoint is read, not ``re.error``;
- a checkpoint table holding a NaN or an Inf is refused resident and cached alike (naming
  the row and column), served alike with ``allow_nonfinite=True``; F16 tables load both
  ways; resident and cached give the same bits (FP8 of F32 tables included).
"""

from __future__ import annotations

import pytest

from tests.store.refusals import run_cases

pytest.importorskip("torch")
pytest.importorskip("safetensors")

MODULES = r"""
import numpy as np
import torch
from rowcache.embed import (EngramConfig, EngramHash, EngramMemory, NgramDims, NgramEmbedding,
                            Qwen4NgramConfig, Qwen4NgramHash, TorchNgramEmbedding)
from rowcache.embed.engram.vocab import CompressedVocab
from rowcache.embed.qwen4.memory import Qwen4NgramMemory
from rowcache.embed.tables import Bf16Table
from rowcache.embed.torch.engram import TorchEngramMemory
from rowcache.embed.torch.qwen4 import TorchQwen4NgramEmbedding
from rowcache.errors import RowCacheError
from rowcache.kernels.reference import BF16

rng = np.random.default_rng(0)
bf = lambda a: a.astype(np.float32).astype(BF16)
dims = NgramDims(vocab_size=300, hidden_size=48, max_ngram=4, splits=2, ratio=2.5, eos_token_id=2)
longcat = TorchNgramEmbedding(NgramEmbedding(
    dims, bf(rng.standard_normal((300, 48))),
    [bf(rng.standard_normal((dims.table_rows(i), dims.table_dim))) for i in range(dims.num_tables)],
    [bf(rng.standard_normal((48, dims.table_dim))) for _ in range(dims.num_tables)]))
ecfg = EngramConfig(vocab_per_ngram=(40, 70, 30), max_ngram=4, n_embed_per_ngram=24,
                    n_head_per_ngram=3, layer_ids=(1, 5), pad_id=0)
eh = EngramHash(ecfg, CompressedVocab(np.arange(500) % 300))
engram = TorchEngramMemory(EngramMemory(eh, {
    layer: Bf16Table(bf(rng.standard_normal((eh.table_rows(layer), ecfg.head_dim))))
    for layer in ecfg.layer_ids}))
qcfg = Qwen4NgramConfig(vocab_size=50, eos_token_id=7, ngram_size=4, heads_per_ngram=3,
                        ngram_vocab_size_base=4000, make_ngram_vocab_size_divisible_by=64,
                        split_ngram_parts=4, ple_layer_ids=(1,), ple_embed_dim=36)
qh = Qwen4NgramHash(qcfg)
qwen4 = TorchQwen4NgramEmbedding(Qwen4NgramMemory(
    qh, Bf16Table(bf(rng.standard_normal((qh.table_rows(), qcfg.head_dim))))))

ids = torch.randint(3, 40, (2, 5))
meta = torch.empty((2, 5), dtype=torch.int64, device="meta")
nested = torch.nested.nested_tensor([torch.arange(3, 8), torch.arange(3, 6)])
sparse = ids.to_sparse()
calls = {
    "longcat input_ids meta": lambda: longcat(meta),
    "longcat input_ids nested": lambda: longcat(nested),
    "longcat input_ids sparse": lambda: longcat(sparse),
    "longcat ngram_context meta": lambda: longcat(ids, meta[:, :3]),
    "longcat ngram_context nested": lambda: longcat(ids, nested),
    "longcat ngram_context[0] meta": lambda: longcat(ids, [meta[0, :3], ids[1, :3]]),
    "longcat attention_mask meta": lambda: longcat(ids, attention_mask=torch.ones_like(meta)),
    "longcat attention_mask nested": lambda: longcat(
        ids, attention_mask=torch.nested.nested_tensor([torch.ones(5), torch.ones(5)])),
    "engram input_ids meta": lambda: engram(1, meta),
    "engram input_ids nested": lambda: engram(1, nested),
    "engram context meta": lambda: engram(1, ids, meta[:, :3]),
    "engram context nested": lambda: engram(1, ids, nested),
    "qwen4 input_ids meta": lambda: qwen4(meta),
    "qwen4 input_ids nested": lambda: qwen4(nested),
}
result = {}
for name, call in calls.items():
    try:
        call()
        result[name] = {"ok": True}
    except RowCacheError as e:
        result[name] = {"error": type(e).__name__, "message": str(e)}
    except Exception as e:
        result[name] = {"error": type(e).__name__, "message": str(e)[:300]}
result["longcat plain"] = list(longcat(ids).shape)
result["engram plain"] = list(engram(1, ids).shape)
result["qwen4 plain"] = list(qwen4(ids).shape)
"""

TABLE_PATTERN = r"""
from rowcache.embed.engram.checkpoint import load_engram_memory
from rowcache.errors import RowCacheError

result = {}
for name, pattern in (("unbalanced", "layers.(\\d+"), ("no group", "layers\\.\\d+\\.w"),
                      ("two groups", "(layers)\\.(\\d+)"), ("not a string", 5),
                      ("bad escape", "\\")):
    try:  # a checkpoint that does not exist: the pattern is checked first
        load_engram_memory(work + "/no-such-checkpoint", table_pattern=pattern)
        result[name] = {"ok": True}
    except RowCacheError as e:
        result[name] = {"error": type(e).__name__, "message": str(e)}
    except Exception as e:
        result[name] = {"error": type(e).__name__, "message": str(e)}
"""

RULE = r"""
import json, os
import numpy as np
from safetensors.numpy import save_file
from rowcache.embed import NgramDims
from rowcache.embed.checkpoint import load_pretrained
from rowcache.errors import RowCacheError
from rowcache.kernels.reference import BF16

dims = NgramDims(vocab_size=500, hidden_size=32, max_ngram=3, splits=2, ratio=1.5, eos_token_id=2)
rng = np.random.default_rng(0)


def checkpoint(name, table_dtype, poison=None):
    d = os.path.join(work, name)
    os.makedirs(d)
    t = {"model.embed_tokens.weight": (rng.standard_normal((500, 32)) * 0.05).astype(BF16)}
    for i in range(dims.num_tables):
        e = rng.standard_normal((dims.table_rows(i), dims.table_dim)).astype(table_dtype)
        if i == 1 and poison is not None:
            e[5, 3] = poison
        t[f"model.ngram_embeddings.embedders.{i}.weight"] = e
        t[f"model.ngram_embeddings.post_projs.{i}.weight"] = (
            rng.standard_normal((32, dims.table_dim)) * 0.2).astype(BF16)
    save_file(t, os.path.join(d, "model.safetensors"))
    open(os.path.join(d, "config.json"), "w").write(json.dumps(dims.to_config()))
    return d


tokens = np.concatenate([np.arange(3, 500), np.arange(3, 500)[::-1]])  # every row of table 1
result = {}
for name, table_dtype, poison in (("nan", BF16, np.nan), ("inf", np.float32, np.inf),
                                  ("f16", np.float16, None), ("f32", np.float32, None)):
    d = checkpoint(name, table_dtype, poison)
    for dtype in ("bf16", "fp8"):
        for allow in (False, True):
            outs = {}
            for how in ("resident", "cached"):
                kw = {"cached": "all", "arena_bytes": "4MiB",
                      "store": os.path.join(d, f"st-{dtype}-{allow}")} if how == "cached" else {}
                key = f"{name} {dtype} {how}" + (" allow" if allow else "")
                try:
                    emb = load_pretrained(d, dtype=dtype, allow_nonfinite=allow, **kw)
                    outs[how] = emb.embed(tokens, len(tokens)).view(np.uint16)
                    result[key] = {"ok": True}
                except RowCacheError as e:
                    result[key] = {"error": type(e).__name__, "message": str(e)}
            if len(outs) == 2:
                result[f"{name} {dtype}" + (" allow" if allow else "") + " same"] = bool(
                    np.array_equal(outs["resident"], outs["cached"]))
"""


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    work = tmp_path_factory.mktemp("inputs")
    code = {}
    for name, body in (("modules", MODULES), ("table_pattern", TABLE_PATTERN), ("rule", RULE)):
        d = work / name
        d.mkdir()
        code[name] = [("python", f"work = {str(d)!r}\n{body}")]
    return run_cases(code, work)


def result_of(cases, name):
    out = cases[name]
    assert out["status"] == 0, f"the child ended with status {out['status']}"
    (call,) = out["calls"]
    assert "error" not in call, call
    return call["result"]


ARGS = [
    "longcat input_ids meta",
    "longcat input_ids nested",
    "longcat input_ids sparse",
    "longcat ngram_context meta",
    "longcat ngram_context nested",
    "longcat ngram_context[0] meta",
    "longcat attention_mask meta",
    "longcat attention_mask nested",
    "engram input_ids meta",
    "engram input_ids nested",
    "engram context meta",
    "engram context nested",
    "qwen4 input_ids meta",
    "qwen4 input_ids nested",
]


@pytest.mark.parametrize("case", ARGS)
def test_a_meta_nested_or_sparse_tensor_is_refused_naming_the_argument(cases, case):
    got = result_of(cases, "modules")
    r = got[case]
    _, arg, kind = case.split()
    assert r.get("error") == "ConfigError", r  # was torch's TypeError / RuntimeError
    assert r["message"].startswith(f"{arg} "), r
    assert {"meta": "meta device", "nested": "nested tensor", "sparse": "layout"}[kind] in (
        r["message"]
    ), r
    assert "\n" not in r["message"]


def test_the_modules_still_take_plain_tensors(cases):
    got = result_of(cases, "modules")
    assert got["longcat plain"] == [2, 5, 48]
    assert got["engram plain"][:2] == [2, 5] and got["qwen4 plain"] == [2, 5, 36]


@pytest.mark.parametrize(
    "name", ["unbalanced", "no group", "two groups", "not a string", "bad escape"]
)
def test_a_bad_table_pattern_is_one_config_error_naming_it(cases, name):
    r = result_of(cases, "table_pattern")[name]
    assert r.get("error") == "ConfigError", r  # was re.error (or a refusal of the path)
    assert r["message"].startswith("table_pattern=") and "\n" not in r["message"], r


@pytest.mark.parametrize("name", ["nan", "inf"])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_a_nonfinite_table_is_refused_resident_and_cached_alike(cases, name, dtype):
    got = result_of(cases, "rule")
    for how in ("resident", "cached"):  # resident loaded it, cached refused it
        r = got[f"{name} {dtype} {how}"]
        assert r.get("error") == "ConfigError", (how, r)
        assert "row 5, column 3" in r["message"] and "allow_nonfinite=True" in r["message"], r
    for how in ("resident", "cached"):
        assert got[f"{name} {dtype} {how} allow"] == {"ok": True}
    assert got[f"{name} {dtype} allow same"], "resident and cached serve the same bits"


@pytest.mark.parametrize("name", ["f16", "f32"])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_f16_and_f32_tables_load_both_ways_to_the_same_bits(cases, name, dtype):
    got = result_of(cases, "rule")
    for how in ("resident", "cached"):  # F16 was refused resident, taken cached
        assert got[f"{name} {dtype} {how}"] == {"ok": True}, got[f"{name} {dtype} {how}"]
    assert got[f"{name} {dtype} same"], "resident and cached serve the same bits"
