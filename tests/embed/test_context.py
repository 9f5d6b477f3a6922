"""NgramContext: chunked and token-by-token prefill give the whole-prefill ids."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from embed.context import NgramContext
from embed.dims import NgramDims
from embed.ids import ngram_ids

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
