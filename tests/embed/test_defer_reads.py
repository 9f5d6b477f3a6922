"""NgramEmbedding(defer_reads=True) on the GPU: a step returns while its rows are read, the
GPU waits for them in stream order; outputs equal resident tables' bit for bit (eager,
graphs, with prefetches), and a failed read is raised by ``settle`` with the caches as
before the step."""

from __future__ import annotations

import numpy as np
import pytest

from rowcache.embed.ngram.context import NgramContext
from rowcache.errors import CorruptDataError
from tests.embed.support import DIMS, bits, corrupt_tables, lookahead_models, restore, token_stream

pytestmark = pytest.mark.gpu


def _decode(rng, resident, cached, caches, steps=60, settle_every=1):
    x = token_stream(rng, steps + 8)
    ctx_r, ctx_c = NgramContext(DIMS), NgramContext(DIMS)
    deferred = 0
    for k in range(steps):
        got = cached.embed(ctx_c.step(x[k : k + 1]), 1)
        deferred += any(c.inspect().pending for c in caches)
        if k % settle_every == 0:
            cached.settle()
        want = resident.embed(ctx_r.step(x[k : k + 1]), 1)
        np.testing.assert_array_equal(bits(got.get()), bits(want.get()))
    return deferred


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("settle_every", [1, 3])
def test_deferred_steps_equal_resident(rng, tmp_path, graphs, settle_every):
    store, shared, word_cache, resident, cached = lookahead_models(
        rng, tmp_path, device="cuda", cuda_graphs=graphs, defer_reads=True
    )
    try:
        assert cached.defer_reads
        deferred = _decode(rng, resident, cached, [shared, word_cache], settle_every=settle_every)
        assert deferred > 5  # steps did return before their reads ended
        cached.settle()
        s = shared.stats()
        assert s.misses > 0 and s.rows_read == s.misses + s.prefetched + s.rows_reread
    finally:
        store.close()


def test_deferred_prefill_with_prefetches_equals_resident(rng, tmp_path):
    """Chunks prefetched one ahead, the decode-like tail of each chunk faulted deferred."""
    store, _, _, resident, cached = lookahead_models(rng, tmp_path, device="cuda", defer_reads=True)
    try:
        x = token_stream(rng, 500)
        ctx_r, ctx_c = NgramContext(DIMS), NgramContext(DIMS)
        keep = DIMS.max_ngram - 1
        chunks = [(0, 90), (90, 200), (200, 330), (330, 500)]
        for k, (a, b) in enumerate(chunks):
            got = cached.embed(ctx_c.step(x[a:b]), b - a)
            if k + 1 < len(chunks):
                na, nb = chunks[k + 1]
                cached.prefetch(x[na - keep : nb - 20], nb - 20 - na)  # settles this step
            cached.settle()
            want = resident.embed(ctx_r.step(x[a:b]), b - a)
            np.testing.assert_array_equal(bits(got.get()), bits(want.get()))
    finally:
        store.close()


def test_a_failed_deferred_read_raises_at_settle_and_changes_nothing(rng, tmp_path):
    store, shared, _, resident, cached = lookahead_models(
        rng, tmp_path, device="cuda", defer_reads=True
    )
    try:
        x = token_stream(rng, 40)
        x[20] = x[:20].max() + 1  # a token not seen yet: its n-grams' rows are missing
        ctx_c = NgramContext(DIMS)
        cached.embed(ctx_c.step(x[:20]), 20)  # warm: shards opened, some rows resident
        cached.settle()
        # every page of the n-gram tables' shards corrupted: any read of the shared cache fails
        saved = corrupt_tables(store, [f"t{k}" for k in range(4)])
        map_before = shared.device_map().get()
        before = shared.inspect().slot_map(), shared.stats()
        window = ctx_c.step(x[20:21])
        cached.embed(window, 1)  # returns: the read runs
        with pytest.raises(CorruptDataError, match="checksum"):
            cached.settle()
        after = shared.inspect().slot_map()
        np.testing.assert_array_equal(after[0], before[0][0])
        np.testing.assert_array_equal(after[1], before[0][1])
        st = shared.stats()
        assert (st.misses, st.rows_read, st.lookups) == (
            before[1].misses,
            before[1].rows_read,
            before[1].lookups,
        )
        np.testing.assert_array_equal(shared.device_map().get(), map_before)  # nothing written
        restore(saved)  # mended: the caches go on (that step was dropped)
        want = resident.embed(window, 1)
        got = cached.embed(window, 1)  # the dropped step again
        cached.settle()
        np.testing.assert_array_equal(bits(got.get()), bits(want.get()))
    finally:
        store.close()
