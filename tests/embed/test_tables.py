"""Bf16Table and Fp8Table: gathers, FP8 quantize-on-load against the store's rule."""

from __future__ import annotations

import numpy as np
import pytest

from rowcache.embed.tables import Bf16Table, Fp8Table
from rowcache.errors import ConfigError
from rowcache.kernels.reference import BF16, dequantize_fp8_reference, quantize_fp8_reference
from rowcache.store.builder import build_store


def _table(rng, rows=300, dim=16):
    t = (rng.standard_normal((rows, dim)) * 0.05).astype(np.float32).astype(BF16)
    t[7] = 0  # an all-zero row: FP8 scale 1.0
    return t


def test_bf16_table_gather(rng):
    t = _table(rng)
    tab = Bf16Table(t)
    assert (tab.rows, tab.dim, tab.device, tab.nbytes) == (300, 16, "cpu", t.nbytes)
    ids = rng.integers(0, 300, size=50)
    np.testing.assert_array_equal(tab.gather(ids).view(np.uint16), t[ids].view(np.uint16))
    out = np.zeros((50, 32), dtype=BF16)
    tab.gather(ids, out=out[:, 16:])  # a column block of a stacked buffer
    np.testing.assert_array_equal(out[:, 16:].view(np.uint16), t[ids].view(np.uint16))
    assert not out[:, :16].astype(np.float32).any()
    assert tab.to("cpu") is tab


def test_bf16_table_from_float32_rounds_to_nearest_even(rng):
    f = rng.standard_normal((10, 8)).astype(np.float32)
    np.testing.assert_array_equal(
        Bf16Table(f).array.view(np.uint16), f.astype(BF16).view(np.uint16)
    )


def test_fp8_quantize_matches_reference_and_store(rng, tmp_path):
    t = _table(rng)
    tab = Fp8Table.quantize(t)
    codes, scales = quantize_fp8_reference(t)
    np.testing.assert_array_equal(tab.codes, codes)
    np.testing.assert_array_equal(tab.scales.view(np.uint32), scales.view(np.uint32))
    assert tab.scales[7] == 1.0
    store = build_store(tmp_path / "s", {"t": t}, dtype="fp8", progress=False)
    try:
        ids = np.arange(300)
        s_codes, s_scales = store.read_rows("t", ids)
        np.testing.assert_array_equal(s_codes, tab.codes)
        np.testing.assert_array_equal(s_scales.view(np.uint32), tab.scales.view(np.uint32))
    finally:
        store.close()
    ids = rng.integers(0, 300, size=40)
    np.testing.assert_array_equal(
        tab.gather(ids).view(np.uint16),
        dequantize_fp8_reference(codes[ids], scales[ids]).view(np.uint16),
    )
    again = Fp8Table(tab.codes, tab.scales)
    assert (again.rows, again.dim, again.nbytes) == (300, 16, 300 * 16 + 300 * 4)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: Bf16Table(np.zeros(4, dtype=BF16)), "2-D"),
        (lambda: Bf16Table(np.zeros((4, 2), dtype=np.int32)), "bfloat16 or float32"),
        (lambda: Fp8Table(np.zeros((4, 2), np.float32), np.ones(4, np.float32)), "uint8"),
        (lambda: Fp8Table(np.zeros((4, 2), np.uint8), np.ones(3, np.float32)), r"float32\[4\]"),
        (lambda: Fp8Table.quantize(np.zeros((4, 2), np.uint8)), "bfloat16 or float32"),
        (lambda: Bf16Table(np.zeros((4, 2), BF16)).to("tpu"), "device='tpu'"),
    ],
)
def test_tables_bad_input(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


def test_bf16_table_gather_out_of_range(rng):
    with pytest.raises(IndexError):
        Bf16Table(_table(rng)).gather(np.array([0, 300]))


@pytest.mark.gpu
def test_tables_gpu_match_cpu(rng):
    import cupy as cp

    t = _table(rng, rows=5000, dim=256)
    ids = rng.integers(0, 5000, size=777)
    gpu = Bf16Table(t).to("cuda")
    assert gpu.device == "cuda"
    np.testing.assert_array_equal(
        cp.asnumpy(gpu.gather(cp.asarray(ids))).view(np.uint16), t[ids].view(np.uint16)
    )
    q_gpu = Fp8Table.quantize(cp.asarray(t))
    q_cpu = Fp8Table.quantize(t)
    np.testing.assert_array_equal(cp.asnumpy(q_gpu.codes), q_cpu.codes)
    np.testing.assert_array_equal(cp.asnumpy(q_gpu.scales), q_cpu.scales)
    np.testing.assert_array_equal(
        cp.asnumpy(q_gpu.gather(cp.asarray(ids))).view(np.uint16),
        q_cpu.gather(ids).view(np.uint16),
    )
    assert q_cpu.to("cuda").device == "cuda" and q_gpu.to("cpu").device == "cpu"


def _store(tmp_path, tables, dtype="bf16"):
    return build_store(tmp_path / f"store-{dtype}", tables, dtype=dtype, progress=False)


def test_cached_table_equals_resident_bit_for_bit(rng, tmp_path):
    from rowcache.cache.row_cache import NgramRowCache
    from rowcache.embed.tables import CachedTable

    t = _table(rng, rows=2000, dim=32)
    store = _store(tmp_path, {"t": t})
    try:
        cached = CachedTable(NgramRowCache(store, "t", slots=400))
        assert (cached.rows, cached.dim, cached.device) == (2000, 32, "cpu")
        assert cached.nbytes == 400 * 32 * 2
        resident = Bf16Table(t)
        for _ in range(20):  # batches of 150 random ids with repeats over a 400-slot arena
            ids = rng.integers(0, 2000, size=150)
            ids[::7] = ids[0]
            got = cached.gather(ids)
            cached.end_step()
            np.testing.assert_array_equal(_bits(got), _bits(resident.gather(ids)))
        s = cached.stats()
        assert s.misses > 0 and s.evictions > 0 and s.lookups == 20 * 150
        hot = rng.integers(0, 2000, size=100)
        cached.gather(hot)
        cached.end_step()
        cached.stats(reset=True)
        cached.gather(hot)
        cached.end_step()
        assert cached.stats().misses == 0  # resident after the first batch
    finally:
        store.close()


def test_cached_fp8_table_equals_quantized_resident(rng, tmp_path):
    from rowcache.cache.row_cache import NgramRowCache
    from rowcache.embed.tables import CachedTable

    t = _table(rng, rows=1500, dim=24)
    store = _store(tmp_path, {"t": t}, dtype="fp8")
    try:
        cached = CachedTable(NgramRowCache(store, 0, slots=300))
        resident = Fp8Table.quantize(t)
        for _ in range(10):
            ids = rng.integers(0, 1500, size=200)
            got = cached.gather(ids)
            cached.end_step()
            np.testing.assert_array_equal(_bits(got), _bits(resident.gather(ids)))
    finally:
        store.close()


def test_cached_table_rejects_non_cache():
    from rowcache.embed.tables import CachedTable

    with pytest.raises(ConfigError, match="NgramRowCache"):
        CachedTable(np.zeros((3, 3)))


def _bits(a):
    return np.asarray(a).view(np.uint16)


def test_cached_table_parts_of_a_shared_cache(rng, tmp_path):
    from rowcache.cache.row_cache import NgramRowCache
    from rowcache.embed.tables import CachedTable
    from rowcache.errors import RowRangeError

    a, b = _table(rng, rows=500, dim=16), _table(rng, rows=300, dim=16)
    store = _store(tmp_path, {"a": a, "b": b})
    try:
        shared = NgramRowCache(store, ["a", "b"], slots=200)
        ta, tb = CachedTable(shared, 0), CachedTable(shared, part=1)
        assert (ta.rows, tb.rows, tb.offset, tb.dim) == (500, 300, 500, 16)
        for _ in range(10):
            ia, ib = rng.integers(0, 500, size=60), rng.integers(0, 300, size=60)
            got_a, got_b = ta.gather(ia), tb.gather(ib)
            shared.end_step()
            np.testing.assert_array_equal(_bits(got_a), _bits(a[ia]))
            np.testing.assert_array_equal(_bits(got_b), _bits(b[ib]))
        assert ta.nbytes == tb.nbytes == 200 * 16 * 2  # one arena
        with pytest.raises(RowRangeError):  # a local id past its own table, not the arena
            tb.resolve(np.array([300]))
        with pytest.raises(ConfigError, match=r"part=2 is out of range.*0\.\.1"):
            CachedTable(shared, 2)
        with pytest.raises(ConfigError, match="part=True"):
            CachedTable(shared, True)
        single = CachedTable(NgramRowCache(store, "b", slots=10))
        assert (single.part, single.offset, single.rows) == (0, 0, 300)
    finally:
        store.close()
