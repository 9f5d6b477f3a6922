"""NgramEmbedding.embed_rows and the rows kernel: against the packed path, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from rowcache.embed.layer import NgramEmbedding
from rowcache.embed.tables import Fp8Table
from rowcache.errors import ConfigError
from rowcache.kernels.ngram.hash import hash_gather_reference
from rowcache.kernels.ngram.rows import first_bad_token, hash_gather_rows_reference, rows_packed
from rowcache.kernels.ngram.stacked import StackedTables
from rowcache.kernels.reference import BF16
from tests.embed.support import DIMS, bits, cached_model, random_weights

EOS = DIMS.eos_token_id
KEEP = DIMS.max_ngram - 1


def _rows(rng, B, L, C, eos_frac=0.15):
    ids = rng.integers(0, DIMS.vocab_size, size=(B, L))
    ctx = rng.integers(0, DIMS.vocab_size, size=(B, C)) if C else None
    for a in (ids, ctx):
        if a is not None:
            a[rng.random(a.shape) < eos_frac] = EOS
    return ids, ctx


def _packed_embed(emb, ids, ctx):
    """The same step through embed_packed: each row packed as its own sequence."""
    B, L = ids.shape
    c = 0 if ctx is None else min(ctx.shape[1], KEEP)
    tokens = np.concatenate([ctx[:, ctx.shape[1] - c :], ids], 1) if c else ids
    return emb.embed_packed(tokens.reshape(-1), np.full(B, c + L), np.full(B, L))


SHAPES = [(1, 1, 0), (1, 1, 2), (1, 9, 0), (1, 6, 5), (5, 1, 1), (5, 1, 2), (4, 7, 3), (3, 4, 0)]


@pytest.mark.parametrize("B,L,C", SHAPES)
def test_rows_reference_is_per_row_hash_gather(rng, B, L, C):
    word, tables, _ = random_weights(rng)
    ids, ctx = _rows(rng, B, L, C)
    c = min(C, KEEP)
    st, wst = StackedTables([(t, None) for t in tables]), StackedTables([(word, None)])
    T, d, D = DIMS.num_tables, DIMS.table_dim, DIMS.hidden_size
    out, words = np.zeros((B * L, T * d), BF16), np.zeros((B * L, D), BF16)
    mult, mod = DIMS.multipliers, DIMS.all_table_rows
    hash_gather_rows_reference(ids, ctx, c, mult, mod, EOS, st, out, wst, words)
    for b in range(B):  # each row alone, as one sequence: its own hash_gather_reference
        tok = np.concatenate([ctx[b, C - c :], ids[b]]) if c else ids[b]
        o, w = np.zeros((L, T * d), BF16), np.zeros((L, D), BF16)
        hash_gather_reference(tok, None, np.arange(c, c + L), mult, mod, EOS, st, o, wst, w)
        np.testing.assert_array_equal(bits(out[b * L : (b + 1) * L]), bits(o))
        np.testing.assert_array_equal(bits(words[b * L : (b + 1) * L]), bits(w))
    assert rows_packed(ids, ctx, c).shape == (B * (c + L),)


@pytest.mark.parametrize("B,L,C", SHAPES)
def test_embed_rows_cpu_equals_embed_packed(rng, B, L, C):
    word, tables, projs = random_weights(rng)
    emb = NgramEmbedding(DIMS, word, tables, projs)
    ids, ctx = _rows(rng, B, L, C)
    got = emb.embed_rows(ids, ctx)
    assert got.shape == (B * L, DIMS.hidden_size) and got.dtype == BF16
    np.testing.assert_array_equal(bits(got), bits(_packed_embed(emb, ids, ctx)))
    # strided and narrower-integer views give the same rows
    wide = np.zeros((B, 2 * L), dtype=np.int32)
    wide[:, ::2] = ids
    wctx = None if ctx is None else np.asfortranarray(ctx)
    np.testing.assert_array_equal(bits(emb.embed_rows(wide[:, ::2], wctx)), bits(got))


def test_embed_rows_cpu_cached_equals_resident(rng, tmp_path):
    store, _, word, tables, projs, cached = cached_model(rng, tmp_path)
    try:
        resident = NgramEmbedding(DIMS, word, tables, projs)
        emb = NgramEmbedding(DIMS, word, cached, projs)
        for B, L, C in SHAPES:
            ids, ctx = _rows(rng, B, L, C)
            np.testing.assert_array_equal(
                bits(emb.embed_rows(ids, ctx)), bits(resident.embed_rows(ids, ctx))
            )
    finally:
        store.close()


def test_embed_rows_errors_name_the_argument(rng):
    word, tables, projs = random_weights(rng)
    emb = NgramEmbedding(DIMS, word, tables, projs)
    ids, ctx = _rows(rng, 2, 3, 2, eos_frac=0)
    with pytest.raises(ConfigError, match="ids must be a 2-D integer array"):
        emb.embed_rows(ids[0])
    with pytest.raises(ConfigError, match="ids must be a 2-D integer array"):
        emb.embed_rows(ids.astype(np.float32))
    with pytest.raises(ConfigError, match="ctx has 1 rows, ids 2"):
        emb.embed_rows(ids, ctx[:1])
    bad = ids.copy()
    bad[1, 2] = DIMS.vocab_size
    with pytest.raises(ConfigError, match=r"input_ids\[1, 2\] = 1000 is outside the vocabulary"):
        emb.embed_rows(bad, ctx)
    wide = np.concatenate([ctx, ctx], 1)  # C = 4: only the last 2 columns are read
    wide[0, 3] = -5
    with pytest.raises(ConfigError, match=r"ngram_context\[0, 3\] = -5"):
        emb.embed_rows(ids, wide)
    wide[0, 3], wide[0, 0] = ctx[0, 1], -5  # a column before the look-back: not checked
    np.testing.assert_array_equal(bits(emb.embed_rows(ids, wide)), bits(emb.embed_rows(ids, ctx)))
    assert first_bad_token(ids, ctx, 2, DIMS.vocab_size) is None
    with pytest.raises(ConfigError, match=r"out must be bfloat16\[6, 48\]"):
        emb.embed_rows(ids, ctx, out=np.zeros((5, 48), BF16))


# --- GPU --------------------------------------------------------------------
def _dev_tables(cp, word, tables, word_kind):
    fp8 = Fp8Table.quantize(tables[1])
    host = [(tables[0], None), fp8.arrays, *[(t, None) for t in tables[2:]]]
    wparts = (word, None) if word_kind == "bf16" else Fp8Table.quantize(word).arrays

    def dev(parts):
        return [(cp.asarray(a), None if s is None else cp.asarray(s)) for a, s in parts]

    return (StackedTables(host), StackedTables([wparts])), (
        StackedTables(dev(host)),
        StackedTables(dev([wparts])),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("word_kind", ["bf16", "fp8"])
def test_hash_gather_rows_gpu_bitexact(rng, word_kind):
    import cupy as cp
    import cupyx

    from rowcache.kernels.ngram.rows import hash_gather_rows

    word, tables, _ = random_weights(rng)
    (host_st, host_w), (dev_st, dev_w) = _dev_tables(cp, word, tables, word_kind)
    T, d, D = DIMS.num_tables, DIMS.table_dim, DIMS.hidden_size
    mult, mod = DIMS.multipliers, DIMS.all_table_rows
    flag = cupyx.empty_pinned(1, dtype=np.int64)
    flag[0] = 0
    for seq, (B, L, C) in enumerate([*SHAPES, (64, 1, 3), (2, 300, 2)], start=1):
        ids, ctx = _rows(rng, B, L, C)
        c = min(C, KEEP)
        n = B * L
        out_ref, words_ref = np.zeros((n, T * d), BF16), np.zeros((n, D), BF16)
        hash_gather_rows_reference(ids, ctx, c, mult, mod, EOS, host_st, out_ref, host_w, words_ref)
        # strided device views: every other column of a wider array, a transposed context
        wide = cp.zeros((B, 2 * L), dtype=cp.int64)
        wide[:, 1::2] = cp.asarray(ids)
        dctx = None if ctx is None else cp.asfortranarray(cp.asarray(ctx))
        for dids in (cp.asarray(ids), wide[:, 1::2]):
            out = cp.full((n + 1, T * d), 7, dtype=cp.uint16).view(BF16)
            words = cp.full((n + 1, D), 7, dtype=cp.uint16).view(BF16)
            args = (cp.asarray(mult), cp.asarray(mod), EOS, DIMS.vocab_size, flag, seq)
            hash_gather_rows(dids, dctx, c, *args, dev_st, out[:n], dev_w, words[:n])
            cp.cuda.get_current_stream().synchronize()
            assert int(flag[0]) != seq
            np.testing.assert_array_equal(bits(cp.asnumpy(out[:n])), bits(out_ref))
            np.testing.assert_array_equal(bits(cp.asnumpy(words[:n])), bits(words_ref))
            assert int(cp.asnumpy(out[n].view(cp.uint16)).max()) == 7
            assert int(cp.asnumpy(words[n].view(cp.uint16)).min()) == 7
    # a bad token, in the ids or in a context column a look-back never reads (after an EOS)
    ids, ctx = _rows(rng, 3, 2, 2, eos_frac=0)
    for which, value in (("ids", -1), ("ids", DIMS.vocab_size), ("ctx", DIMS.vocab_size + 9)):
        bad_ids, bad_ctx = ids.copy(), ctx.copy()
        if which == "ids":
            bad_ids[2, 1] = value
        else:
            bad_ctx[1, 0], bad_ctx[1, 1] = value, EOS
        out, words = cp.zeros((6, T * d), BF16), cp.zeros((6, D), BF16)
        seq += 1
        args = (cp.asarray(mult), cp.asarray(mod), EOS, DIMS.vocab_size, flag, seq)
        hash_gather_rows(
            cp.asarray(bad_ids), cp.asarray(bad_ctx), 2, *args, dev_st, out, dev_w, words
        )
        cp.cuda.get_current_stream().synchronize()
        assert int(flag[0]) == seq, (which, value)


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_embed_rows_gpu_equals_packed_resident_and_cached(rng, tmp_path, graphs):
    import cupy as cp

    store, caches, word, tables, projs, cached = cached_model(
        rng, tmp_path, device="cuda", word_cached=True
    )
    try:
        from rowcache.embed.tables import CachedTable

        dev = [cp.asarray(t) for t in tables]
        dev[2] = Fp8Table.quantize(dev[2])
        resident = NgramEmbedding(DIMS, cp.asarray(word), dev, projs, cuda_graphs=graphs)
        cached[2] = dev[2]
        mixed = NgramEmbedding(DIMS, CachedTable(caches["word"]), cached, projs, cuda_graphs=graphs)
        for _ in range(2):  # the second pass: every row a hit
            for B, L, C in [*SHAPES, (64, 1, 3)]:
                ids, ctx = _rows(rng, B, L, C)
                want = bits(cp.asnumpy(_packed_embed(resident, ids, ctx)))
                dids = cp.asarray(ids)
                dctx = None if ctx is None else cp.asarray(ctx)
                for emb in (resident, mixed):
                    got = emb.embed_rows(dids, dctx)
                    np.testing.assert_array_equal(bits(cp.asnumpy(got)), want)
                out = cp.empty((B * L, DIMS.hidden_size), BF16)
                assert resident.embed_rows(dids, dctx, out=out) is out
        # bad tokens raise on both paths, naming the token; the next call is clean
        ids, ctx = _rows(rng, 2, 3, 2, eos_frac=0)
        bad = ids.copy()
        bad[1, 0] = -3
        for emb in (resident, mixed):
            with pytest.raises(ConfigError, match=r"input_ids\[1, 0\] = -3 is outside"):
                emb.embed_rows(cp.asarray(bad), cp.asarray(ctx))
            got = emb.embed_rows(cp.asarray(ids), cp.asarray(ctx))
            want = bits(cp.asnumpy(_packed_embed(resident, ids, ctx)))
            np.testing.assert_array_equal(bits(cp.asnumpy(got)), want)
    finally:
        store.close()
