"""Engram's hash (issue 40, part 1): config, compressed vocabulary, head primes, multipliers
and the native hash, against DeepSeek's reference on real text and the NumPy spec."""

from __future__ import annotations

import hashlib
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from rowcache.embed.engram.config import EngramConfig, head_primes, is_prime
from rowcache.embed.engram.hash import EngramContext, EngramHash, hash_reference
from rowcache.embed.engram.vocab import CompressedVocab
from rowcache.errors import ConfigError
from rowcache.kernels import host
from rowcache.tools.tokens import tokenizer_json_path

DATA = pathlib.Path(__file__).parent / "data" / "engram_reference.json"


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a, dtype="<i8").tobytes()).hexdigest()


@pytest.fixture(scope="module")
def deepseek_vocab(tmp_path_factory):
    return CompressedVocab.from_tokenizer(
        tokenizer_json_path("deepseek"), cache_dir=tmp_path_factory.mktemp("vocab")
    )


def test_hash_equals_deepseeks_reference_on_real_text(deepseek_vocab):
    ref = json.loads(DATA.read_text())
    assert len(deepseek_vocab) == ref["compressed_vocab"] == 99_092
    assert _sha(deepseek_vocab.lookup) == ref["lookup_sha256"]
    h = EngramHash(EngramConfig(), deepseek_vocab)
    assert h.pad == ref["pad"]
    tokens = np.array(ref["tokens"], dtype=np.int64)
    ids = h.hash(tokens)
    for layer in (1, 15):
        assert h.multipliers[layer].tolist() == ref["multipliers"][str(layer)]
        assert h.primes[layer].tolist() == ref["primes"][str(layer)]
        assert ids[layer].shape == (2, 1500, 16)
        assert ids[layer][:, ::97].tolist() == ref["ids_sample"][str(layer)]
        assert _sha(ids[layer]) == ref["ids_sha256"][str(layer)]
        assert (ids[layer] < h.primes[layer].reshape(-1)).all() and (ids[layer] >= 0).all()
    assert h.table_rows(1) == sum(map(sum, ref["primes"]["1"]))


def _random_case(rng, n, heads, layers, vocab_rows):
    V = int(rng.integers(5, 3000))
    lookup = np.empty(V, dtype=np.int64)  # numbered by first appearance, as the rule does
    keys: dict[int, int] = {}
    for t, k in enumerate(rng.integers(0, max(2, V // 3), V)):
        lookup[t] = keys.setdefault(int(k), len(keys))
    cfg = EngramConfig(
        vocab_per_ngram=tuple(int(v) for v in rng.integers(2, vocab_rows, n - 1)),
        max_ngram=n,
        n_embed_per_ngram=heads * 4,
        n_head_per_ngram=heads,
        layer_ids=tuple(int(x) for x in rng.choice(60, layers, replace=False)),
        pad_id=int(rng.integers(0, V)),
        seed=int(rng.integers(0, 1000)),
    )
    return cfg, CompressedVocab(lookup)


@pytest.mark.parametrize("seed", range(12))
def test_native_hash_equals_the_numpy_spec(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 7))
    cfg, vocab = _random_case(rng, n, int(rng.integers(1, 6)), int(rng.integers(1, 4)), 10**7)
    h = EngramHash(cfg, vocab)
    B, T = int(rng.integers(1, 5)), int(rng.integers(0, 300))
    tokens = rng.integers(0, vocab.tokenizer_size, (B, T))
    ctx = rng.integers(0, vocab.tokenizer_size, (B, int(rng.integers(0, 2 * n))))
    got = h.hash(tokens, ctx)
    xc = vocab.compress(h.padded(tokens, ctx))
    for layer in cfg.layer_ids:
        want = hash_reference(xc, n - 1, h.multipliers[layer], h.primes[layer])
        assert got[layer].shape == (B, T, cfg.heads_per_layer)
        np.testing.assert_array_equal(got[layer], want)


def test_native_hash_over_threads_equals_one_thread():
    rng = np.random.default_rng(5)
    cfg, vocab = _random_case(rng, 4, 8, 2, 10**8)
    h = EngramHash(cfg, vocab)
    x = rng.integers(0, vocab.tokenizer_size, (3, 5000))
    outs = []
    for threads in (1, 4):
        out = np.empty((2, 3, 5000, cfg.heads_per_layer), dtype=np.int64)
        h._native.hash(x, 3, x[:, :2].copy(), cfg.pad_id, out, threads)
        outs.append(out)
    np.testing.assert_array_equal(*outs)


PATHS = ("scalar", "avx2", "avx512")  # csrc/engram_hash.c's reductions


def _hash_on(path, cfg, vocab, monkeypatch):
    """An EngramHash whose native hasher runs ``path`` (ROWCACHE_ENGRAM_HASH, read when the
    hasher is made); skipped where this machine's CPU lacks it."""
    if host.native is None:
        pytest.skip("no native module")
    monkeypatch.setenv("ROWCACHE_ENGRAM_HASH", path)
    try:
        h = EngramHash(cfg, vocab)
    except ConfigError as e:
        if "this CPU lacks it" in str(e):
            pytest.skip(f"this CPU has no {path}")
        raise
    monkeypatch.delenv("ROWCACHE_ENGRAM_HASH")
    assert h.path == path
    return h


def _assert_hash_equals_reference(h, tokens, context, threads=1):
    B, T = tokens.shape
    out = np.empty((len(h.layer_ids), B, T, h.config.heads_per_layer), dtype=np.int64)
    c = None if context is None else np.ascontiguousarray(context, dtype=np.int64)
    h._native.hash(tokens, B, c, h.config.pad_id, out, threads)
    xc = h.vocab.compress(h.padded(tokens, context))
    for i, layer in enumerate(h.layer_ids):
        want = hash_reference(xc, h.keep, h.multipliers[layer], h.primes[layer])
        np.testing.assert_array_equal(out[i], want, err_msg=f"layer {layer}")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "heads, n, rows, B, T",
    [
        (8, 3, 646400, 2, 300),  # the demo's heads; T past one block of 256 positions
        (1, 2, 2**15, 1, 1),  # one lane of a vector; the smallest prime the vectors take; 1 id
        (3, 4, 10**6, 3, 5),  # heads below a vector, not a multiple of 4
        (5, 2, 16_000_000, 1, 257),  # one 4-lane vector and a lane; one 8-lane vector, masked
        (9, 5, 2**31, 2, 17),  # past 8 heads by one; primes about 2**31
        (16, 3, 2**32 - 20, 1, 513),  # primes about 2**32, both sides (the AVX2 product's halves)
        (4, 3, 2**40, 2, 64),  # the largest head EngramConfig allows: primes above 2**40
    ],
)
def test_every_path_equals_the_numpy_spec(path, heads, n, rows, B, T, monkeypatch):
    """Each reduction the CPU has, bit for bit against hash_reference: vector widths and their
    masked tails, primes from 2**15 to above 2**40, blocks and single ids, look-back from the
    context (shorter than, as long as and longer than max_ngram - 1) and from pad."""
    rng = np.random.default_rng(heads * 1000 + n)
    V = 5000
    cfg = EngramConfig(
        vocab_per_ngram=tuple(rows - 7 * i for i in range(n - 1)),
        max_ngram=n,
        n_embed_per_ngram=heads * 2,
        n_head_per_ngram=heads,
        layer_ids=(3, 0),
        pad_id=7,
    )
    h = _hash_on(path, cfg, CompressedVocab(np.arange(V)), monkeypatch)
    assert h.primes[3].min() >= 2**15
    tokens = rng.integers(0, V, (B, T))
    for ctx_len in (None, 0, 1, n - 1, n + 3):
        context = None if ctx_len is None else rng.integers(0, V, (B, ctx_len))
        _assert_hash_equals_reference(h, tokens, context)
    _assert_hash_equals_reference(h, tokens, None, threads=4)


@pytest.mark.parametrize("path", PATHS)
def test_every_path_at_the_mixes_extremes(path, monkeypatch):
    """Mixes up to 2**63 - 1 (the multipliers at the largest the hasher takes) against the
    primes nearest each bound the reductions depend on: 2**15 (the vector quotient's error),
    2**32 (AVX2's 32-bit product halves) and 2**61 - 1 (a prime near the 2**62 cap)."""
    if host.native is None:
        pytest.skip("no native module")
    V = 1 << 12
    lookup = np.arange(V, dtype=np.int64)
    top = (2**63 - 1) // V  # x * m < 2**63 for every compressed x < V
    mult = np.array([[top, top - 2, top // 3]], dtype=np.int64)
    primes = np.array([[32771, 32779, 4294967291, 4294967311, 2**61 - 1, 2**31 - 1, 65537, 40009]])
    monkeypatch.setenv("ROWCACHE_ENGRAM_HASH", path)
    try:
        hasher = host.native.EngramHasher(lookup, mult, primes, 4)
    except ValueError as e:
        if "this CPU lacks it" in str(e):
            pytest.skip(f"this CPU has no {path}")
        raise
    assert hasher.path == path
    tokens = np.concatenate([np.arange(V), np.arange(V)[::-1], [V - 1] * 5])[None, :]
    out = np.empty((1, 1, tokens.shape[1], 8), dtype=np.int64)
    hasher.hash(tokens, 1, None, V - 1, out)
    x = np.concatenate([[V - 1, V - 1], tokens[0]])[None, :]
    want = hash_reference(x, 2, mult[0], primes.reshape(2, 4))
    np.testing.assert_array_equal(out[0], want)


def test_path_choice_and_its_refusals(monkeypatch):
    """Unset: AVX2 where the CPU has it (AVX-512 only when asked), else scalar, and scalar
    where a prime is below 2**15; a path asked
    for that cannot run is refused, naming the variable, the value and what is allowed."""
    rng = np.random.default_rng(8)
    cfg, vocab = _random_case(rng, 3, 4, 1, 1000)  # primes below 2**15
    monkeypatch.delenv("ROWCACHE_ENGRAM_HASH", raising=False)
    assert EngramHash(cfg, vocab).path == "scalar"
    big = EngramConfig(vocab_per_ngram=(10**6, 10**6))
    runs = []
    for path in PATHS:
        monkeypatch.setenv("ROWCACHE_ENGRAM_HASH", path)
        try:
            runs.append(EngramHash(big, vocab).path)
        except ConfigError as e:
            assert str(e) == f"ROWCACHE_ENGRAM_HASH={path}, but this CPU lacks it"
    monkeypatch.delenv("ROWCACHE_ENGRAM_HASH")
    default = "avx2" if "avx2" in runs else "scalar"
    assert runs[0] == "scalar" and EngramHash(big, vocab).path == default
    monkeypatch.setenv("ROWCACHE_ENGRAM_HASH", "avx2")
    if "avx2" in runs:
        with pytest.raises(ConfigError, match=r"ROWCACHE_ENGRAM_HASH=avx2, but a prime is \d+"):
            EngramHash(cfg, vocab)
    monkeypatch.setenv("ROWCACHE_ENGRAM_HASH", "sse9")
    with pytest.raises(ConfigError, match="sse9: give scalar, avx2 or avx512"):
        EngramHash(big, vocab)


def test_hash_into_a_given_buffer():
    rng = np.random.default_rng(4)
    cfg, vocab = _random_case(rng, 3, 2, 2, 10**5)
    h = EngramHash(cfg, vocab)
    tokens = rng.integers(0, vocab.tokenizer_size, (2, 30))
    out = np.full((2, 2, 30, cfg.heads_per_layer), -7, dtype=np.int64)
    got = h.hash(tokens, out=out)
    for i, layer in enumerate(cfg.layer_ids):
        assert np.shares_memory(got[layer], out)
        np.testing.assert_array_equal(out[i], h.hash(tokens)[layer])
    for bad in (out[:, :1], out.astype(np.int32), out.transpose(0, 2, 1, 3), [[1]]):
        with pytest.raises(ConfigError, match="out: give a writable C-contiguous int64"):
            h.hash(tokens, out=bad)


def test_no_native_module_runs_the_reference(monkeypatch):
    rng = np.random.default_rng(1)
    cfg, vocab = _random_case(rng, 3, 4, 2, 10**6)
    h = EngramHash(cfg, vocab)
    tokens = rng.integers(0, vocab.tokenizer_size, (2, 50))
    native = h.hash(tokens)
    monkeypatch.setattr(host, "native", None)
    for layer, ids in h.hash(tokens).items():
        np.testing.assert_array_equal(ids, native[layer])


def test_context_prefill_then_decode_equals_one_prefill():
    rng = np.random.default_rng(2)
    cfg, vocab = _random_case(rng, 4, 3, 2, 10**6)
    h = EngramHash(cfg, vocab)
    tokens = rng.integers(0, vocab.tokenizer_size, (3, 40))
    whole = h.hash(tokens)
    ctx = EngramContext(h, batch=3)
    parts = [ctx.step(tokens[:, :17])]
    parts += [ctx.step(tokens[:, t : t + 1]) for t in range(17, 30)]
    parts.append(ctx.step(tokens[:, 30:]))
    for layer in cfg.layer_ids:
        np.testing.assert_array_equal(
            np.concatenate([p[layer] for p in parts], axis=1), whole[layer]
        )
    # the same with the context given by hand: any longer look-back is cut to the last 3
    for layer, ids in h.hash(tokens[:, 25:], context=tokens[:, :25]).items():
        np.testing.assert_array_equal(ids, whole[layer][:, 25:])
    ctx.reset()
    assert (ctx.kept == cfg.pad_id).all()


def test_head_primes_distinct_and_above_their_start():
    cfg = EngramConfig(vocab_per_ngram=(100, 100, 50), max_ngram=4, layer_ids=(3, 0, 7))
    primes = head_primes(cfg)
    flat = np.concatenate([primes[layer].reshape(-1) for layer in (3, 0, 7)])
    assert len(set(flat.tolist())) == flat.size and all(is_prime(int(p)) for p in flat)
    assert primes[3][0, 0] == 101 and primes[3][2, 0] == 53
    assert (np.diff(primes[3][0]) > 0).all()  # each head searches above the one before
    assert primes[0][0, 0] > primes[3][0, -1]  # layers in the order given, primes not reused
    sieve = np.ones(20000, dtype=bool)
    sieve[:2] = False
    for i in range(2, 142):
        sieve[i * i :: i] = False
    assert [is_prime(i) for i in range(20000)] == sieve.tolist()
    assert is_prime(2**61 - 1) and not is_prime((2**31 - 1) * (2**61 - 1))


def walk_primes(config):
    """The head primes as the spec words them, and as head_primes found them before issue 51:
    from each start, every number tested in turn, skipping primes already used."""
    used, out = set(), {}
    for layer in config.layer_ids:
        rows = np.empty((config.max_ngram - 1, config.n_head_per_ngram), dtype=np.int64)
        for order in range(2, config.max_ngram + 1):
            start = config.vocab_per_ngram[order - 2] - 1
            for h in range(config.n_head_per_ngram):
                p = start + 1
                while p in used or not is_prime(p):
                    p += 1
                used.add(p)
                rows[order - 2, h] = start = p
        out[layer] = rows
    return out


def test_head_primes_of_the_demo_and_v41_are_those_of_before_the_sieve():
    demo = head_primes(EngramConfig())  # what head_primes gave before issue 51
    assert demo[1].tolist() == [
        [646403, 646411, 646421, 646423, 646433, 646453, 646519, 646523],
        [646537, 646543, 646549, 646571, 646573, 646577, 646609, 646619],
    ]
    assert demo[15].tolist() == [
        [646631, 646637, 646643, 646669, 646687, 646721, 646757, 646771],
        [646781, 646823, 646831, 646837, 646843, 646859, 646873, 646879],
    ]
    v41 = head_primes(EngramConfig.reported_v41())
    assert v41[1][0, 0] == 16000057 and v41[14][-1, -1] == 16000889
    flat = np.concatenate([v41[1].reshape(-1), v41[14].reshape(-1)])
    assert _sha(flat) == "ed542f58c4b3593c4120e899620231785b695dfc61bcc3d04b61b113abd9cf9e"


def test_head_primes_equal_the_spec_walk_on_random_configs():
    rng = np.random.default_rng(51)
    starts = [2, 3, 4, 5, 17, 100, 1 << 20, (1 << 20) - 3, 2**40 - 87, 10**12]
    for _ in range(120):
        n = int(rng.integers(2, 6))
        heads = int(rng.integers(1, 10))
        vocab = tuple(
            int(rng.choice(starts)) + int(rng.integers(0, 3000)) * int(rng.integers(0, 2))
            for _ in range(n - 1)
        )
        cfg = EngramConfig(
            vocab_per_ngram=tuple(min(v, 2**40) for v in vocab),
            max_ngram=n,
            n_head_per_ngram=heads,
            n_embed_per_ngram=heads,
            layer_ids=tuple(int(x) for x in rng.permutation(40)[: int(rng.integers(1, 7))]),
        )
        want, got = walk_primes(cfg), head_primes(cfg)
        assert list(got) == list(want), cfg
        for layer in want:
            np.testing.assert_array_equal(got[layer], want[layer], err_msg=str(cfg))


HEAD_PRIMES_TIME = r"""
import sys, time
from rowcache.embed.engram.config import EngramConfig, head_primes
layers, vocab = int(sys.argv[1]), int(sys.argv[2])
cfg = EngramConfig(vocab_per_ngram=(vocab,) * 3, max_ngram=4, n_head_per_ngram=64,
                   n_embed_per_ngram=1024, layer_ids=tuple(range(layers)))
t = time.perf_counter()
primes = head_primes(cfg)
print(sum(p.size for p in primes.values()), time.perf_counter() - t)
"""


@pytest.mark.parametrize("layers, vocab", [(200, 16_000_000), (1000, 16_000_000), (200, 2**40)])
def test_head_primes_of_a_thousand_layers_take_seconds_not_hours(layers, vocab):
    # 200 layers of 3 x 64 heads took 35 s, 1,000 layers more than 3 minutes (issue 51, 5).
    res = subprocess.run(
        [sys.executable, "-c", HEAD_PRIMES_TIME, str(layers), str(vocab)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    count, took = res.stdout.split()
    assert int(count) == layers * 192 and float(took) < 15, res.stdout


def test_a_config_of_more_heads_than_the_bound_is_refused_at_once():
    with pytest.raises(ConfigError, match=r"1,366 layers of 192 heads .* at most 262,144"):
        EngramConfig(
            vocab_per_ngram=(16_000_000,) * 3,
            max_ngram=4,
            n_head_per_ngram=64,
            n_embed_per_ngram=1024,
            layer_ids=tuple(range(1366)),
        )


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"max_ngram": 1}, "max_ngram"),
        ({"max_ngram": 17, "vocab_per_ngram": (9,) * 16}, "max_ngram"),
        ({"vocab_per_ngram": (10,)}, "one size per order"),
        ({"vocab_per_ngram": (10, 1)}, "vocab_per_ngram"),
        ({"n_embed_per_ngram": 100}, "divisible"),
        ({"layer_ids": (1, 1)}, "twice"),
        ({"layer_ids": ()}, "layer_ids"),
        ({"layer_ids": (-1,)}, "layer_ids"),
        ({"pad_id": True}, "pad_id"),
        ({"vocab_per_ngram": "ab"}, "sequence"),
        ({"vocab_per_ngram": (2**41, 5)}, "at most"),
        ({"n_head_per_ngram": 8192, "n_embed_per_ngram": 8192}, "at most 4096"),
    ],
)
def test_config_refusals(kw, match):
    with pytest.raises(ConfigError, match=match):
        EngramConfig(**kw)


def test_config_from_a_checkpoints_fields():
    cfg = EngramConfig.from_config(
        {
            "hidden_size": 4096,
            "engram_layer_ids": [1, 14],
            "engram_max_ngram_size": 4,
            "engram_n_heads": 8,
            "engram_head_dim": 32,
            "engram_vocab_size": [1000, 2000, 3000],
        }
    )
    assert cfg.layer_ids == (1, 14) and cfg.max_ngram == 4 and cfg.n_embed_per_ngram == 256
    assert cfg.vocab_per_ngram == (1000, 2000, 3000) and cfg.head_dim == 32
    assert set(cfg.defaults_used) == {"pad_id", "seed"}
    assert (
        EngramConfig.from_config({}).defaults_used
        and EngramConfig.from_config({}) == EngramConfig()
    )
    nested = EngramConfig.from_config({"engram_config": {"layer_ids": [2, 15], "seed": 3}})
    assert nested.layer_ids == (2, 15) and nested.seed == 3
    with pytest.raises(ConfigError, match=r"config\['engram_layer_ids'\]"):
        EngramConfig.from_config({"engram_layer_ids": [3, 3]})
    with pytest.raises(ConfigError, match="compresses to"):
        EngramHash(EngramConfig(compressed_vocab_size=5), CompressedVocab([0, 1, 2, 0]))


def test_tokens_outside_the_vocabulary_are_named(monkeypatch):
    h = EngramHash(EngramConfig(pad_id=0), CompressedVocab([0, 1, 2, 0]))
    with pytest.raises(ConfigError, match=r"tokens\[1, 1\] = 4 is outside"):
        h.hash([[0, 1], [2, 4]])
    with pytest.raises(ConfigError, match=r"context\[0, 2\] = -1 is outside"):
        h.hash([[0, 1]], context=[[0, 0, -1]])
    monkeypatch.setattr(host, "native", None)  # the reference path names it the same way
    with pytest.raises(ConfigError, match=r"tokens\[0, 1\] = -1 is outside"):
        h.hash([[0, -1]])
    with pytest.raises(ConfigError, match="integer"):
        h.hash([[0.5]])
    with pytest.raises(ConfigError, match="pad_id"):
        EngramHash(EngramConfig(pad_id=9), CompressedVocab([0, 1, 2, 0]))
    with pytest.raises(ConfigError, match="first appearance"):
        CompressedVocab([0, 2, 1])
    assert h.hash(np.zeros((2, 0), dtype=np.int64))[1].shape == (2, 0, 16)
    assert h.hash(np.zeros((0, 5), dtype=np.int64))[15].shape == (0, 5, 16)  # no sequences
    assert h.hash([])[1].shape == (1, 0, 16)  # an empty list is no tokens, not floats


def _small_tokenizer(path):
    """A 306-token word-level tokenizer.json at ``path`` (three spellings of "hello", a
    space, a newline): the compression rule in a few milliseconds instead of DeepSeek's
    129,280 ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(300)}
    vocab.update({"Hello": 300, "hello": 301, "HÉLLO": 302, " ": 303, "\n": 304, "[UNK]": 305})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return str(path)


def test_small_tokenizer_compresses_by_normalized_text(tmp_path):
    v = CompressedVocab.from_tokenizer(_small_tokenizer(tmp_path / "t.json"), cache_dir=tmp_path)
    assert v.tokenizer_size == 306 and len(v) == 303
    assert v.lookup[300] == v.lookup[301] == v.lookup[302]  # Hello, hello, HÉLLO
    assert v.lookup[303] == v.lookup[304]  # " " is kept as " "; "\n" alone becomes " " too
    assert list(v.lookup[:300]) == list(range(300))


def test_vocab_cache_is_kept_and_a_damaged_one_rebuilt(tmp_path):
    path = _small_tokenizer(tmp_path / "tokenizer.json")
    cache = tmp_path / "cache"
    v = CompressedVocab.from_tokenizer(path, cache_dir=cache)
    (kept,) = (cache / "engram-vocab").iterdir()
    data = bytearray(kept.read_bytes())
    data[100] ^= 0x10  # one bit of one id: the checksum refuses it, the map is rebuilt
    kept.write_bytes(bytes(data))
    np.testing.assert_array_equal(
        CompressedVocab.from_tokenizer(path, cache_dir=cache).lookup, v.lookup
    )
    assert kept.read_bytes() != bytes(data)  # and kept again, sound
    kept.write_bytes(b"")
    assert len(CompressedVocab.from_tokenizer(path, cache_dir=cache)) == len(v)


def test_vocab_cache_never_follows_a_link_or_waits_on_a_fifo(tmp_path):
    """In a child process with a timeout: a FIFO or a symlink where the kept map would be is
    not read (the map is built); an unwritable cache directory only skips the keeping."""
    tok = _small_tokenizer(tmp_path / "tokenizer.json")
    code = f"""
import os, pathlib
from rowcache.embed.engram.vocab import CompressedVocab
p = {tok!r}
root = pathlib.Path({str(tmp_path)!r})
v = CompressedVocab.from_tokenizer(p, cache_dir=root / "a")
(kept,) = (root / "a" / "engram-vocab").iterdir()
other = root / "elsewhere"; other.write_bytes(kept.read_bytes())
for kind in ("fifo", "link"):
    kept.unlink()
    os.mkfifo(kept) if kind == "fifo" else os.symlink(other, kept)
    w = CompressedVocab.from_tokenizer(p, cache_dir=root / "a")
    assert (w.lookup == v.lookup).all(), kind
blocked = root / "ro"; blocked.write_text("a file, not a directory")
assert len(CompressedVocab.from_tokenizer(p, cache_dir=blocked)) == len(v)
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_native_hash_refuses_bad_arguments_in_a_child():
    """The extension's own checks (once per call): never a signal, a ValueError each."""
    code = """
import numpy as np
from rowcache.kernels import host
E = host.native.EngramHasher
lk = np.arange(10, dtype=np.int64); m = np.ones((1, 3), np.int64) * 3
p = np.full((1, 4), 7, np.int64); x = np.zeros((2, 3), np.int64); o = np.empty((1, 2, 3, 4), np.int64)
c = np.zeros((2, 4), np.int64)
made = [
  (lk, m, p, 2),                                   # sound
  (lk, m, p, 3),                                   # heads disagree with primes
  (lk, m, np.full((1, 4), 1, np.int64), 2),        # a prime below 2
  (lk, m * 2**62, p, 2),                           # multipliers that wrap
  (lk + 5, m, p, 2),                               # lookup outside [0, V)
  (lk[:0], m, p, 2),                               # empty lookup
  (lk, m, p[:, :3], 2),                            # primes not [L, (N - 1) * heads]
  (lk, np.ones((1, 17), np.int64), np.full((1, 32), 7, np.int64), 2),  # max_ngram 17
]
calls = [
  (x, 2, c, 0, o),                                 # sound
  (x, 3, c, 0, o),                                 # B does not divide tokens
  (x, 2, c[:, :1].ravel()[:1], 0, o),              # B does not divide context
  (x, 2, c, 10, o),                                # pad outside the vocabulary
  (x + 10, 2, c, 0, o),                            # tokens outside the vocabulary
  (x - 1, 2, None, 0, o),                          # negative tokens
  (x, 2, c - 1, 0, o),                             # context read outside the vocabulary
  (x, 2, c, 0, o[:, :1]),                          # out too small
  (x, 0, c, 0, o),                                 # B = 0
]
res = []
for c in made:
    try:
        E(*c); res.append("ok")
    except ValueError:
        res.append("ValueError")
h = E(*made[0])
for c in calls:
    try:
        h.hash(*c); res.append("ok")
    except ValueError:
        res.append("ValueError")
try:
    E.__new__(E).hash(x, 2, None, 0, o); res.append("ok")
except ValueError:
    res.append("ValueError")
print(",".join(res))
"""
    if host.native is None:
        pytest.skip("no native module")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().split(",") == ["ok"] + ["ValueError"] * 7 + ["ok"] + ["ValueError"] * 9


def test_native_hash_names_the_token_outside_the_vocabulary():
    """Where the native call is used directly: the token read, in tokens or in the context's
    columns read (all of a context as long as the look-back; its last columns of a longer one;
    columns not read are not checked)."""
    if host.native is None:
        pytest.skip("no native module")
    hasher = host.native.EngramHasher(np.arange(10), np.full((1, 3), 3), np.full((1, 4), 7), 2)
    x, o = np.zeros((2, 3), np.int64), np.empty((1, 2, 3, 4), np.int64)
    cases = [
        ([[0, 0], [0, 10]], r"context\[1, 1\] = 10 is outside the vocabulary \[0, 10\)"),
        ([[0, 0, 0], [0, -1, 0]], r"context\[1, 1\] = -1 is outside"),
        ([[0, 0, 0], [-1, 0, 0]], None),  # column 0 is not read: max_ngram - 1 = 2 are
    ]
    for c, match in cases:
        if match is None:
            hasher.hash(x, 2, np.array(c), 0, o)
            continue
        with pytest.raises(ValueError, match=match):
            hasher.hash(x, 2, np.array(c), 0, o)
    with pytest.raises(ValueError, match=r"tokens\[1, 2\] = 12 is outside"):
        hasher.hash(np.array([[0, 0, 0], [0, 0, 12]]), 2, None, 0, o)


def test_no_engram_state_leaks_between_hashes():
    rng = np.random.default_rng(9)
    cfg, vocab = _random_case(rng, 3, 2, 1, 1000)
    h = EngramHash(cfg, vocab)
    t = rng.integers(0, vocab.tokenizer_size, (1, 20))
    a = h.hash(t)
    h.hash(rng.integers(0, vocab.tokenizer_size, (4, 100)))
    for layer, ids in h.hash(t).items():
        np.testing.assert_array_equal(ids, a[layer])
