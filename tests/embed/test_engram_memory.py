"""EngramMemory (issue 40, part 2): every Engram layer's rows through resident tables and
through a store and a row cache, cached == resident bit for bit, with prefetch."""

from __future__ import annotations

import numpy as np
import pytest

from rowcache import NgramRowCache, build_store
from rowcache.cache.config import Tuning
from rowcache.embed.engram.config import EngramConfig
from rowcache.embed.engram.hash import EngramContext, EngramHash
from rowcache.embed.engram.memory import EngramMemory
from rowcache.embed.engram.vocab import CompressedVocab
from rowcache.embed.tables import Bf16Table, CachedTable, Fp8Table
from rowcache.errors import ConfigError
from rowcache.kernels.reference import BF16

CFG = EngramConfig(
    vocab_per_ngram=(40, 70, 30),
    max_ngram=4,
    n_embed_per_ngram=24,
    n_head_per_ngram=3,
    layer_ids=(1, 5),
    pad_id=0,
)


def _setup(tmp_path, dtype="bf16", shared=True, slots=None, device="cpu", row_map="auto"):
    """Two layers' tables (~620 rows each) in a store; the cached memory's arena holds one
    step's rows of both layers (3 x 12 tokens x 9 heads x 2) but not every row; ``row_map``:
    the caches' host row maps (rowcache.cache.row_map)."""
    tuning = Tuning(row_map=row_map)
    rng = np.random.default_rng(0)
    lookup = np.empty(500, dtype=np.int64)
    keys: dict[int, int] = {}
    for t, k in enumerate(rng.integers(0, 300, 500)):
        lookup[t] = keys.setdefault(int(k), len(keys))
    h = EngramHash(CFG, CompressedVocab(lookup))
    arrays = {
        f"engram.{layer}": rng.standard_normal((h.table_rows(layer), CFG.head_dim)).astype(BF16)
        for layer in CFG.layer_ids
    }
    store = build_store(str(tmp_path / "store"), arrays, dtype=dtype, progress=False)
    names = list(arrays)
    if slots == "all":
        slots = sum(h.table_rows(layer) for layer in CFG.layer_ids)
    if shared:
        cache = NgramRowCache.assemble(store, names, slots=slots or 700, device=device,
                                       tuning=tuning)  # fmt: skip
        cached = {layer: CachedTable(cache, i) for i, layer in enumerate(CFG.layer_ids)}
    else:
        cached = {
            layer: CachedTable(
                NgramRowCache.assemble(store, name, slots=slots or 360, device=device, tuning=tuning)
            )
            for layer, name in zip(CFG.layer_ids, names)
        }
    if dtype == "fp8":
        resident = {layer: Fp8Table.quantize(arrays[f"engram.{layer}"]) for layer in CFG.layer_ids}
    else:
        resident = {layer: Bf16Table(arrays[f"engram.{layer}"]) for layer in CFG.layer_ids}
    if device == "cuda":
        resident = {layer: t.to("cuda") for layer, t in resident.items()}
    return h, arrays, EngramMemory(h, resident), EngramMemory(h, cached), store


def _bits(x):
    return np.asarray(x.get() if hasattr(x, "get") else x).view(np.uint16)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("shared,row_map", [(True, "dense"), (True, "hash"), (False, "hash")])
def test_cached_equals_resident_over_a_prefill_and_decode(tmp_path, dtype, shared, row_map):
    h, _, resident, cached, _ = _setup(tmp_path, dtype, shared, row_map=row_map)
    assert {t.cache.row_map_kind for t in cached.tables.values()} == {row_map}
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 500, (3, 60))
    ctx_r, ctx_c = EngramContext(h, 3), EngramContext(h, 3)
    steps = [(0, 12), (12, 13), (13, 14), (14, 26), (26, 38), (38, 50), (50, 60)]
    for k, (a, b) in enumerate(steps):
        piece = tokens[:, a:b]
        kept_r, kept_c = ctx_r.kept, ctx_c.kept
        pf = cached.prefetch(piece, kept_c) if k % 2 == 0 else None  # odd steps fault
        for layer in CFG.layer_ids:
            want = resident.lookup(layer, piece, kept_r)
            got = cached.lookup(layer, piece, kept_c)
            assert got.shape == (3, b - a, CFG.output_dim) and got.dtype == BF16
            np.testing.assert_array_equal(_bits(got), _bits(want))
        if pf is not None:
            assert pf.wait(30) and pf.exception() is None
        cached.end_step()
        ctx_r.step(piece)
        ctx_c.step(piece)
    stats = [t.cache.stats() for t in cached.tables.values()]
    assert sum(s.misses for s in stats) > 0 and sum(s.prefetched for s in stats) > 0
    assert sum(s.evictions for s in stats) > 0  # the arena holds a step, not every row


def test_e_is_each_heads_row_concatenated(tmp_path):
    h, arrays, resident, _, _ = _setup(tmp_path)
    tokens = np.array([[5, 9, 100, 7]])
    ids = h.hash(tokens)
    for layer in CFG.layer_ids:
        e = resident.lookup(layer, tokens)
        table = arrays[f"engram.{layer}"]
        rows = ids[layer][0] + h.head_offsets(layer)  # [T, K]
        want = table[rows].reshape(4, -1)
        np.testing.assert_array_equal(e[0].view(np.uint16), want.view(np.uint16))


def test_prefetch_then_lookup_faults_nothing_more(tmp_path):
    _, _, _, cached, _ = _setup(tmp_path, slots="all")
    tokens = np.random.default_rng(2).integers(0, 500, (2, 20))
    cache = cached.tables[1].cache
    pf = cached.prefetch(tokens)
    assert pf.wait(30) and pf.rows > 0 and pf.dropped == 0
    before = cache.stats()
    for layer in CFG.layer_ids:
        cached.lookup(layer, tokens)
    cached.end_step()
    after = cache.stats()
    assert after.misses == before.misses and after.hits > before.hits


def test_empty_steps(tmp_path):
    _, _, resident, cached, _ = _setup(tmp_path)
    for mem in (resident, cached):
        for shape in ((2, 0), (0, 3)):
            mem.prefetch(np.zeros(shape, dtype=np.int64)).wait(10)
            e = mem.lookup(1, np.zeros(shape, dtype=np.int64))
            assert e.shape == (*shape, CFG.output_dim)
        mem.end_step()


def test_lookup_into_out_and_refusals(tmp_path):
    h, _, resident, _, _ = _setup(tmp_path)
    tokens = np.array([[1, 2, 3]])
    out = np.zeros((1, 3, CFG.output_dim), dtype=BF16)
    got = resident.lookup(5, tokens, out=out)
    assert got is out
    np.testing.assert_array_equal(out.view(np.uint16), resident.lookup(5, tokens).view(np.uint16))
    with pytest.raises(ConfigError, match="out: give shape"):
        resident.lookup(5, tokens, out=out[:, :2])
    with pytest.raises(ConfigError, match="holds no Engram memory"):
        resident.lookup(2, tokens)
    t1 = resident.tables[1]
    with pytest.raises(ConfigError, match="missing \\[5\\]"):
        EngramMemory(h, {1: t1})
    with pytest.raises(ConfigError, match="not Engram layers: \\[7\\]"):
        EngramMemory(h, {1: t1, 5: resident.tables[5], 7: t1})
    with pytest.raises(ConfigError, match="layer 5's heads need"):
        EngramMemory(h, {1: t1, 5: t1})
    with pytest.raises(ConfigError, match="Fp8BlockScaleTable, CachedTable; got ndarray"):
        EngramMemory(h, {1: t1, 5: np.zeros((3, 3))})


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,row_map", [("bf16", "dense"), ("fp8", "hash")])
def test_cached_equals_resident_on_the_gpu(tmp_path, dtype, row_map):
    h, _, resident, cached, _ = _setup(tmp_path, dtype, shared=True, device="cuda", row_map=row_map)
    rng = np.random.default_rng(3)
    ctx_r, ctx_c = EngramContext(h, 4), EngramContext(h, 4)
    for T in (9, 1, 1, 8):  # 4 x 9 tokens x 9 heads x 2 layers = 648 rows <= 700 slots
        piece = rng.integers(0, 500, (4, T))
        pf = cached.prefetch(piece, ctx_c.kept)
        for layer in CFG.layer_ids:
            want = resident.lookup(layer, piece, ctx_r.kept)
            got = cached.lookup(layer, piece, ctx_c.kept)
            assert type(got).__module__.startswith("cupy")
            np.testing.assert_array_equal(_bits(got), _bits(want))
        pf.wait()
        cached.end_step()
        ctx_r.step(piece)
        ctx_c.step(piece)


def test_a_step_reuses_its_prefetch_hash_across_the_next_steps_prefetch(tmp_path):
    h, _, resident, cached, _ = _setup(tmp_path)
    rng = np.random.default_rng(5)
    a, b = rng.integers(0, 500, (2, 6)), rng.integers(0, 500, (2, 6))
    calls = []
    real = h.hash

    def counting(tokens, context=None, **kw):
        calls.append(np.asarray(tokens).shape)
        return real(tokens, context, **kw)

    h.hash = counting  # the instance's method, counted (resident uses the same hash)
    try:
        cached.prefetch(a)
        cached.prefetch(b, a[:, -h.keep :])  # the next chunk, one step ahead
        got = [cached.lookup(layer, a) for layer in CFG.layer_ids]
        assert len(calls) == 2  # a's rows came from its prefetch's hash
        for layer, g in zip(CFG.layer_ids, got):
            np.testing.assert_array_equal(_bits(g), _bits(resident.lookup(layer, a)))
    finally:
        del h.hash
    cached.end_step()


def test_engram_store_streams_from_a_safetensors_checkpoint(tmp_path):
    """The layers' tables as a checkpoint holds them (the reference module's
    ``multi_head_embedding.embedding.weight`` per Engram layer, float32 here) are streamed by
    ``build_store`` from the file, and serve the same rows as the arrays."""
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    h, arrays, resident, _, _ = _setup(tmp_path)
    ckpt = tmp_path / "model.safetensors"
    names = {
        layer: f"layers.{layer}.engram.multi_head_embedding.embedding.weight"
        for layer in CFG.layer_ids
    }
    safetensors_numpy.save_file(
        {names[layer]: arrays[f"engram.{layer}"].astype(np.float32) for layer in CFG.layer_ids},
        str(ckpt),
    )
    store = build_store(
        str(tmp_path / "from-ckpt"),
        {f"engram.{layer}": (str(ckpt), names[layer]) for layer in CFG.layer_ids},
        progress=False,
    )
    cache = NgramRowCache(store, [f"engram.{layer}" for layer in CFG.layer_ids], slots=700)
    mem = EngramMemory(h, {layer: CachedTable(cache, i) for i, layer in enumerate(CFG.layer_ids)})
    tokens = np.random.default_rng(6).integers(0, 500, (2, 9))
    for layer in CFG.layer_ids:
        np.testing.assert_array_equal(
            _bits(mem.lookup(layer, tokens)), _bits(resident.lookup(layer, tokens))
        )
    mem.end_step()
