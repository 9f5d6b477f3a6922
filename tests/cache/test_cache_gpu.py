"""NgramRowCache on the GPU: the model test on device and mapped-host arenas, both readers,
and the gather kernels reading the arena by slot. Skipped without a GPU."""

from __future__ import annotations

import numpy as np
import pytest

import rowcache
import rowcache.kernels
from rowcache import NgramRowCache
from rowcache.cache.config import Tuning
from tests.cache.support import (
    batches,
    check_invariants,
    expected,
    expected_part,
    make_multi_store,
    make_store,
)

pytestmark = pytest.mark.gpu


def _reader_ok(reader):
    if reader != "kvikio":
        return
    pytest.importorskip("kvikio")


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("arena", ["device", "host"])
@pytest.mark.parametrize("reader", ["posix", "kvikio"])
def test_gpu_cache_model_based(tmp_path, rng, dtype, arena, reader, ref_lru):
    import cupy as cp

    _reader_ok(reader)
    store, _ = make_store(tmp_path, rng, dtype=dtype)
    slots = 150
    cache = NgramRowCache(store, "t", slots=slots, device="cuda", arena=arena, reader=reader)
    assert cache.reader_kind == reader and cache.arena_kind == arena
    lru = ref_lru(slots)
    for calls in batches(rng, 3000, slots, 30):
        for ids in calls:
            try:
                lru.resolve(ids)
            except rowcache.ArenaExhaustedError:
                with pytest.raises(rowcache.ArenaExhaustedError):
                    cache.resolve(ids)
                continue
            got = cache.resolve(ids)
            assert isinstance(got, cp.ndarray) and got.dtype == cp.int32
            if dtype == "bf16":
                rows = rowcache.kernels.batched_embed(got, cache.table)
            else:
                rows = rowcache.kernels.batched_embed_fp8(got, cache.table, cache.scales)
            np.testing.assert_array_equal(
                cp.asnumpy(rows).view(np.uint16), expected(store, ids).view(np.uint16)
            )
        assert cache.stats().misses == lru.faults
        check_invariants(cache, lru)
        cache.end_step()
        lru.end_batch()


def test_gpu_cache_cupy_ids_and_auto_reader(rng, tiny_store):
    import cupy as cp

    store, x = tiny_store
    cache = NgramRowCache(store, "t", slots=500, device="cuda")
    assert cache.reader_kind in ("posix", "kvikio")
    ids = cp.asarray(rng.integers(0, 3000, 400))
    got = cache.resolve(ids)
    rows = rowcache.kernels.batched_embed(got, cache.table)
    np.testing.assert_array_equal(
        cp.asnumpy(rows).view(np.uint16), x[cp.asnumpy(ids)].view(np.uint16)
    )


@pytest.mark.parametrize("arena", ["device", "host"])
def test_gpu_shared_cache_over_several_tables(tmp_path, rng, arena):
    import cupy as cp

    store, tabs = make_multi_store(tmp_path, rng, "fp8")
    names = ["t1", "t3", "t0"]
    cache = NgramRowCache(store, names, slots=200, device="cuda", arena=arena)
    for _ in range(10):
        local = [rng.zipf(1.3, 40) % tabs[n].shape[0] for n in names]
        ids = np.concatenate([cache.global_ids(k, x) for k, x in enumerate(local)])
        rows = rowcache.kernels.batched_embed_fp8(cache.resolve(ids), cache.table, cache.scales)
        want = np.concatenate([expected_part(store, n, x) for n, x in zip(names, local)])
        np.testing.assert_array_equal(cp.asnumpy(rows).view(np.uint16), want.view(np.uint16))
        cache.end_step()


@pytest.mark.parametrize("arena,row_map", [("device", "dense"), ("host", "dense"), ("device", "hash")])
def test_gpu_device_map_mirrors_host_map(rng, arena, row_map, tiny_store):
    """(the device map is dense whatever the host map's kind: made from a hash too)"""
    import cupy as cp

    store, _ = tiny_store
    cache = NgramRowCache.assemble(store, "t", slots=150, device="cuda", arena=arena,
                                   tuning=Tuning(row_map=row_map))  # fmt: skip
    assert cache.row_map_kind == row_map
    cache.resolve(np.arange(40))
    cache.end_step()
    dmap = cache.device_map()  # made after some faults: starts as a copy
    assert dmap is cache.device_map() and dmap.dtype == cp.int32 and dmap.shape == (3000,)
    faulted = 0
    for calls in batches(rng, 3000, 150, 25):
        for ids in calls:
            try:
                cache.resolve(ids, host=True)
            except rowcache.ArenaExhaustedError:
                continue
            faulted += cache.last_faults
            cache.stream.synchronize()
            row_slot, _ = cache.inspect().slot_map()
            np.testing.assert_array_equal(cp.asnumpy(dmap), row_slot)
        cache.end_step()
    assert faulted > 0 and cache.stats().evictions > 0
    cache.resolve(np.flatnonzero(cache.inspect().slot_map()[0] >= 0)[:5], host=True)
    assert cache.last_faults == 0


_SPIN = r"""
extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""


def _spin(cp, seconds):
    """Occupy the current stream for ``seconds`` (returns at once on the host)."""
    cp.RawKernel(_SPIN, "spin")((1,), (1,), (np.uint64(int(seconds * 1e9)),))


def test_gpu_prefetch_pieces_do_not_queue_behind_the_cache_streams_work(rng, tiny_store):
    """Work queued on the cache's stream after end_batch (a model's rest of the step)
    does not hold a prefetch's pieces back: they go on a stream of their own, and the rows
    are right when the cache's stream gathers them."""
    import cupy as cp



    store, _ = tiny_store
    cache = NgramRowCache.assemble(
        store, "t", slots=600, device="cuda", tuning=Tuning(piece_rows=16)
    )
    cache.resolve(np.arange(10))
    cache.end_step()
    cache.prefetch(np.arange(10, 20)).wait()  # the prefetch stream exists
    cache.end_step()
    with cache.stream:
        _spin(cp, 1.5)
    ids = rng.choice(np.arange(100, 3000), 128, replace=False)
    h = cache.prefetch(ids)
    assert h.rows == 128
    assert h.wait(timeout=1.0), "the prefetch's 8 pieces waited for the spin on the cache stream"
    with cache.stream:
        rows = rowcache.kernels.batched_embed(cache.resolve(ids), cache.table)
    st = cache.stats()  # the prefetched rows are hits of the resolve, faulted by it
    assert cache.last_faults == 128 and st.misses == 10 and st.prefetched == 10 + 128
    np.testing.assert_array_equal(
        cp.asnumpy(rows).view(np.uint16), expected(store, ids).view(np.uint16)
    )


def test_gpu_prefetch_waits_for_earlier_batches_gathers_of_its_victims(tiny_store):
    """A prefetch on its own stream never overwrites a slot before a gather of an earlier
    batch, still queued behind other work on the cache's stream, has read it."""
    import cupy as cp

    store, _ = tiny_store
    cache = NgramRowCache(store, "t", slots=64, device="cuda")
    cache.prefetch(np.arange(64)).wait()
    cache.end_step()
    old = np.arange(64)
    with cache.stream:
        slots = cache.resolve(old)
        _spin(cp, 1.0)  # the gather of the old rows runs only after this
        got = rowcache.kernels.batched_embed(slots, cache.table)
    cache.end_step()  # their slots are unpinned: the next prefetch evicts every one
    new = np.arange(1000, 1064)
    h = cache.prefetch(new)
    assert h.rows == 64 and h.dropped == 0
    h.wait()
    np.testing.assert_array_equal(
        cp.asnumpy(got).view(np.uint16), expected(store, old).view(np.uint16)
    )
    with cache.stream:
        rows = rowcache.kernels.batched_embed(cache.resolve(new), cache.table)
    np.testing.assert_array_equal(
        cp.asnumpy(rows).view(np.uint16), expected(store, new).view(np.uint16)
    )
