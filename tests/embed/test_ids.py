"""ngram_ids: vectorized and GPU ids against the plain-loop spec formula."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rowcache.embed.ngram.dims import NgramDims
from rowcache.embed.ngram.ids import ngram_ids, ngram_ids_loop_reference
from rowcache.errors import ConfigError

LITE = NgramDims.longcat_flash_lite()
V = LITE.vocab_size
EOS = LITE.eos_token_id


def _stream(rng, n, vocab=V, eos=EOS):
    """Random tokens with EOS at the start, the end, adjacent EOS, 0 and vocab-1."""
    x = rng.integers(0, vocab, size=n)
    x[rng.random(n) < 0.08] = eos
    x[0] = eos
    x[-1] = eos
    x[n // 3 : n // 3 + 2] = eos
    x[n // 2] = 0
    x[n // 2 + 1] = vocab - 1
    x[n // 2 + 2] = 0
    return x


def test_ids_match_loop_reference_longcat(rng):
    x = _stream(rng, 400)
    ids = ngram_ids(LITE, x)
    assert ids.dtype == np.int64 and ids.shape == (12, 400)
    np.testing.assert_array_equal(ids, ngram_ids_loop_reference(LITE, x))
    assert ((ids >= 0) & (ids < LITE.all_table_rows[:, None])).all()


@pytest.mark.parametrize(
    "dims",
    [
        # N = 5 and a non-integer ratio, as other members of the family
        NgramDims(
            vocab_size=163840, hidden_size=64, max_ngram=5, splits=4, ratio=100.567, eos_token_id=1
        ),
        # fewer rows than tokens: the current token itself must be reduced
        NgramDims(
            vocab_size=1000, hidden_size=12, max_ngram=3, splits=2, ratio=0.37, eos_token_id=999
        ),
    ],
)
def test_ids_match_loop_reference_other_dims(rng, dims):
    x = _stream(rng, 300, dims.vocab_size, dims.eos_token_id)
    np.testing.assert_array_equal(ngram_ids(dims, x), ngram_ids_loop_reference(dims, x))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=0, max_size=24))
def test_ids_match_loop_reference_dense_eos(tokens):
    # vocab 6 with EOS 2: EOS runs, token 0 and vocab-1 everywhere
    dims = NgramDims(vocab_size=6, hidden_size=6, max_ngram=4, splits=2, ratio=3.5, eos_token_id=2)
    x = np.array(tokens, dtype=np.int32)
    np.testing.assert_array_equal(ngram_ids(dims, x), ngram_ids_loop_reference(dims, x))


def test_ids_first_token_of_segment_is_token(rng):
    x = np.array([17, 5000, EOS, 131071, 9, EOS, EOS, 0, 3], dtype=np.int64)
    ids = ngram_ids(LITE, x)
    for t in (0, 3, 6, 7):  # sequence start, and each token right after an EOS
        assert (ids[:, t] == x[t]).all(), t


def test_ids_rule_78_second_token_same_in_all_tables(rng):
    for prev in (0, 1, 77):
        for cur in (0, 12345, V - 1):
            x = np.array([EOS, prev, cur])
            ids = ngram_ids(LITE, x)
            assert (ids[:, 2] == cur + V * prev).all(), (prev, cur)
    # at 78 the order-2 sum exceeds M_i and the tables disagree
    ids = ngram_ids(LITE, np.array([78, V - 1]))
    assert len(set(ids[:, 1].tolist())) > 1


def test_ids_eos_current_token_sees_full_lookback():
    x = np.array([11, 22, 33, EOS, 44])
    ids = ngram_ids(LITE, x)
    for i in range(12):
        n, m = LITE.table_order(i), LITE.table_rows(i)
        hist = [EOS, 33, 22, 11][:n]
        assert ids[i, 3] == sum(tok * V**j for j, tok in enumerate(hist)) % m
        assert ids[i, 4] == 44  # after the EOS: a new segment


def test_ids_token_zero_same_as_missing():
    a = ngram_ids(LITE, np.array([0, 0, 0, 500]))
    b = ngram_ids(LITE, np.array([500]))
    np.testing.assert_array_equal(a[:, -1], b[:, 0])


def test_ids_accepts_lists_and_empty():
    assert ngram_ids(LITE, []).shape == (12, 0)
    np.testing.assert_array_equal(ngram_ids(LITE, [5, 6]), ngram_ids(LITE, np.array([5, 6])))


@pytest.mark.parametrize(
    ("tokens", "match"),
    [
        ([1, 2, 131072, -1], r"ctx_tokens\[2\] = 131072 is outside the vocabulary \[0, 131072\)"),
        ([-3], r"ctx_tokens\[0\] = -3"),
        (np.array([1.0, 2.0]), "integer"),
        (np.zeros((2, 2), dtype=np.int64), "1-D"),
    ],
)
def test_ids_bad_tokens_raise(tokens, match):
    with pytest.raises(ValueError, match=match) as info:
        ngram_ids(LITE, tokens)
    assert isinstance(info.value, ConfigError)


@pytest.mark.gpu
def test_ids_gpu_kernel_matches_loop_reference(rng):
    import cupy as cp

    x = _stream(rng, 2000)
    got = ngram_ids(LITE, cp.asarray(x, dtype=cp.int32))
    assert isinstance(got, cp.ndarray) and got.dtype == cp.int64
    np.testing.assert_array_equal(cp.asnumpy(got), ngram_ids_loop_reference(LITE, x))
    big = _stream(rng, 100_000)
    np.testing.assert_array_equal(
        cp.asnumpy(ngram_ids(LITE, cp.asarray(big))), ngram_ids(LITE, big)
    )
    dims5 = NgramDims(
        vocab_size=163840, hidden_size=64, max_ngram=5, splits=4, ratio=100.567, eos_token_id=1
    )
    y = _stream(rng, 500, dims5.vocab_size, 1)
    np.testing.assert_array_equal(
        cp.asnumpy(ngram_ids(dims5, cp.asarray(y))), ngram_ids_loop_reference(dims5, y)
    )
    assert ngram_ids(LITE, cp.zeros(0, dtype=cp.int64)).shape == (12, 0)
    with pytest.raises(ValueError, match=r"ctx_tokens\[1\] = 131072"):
        ngram_ids(LITE, cp.asarray([3, V, 4]))


def test_ngram_hash_starts_and_fused_range_check(rng):
    from rowcache.kernels.ngram.hash import TokenRangeError, ngram_hash

    a, b = _stream(rng, 50), _stream(rng, 30)
    both = np.concatenate([a, b])
    starts = np.repeat([0, 50], [50, 30])
    ids = ngram_hash(both, LITE.multipliers, LITE.all_table_rows, EOS, starts)
    np.testing.assert_array_equal(ids[:, :50], ngram_ids_loop_reference(LITE, a))
    np.testing.assert_array_equal(ids[:, 50:], ngram_ids_loop_reference(LITE, b))
    bad = both.copy()
    bad[[7, 9]] = [V, -1]
    with pytest.raises(TokenRangeError, match=r"tokens\[7\] = 131072") as info:
        ngram_hash(bad, LITE.multipliers, LITE.all_table_rows, EOS, vocab=V)
    assert info.value.position == 7 and isinstance(info.value, ValueError)


@pytest.mark.gpu
def test_ngram_hash_gpu_starts_and_fused_range_check(rng):
    import cupy as cp

    from rowcache.kernels.ngram.hash import TokenRangeError, ngram_hash

    x = _stream(rng, 3000)
    starts = np.repeat([0, 1000, 1001, 2500], [1000, 1, 1499, 500])
    want = ngram_hash(x, LITE.multipliers, LITE.all_table_rows, EOS, starts)
    got = ngram_hash(
        cp.asarray(x), LITE.multipliers, LITE.all_table_rows, EOS, cp.asarray(starts), vocab=V
    )
    np.testing.assert_array_equal(cp.asnumpy(got), want)
    x[[1234, 2000]] = [V + 5, -2]
    with pytest.raises(TokenRangeError, match=r"tokens\[1234\] = 131077") as info:
        ngram_hash(cp.asarray(x), LITE.multipliers, LITE.all_table_rows, EOS, vocab=V)
    assert info.value.position == 1234


def test_ngram_hash_into_out_on_numpy_and_cupy(rng, xp):
    """``out=`` receives the same ids as a fresh result, on either device, and is returned;
    an ``out`` of the wrong shape, dtype or device is refused naming what it needs."""
    from rowcache.kernels.ngram.hash import ngram_hash

    a, b = _stream(rng, 40), _stream(rng, 25)
    tokens = xp.asarray(np.concatenate([a, b]))
    starts = xp.asarray(np.repeat([0, 40], [40, 25]))
    mult, rows = LITE.multipliers, LITE.all_table_rows
    want = ngram_hash(tokens, mult, rows, EOS, starts)
    out = xp.full((LITE.num_tables, 65), -7, dtype=xp.int64)
    assert ngram_hash(tokens, mult, rows, EOS, starts, out=out) is out
    np.testing.assert_array_equal(
        xp.asnumpy(out) if xp is not np else out, xp.asnumpy(want) if xp is not np else want
    )
    for bad in (
        xp.empty((LITE.num_tables, 64), dtype=xp.int64),  # shape
        xp.empty((LITE.num_tables, 65), dtype=xp.int32),  # dtype
        xp.empty((65, LITE.num_tables), dtype=xp.int64).T,  # not C-contiguous
        np.empty((LITE.num_tables, 65), dtype=np.int64) if xp is not np else None,  # device
    ):
        if bad is None:
            continue
        with pytest.raises(ConfigError, match=r"out must be a C-contiguous int64 array of shape"):
            ngram_hash(tokens, mult, rows, EOS, starts, out=bad)
