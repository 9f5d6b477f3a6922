"""Tables of the ``fp8_block_e8m0`` codec: the resident ``Fp8BlockScaleTable`` (two tensors, as
the checkpoint ships them), a cache over such a store (its arena holds whole records: codes,
then scale bytes) step after step with evictions, rows read by prefetch, a shared arena (and
its refusal of two block sizes), and the fused n-gram step's refusal. GPU tests marked ``gpu``:
the cache's arena in device and in mapped host memory, and the resident table on the device,
against the NumPy reference bit for bit."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import rowcache
from rowcache.cache.row_cache import NgramRowCache
from rowcache.embed.tables import CachedTable, Fp8BlockScaleTable
from rowcache.errors import ConfigError
from rowcache.kernels.ngram.stacked import StackedTables
from rowcache.kernels.reference import BF16, BF16_NAN_BITS, dequantize_fp8_block_reference
from rowcache.store.sources import Fp8BlockScaleSource


def bits(a):
    host = a.get() if hasattr(a, "get") else np.asarray(a)
    return host.view(np.uint16)


def block_table(rng, rows, dim=256, block=32, nan=False):
    codes = rng.integers(0, 256, size=(rows, dim), dtype=np.uint8)
    scales = rng.integers(0, 256 if nan else 255, size=(rows, dim // block), dtype=np.uint8)
    if not nan:
        codes[(codes & 0x7F) == 0x7F] &= 0xFE
    codes[0, :4] = [0x01, 0x81, 0x00, 0x80]  # subnormal codes and signed zeros
    scales[0, 0] = 0  # 2**-127
    return codes, scales


def expected(codes, scales, ids):
    ids = np.asarray(ids)
    return dequantize_fp8_block_reference(codes[ids], scales[ids])


def test_resident_table_gathers_by_the_codec_rule(rng):
    codes, scales = block_table(rng, 400, nan=True)
    scales[5, 2] = 255  # a NaN scale byte: its block of 32 values is NaN
    tab = Fp8BlockScaleTable(codes, scales)
    assert (tab.rows, tab.dim, tab.block_size, tab.device, tab.nbytes, tab.kind) == (
        400,
        256,
        32,
        "cpu",
        codes.nbytes + scales.nbytes,
        "fp8_block_e8m0",
    )
    ids = rng.integers(0, 400, size=300)
    ids[0] = 5
    got = tab.gather(ids)
    np.testing.assert_array_equal(bits(got), bits(expected(codes, scales, ids)))
    assert (bits(got)[0, 64:96] == BF16_NAN_BITS).all()
    out = np.zeros((300, 512), BF16)
    tab.gather(ids, out[:, 256:])
    np.testing.assert_array_equal(bits(out[:, 256:]), bits(got))
    assert tab.to("cpu") is tab
    typed = Fp8BlockScaleTable(
        codes.view(ml_dtypes.float8_e4m3fn), scales.view(ml_dtypes.float8_e8m0fnu), 32
    )
    np.testing.assert_array_equal(bits(typed.gather(ids)), bits(got))


@pytest.mark.parametrize(
    ("codes", "scales", "block", "match"),
    [
        (np.zeros((4, 64), np.float32), np.zeros((4, 2), np.uint8), None, r"uint8\[rows, dim\]"),
        (np.zeros((4, 64), np.uint8), np.zeros((3, 2), np.uint8), None, r"uint8\[4, dim / block\]"),
        (np.zeros((4, 64), np.uint8), np.zeros(4, np.uint8), None, r"uint8\[4, dim / block\]"),
        (np.zeros((4, 64), np.uint8), np.zeros((4, 3), np.uint8), None, "dividing the rows' 64"),
        (np.zeros((4, 64), np.uint8), np.zeros((4, 2), np.uint8), 16, "blocks of 16 need 4"),
        (np.zeros((4, 64), np.uint8), np.zeros((4, 2), np.float32), None, "uint8"),
    ],
)
def test_resident_table_refuses_bad_input(codes, scales, block, match):
    with pytest.raises(ConfigError, match=match) as e:
        Fp8BlockScaleTable(codes, scales, block)
    assert "\n" not in str(e.value)


def _store(tmp_path, tables, **kw):
    return rowcache.build_store(
        tmp_path / "s",
        {name: Fp8BlockScaleSource(c, s) for name, (c, s) in tables.items()},
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


def test_cache_over_a_block_scale_store_gathers_the_rule_step_after_step(rng, tmp_path):
    codes, scales = block_table(rng, 3000)
    store = _store(tmp_path, {"t": (codes, scales)})
    try:
        cache = NgramRowCache(store, "t", slots=500)
        assert cache.table.dtype == np.uint8 and cache.table.shape == (500, 264)
        assert cache.scales is None  # the scale bytes are in the records
        cached = CachedTable(cache)
        assert (cached.rows, cached.dim, cached.nbytes) == (3000, 256, 500 * 264)
        resident = Fp8BlockScaleTable(codes, scales)
        _cache_steps(rng, cached, resident, 3000)
        s = cached.stats()
        assert s.misses > 0 and s.evictions > 0
        # the arena holds the records verbatim: codes, then the row's scale bytes
        ids = np.arange(100, 300)
        slots = cached.resolve(ids)
        np.testing.assert_array_equal(cache.table[slots], np.hstack([codes, scales])[ids])
        cached.end_step()
    finally:
        store.close()


def test_prefetched_rows_gather_the_rule(rng, tmp_path):
    codes, scales = block_table(rng, 2000, dim=64)
    store = _store(tmp_path, {"t": (codes, scales)})
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
            np.testing.assert_array_equal(bits(got), bits(expected(codes, scales, ids)))
    finally:
        store.close()


def test_shared_arena_of_two_tables_and_the_refusal_of_two_block_sizes(rng, tmp_path):
    a, b = block_table(rng, 900, dim=64), block_table(rng, 700, dim=64)
    store = _store(tmp_path, {"a": a, "b": b})
    try:
        shared = NgramRowCache(store, ["a", "b"], slots=400)
        for k, (codes, scales) in enumerate((a, b)):
            _cache_steps(
                rng, CachedTable(shared, k), Fp8BlockScaleTable(codes, scales), 900 - 200 * k, 8
            )
    finally:
        store.close()
    c16 = rng.integers(0, 0x7E, size=(50, 64), dtype=np.uint8)
    s16 = rng.integers(100, 140, size=(50, 4), dtype=np.uint8)
    with rowcache.build_store(
        tmp_path / "two",
        {"a": Fp8BlockScaleSource(*a), "b": Fp8BlockScaleSource(c16, s16)},
        progress=False,
    ) as two:
        assert [t.record_bytes for t in two.tables] == [66, 68]
        with pytest.raises(ConfigError, match="need one record size") as e:
            NgramRowCache(two, ["a", "b"], slots=10)
        assert "\n" not in str(e.value)


def test_the_fused_ngram_step_refuses_block_scaled_codes(rng):
    codes, scales = block_table(rng, 50, dim=64)
    with pytest.raises(ConfigError, match="fp8_block_e8m0") as e:
        StackedTables([Fp8BlockScaleTable(codes, scales).arrays])
    assert "\n" not in str(e.value)


@pytest.mark.gpu
@pytest.mark.parametrize("arena", ["device", "host"])
def test_gpu_cache_and_resident_gather_the_same(rng, tmp_path, arena):
    import cupy as cp

    codes, scales = block_table(rng, 3000, nan=True)
    store = _store(tmp_path, {"t": (codes, scales)}, allow_nonfinite=True)
    try:
        cached = CachedTable(NgramRowCache(store, "t", slots=400, device="cuda", arena=arena))
        resident = Fp8BlockScaleTable(codes, scales).to("cuda")
        assert resident.device == "cuda" and isinstance(resident.scales, cp.ndarray)
        for _ in range(20):
            ids = rng.integers(0, 3000, size=200)
            ids[0] = 0
            got = cached.gather(ids)
            cp.cuda.get_current_stream().synchronize()
            cached.end_step()
            want = expected(codes, scales, ids)
            np.testing.assert_array_equal(bits(got), bits(want))
            np.testing.assert_array_equal(bits(resident.gather(cp.asarray(ids))), bits(want))
        assert cached.stats().evictions > 0
    finally:
        store.close()
