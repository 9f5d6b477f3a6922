"""NgramContext: chunked and token-by-token prefill give the whole-prefill ids."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from rowcache.embed.ngram.context import NgramContext
from rowcache.embed.ngram.dims import NgramDims
from rowcache.embed.ngram.ids import ngram_ids

LITE = NgramDims.longcat_flash_lite()


def _ids_by_chunks(dims, tokens, bounds):
    ctx = NgramContext(dims)
    parts = []
    for a, b in itertools.pairwise(bounds):
        chunk = tokens[a:b]
        c = ctx.step(chunk)
        assert c.dtype == np.int64
        assert c.shape[0] == min(a, dims.max_ngram - 1) + (b - a)
        parts.append(ngram_ids(dims, c)[:, c.shape[0] - (b - a) :])
    return np.concatenate(parts, axis=1), ctx


def test_context_chunked_and_token_by_token_equal_whole(rng):
    x = rng.integers(0, LITE.vocab_size, size=300)
    x[rng.random(300) < 0.1] = LITE.eos_token_id
    whole = ngram_ids(LITE, x)
    cuts = np.sort(rng.choice(np.arange(1, 300), size=12, replace=False))
    for bounds in ([0, 300], [0, *cuts.tolist(), 300], list(range(301))):
        got, ctx = _ids_by_chunks(LITE, x, bounds)
        np.testing.assert_array_equal(got, whole)
        assert ctx.tokens_seen == 300
        np.testing.assert_array_equal(ctx.kept_tokens, x[-3:])


def test_context_keeps_eos_and_short_history():
    ctx = NgramContext(LITE)
    assert ctx.keep == 3
    np.testing.assert_array_equal(ctx.step([LITE.eos_token_id]), [2])
    np.testing.assert_array_equal(ctx.step([7, 8]), [2, 7, 8])
    np.testing.assert_array_equal(ctx.step([9]), [2, 7, 8, 9])
    np.testing.assert_array_equal(ctx.step([]), [7, 8, 9])
    ctx.reset()
    assert ctx.tokens_seen == 0 and ctx.kept_tokens.size == 0
    np.testing.assert_array_equal(ctx.step([5]), [5])


def test_context_bad_token_leaves_state_unchanged():
    ctx = NgramContext(LITE)
    ctx.step([1, 2, 3, 4])
    with pytest.raises(ValueError, match=r"new_tokens\[1\] = 131072"):
        ctx.step([5, LITE.vocab_size])
    assert ctx.tokens_seen == 4
    np.testing.assert_array_equal(ctx.kept_tokens, [2, 3, 4])
    with pytest.raises(TypeError, match="NgramDims"):
        NgramContext(3)


@pytest.mark.gpu
def test_context_device_tokens(rng):
    import cupy as cp

    x = rng.integers(0, LITE.vocab_size, size=50)
    ctx = NgramContext(LITE)
    ctx.step(x[:20])  # host, then device
    c = ctx.step(cp.asarray(x[20:]))
    assert isinstance(c, cp.ndarray)
    np.testing.assert_array_equal(cp.asnumpy(c), x[17:])
    np.testing.assert_array_equal(cp.asnumpy(ngram_ids(LITE, c)[:, 3:]), ngram_ids(LITE, x)[:, 20:])


def test_batch_context_equals_per_sequence_contexts(rng):
    from rowcache.embed.ngram.context import NgramBatchContext

    S = 7
    batch_ctx = NgramBatchContext(LITE, S)
    singles = [NgramContext(LITE) for _ in range(S)]
    for step in range(40):
        # a random subset of slots steps, in random order, with 0..5 new tokens each
        seqs = rng.permutation(S)[: rng.integers(1, S + 1)]
        lens = rng.integers(0, 6, size=seqs.size) if step % 3 else np.ones(seqs.size, np.int64)
        new = rng.integers(0, LITE.vocab_size, size=int(lens.sum()))
        new[rng.random(new.size) < 0.15] = LITE.eos_token_id
        if step == 20:
            batch_ctx.reset([int(seqs[0])])
            singles[int(seqs[0])].reset()
        batch = batch_ctx.step(new, lens, seqs=seqs)
        np.testing.assert_array_equal(batch.seq_lens, lens)
        split = np.cumsum(lens)[:-1]
        want = [singles[s].step(chunk) for s, chunk in zip(seqs, np.split(new, split))]
        np.testing.assert_array_equal(batch.ctx_lens, [len(w) for w in want])
        np.testing.assert_array_equal(batch.tokens, np.concatenate(want))
        # the packed ids equal each sequence's own ids
        ids = batch.host_ids()
        expect = [ngram_ids(LITE, w)[:, len(w) - k :] for w, k in zip(want, lens)]
        np.testing.assert_array_equal(ids, np.concatenate(expect, axis=1))
    for s in range(S):
        np.testing.assert_array_equal(batch_ctx.kept_tokens(s), singles[s].kept_tokens)
        assert batch_ctx.tokens_seen[s] == singles[s].tokens_seen


def test_batch_context_decode_default_and_bad_input():
    from rowcache.embed.ngram.context import NgramBatchContext
    from rowcache.errors import ConfigError

    ctx = NgramBatchContext(LITE, 3)
    b = ctx.step([5, 6, 7, 8, 9, 10], [1, 2, 3])
    np.testing.assert_array_equal(b.tokens, [5, 6, 7, 8, 9, 10])
    b = ctx.step([11, 12, 13])  # decode: one token per slot
    np.testing.assert_array_equal(b.tokens, [5, 11, 6, 7, 12, 8, 9, 10, 13])
    np.testing.assert_array_equal(b.ctx_lens, [2, 3, 4])
    with pytest.raises(ValueError, match=r"new_tokens\[1\] = 131072"):
        ctx.step([1, LITE.vocab_size, 3])
    with pytest.raises(ConfigError, match="new_lens sums to 2"):
        ctx.step([1, 2, 3], [1, 1, 0])
    with pytest.raises(ConfigError, match="at most once"):
        ctx.step([1, 2], seqs=[0, 0])
    with pytest.raises(ConfigError, match=r"seqs must lie in \[0, 3\)"):
        ctx.step([1], seqs=[3])
    with pytest.raises(ConfigError, match="num_seqs"):
        NgramBatchContext(LITE, 0)
    # nothing changed by the failed steps
    np.testing.assert_array_equal(ctx.tokens_seen, [2, 3, 4])
    np.testing.assert_array_equal(ctx.kept_tokens(2), [9, 10, 13])
