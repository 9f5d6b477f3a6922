"""Tables of the ``fp8_table_scale`` codec: the resident ``Fp8TableScaleTable``, a cache
over such a store (``CachedTable`` dispatching on the cache's codec) step after step with
evictions, a shared arena over tables of different scales, and the fused n-gram step's
refusal. GPU tests marked ``gpu``."""

from __future__ import annotations

import numpy as np
import pytest

import rowcache
from rowcache.cache.row_cache import NgramRowCache
from rowcache.embed.layer import NgramEmbedding
from rowcache.embed.tables import Bf16Table, CachedTable, Fp8TableScaleTable
from rowcache.errors import ConfigError
from rowcache.kernels.ngram.stacked import StackedTables
from rowcache.kernels.reference import BF16, dequantize_fp8_table_scale_reference
from rowcache.store.sources import Fp8TableScaleSource
from tests.embed.support import DIMS, random_weights

SCALES = (np.array(0x3B8C, np.uint16).view(BF16), np.array(0xC2F0, np.uint16).view(BF16))


def bits(a):
    host = a.get() if hasattr(a, "get") else np.asarray(a)
    return host.view(np.uint16)


def codes_table(rng, rows, dim):
    c = rng.integers(0, 256, size=(rows, dim), dtype=np.uint8)
    c[(c & 0x7F) == 0x7F] &= 0xFE
    c[0, :4] = [0x01, 0x81, 0x00, 0x80]  # subnormal codes and signed zeros
    return c


def expected(codes, scale, ids):
    return dequantize_fp8_table_scale_reference(codes[np.asarray(ids)], scale)


def test_resident_table_gathers_by_the_codec_rule(rng):
    codes = codes_table(rng, 400, 160)
    codes[5, 7] = 0x7F  # a NaN code gathers as NaN
    tab = Fp8TableScaleTable(codes, SCALES[0])
    assert (tab.rows, tab.dim, tab.device, tab.nbytes, tab.kind) == (
        400,
        160,
        "cpu",
        codes.nbytes,
        "fp8_table_scale",
    )
    ids = rng.integers(0, 400, size=300)
    ids[0] = 5
    got = tab.gather(ids)
    np.testing.assert_array_equal(bits(got), bits(expected(codes, SCALES[0], ids)))
    assert np.isnan(float(got[0, 7]))
    out = np.zeros((300, 320), BF16)
    tab.gather(ids, out[:, 160:])
    np.testing.assert_array_equal(bits(out[:, 160:]), bits(got))
    assert tab.to("cpu") is tab
    assert bits(tab.scale).item() == 0x3B8C
    e4m3 = Fp8TableScaleTable(codes.view("float8_e4m3fn"), float(SCALES[0]))
    np.testing.assert_array_equal(bits(e4m3.gather(ids)), bits(got))


@pytest.mark.parametrize(
    ("codes", "scale", "match"),
    [
        (np.zeros((4, 4), np.float32), 1.0, "uint8\\[rows, dim\\]"),
        (np.zeros(4, np.uint8), 1.0, "uint8\\[rows, dim\\]"),
        (np.zeros((4, 4), np.uint8), float("inf"), "must be finite"),
        (np.zeros((4, 4), np.uint8), float("nan"), "must be finite"),
        (np.zeros((4, 4), np.uint8), 0.3, "not a bfloat16 value"),
        (np.zeros((4, 4), np.uint8), np.ones(3, np.float32), "one bfloat16 value"),
    ],
)
def test_resident_table_refuses_bad_input(codes, scale, match):
    with pytest.raises(ConfigError, match=match) as e:
        Fp8TableScaleTable(codes, scale)
    assert "\n" not in str(e.value)


def _store(tmp_path, tables, **kw):
    return rowcache.build_store(
        tmp_path / "s",
        {name: Fp8TableScaleSource(c, s) for name, (c, s) in tables.items()},
        progress=False,
        **kw,
    )


def _cache_steps(rng, cached, resident, rows, steps=25, n=180):
    for _ in range(steps):
        ids = rng.integers(0, rows, size=n)
        ids[::9] = ids[0]
        got = cached.gather(ids)
        cached.end_step()
        np.testing.assert_array_equal(bits(got), bits(resident.gather(ids)))


def test_cache_over_a_table_scale_store_gathers_the_rule_step_after_step(rng, tmp_path):
    codes = codes_table(rng, 3000, 160)
    store = _store(tmp_path, {"t": (codes, SCALES[0])})
    try:
        cache = NgramRowCache(store, "t", slots=500)
        assert cache.table.dtype == np.uint8 and cache.table.shape == (500, 160)
        assert cache.scales is None  # the scale is the table's, not a slot's
        cached = CachedTable(cache)
        assert cached.nbytes == 500 * 160
        resident = Fp8TableScaleTable(codes, SCALES[0])
        _cache_steps(rng, cached, resident, 3000)
        s = cached.stats()
        assert s.misses > 0 and s.evictions > 0
        # the arena holds the codes verbatim: its slots of a step are the store's rows
        ids = np.arange(100, 300)
        slots = cached.resolve(ids)
        np.testing.assert_array_equal(cache.table[slots], codes[ids])
        cached.end_step()
    finally:
        store.close()


def test_shared_cache_applies_each_parts_scale(rng, tmp_path):
    a, b = codes_table(rng, 900, 32), codes_table(rng, 700, 32)
    store = _store(tmp_path, {"a": (a, SCALES[0]), "b": (b, SCALES[1])})
    try:
        shared = NgramRowCache(store, ["a", "b"], slots=400)
        for k, (codes, scale) in enumerate(((a, SCALES[0]), (b, SCALES[1]))):
            _cache_steps(
                rng,
                CachedTable(shared, k),
                Fp8TableScaleTable(codes, scale),
                codes.shape[0],
                8,
                150,
            )
    finally:
        store.close()


def test_the_fused_ngram_step_refuses_table_scaled_codes(rng, tmp_path):
    codes = codes_table(rng, 50, 8)
    with pytest.raises(ConfigError, match="fp8_table_scale") as e:
        StackedTables([Fp8TableScaleTable(codes, 1.0).arrays])
    assert "\n" not in str(e.value)
    word, tables, projs = random_weights(rng)
    mixed = [Bf16Table(t) for t in tables]
    shape = tables[0].shape
    # resident: NgramEmbedding's own check of its tables' kinds
    mixed[0] = Fp8TableScaleTable(rng.integers(0, 0x7E, size=shape, dtype=np.uint8), 1.0)
    with pytest.raises(ConfigError, match="got Fp8TableScaleTable"):
        NgramEmbedding(DIMS, word, mixed, projs)
    # cached: a CachedTable passes that check; the fused step's StackedTables refuses it
    store = _store(tmp_path, {"t": (rng.integers(0, 0x7E, size=shape, dtype=np.uint8), 1.0)})
    try:
        mixed[0] = CachedTable(NgramRowCache(store, "t", slots=64))
        with pytest.raises(ConfigError, match="fp8_table_scale"):
            NgramEmbedding(DIMS, word, mixed, projs)
    finally:
        store.close()


@pytest.mark.gpu
@pytest.mark.parametrize("arena", ["device", "host"])
def test_gpu_cache_and_resident_gather_the_same(rng, tmp_path, arena):
    import cupy as cp

    codes = codes_table(rng, 3000, 160)
    codes[7, :2] = [0x7F, 0xFF]  # NaN codes stored as asked, gathered as NaN by both
    store = _store(tmp_path, {"t": (codes, SCALES[1])}, allow_nonfinite=True)
    try:
        cached = CachedTable(NgramRowCache(store, "t", slots=400, device="cuda", arena=arena))
        resident = Fp8TableScaleTable(codes, SCALES[1]).to("cuda")
        assert resident.device == "cuda" and isinstance(resident.codes, cp.ndarray)
        for _ in range(20):
            ids = rng.integers(0, 3000, size=200)
            ids[0] = 7
            got = cached.gather(ids)
            cp.cuda.get_current_stream().synchronize()
            cached.end_step()
            want = expected(codes, SCALES[1], ids)
            np.testing.assert_array_equal(bits(got), bits(want))
            np.testing.assert_array_equal(bits(resident.gather(cp.asarray(ids))), bits(want))
        assert cached.stats().evictions > 0
    finally:
        store.close()


def test_prefetched_rows_gather_the_rule(rng, tmp_path):
    """Rows a prefetch read in (the prefetcher's scatter, not the fault's) gather the same."""
    codes = codes_table(rng, 2000, 48)
    store = _store(tmp_path, {"t": (codes, SCALES[1])})
    try:
        cache = NgramRowCache(store, "t", slots=300)
        cached = CachedTable(cache)
        for _ in range(5):
            ids = rng.integers(0, 2000, size=250)
            cache.prefetch(ids).wait()
            cache.stats(reset=True)
            got = cached.gather(ids)
            cached.end_step()
            assert cache.stats().misses == 0  # every row came from the prefetch
            np.testing.assert_array_equal(bits(got), bits(expected(codes, SCALES[1], ids)))
    finally:
        store.close()
