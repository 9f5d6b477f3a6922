"""Qwen3.8-Flash-Next's (``qwen4_exp``) n-gram hash (issue 49 item 1): config, multipliers,
head primes and offsets, and the native hash against the NumPy spec and against transformers'
own ``Qwen4ExpTextNGramEmbedding`` on real text with EOS segments, whole and chunked."""

from __future__ import annotations

import dataclasses
import itertools
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rowcache.embed import Qwen4NgramConfig, Qwen4NgramHash
from rowcache.embed.qwen4.hash import hash_reference, head_primes, splitmix64
from rowcache.errors import ConfigError
from rowcache.kernels import host
from rowcache.tools.tokens import make_tokenizer

torch = pytest.importorskip("torch")
M = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")
from transformers import DynamicCache  # noqa: E402
from transformers.models.qwen4_exp.configuration_qwen4_exp import (  # noqa: E402
    Qwen4ExpTextConfig,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
RELEASE_EOS = 248_044
RELEASE_MULTIPLIERS = [23703573157769, 20109073645365, 8052911324071]  # docs/qwen4-spec.md


def _hf_config(cfg: Qwen4NgramConfig) -> Qwen4ExpTextConfig:
    """transformers' text config with ``cfg``'s n-gram fields (4 decoder layers: 1..3 are
    linear attention, where tables may sit)."""
    return Qwen4ExpTextConfig(
        vocab_size=cfg.vocab_size,
        eos_token_id=[cfg.eos_token_id],
        ngram_size=cfg.ngram_size,
        heads_per_ngram=cfg.heads_per_ngram,
        ngram_vocab_size_base=cfg.ngram_vocab_size_base,
        make_ngram_vocab_size_divisible_by=cfg.make_ngram_vocab_size_divisible_by,
        split_ngram_parts=cfg.split_ngram_parts,
        ple_layer_ids=list(cfg.ple_layer_ids),
        ple_embed_dim=cfg.ple_embed_dim,
        seed=cfg.seed,
        num_hidden_layers=4,
    )


class _Reference:
    """transformers' ``Qwen4ExpTextNGramEmbedding`` of one table, run as it is; its ids are
    read where its forward hands them to its table (a forward pre-hook on the embedding).
    ``meta``: built on the meta device (the release's table is 51G values), its buffers then
    made as ``Qwen4ExpPreTrainedModel._init_weights`` makes them and its table a zero row
    broadcast to the table's shape (no memory): the forward still runs, lookup included."""

    def __init__(self, cfg: Qwen4NgramConfig, table: int = 0, meta: bool = False) -> None:
        hf = _hf_config(cfg)
        layer_idx = cfg.ple_layer_ids[table] - 1
        if meta:
            with torch.device("meta"):
                m = M.Qwen4ExpTextNGramEmbedding(hf, hf.ple_embed_dim, layer_idx, table)
            m.layer_multipliers = M._build_layer_multipliers(
                m.unigram_vocab_size, m.ngram_size, m.ple_layer_index, m.seed
            )
            m.ngram_heads_vocab_sizes = torch.tensor(m.head_vocab_sizes, dtype=torch.long)
            m.ngram_heads_offsets = torch.tensor(m.head_offsets, dtype=torch.long)
            rows, dim = m.ngram_embedding.weight.shape
            zero = torch.zeros(1, dim).expand(rows, dim)
            m.ngram_embedding.weight = torch.nn.Parameter(zero, requires_grad=False)
        else:
            m = M.Qwen4ExpTextNGramEmbedding(hf, hf.ple_embed_dim, layer_idx, table)
        self.module, self.hf, self.layer_idx = m, hf, layer_idx
        self._seen: list[torch.Tensor] = []
        m.ngram_embedding.register_forward_pre_hook(
            lambda _mod, args: self._seen.append(args[0].clone())
        )

    def ids(self, tokens: np.ndarray, cache: object = None) -> np.ndarray:
        self._seen.clear()
        with torch.no_grad():
            self.module(torch.from_numpy(np.ascontiguousarray(tokens)), cache)
        (ids,) = self._seen
        return ids.numpy()

    def cache(self) -> object:
        return DynamicCache(config=self.hf)


@pytest.fixture(scope="module")
def release_reference():
    return _Reference(Qwen4NgramConfig.release(), meta=True)


@pytest.fixture(scope="module")
def release_hash():
    return Qwen4NgramHash(Qwen4NgramConfig.release())


@pytest.fixture(scope="module")
def real_tokens():
    """DeepSeek's tokenizer over the repository's docs (real text, ids below 129,280)."""
    tok = make_tokenizer("deepseek", 248_320)
    text = "\n".join(
        (ROOT / "docs" / name).read_text() for name in ("qwen4-spec.md", "engram-spec.md")
    )
    ids = tok(text)
    assert ids.size > 3000
    return ids


def _with_eos(rng, tokens, eos, n_eos):
    """``tokens`` with ``n_eos`` EOS tokens inserted: at the start, in runs of two and three,
    at the end, and at random places (segments of every length from 0 up)."""
    t = list(tokens)
    places = sorted(rng.integers(0, len(t), n_eos).tolist(), reverse=True)
    for p in places:
        t.insert(p, eos)
    t[0:0] = [eos]
    mid = len(t) // 2
    t[mid:mid] = [eos, eos, 17, eos, eos, eos]
    t.append(eos)
    return np.array(t, dtype=np.int64)


def test_release_tables_equal_the_spec_and_transformers(release_hash, release_reference):
    h, m = release_hash, release_reference.module
    assert h.multipliers.tolist() == RELEASE_MULTIPLIERS == m.layer_multipliers.tolist()
    assert h.primes.tolist() == m.head_vocab_sizes and h.offsets.tolist() == m.head_offsets
    assert h.primes[0] == 20_000_003 and h.primes[-1] == 20_000_171 and h.primes.size == 16
    assert h.used_rows() == 320_001_446 == m.total_vocab_size
    assert h.table_rows() == 320_001_536 == m.ngram_embedding.weight.shape[0]
    assert h.table_rows() % h.config.split_ngram_parts == 0
    for a in (h.primes, h.multipliers, h.offsets):
        assert isinstance(a, np.ndarray) and a.dtype == np.int64
    assert splitmix64(0) == 0xE220A8397B1DCDAF  # SplitMix64's first output from state 0


def test_release_hash_equals_transformers_on_real_text_with_eos(
    release_hash, release_reference, real_tokens
):
    rng = np.random.default_rng(0)
    h = release_hash
    a = _with_eos(rng, real_tokens[:1500], RELEASE_EOS, 40)
    b = _with_eos(rng, real_tokens[1500:3000], RELEASE_EOS, 5)
    n = min(a.size, b.size)
    tokens = np.stack([a[:n], b[:n]])
    want = release_reference.ids(tokens)
    assert want.shape == (2, n, 16)
    np.testing.assert_array_equal(h.hash(tokens), want)
    ref = hash_reference(h.padded(tokens), h.keep, h.eos, h.multipliers, h.primes, h.offsets)
    np.testing.assert_array_equal(ref, want)
    assert (want >= h.offsets).all() and (want < h.offsets + h.primes).all()
    np.testing.assert_array_equal(h.hash(tokens[0]), want[:1])  # 1-D: one sequence


def test_release_chunks_and_decode_equal_transformers_cached_calls(
    release_hash, release_reference, real_tokens
):
    """The reference's own cache (its conv_state index 2) across a prefill, decode steps of
    one token and another chunk: each call's ids equal ours given the context we keep, and
    the context we keep equals its conv_state."""
    rng = np.random.default_rng(1)
    h, ref = release_hash, release_reference
    seqs = [_with_eos(rng, real_tokens[i * 400 : i * 400 + 300], RELEASE_EOS, 12) for i in (0, 1)]
    n = min(s.size for s in seqs)
    tokens = np.stack([s[:n] for s in seqs])
    whole = h.hash(tokens)
    cache = ref.cache()
    ctx = None
    cuts = [0, 1, 2, 3, 57, 58, 59, 60, 200, n]  # a prefill of 1, then decode steps, chunks
    for a, b in itertools.pairwise(cuts):
        part = tokens[:, a:b]
        got = h.hash(part, ctx)
        np.testing.assert_array_equal(got, ref.ids(part, cache))
        np.testing.assert_array_equal(got, whole[:, a:b])
        ctx = h.next_context(part, ctx)
        kept = cache.get_conv_state(ref.layer_idx, state_idx=2).numpy()
        np.testing.assert_array_equal(ctx, kept)


@pytest.mark.parametrize("table", [0, 1])
def test_small_config_equals_transformers(table):
    """A tiny table built whole by transformers (two tables: the second's multipliers and
    primes run on from the first's), 4-grams of 3 heads, a vocabulary where EOS is common."""
    cfg = Qwen4NgramConfig(
        vocab_size=50,
        eos_token_id=7,
        ngram_size=4,
        heads_per_ngram=3,
        ngram_vocab_size_base=40_000,
        make_ngram_vocab_size_divisible_by=64,
        split_ngram_parts=4,
        ple_layer_ids=(3, 1),
        ple_embed_dim=36,
        seed=99,
    )
    assert cfg.ple_layer_ids == (1, 3)
    ref = _Reference(cfg, table=table)
    h = Qwen4NgramHash(cfg, table=table)
    assert h.multipliers.tolist() == ref.module.layer_multipliers.tolist()
    assert h.primes.tolist() == ref.module.head_vocab_sizes
    assert h.table_rows() == ref.module.ngram_embedding.weight.shape[0]
    rng = np.random.default_rng(table)
    tokens = rng.integers(0, 50, (3, 400))
    tokens[rng.random(tokens.shape) < 0.15] = 7
    np.testing.assert_array_equal(h.hash(tokens), ref.ids(tokens))
    cache, ctx, parts = ref.cache(), None, []
    for a, b in ((0, 2), (2, 3), (3, 4), (4, 5), (5, 150), (150, 400)):
        parts.append(ref.ids(tokens[:, a:b], cache))
        np.testing.assert_array_equal(h.hash(tokens[:, a:b], ctx), parts[-1])
        ctx = h.next_context(tokens[:, a:b], ctx)
    np.testing.assert_array_equal(np.concatenate(parts, axis=1), ref.ids(tokens))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(2, 5),
    heads=st.integers(1, 9),
    length=st.integers(1, 120),
    eos_rate=st.sampled_from([0.0, 0.05, 0.3, 0.9]),
    data=st.data(),
)
def test_any_chunking_equals_the_whole_sequence(seed, n, heads, length, eos_rate, data):
    """Random configs and chunkings: the chunks, each hashed with the context kept from the
    ones before, equal the whole sequence; native and NumPy spec equal throughout."""
    rng = np.random.default_rng(seed)
    V = int(rng.integers(2, 300))
    cfg = Qwen4NgramConfig(
        vocab_size=V,
        eos_token_id=int(rng.integers(0, V)),
        ngram_size=n,
        heads_per_ngram=heads,
        ngram_vocab_size_base=int(rng.integers(2, 10**7)),
        ple_layer_ids=(1,),
        ple_embed_dim=(n - 1) * heads * 2,
        seed=int(rng.integers(0, 2**40)),
    )
    h = Qwen4NgramHash(cfg)
    B = int(rng.integers(1, 4))
    tokens = rng.integers(0, V, (B, length))
    tokens[rng.random(tokens.shape) < eos_rate] = cfg.eos_token_id
    whole = h.hash(tokens)
    ref = hash_reference(h.padded(tokens), h.keep, h.eos, h.multipliers, h.primes, h.offsets)
    np.testing.assert_array_equal(whole, ref)
    cuts = sorted(
        set(data.draw(st.lists(st.integers(1, length - 1), max_size=8)) if length > 1 else [])
    )
    ctx = None
    for a, b in itertools.pairwise([0, *cuts, length]):
        np.testing.assert_array_equal(h.hash(tokens[:, a:b], ctx), whole[:, a:b])
        ctx = h.next_context(tokens[:, a:b], ctx)


def test_decode_steps_of_one_token_equal_the_prefill(release_hash, real_tokens):
    h = release_hash
    rng = np.random.default_rng(3)
    seqs = [_with_eos(rng, real_tokens[i * 50 : i * 50 + 60], RELEASE_EOS, 6) for i in range(64)]
    n = min(s.size for s in seqs)
    tokens = np.stack([s[:n] for s in seqs])
    whole = h.hash(tokens)
    ctx = h.next_context(tokens[:, :10])
    out = np.empty((64, 1, 16), dtype=np.int64)
    for t in range(10, n):
        step = np.ascontiguousarray(tokens[:, t : t + 1])
        assert h.hash(step, ctx, out=out) is out
        np.testing.assert_array_equal(out, whole[:, t : t + 1])
        ctx = h.next_context(step, ctx)
    # a longer context than the look-back: only its last ngram_size - 1 columns count
    np.testing.assert_array_equal(h.hash(tokens[:, 30:], tokens[:, :30]), whole[:, 30:])


PATHS = ("scalar", "avx2", "avx512")  # csrc/engram_hash.c's reductions


@pytest.mark.parametrize("path", PATHS)
def test_every_path_equals_the_numpy_spec(path, monkeypatch, release_hash):
    """Each reduction the CPU has, with the offsets and the segment rule, over blocks, their
    edges, decode-sized calls and the threads' parts."""
    if host.native is None:
        pytest.skip("no native module")
    monkeypatch.setenv("ROWCACHE_ENGRAM_HASH", path)
    try:
        h = Qwen4NgramHash(Qwen4NgramConfig.release())
    except ConfigError as e:
        if "this CPU lacks it" in str(e):
            pytest.skip(f"this CPU has no {path}")
        raise
    monkeypatch.delenv("ROWCACHE_ENGRAM_HASH")
    assert h.path == path
    rng = np.random.default_rng(4)
    for B, T in ((1, 1), (3, 63), (2, 64), (2, 65), (1, 3000), (64, 1)):
        tokens = rng.integers(0, 248_320, (B, T))
        tokens[rng.random(tokens.shape) < 0.1] = RELEASE_EOS
        for ctx in (None, rng.integers(0, 248_320, (B, 2)), np.full((B, 1), RELEASE_EOS)):
            want = hash_reference(
                h.padded(tokens, ctx), h.keep, h.eos, h.multipliers, h.primes, h.offsets
            )
            np.testing.assert_array_equal(h.hash(tokens, ctx), want)
            out = np.empty((B, T, 16), dtype=np.int64)
            c = None if ctx is None else np.ascontiguousarray(ctx, dtype=np.int64)
            h._native.hash(tokens, B, c, h.eos, out, 4)  # split over threads: the same
            np.testing.assert_array_equal(out, want)


def test_the_kernels_other_combinations_equal_their_references():
    """The identity map without segments is Engram's rule over raw tokens; a lookup with the
    segment rule applies it to the raw tokens, then the map (an identity lookup here: the
    Qwen4 spec again)."""
    if host.native is None:
        pytest.skip("no native module")
    from rowcache.embed.engram.hash import hash_reference as engram_reference

    rng = np.random.default_rng(6)
    V = 3000
    mult = np.array([[1001, 2003, 3007, 4001]], dtype=np.int64)
    primes = np.array([[70001, 70003, 70009, 80021, 80039, 80051, 90001, 90007, 90011]])
    tokens = rng.integers(0, V, (2, 300))
    tokens[rng.random(tokens.shape) < 0.2] = 5
    ctx = rng.integers(0, V, (2, 3))
    out = np.empty((1, 2, 300, 9), dtype=np.int64)
    plain = host.native.EngramHasher(None, mult, primes, 3, vocab=V)
    plain.hash(tokens, 2, ctx, 9, out)
    x = np.concatenate([ctx, tokens], axis=1)
    np.testing.assert_array_equal(out[0], engram_reference(x, 3, mult[0], primes.reshape(3, 3)))
    seg = host.native.EngramHasher(np.arange(V), mult, primes, 3, eos=5)
    seg.hash(tokens, 2, ctx, 5, out)
    zero = np.zeros(9, dtype=np.int64)
    np.testing.assert_array_equal(out[0], hash_reference(x, 3, 5, mult[0], primes[0], zero))


def test_no_native_module_runs_the_reference(monkeypatch, release_hash, real_tokens):
    tokens = _with_eos(np.random.default_rng(7), real_tokens[:500], RELEASE_EOS, 9)
    native = release_hash.hash(tokens, [[3, RELEASE_EOS]])
    monkeypatch.setattr(host, "native", None)
    np.testing.assert_array_equal(release_hash.hash(tokens, [[3, RELEASE_EOS]]), native)
    with pytest.raises(ConfigError, match=r"tokens\[0, 2\] = 248320 is outside"):
        release_hash.hash([[0, 1, 248_320]])


def test_tokens_outside_the_vocabulary_are_named(release_hash):
    h = release_hash
    with pytest.raises(ConfigError, match=r"tokens\[1, 1\] = 248320 is outside the token ids"):
        h.hash([[0, 1], [2, 248_320]])
    with pytest.raises(ConfigError, match=r"context\[0, 1\] = -1 is outside"):
        h.hash([[0, 1]], context=[[0, -1]])
    h.hash([[0, 1]], context=[[-1, 0, 0]])  # a column not read is not checked
    with pytest.raises(ConfigError, match="integer"):
        h.hash([[0.5]])
    with pytest.raises(ConfigError, match="one per sequence"):
        h.hash([[0, 1]], context=[[0, 1], [1, 2]])
    with pytest.raises(ConfigError, match="out: give a writable C-contiguous int64"):
        h.hash([[0, 1]], out=np.empty((1, 2, 16), np.int32))
    assert h.hash(np.zeros((2, 0), dtype=np.int64)).shape == (2, 0, 16)
    assert h.hash([]).shape == (1, 0, 16)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"vocab_size": 0}, r"vocab_size=0: give an integer in \[1, 2147483647\]"),
        ({"eos_token_id": 248_320}, r"eos_token_id=248320: give an integer in \[0, 248319\]"),
        ({"ngram_size": 1}, "ngram_size=1"),
        ({"ngram_size": 17}, "ngram_size=17"),
        ({"heads_per_ngram": 0}, "heads_per_ngram=0"),
        ({"ngram_vocab_size_base": 1}, "ngram_vocab_size_base=1"),
        ({"make_ngram_vocab_size_divisible_by": 0}, "make_ngram_vocab_size_divisible_by=0"),
        ({"split_ngram_parts": True}, "split_ngram_parts=True"),
        ({"ple_layer_ids": ()}, r"ple_layer_ids=\(\)"),
        ({"ple_layer_ids": (0,)}, r"ple_layer_ids=\(0,\): give 1-based decoder layer ids"),
        ({"ple_layer_ids": (2, 1.5)}, r"ple_layer_ids=\(2, 1.5\)"),
        ({"ple_layer_ids": "2"}, "ple_layer_ids='2'"),
        ({"ple_embed_dim": 100}, "ple_embed_dim=100: must be divisible by the heads"),
        ({"seed": -1}, "seed=-1"),
    ],
)
def test_config_refusals(kw, match):
    base = dict(Qwen4NgramConfig.release().__dict__)
    base.pop("defaulted")
    with pytest.raises(ConfigError, match=match):
        Qwen4NgramConfig(**{**base, **kw})


def test_config_defaults_are_transformers_and_release_is_the_checkpoints():
    hf = Qwen4ExpTextConfig(eos_token_id=[1], ple_layer_ids=[2], ple_embed_dim=2048)
    cfg = Qwen4NgramConfig(eos_token_id=1, ple_layer_ids=(2,), ple_embed_dim=2048)
    for name in (
        "vocab_size",
        "ngram_size",
        "heads_per_ngram",
        "ngram_vocab_size_base",
        "make_ngram_vocab_size_divisible_by",
        "split_ngram_parts",
        "seed",
    ):
        assert getattr(cfg, name) == getattr(hf, name), name
    rel = Qwen4NgramConfig.release()
    assert (rel.split_ngram_parts, rel.ple_layer_ids, rel.ple_embed_dim) == (128, (2,), 2560)
    assert rel.heads == 16 and rel.head_dim == 160 and rel.eos_token_id == RELEASE_EOS
    with pytest.raises(dataclasses.FrozenInstanceError):
        rel.seed = 3  # type: ignore[misc]


def _release_json():
    text = {
        "model_type": "qwen4_exp_text",
        "vocab_size": 248320,
        "hidden_size": 2048,
        "eos_token_id": [248044, 248046],
        "ngram_size": 3,
        "heads_per_ngram": 8,
        "ngram_vocab_size_base": 20000000,
        "make_ngram_vocab_size_divisible_by": 128,
        "split_ngram_parts": 128,
        "ple_layer_ids": [2],
        "ple_embed_dim": 2560,
    }
    return {"model_type": "qwen4_exp", "text_config": text, "image_token_id": 248056}


def test_config_from_a_path_a_full_or_a_text_config(tmp_path):
    full = _release_json()
    (tmp_path / "config.json").write_text(json.dumps(full))
    for source in (tmp_path, tmp_path / "config.json", str(tmp_path), full, full["text_config"]):
        cfg = Qwen4NgramConfig.from_config(source)
        assert cfg == Qwen4NgramConfig.release()
        assert cfg.defaulted == ("seed",)
    bare = Qwen4NgramConfig.from_config({"eos_token_id": 5, "ple_layer_ids": [1]})
    assert bare.ple_embed_dim == 2048 and bare.vocab_size == 248_320
    assert set(bare.defaulted) == {
        "vocab_size",
        "ngram_size",
        "heads_per_ngram",
        "ngram_vocab_size_base",
        "make_ngram_vocab_size_divisible_by",
        "split_ngram_parts",
        "ple_embed_dim",
        "seed",
    }
    with pytest.raises(ConfigError, match="config has no 'eos_token_id'"):
        Qwen4NgramConfig.from_config({"ple_layer_ids": [2]})
    with pytest.raises(ConfigError, match="config has no 'ple_layer_ids'"):
        Qwen4NgramConfig.from_config({"eos_token_id": 2})
    with pytest.raises(ConfigError, match=r"config\['eos_token_id'\] = \[\]"):
        Qwen4NgramConfig.from_config({"eos_token_id": [], "ple_layer_ids": [2]})
    with pytest.raises(ConfigError, match=r"config\['ple_embed_dim'\]: ple_embed_dim=100"):
        Qwen4NgramConfig.from_config({**full["text_config"], "ple_embed_dim": 100})
    with pytest.raises(ConfigError, match=r"config\['hidden_size'\]: ple_embed_dim=100"):
        Qwen4NgramConfig.from_config({"eos_token_id": 2, "ple_layer_ids": [2], "hidden_size": 100})
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="not JSON"):
        Qwen4NgramConfig.from_config(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="cannot be read"):
        Qwen4NgramConfig.from_config(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match=r"config must be a dict or a config\.json path, got int"):
        Qwen4NgramConfig.from_config(3)  # type: ignore[arg-type]


def test_hash_refuses_a_table_it_does_not_have():
    with pytest.raises(
        ConfigError, match=r"table=1: give the table's index in ple_layer_ids, 0..0"
    ):
        Qwen4NgramHash(Qwen4NgramConfig.release(), table=1)
    with pytest.raises(ConfigError, match="must be a Qwen4NgramConfig"):
        Qwen4NgramHash({"eos_token_id": 1})  # type: ignore[arg-type]
    assert head_primes(Qwen4NgramConfig.release(), 0)[0] == 20_000_003


def test_native_qwen4_hasher_refuses_bad_arguments_in_a_child():
    """The extension's own checks on the identity map, offsets and eos: never a signal, a
    ValueError each (and a sound call after them)."""
    if host.native is None:
        pytest.skip("no native module")
    code = """
import numpy as np
from rowcache.kernels import host
E = host.native.EngramHasher
m = np.ones((1, 3), np.int64) * 3; p = np.full((1, 4), 70001, np.int64)
off = np.zeros((1, 4), np.int64)
x = np.zeros((2, 3), np.int64); o = np.empty((1, 2, 3, 4), np.int64)
made = [
  dict(args=(None, m, p, 2), kw=dict(offsets=off, eos=3, vocab=10)),      # sound
  dict(args=(None, m, p, 2), kw=dict(eos=3)),                             # no vocab
  dict(args=(None, m, p, 2), kw=dict(eos=10, vocab=10)),                  # eos outside
  dict(args=(None, m, p, 2), kw=dict(eos=-2, vocab=10)),                  # eos below -1
  dict(args=(None, m, p, 2), kw=dict(offsets=off[:, :3], vocab=10)),      # offsets' shape
  dict(args=(None, m, p, 2), kw=dict(offsets=off - 1, vocab=10)),         # negative offset
  dict(args=(None, m, p, 2), kw=dict(offsets=off + 2**62 + 1, vocab=10)), # offset too large
  dict(args=(np.arange(10), m, p, 2), kw=dict(vocab=10)),                 # vocab with lookup
  dict(args=(None, m * 2**61, p, 2), kw=dict(vocab=10)),                  # products would wrap
  dict(args=(None, m, p, 2), kw=dict(vocab=2**31)),                       # vocab too large
  dict(args=(None, m, p, 2), kw=dict(offsets=off.astype(np.int32), vocab=10)),  # item size
]
res = []
for c in made:
    try:
        E(*c["args"], **c["kw"]); res.append("ok")
    except (ValueError, TypeError) as e:
        res.append(type(e).__name__)
h = E(*made[0]["args"], **made[0]["kw"])
for call in [(x, 2, None, 3, o), (x + 10, 2, None, 3, o), (x, 2, None, 10, o), (x, 2, x - 1, 3, o)]:
    try:
        h.hash(*call); res.append("ok")
    except ValueError:
        res.append("ValueError")
print(",".join(res))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"rc {r.returncode}: {r.stderr[-3000:]}"
    assert r.stdout.strip().split(",") == (
        ["ok"] + ["ValueError"] * 9 + ["TypeError"] + ["ok"] + ["ValueError"] * 3
    )


def test_native_rows_checks_dtypes_and_shapes_in_a_child():
    """``EngramHasher.rows`` (what ``hash(..., out=)`` calls first) refuses every array it
    cannot take with a TypeError (never a signal, never a write), and ``hash`` then names
    the problem as a ConfigError."""
    if host.native is None:
        pytest.skip("no native module")
    code = """
import numpy as np
from rowcache.embed import Qwen4NgramConfig, Qwen4NgramHash
from rowcache.errors import ConfigError
h = Qwen4NgramHash(Qwen4NgramConfig.release())
n = h._native
t = np.arange(6, dtype=np.int64).reshape(2, 3); c = np.zeros((2, 2), np.int64)
o = np.empty((2, 3, 16), np.int64)
calls = [
  (t, c, o),                                   # sound
  (t, None, o.reshape(1, 2, 3, 16)),           # sound: [L, B, T, K]
  (t.astype(np.float64), c, o),                # float tokens of 8 bytes
  (t.astype(np.uint64), c, o),                 # unsigned tokens
  (t.ravel(), c, o),                           # 1-D tokens
  (t, c[:1], o),                               # context rows differ
  (t, c.ravel(), o),                           # 1-D context
  (t, c, o.reshape(6, 16)),                    # out of the right size, wrong shape
  (t, c, o[:, :2]),                            # out not C-contiguous
  (t, c, o.astype(np.float64)),                # float out
  (t, c, np.empty((2, 3, 16), np.int64)[::1].view(np.uint64)),  # unsigned out
  ([[1, 2, 3]], c, o),                         # a list
]
res = []
for a in calls:
    try:
        n.rows(a[0], a[1], h.eos, a[2], 1); res.append("ok")
    except (TypeError, ValueError, BufferError) as e:
        res.append(type(e).__name__)
ro = np.empty((2, 3, 16), np.int64); ro.flags.writeable = False
for a in [(t, c, ro), (t + 10**6, c, o)]:
    try:
        n.rows(a[0], a[1], h.eos, a[2], 1); res.append("ok")
    except (TypeError, ValueError, BufferError) as e:
        res.append(type(e).__name__)
for a in calls[2:]:
    try:
        h.hash(a[0], a[1], out=a[2]); res.append("ok")
    except ConfigError:
        res.append("ConfigError")
print(",".join(res))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"rc {r.returncode}: {r.stderr[-3000:]}"
    got = r.stdout.strip().split(",")
    assert got[:2] == ["ok", "ok"]
    # NumPy itself refuses a non-contiguous or read-only buffer (ValueError); the rest are
    # rows' TypeErrors; a token outside the vocabulary is hash's ValueError
    assert got[2:12] == ["TypeError"] * 6 + ["ValueError"] + ["TypeError"] * 3, got
    assert got[12:14] == ["ValueError", "ValueError"], got
    # through hash: each is named as a ConfigError, but unsigned tokens of small values,
    # which hash takes as token ids (converted)
    assert got[14:] == ["ConfigError", "ok"] + ["ConfigError"] * 8, got
