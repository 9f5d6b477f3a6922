"""Small input checks of issue 11 outside the store: ``global_ids``, ``NgramBatchContext.reset``,
and the device ``seq_slot`` cast of the token overlay."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import rowcache
from rowcache import NgramRowCache
from rowcache.embed.ngram.context import NgramBatchContext
from rowcache.embed.ngram.dims import NgramDims
from rowcache.errors import ConfigError

BF16 = np.dtype(ml_dtypes.bfloat16)


def test_global_ids_refuses_bool_and_non_int_parts(tmp_path, rng):
    tabs = {f"t{i}": rng.standard_normal((30 + i, 8), dtype=np.float32) for i in range(3)}
    store = rowcache.build_store(tmp_path / "s", tabs, progress=False)
    cache = NgramRowCache(store, ["t0", "t1", "t2"], slots=20)
    for part in (True, False, 1.0, "1", -1, 3):
        with pytest.raises(ConfigError, match=r"part=.*give an int index"):
            cache.global_ids(part, np.array([0, 1]))
    got = cache.global_ids(np.int64(1), np.array([0, 4]))
    assert got.ndim == 1 and got.tolist() == [30, 34]
    assert cache.global_ids(2, [5]).tolist() == [30 + 31 + 5]


def small_dims():
    return NgramDims(vocab_size=100, hidden_size=32, max_ngram=3, splits=2, ratio=4, eos_token_id=2)


def test_batch_context_reset_refuses_out_of_range_slots_and_changes_nothing():
    ctx = NgramBatchContext(small_dims(), 4)
    ctx.step(np.array([5, 6, 7, 8]))
    seen = ctx.tokens_seen
    for bad in ([-1], [4], -1, [0, 9], [[0]], [True], [0.5]):
        with pytest.raises(ConfigError, match="seqs"):
            ctx.reset(bad)
        np.testing.assert_array_equal(ctx.tokens_seen, seen)
    ctx.reset([3])
    ctx.reset(np.int64(2))
    ctx.reset([])
    assert ctx.tokens_seen.tolist() == [1, 1, 0, 0]
    ctx.reset()
    assert ctx.tokens_seen.tolist() == [0, 0, 0, 0]


def overlay_with_adapter(rng, device):
    from rowcache.embed.overlay.overlay import TokenOverlay

    V, H = 64, 32
    served = rng.standard_normal((V, H), dtype=np.float32).astype(BF16)
    adapter = served.copy()
    adapter[5] = rng.standard_normal(H, dtype=np.float32).astype(BF16)
    ov = TokenOverlay(V, H, 4, device=device)
    ov.set_adapter(2, embed_weight=adapter, served_embed=served)
    return ov, served, adapter


def test_host_int64_seq_slot_beyond_int32_is_refused(rng):
    ov, served, _ = overlay_with_adapter(rng, "cpu")
    rows = served[[5, 5]].copy()
    with pytest.raises(ConfigError, match=r"seq_slot\[1\] = 4294967298 is not an adapter slot"):
        ov.apply_embed(np.array([5, 5]), rows, seq_slot=np.array([2, 2**32 + 2], np.int64))


@pytest.mark.gpu
def test_device_int64_seq_slot_never_wraps_into_an_adapter(rng):
    import cupy as cp

    ov, served, adapter = overlay_with_adapter(rng, "cuda")
    ids = cp.asarray([5, 5, 5, 5, 5])
    slots = cp.asarray([2, 2**32 + 2, -(2**32) + 2, 2**31 + 2, 4], dtype=cp.int64)
    rows = cp.asarray(served[[5, 5, 5, 5, 5]])
    ov.apply_embed(ids, rows, seq_slot=slots)
    got = rows.get().view(np.uint16)
    np.testing.assert_array_equal(got[0], adapter[5].view(np.uint16))  # slot 2: the adapter
    for r in range(1, 5):  # out of [0, 4): no adapter, never slot 2
        np.testing.assert_array_equal(got[r], served[5].view(np.uint16))
