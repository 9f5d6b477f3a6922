"""NgramEmbedding.prefetch*: cached == resident bit for bit with the next chunk prefetched
(CPU; GPU eager, graphs and overlay), nothing faulted twice, a failed read raised by the
step that needs it."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from rowcache.cache.row_cache import Tuning
from rowcache.embed.ngram.context import NgramBatchContext, NgramContext
from rowcache.errors import CorruptDataError
from tests.cache.support import Hooked
from tests.embed.support import DIMS, bits, lookahead_models, token_stream


def _host(a):
    return a.get() if hasattr(a, "get") else a


def _chunked_prefill_with_lookahead(rng, resident, cached, caches, wait):
    x = token_stream(rng, 400)
    chunks = [(0, 100), (100, 180), (180, 300), (300, 400)]
    ctx_r, ctx_c = NgramContext(DIMS), NgramContext(DIMS)
    keep = DIMS.max_ngram - 1
    h = cached.prefetch(x[0:100])
    for k, (a, b) in enumerate(chunks):
        if wait:
            h.wait()
        before = sum(c.stats().misses for c in caches)
        got = cached.embed(ctx_c.step(x[a:b]), b - a)
        assert sum(c.stats().misses for c in caches) == before  # prefetched: no demand fault
        if k + 1 < len(chunks):  # the next chunk's rows, with this chunk's tail as look-back
            na, nb = chunks[k + 1]
            h = cached.prefetch(x[na - keep : nb], nb - na)
        want = resident.embed(ctx_r.step(x[a:b]), b - a)
        np.testing.assert_array_equal(bits(_host(got)), bits(_host(want)))
    s = [c.stats() for c in caches]
    assert sum(t.prefetched for t in s) > 0 and sum(t.misses for t in s) == 0


@pytest.mark.parametrize("wait", [True, False])
def test_prefetch_next_chunk_equals_resident_and_faults_nothing(rng, tmp_path, wait):
    store, shared, word_cache, resident, cached = lookahead_models(rng, tmp_path)
    try:
        _chunked_prefill_with_lookahead(rng, resident, cached, [shared, word_cache], wait)
        assert shared.inspect().pinned == 0 and word_cache.inspect().pinned == 0
    finally:
        store.close()


def test_prefetch_packed_and_batch_forms(rng, tmp_path):
    store, shared, word_cache, resident, cached = lookahead_models(rng, tmp_path)
    try:
        S = 3
        ctx_r, ctx_c = NgramBatchContext(DIMS, S), NgramBatchContext(DIMS, S)
        x = [token_stream(rng, 60) for _ in range(S)]
        new = np.concatenate([s[:40] for s in x])
        lens = np.full(S, 40)
        batch = ctx_c.step(new, lens)
        cached.prefetch_packed(batch).wait()
        got = cached.embed_packed(batch)
        assert shared.stats().misses == 0 and word_cache.stats().misses == 0
        np.testing.assert_array_equal(bits(got), bits(resident.embed_packed(ctx_r.step(new, lens))))
        h = cached.prefetch_batch([s[30:50] for s in x], [20] * S)
        assert h.wait(10) and h.exception() is None and h.rows > 0
        with pytest.raises(Exception, match="ctx_lens and seq_lens"):
            cached.prefetch_packed(new)
        assert resident.prefetch(x[0]).rows == 0  # resident tables read nothing
    finally:
        store.close()


def test_prefetch_failure_raises_at_the_step_that_needs_it(rng, tmp_path):
    fail = [True]

    def failing(rows):
        if fail[0] and threading.current_thread().name.startswith("rowcache-prefetch"):
            raise CorruptDataError("injected: read failed")

    store, shared, word_cache, resident, cached = lookahead_models(
        rng, tmp_path, shared_kw={"part_reader": lambda reads: Hooked(reads, failing)}
    )
    try:
        x = token_stream(rng, 50)
        h = cached.prefetch(x)
        h.wait()
        assert isinstance(h.exception(), CorruptDataError)
        with pytest.raises(CorruptDataError, match="prefetch of row"):
            cached.embed(x, 50)
        assert shared.inspect().pinned == 0 and word_cache.inspect().pinned == 0
        fail[0] = False
        np.testing.assert_array_equal(bits(cached.embed(x, 50)), bits(resident.embed(x, 50)))
    finally:
        store.close()


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("wait", [True, False])
def test_gpu_prefetch_next_chunk_equals_resident(rng, tmp_path, graphs, wait):
    store, shared, word_cache, resident, cached = lookahead_models(
        rng, tmp_path, device="cuda", cuda_graphs=graphs
    )
    try:
        assert cached.runner == ("graphs" if graphs else "eager")
        _chunked_prefill_with_lookahead(rng, resident, cached, [shared, word_cache], wait)
    finally:
        store.close()


def _slow_prefetch_thread(rows, seconds=0.002):
    """A hook on a cache's reads: prefetch-thread reads sleep first, so steps meet pieces
    still queued."""
    if threading.current_thread().name.startswith("rowcache-prefetch"):
        time.sleep(seconds)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param("cuda", marks=pytest.mark.gpu),
        pytest.param("cuda-graphs", marks=pytest.mark.gpu),
    ],
)
def test_steps_meet_queued_pieces_and_equal_resident(rng, tmp_path, device):
    """Prefetches read in pieces of 8 rows, slowly, so that steps meet their rows in pieces
    not started yet: a step waits for the pieces it mostly needs (``WAIT_SHARE``) and reads
    its few rows of the others itself; no row is read twice, outputs stay bit for bit those
    of resident tables, and no row is faulted (every one was prefetched)."""
    dev = "cuda" if device.startswith("cuda") else "cpu"
    kw = {"cuda_graphs": True} if device == "cuda-graphs" else {}
    shared_kw = {
        "tuning": Tuning(piece_rows=8),
        "part_reader": lambda reads: Hooked(reads, _slow_prefetch_thread),
    }
    store, shared, word_cache, resident, cached = lookahead_models(
        rng, tmp_path, device=dev, shared_kw=shared_kw, **kw
    )
    try:
        _chunked_prefill_with_lookahead(rng, resident, cached, [shared, word_cache], False)
        s = shared.stats()
        assert s.prefetch_wait_seconds > 0  # some step met its rows in flight
        assert s.rows_reread == 0 and s.misses == 0
    finally:
        store.close()
