"""The LongCat checkpoint loader on small synthetic .safetensors checkpoints."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from rowcache.embed.checkpoint import Checkpoint, load_ngram_embedding, table_sources
from rowcache.embed.layer import NgramEmbedding
from rowcache.embed.ngram.dims import NgramDims
from rowcache.embed.tables import Fp8Table
from rowcache.errors import ConfigError
from rowcache.kernels.reference import BF16

DIMS = NgramDims(vocab_size=500, hidden_size=32, max_ngram=3, splits=2, ratio=1.5, eos_token_id=2)
_ST = {np.dtype(BF16): "BF16", np.dtype(np.float32): "F32"}


def _save(path, tensors):
    """A minimal .safetensors writer: 8-byte header length, JSON header, raw data."""
    header, blobs, off = {}, [], 0
    for name, arr in tensors.items():
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {
            "dtype": _ST[arr.dtype],
            "shape": list(arr.shape),
            "data_offsets": [off, off + len(raw)],
        }
        blobs.append(raw)
        off += len(raw)
    head = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def _weights(rng):
    T, d, D = DIMS.num_tables, DIMS.table_dim, DIMS.hidden_size
    bf = lambda a: (a * 0.05).astype(np.float32).astype(BF16)  # noqa: E731
    word = bf(rng.standard_normal((DIMS.vocab_size, D)))
    tables = [bf(rng.standard_normal((DIMS.table_rows(i), d))) for i in range(T)]
    projs = [bf(rng.standard_normal((D, d)) * 4) for _ in range(T)]
    return word, tables, projs


def _tensors(word, tables, projs, word_name="model.embed_tokens.weight"):
    t = {word_name: word, "model.norm.weight": np.ones(DIMS.hidden_size, np.float32)}
    for i, (e, w) in enumerate(zip(tables, projs)):
        t[f"model.ngram_embeddings.embedders.{i}.weight"] = e
        t[f"model.ngram_embeddings.post_projs.{i}.weight"] = w
    return t


def _bits(a):
    return np.asarray(a).view(np.uint16)


def _ctx(rng):
    x = rng.integers(0, DIMS.vocab_size, size=120)
    x[::17] = DIMS.eos_token_id
    return x


def test_checkpoint_single_file_with_config(rng, tmp_path):
    word, tables, projs = _weights(rng)
    _save(tmp_path / "model.safetensors", _tensors(word, tables, projs))
    (tmp_path / "config.json").write_text(json.dumps({**DIMS.to_config(), "num_layers": 14}))
    emb = load_ngram_embedding(tmp_path / "model.safetensors")
    assert emb.dims == DIMS
    x = _ctx(rng)
    want = NgramEmbedding(DIMS, word, tables, projs).embed(x, 100)
    np.testing.assert_array_equal(_bits(emb.embed(x, 100)), _bits(want))


def test_checkpoint_sharded_index_mlx_name_and_fp8(rng, tmp_path):
    word, tables, projs = _weights(rng)
    t = _tensors(word, tables, projs, word_name="model.ngram_embeddings.word_embeddings.weight")
    names = sorted(t)
    parts = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    weight_map = {}
    for fn, keys in parts.items():
        _save(tmp_path / fn, {k: t[k] for k in keys})
        weight_map.update(dict.fromkeys(keys, fn))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ckpt = Checkpoint(tmp_path)
    assert ckpt.word_name() == "model.ngram_embeddings.word_embeddings.weight"
    x = _ctx(rng)
    emb = load_ngram_embedding(ckpt, dims=DIMS, table_dtype="fp8")
    want = NgramEmbedding(DIMS, word, [Fp8Table.quantize(e) for e in tables], projs).embed(x, 120)
    np.testing.assert_array_equal(_bits(emb.embed(x, 120)), _bits(want))
    # a directory without an index: every shard's header is read
    (tmp_path / "model.safetensors.index.json").unlink()
    assert Checkpoint(tmp_path).files.keys() == t.keys()


def test_checkpoint_tables_behind_caches(rng, tmp_path):
    from rowcache.cache.row_cache import NgramRowCache
    from rowcache.store.builder import build_store

    word, tables, projs = _weights(rng)
    _save(tmp_path / "m.safetensors", _tensors(word, tables, projs))
    src = table_sources(tmp_path / "m.safetensors", DIMS, tables=[2, 3])
    assert src["3"] == (
        str(tmp_path / "m.safetensors"),
        "model.ngram_embeddings.embedders.3.weight",
    )
    store = build_store(tmp_path / "store", src, progress=False)
    try:
        caches = {i: NgramRowCache(store, str(i), slots=200) for i in (2, 3)}
        emb = load_ngram_embedding(tmp_path / "m.safetensors", dims=DIMS, caches=caches)
        assert [t.kind for t in emb.tables] == ["bf16", "bf16", "cached", "cached"]
        resident = NgramEmbedding(DIMS, word, tables, projs)
        x = _ctx(rng)
        for a in range(0, 120, 30):
            c = x[max(0, a - 2) : a + 30]
            np.testing.assert_array_equal(_bits(emb.embed(c, 30)), _bits(resident.embed(c, 30)))
        assert caches[2].stats().misses > 0
    finally:
        store.close()


def test_checkpoint_errors(rng, tmp_path):
    word, tables, projs = _weights(rng)
    t = _tensors(word, tables, projs)
    _save(tmp_path / "m.safetensors", t)
    with pytest.raises(ConfigError, match=r"config\.json"):
        load_ngram_embedding(tmp_path / "m.safetensors")
    wrong = NgramDims(
        vocab_size=500, hidden_size=32, max_ngram=3, splits=2, ratio=2, eos_token_id=2
    )
    with pytest.raises(
        ConfigError, match=r"embedders.0.weight has shape \[751, 8\], expected \[1001, 8\]"
    ):
        load_ngram_embedding(tmp_path / "m.safetensors", dims=wrong)
    del t["model.ngram_embeddings.post_projs.3.weight"]
    _save(tmp_path / "n.safetensors", t)
    with pytest.raises(
        ConfigError, match=r"no tensor 'model\.ngram_embeddings\.post_projs\.3\.weight'"
    ):
        load_ngram_embedding(tmp_path / "n.safetensors", dims=DIMS)
    with pytest.raises(ConfigError, match="neither"):
        Checkpoint(tmp_path / "missing.safetensors")
    with pytest.raises(ConfigError, match="table_dtype"):
        load_ngram_embedding(tmp_path / "m.safetensors", dims=DIMS, table_dtype="int4")
    with pytest.raises(ConfigError, match="caches keys"):
        load_ngram_embedding(tmp_path / "m.safetensors", dims=DIMS, caches={7: None})
