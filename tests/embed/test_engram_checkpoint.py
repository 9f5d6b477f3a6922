"""load_engram_memory: an Engram checkpoint (config.json, tokenizer.json, one table a layer
in safetensors) served from resident tables or from a store built from it, the same rows."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rowcache.embed.engram.checkpoint import load_engram_memory
from rowcache.embed.engram.config import EngramConfig
from rowcache.embed.engram.hash import EngramHash
from rowcache.embed.engram.vocab import CompressedVocab
from rowcache.errors import ConfigError
from tests.embed.test_engram_hash import _small_tokenizer

safetensors_numpy = pytest.importorskip("safetensors.numpy")

CONFIG = {
    "hidden_size": 64,
    "engram_layer_ids": [1, 3],
    "engram_max_ngram_size": 3,
    "engram_n_heads": 2,
    "engram_head_dim": 8,
    "engram_vocab_size": [60, 90],
    "engram_pad_token_id": 0,
}
NAME = "model.layers.{}.engram.multi_head_embedding.embedding.weight"


def _checkpoint(tmp_path, shape_of=None):
    tok = _small_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    h = EngramHash(EngramConfig.from_config(CONFIG), CompressedVocab.from_tokenizer(tok))
    rng = np.random.default_rng(0)
    arrays = {}
    for layer in (1, 3):
        shape = (shape_of or {}).get(layer, (h.table_rows(layer), 8))
        arrays[NAME.format(layer)] = rng.standard_normal(shape).astype(np.float32)
    safetensors_numpy.save_file(arrays, str(tmp_path / "model.safetensors"))
    return h, arrays


def test_cached_equals_resident_and_the_store_is_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("ROWCACHE_CACHE_DIR", str(tmp_path / "cache"))
    h, arrays = _checkpoint(tmp_path)
    resident = load_engram_memory(tmp_path, cached=False)
    cached = load_engram_memory(tmp_path, slots=200, progress=False)
    assert (tmp_path / "rowcache-engram-bf16").is_dir()
    tokens = np.random.default_rng(1).integers(0, 306, (2, 7))
    for layer in (1, 3):
        want = resident.lookup(layer, tokens)
        np.testing.assert_array_equal(
            cached.lookup(layer, tokens).view(np.uint16), want.view(np.uint16)
        )
        rows = h.hash(tokens)[layer] + h.head_offsets(layer)
        from rowcache.kernels.reference import BF16

        direct = arrays[NAME.format(layer)].astype(BF16)[rows].reshape(2, 7, -1)
        np.testing.assert_array_equal(want.view(np.uint16), direct.view(np.uint16))
    cached.end_step()
    again = load_engram_memory(tmp_path / "model.safetensors", slots=200, progress=False)
    assert again.tables[1].cache.store.path == cached.tables[1].cache.store.path  # reused
    with pytest.raises(ConfigError, match=r"does not hold engram\.1 as .* fp8"):
        load_engram_memory(tmp_path, dtype="fp8", store=tmp_path / "rowcache-engram-bf16")


def test_refusals_name_the_layer_and_the_tensor(tmp_path, monkeypatch):
    monkeypatch.setenv("ROWCACHE_CACHE_DIR", str(tmp_path / "cache"))
    _checkpoint(tmp_path, shape_of={3: (10, 8)})
    with pytest.raises(
        ConfigError, match=r"'model.layers.3.engram.*' is \[10, 8\]; Engram layer 3 needs"
    ):
        load_engram_memory(tmp_path, cached=False)
    with pytest.raises(ConfigError, match=r"no table for Engram layer\(s\) \[1, 3\]"):
        load_engram_memory(tmp_path, table_pattern=r"nothing\.(\d+)")
    with pytest.raises(ConfigError, match="arena_fraction"):
        load_engram_memory(tmp_path, arena_fraction=0)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"no config\.json"):
        load_engram_memory(tmp_path)
