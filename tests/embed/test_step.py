"""The step's objects (``rowcache.embed.step``): the one order policy of the cached groups,
decided by the call alone; the runner chosen at construction and its plan/run split; the
constructor without the retired ``fused`` / ``device_lookup`` options. CPU; the GPU runners
are checked against the NumPy reference in test_layer.py."""

from __future__ import annotations

import numpy as np
import pytest

import rowcache.embed.step.cached_groups as cached_groups
from rowcache.embed.layer import NgramEmbedding
from rowcache.embed.ngram.batch import NgramBatch
from rowcache.embed.step.cached_groups import CachedGroups
from rowcache.embed.step.device import StepShape
from rowcache.embed.step.stages import StepCall
from tests.embed.support import DIMS, bits, cached_model, random_weights, token_stream


def _events(groups, batch):
    """The order of ``groups.ordered(batch, ...)``'s host resolves and device parts."""
    events = []
    real = groups.rows.resolve

    def resolve(*args, **kw):
        events.append("resolve")
        return real(*args, **kw)

    groups.rows.resolve = resolve
    try:
        groups.ordered(batch, lambda: events.append("device"))
    finally:
        del groups.rows.resolve
        groups.end_step()
    return events


@pytest.mark.parametrize("check", [True, False])
def test_order_is_decided_by_the_call_alone(rng, tmp_path, monkeypatch, check):
    """A step of at most CHECK_TOKENS tokens resolves first when it would fault and once
    after its device part when it would not; a larger one (CHECK_TOKENS = 0 here) runs its
    device part first, and again when the resolve faulted. The same call on caches in the
    same state orders them the same way, whatever the calls before it."""
    if not check:
        monkeypatch.setattr(cached_groups, "CHECK_TOKENS", 0)
    cold = ["resolve", "device"] if check else ["device", "resolve", "device"]
    warm = ["device", "resolve"]
    runs = []
    for _ in range(2):  # two embeddings over two stores: the same calls, the same orders
        store, caches, word, _, _, cached = cached_model(
            rng, tmp_path / str(len(runs)), slots_frac=0.5
        )
        try:
            groups = CachedGroups(word, cached, np, defer_reads=False)
            x = token_stream(np.random.default_rng(5), 40)
            a = NgramBatch.single(DIMS, x[:20], 20)
            b = NgramBatch.single(DIMS, x[20:], 20)
            got = [_events(groups, a), _events(groups, a), _events(groups, b), _events(groups, a)]
            assert got == [cold, warm, cold, warm]
            assert all(c.inspect().pinned == 0 for c in caches.values())
            runs.append(got)
        finally:
            store.close()
    assert runs[0] == runs[1]


def test_runner_chosen_at_construction_and_plan_run(rng):
    word, tables, projs = random_weights(rng)
    emb = NgramEmbedding(DIMS, word, tables, projs, cuda_graphs=True)  # ignored on the CPU
    assert emb.runner == "cpu" and not emb.cuda_graphs
    x = [token_stream(rng, 30) for _ in range(3)]
    batch = NgramBatch.from_contexts(DIMS, x, [30, 5, 1])
    want = emb.embed_packed(batch)
    step = emb._runner.plan(StepShape.of(batch))  # the step's buffers for this shape
    assert step.buf.out.shape == (36, DIMS.hidden_size)
    got = step.run_resolved(batch, StepCall())
    assert got is step.buf.out
    np.testing.assert_array_equal(bits(got), bits(want))
    for retired in ("fused", "device_lookup"):
        with pytest.raises(TypeError, match=retired):
            NgramEmbedding(DIMS, word, tables, projs, **{retired: True})
