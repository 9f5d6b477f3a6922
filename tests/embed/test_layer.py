"""NgramEmbedding: against a float64 reference, FP8 tolerance, chunking, batches, overlay."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from rowcache.embed.layer import NgramEmbedding
from rowcache.embed.ngram.batch import NgramBatch
from rowcache.embed.ngram.context import NgramContext
from rowcache.embed.ngram.dims import NgramDims
from rowcache.embed.ngram.ids import ngram_ids, ngram_ids_loop_reference
from rowcache.embed.overlay.overlay import TokenOverlay
from rowcache.embed.tables import Bf16Table, Fp8Table
from rowcache.errors import ConfigError
from rowcache.kernels.reference import BF16
from tests.embed.support import (
    DIMS,
    bits,
    cached_model,
    gpu_reference,
    random_weights,
    shared_cache_model,
    token_stream,
)


def _reference64(dims, word, tables, projs, ctx, seq_len):
    ids = ngram_ids(dims, ctx)[:, len(ctx) - seq_len :]
    x = np.asarray(ctx)[len(ctx) - seq_len :]
    acc = word[x].astype(np.float64)
    for i in range(dims.num_tables):
        acc += tables[i][ids[i]].astype(np.float64) @ projs[i].astype(np.float64).T
    return acc / (1 + dims.num_tables)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_layer_matches_float64_reference(rng):
    word, tables, projs = random_weights(rng)
    emb = NgramEmbedding(DIMS, word, tables, projs)
    x = token_stream(rng, 200)
    out = emb.embed(x, 150)
    assert out.dtype == BF16 and out.shape == (150, 48)
    ref = _reference64(DIMS, word, tables, projs, x, 150)
    assert _rel(out.astype(np.float32), ref) <= 1e-2
    err = np.abs(out.astype(np.float64) - ref)
    assert err.max() <= 1e-2 * np.abs(ref).max()
    # the projections matter: dropping them is far from the reference
    assert _rel(word[x[50:]].astype(np.float64) / 5, ref) > 0.1


def test_layer_fp8_tables_close_to_bf16(rng):
    word, tables, projs = random_weights(rng)
    x = token_stream(rng, 300)
    bf16 = NgramEmbedding(DIMS, word, tables, projs).embed(x, 300)
    fp8 = NgramEmbedding(DIMS, word, [Fp8Table.quantize(t) for t in tables], projs).embed(x, 300)
    rel = _rel(fp8.astype(np.float32), bf16.astype(np.float32))
    assert 0 < rel <= 5e-2
    mixed_tables = [Bf16Table(t) if i < 2 else Fp8Table.quantize(t) for i, t in enumerate(tables)]
    mixed = NgramEmbedding(DIMS, Bf16Table(word), mixed_tables, np.stack(projs)).embed(x, 300)
    assert _rel(mixed.astype(np.float32), bf16.astype(np.float32)) <= 5e-2


def test_layer_chunked_prefill_equals_whole(rng):
    word, tables, projs = random_weights(rng)
    emb = NgramEmbedding(DIMS, word, tables, projs)
    x = token_stream(rng, 120)
    whole = emb.embed(x, 120)
    for bounds in ([0, 50, 51, 90, 120], list(range(121))):
        ctx = NgramContext(DIMS)
        parts = []
        for a, b in itertools.pairwise(bounds):
            c = ctx.step(x[a:b])
            np.testing.assert_array_equal(
                emb.ids(c)[:, len(c) - (b - a) :], ngram_ids(DIMS, x)[:, a:b]
            )
            parts.append(emb.embed(c, b - a))
        got = np.concatenate(parts)
        # ids are identical; the float32 GEMM may sum in another order for another
        # row count, so allow one bf16 rounding step
        np.testing.assert_allclose(
            got.astype(np.float32), whole.astype(np.float32), rtol=1e-2, atol=1e-6
        )
        assert (bits(got) == bits(whole)).mean() > 0.99


def test_layer_embed_batch_equals_separate_sequences(rng):
    word, tables, projs = random_weights(rng)
    emb = NgramEmbedding(DIMS, word, tables, projs)
    ctxs = [token_stream(rng, n) for n in (3, 40, 1, 17)]
    lens = [1, 25, 1, 0]
    _, ids = emb.embed_ids(ctxs, lens)
    expect = np.concatenate(
        [ngram_ids(DIMS, c)[:, len(c) - k :] for c, k in zip(ctxs, lens)], axis=1
    )
    np.testing.assert_array_equal(ids, expect)
    out = emb.embed_batch(ctxs, lens)
    sep = np.concatenate([emb.embed(c, k) for c, k in zip(ctxs, lens)])
    assert out.shape == (27, 48)
    np.testing.assert_allclose(out.astype(np.float32), sep.astype(np.float32), rtol=1e-2, atol=1e-6)


def test_layer_overlay_replaces_word_rows(rng):
    word, tables, projs = random_weights(rng)
    adapter = word.copy()
    changed = np.array([5, 17, 999])
    adapter[changed] = (rng.standard_normal((3, 48)) * 0.3).astype(np.float32).astype(BF16)
    ov = TokenOverlay(DIMS.vocab_size, DIMS.hidden_size, 2)
    ov.set_adapter(1, embed_weight=adapter, served_embed=word)
    x = np.concatenate([token_stream(rng, 30), changed])
    base = NgramEmbedding(DIMS, word, tables, projs)
    with_ov = base.embed(x, 33, overlay=ov, active=1)
    direct = NgramEmbedding(DIMS, adapter, tables, projs).embed(x, 33)
    np.testing.assert_array_equal(bits(with_ov), bits(direct))
    assert (bits(with_ov[-3:]) != bits(base.embed(x, 33)[-3:])).any()
    # routed per sequence: sequence 0 without adapter, sequence 1 with it
    out = base.embed_batch([x, x], [33, 33], overlay=ov, seq_slots=np.array([-1, 1], np.int32))
    np.testing.assert_array_equal(bits(out[:33]), bits(base.embed(x, 33)))
    np.testing.assert_array_equal(bits(out[33:]), bits(direct))


def test_layer_staging_allocated_once(rng):
    word, tables, projs = random_weights(rng)
    emb = NgramEmbedding(DIMS, word, tables, projs)
    x = token_stream(rng, 64)
    emb.embed(x, 64)
    stack = emb._staging.stack
    for k in (1, 10, 64):
        emb.embed(x, k)
        assert emb._staging.stack is stack
    assert emb.resident_bytes() > sum(t.nbytes for t in tables) + word.nbytes
    assert emb.embed(x, 0).shape == (0, 48)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"tables": "short"}, "num_tables=4"),
        ({"tables": "bad_rows"}, r"tables\[1\] is \[10, 12\]"),
        ({"word": "bad"}, "word table"),
        ({"projs": "bad"}, r"projs\[0\]"),
    ],
)
def test_layer_bad_construction(rng, change, match):
    word, tables, projs = random_weights(rng)
    if change.get("tables") == "short":
        tables = tables[:3]
    if change.get("tables") == "bad_rows":
        tables[1] = tables[1][:10]
    if change.get("word"):
        word = word[:, :40]
    if change.get("projs"):
        projs[0] = projs[0].T
    with pytest.raises(ConfigError, match=match):
        NgramEmbedding(DIMS, word, tables, projs)


def test_layer_bad_calls(rng):
    emb = NgramEmbedding(DIMS, *random_weights(rng))
    with pytest.raises(ConfigError, match=r"seq_len=5 .* \[0, 4\]"):
        emb.embed([1, 2, 3, 4], 5)
    with pytest.raises(ValueError, match=r"ctx_tokens\[1\] = 1000"):
        emb.embed([1, 1000], 1)
    with pytest.raises(ConfigError, match="out must be"):
        emb.embed([1, 2], 2, out=np.zeros((2, 48), np.float32))


@pytest.mark.gpu
def test_layer_gpu_matches_cpu(rng):
    import cupy as cp

    word, tables, projs = random_weights(rng)
    x = token_stream(rng, 500)
    cpu = NgramEmbedding(DIMS, word, tables, projs)
    gpu = NgramEmbedding(DIMS, cp.asarray(word), [cp.asarray(t) for t in tables], projs)
    assert gpu.device == "cuda"
    got = gpu.embed(cp.asarray(x), 400)
    assert isinstance(got, cp.ndarray) and got.dtype == BF16
    ref = _reference64(DIMS, word, tables, projs, x, 400)
    assert _rel(cp.asnumpy(got).astype(np.float32), ref) <= 1e-2
    want = cpu.embed(x, 400).astype(np.float32)
    np.testing.assert_allclose(cp.asnumpy(got).astype(np.float32), want, rtol=2e-2, atol=1e-5)
    ctxs = [x[:4], x[10:14], x[100:300]]
    gb = gpu.embed_batch([cp.asarray(c) for c in ctxs], [1, 1, 150])
    cb = cpu.embed_batch(ctxs, [1, 1, 150])
    np.testing.assert_allclose(
        cp.asnumpy(gb).astype(np.float32), cb.astype(np.float32), rtol=2e-2, atol=1e-5
    )
    fp8 = NgramEmbedding(
        DIMS, cp.asarray(word), [Fp8Table.quantize(cp.asarray(t)) for t in tables], projs
    )
    cpu8 = NgramEmbedding(DIMS, word, [Fp8Table.quantize(t) for t in tables], projs)
    np.testing.assert_allclose(
        cp.asnumpy(fp8.embed(x, 400)).astype(np.float32),
        cpu8.embed(x, 400).astype(np.float32),
        rtol=2e-2,
        atol=1e-5,
    )
    with pytest.raises(ConfigError, match="one device"):
        NgramEmbedding(DIMS, word, [cp.asarray(t) for t in tables], projs)


def test_layer_cached_equals_resident_bit_for_bit(rng, tmp_path):
    store, caches, word, tables, projs, cached = cached_model(rng, tmp_path, word_cached=True)
    try:
        from rowcache.embed.tables import CachedTable

        resident = NgramEmbedding(DIMS, word, tables, projs)
        # order-2 tables resident, higher orders cached, word table cached
        mixed = [
            Bf16Table(t) if DIMS.table_order(i) == 2 else c
            for i, (t, c) in enumerate(zip(tables, cached))
        ]
        models = [
            NgramEmbedding(DIMS, word, cached, projs),
            NgramEmbedding(DIMS, CachedTable(caches["word"]), mixed, projs),
        ]
        x = token_stream(rng, 400)
        for emb in models:
            ctx_r, ctx_c = NgramContext(DIMS), NgramContext(DIMS)
            for a, b in [
                (0, 150),
                (150, 151),
                (151, 152),
                (152, 300),
                *[(k, k + 1) for k in range(300, 400)],
            ]:
                want = resident.embed(ctx_r.step(x[a:b]), b - a)
                got = emb.embed(ctx_c.step(x[a:b]), b - a)
                np.testing.assert_array_equal(bits(got), bits(want))
        hits = sum(c.stats().hits for c in caches.values())
        misses = sum(c.stats().misses for c in caches.values())
        assert hits > 0 and misses > 0
        assert all(c.inspect().pinned == 0 for c in caches.values())  # every batch was ended
    finally:
        store.close()


def test_layer_cached_fp8_equals_resident_fp8(rng, tmp_path):
    store, _, word, tables, projs, cached = cached_model(rng, tmp_path, dtype="fp8")
    try:
        resident = NgramEmbedding(DIMS, word, [Fp8Table.quantize(t) for t in tables], projs)
        emb = NgramEmbedding(DIMS, word, cached, projs)
        x = token_stream(rng, 300)
        for a in range(0, 300, 60):
            np.testing.assert_array_equal(
                bits(emb.embed(x[max(0, a - 2) : a + 60], 60)),
                bits(resident.embed(x[max(0, a - 2) : a + 60], 60)),
            )
    finally:
        store.close()


def test_layer_cached_arena_exhausted_releases_batch(rng, tmp_path):
    from rowcache.errors import ArenaExhaustedError

    store, caches, word, tables, projs, cached = cached_model(rng, tmp_path, slots_frac=0.01)
    try:
        emb = NgramEmbedding(DIMS, word, cached, projs)
        x = rng.integers(3, DIMS.vocab_size, size=200)  # ~200 distinct rows per table > 25 slots
        with pytest.raises(ArenaExhaustedError):
            emb.embed(x, 200)
        assert all(c.inspect().pinned == 0 for c in caches.values())
        small = emb.embed(x[:10], 10)  # the cache is still usable
        np.testing.assert_array_equal(
            bits(small), bits(NgramEmbedding(DIMS, word, tables, projs).embed(x[:10], 10))
        )
    finally:
        store.close()


@pytest.mark.gpu
def test_layer_gpu_cached_equals_resident(rng, tmp_path):
    import cupy as cp

    for arena in ("device", "host"):
        from rowcache.cache.row_cache import NgramRowCache
        from rowcache.embed.tables import CachedTable
        from rowcache.store.builder import build_store

        word, tables, projs = random_weights(rng)
        store = build_store(
            tmp_path / arena, {f"t{i}": t for i, t in enumerate(tables)}, progress=False
        )
        try:
            cached = [
                CachedTable(
                    NgramRowCache(store, f"t{i}", slots=t.shape[0] // 4, device="cuda", arena=arena)
                )
                for i, t in enumerate(tables)
            ]
            gpu_res = NgramEmbedding(DIMS, cp.asarray(word), [cp.asarray(t) for t in tables], projs)
            gpu_c = NgramEmbedding(DIMS, cp.asarray(word), cached, projs)
            x = token_stream(rng, 600)
            ctx_r, ctx_c = NgramContext(DIMS), NgramContext(DIMS)
            for a, b in [(0, 200), (200, 400), *[(k, k + 1) for k in range(400, 600)]]:
                want = gpu_res.embed(ctx_r.step(x[a:b]), b - a)
                got = gpu_c.embed(ctx_c.step(x[a:b]), b - a)
                np.testing.assert_array_equal(
                    cp.asnumpy(got).view(np.uint16), cp.asnumpy(want).view(np.uint16)
                )
            out = gpu_c.embed_batch([x[:4], x[100:104], x[200:300]], [1, 1, 50])
            want = gpu_res.embed_batch([x[:4], x[100:104], x[200:300]], [1, 1, 50])
            np.testing.assert_array_equal(
                cp.asnumpy(out).view(np.uint16), cp.asnumpy(want).view(np.uint16)
            )
        finally:
            store.close()


def test_gather_stacked_reference_matches_per_table(rng):
    from rowcache.kernels.ngram.stacked import StackedTables, gather_stacked

    word, tables, _ = random_weights(rng)
    fp8 = Fp8Table.quantize(tables[1])
    st = StackedTables([(tables[0], None), fp8.arrays, (tables[2], None), (tables[3], None)])
    ids = np.stack([rng.integers(0, DIMS.table_rows(0), size=40) for _ in range(4)])
    out = np.zeros((40, 48), BF16)
    gather_stacked(ids, st, out)
    np.testing.assert_array_equal(bits(out[:, :12]), bits(tables[0][ids[0]]))
    np.testing.assert_array_equal(bits(out[:, 12:24]), bits(fp8.gather(ids[1])))
    np.testing.assert_array_equal(bits(out[:, 36:]), bits(tables[3][ids[3]]))
    np.testing.assert_array_equal(bits(gather_stacked(ids, st)), bits(out))  # out allocated
    with pytest.raises(ConfigError, match="one width"):
        StackedTables([(tables[0], None), (word, None)])


@pytest.mark.gpu
def test_layer_gpu_mixed_tables_equal_the_reference(rng, tmp_path):
    """Resident BF16, FP8 and cached tables mixed on the GPU: steps from host tokens (hash
    and gathers in one launch, the cached table through its device map) and from device
    tokens (hashed on the device, resolved first, gathered by slot) equal the NumPy
    reference's ids and gathers under the one GEMM-and-sum tail, bit for bit."""
    import cupy as cp

    from rowcache.cache.row_cache import NgramRowCache
    from rowcache.embed.ngram.batch import NgramBatch
    from rowcache.embed.tables import CachedTable
    from rowcache.kernels.gemm import gemm_bf16_f32, scale_sum, scale_sum_reference
    from rowcache.kernels.ngram.stacked import StackedTables, gather_stacked
    from rowcache.store.builder import build_store

    word, tables, projs = random_weights(rng)
    store = build_store(tmp_path / "s", {f"t{i}": t for i, t in enumerate(tables)}, progress=False)
    try:
        cache = NgramRowCache(store, "t3", slots=DIMS.table_rows(3) // 3, device="cuda")
        mixed = [
            Bf16Table(cp.asarray(tables[0])),
            Fp8Table.quantize(cp.asarray(tables[1])),
            Bf16Table(cp.asarray(tables[2])),
            CachedTable(cache),
        ]
        emb = NgramEmbedding(DIMS, cp.asarray(word), mixed, projs)
        assert emb.runner == "eager"
        ref_tables = [*mixed[:3], tables[3]]  # the cached table's reference: its source
        x = token_stream(rng, 700)
        for a, b in [(0, 300), (300, 301), (301, 700)]:
            c = x[max(0, a - 2) : b]
            k = b - a
            want = gpu_reference(DIMS, word, ref_tables, projs, NgramBatch.single(DIMS, c, k))
            for tokens in (c, cp.asarray(c)):  # host tokens, device tokens
                np.testing.assert_array_equal(bits(cp.asnumpy(emb.embed(tokens, k))), bits(want))
        with pytest.raises(ConfigError, match=r"ctx_tokens\[5\] = 131072"):
            bad = x[:10].copy()
            bad[5] = 131072
            emb.embed(cp.asarray(bad), 3)
        with pytest.raises(ConfigError, match=r"contexts\[1\]\[2\] = 131072"):
            emb.embed_batch([cp.asarray(x[:4]), cp.asarray(bad[3:9])], [1, 1])
        host_ctx = [x[10:14], x[50:54], x[90:190]]
        want = gpu_reference(
            DIMS, word, ref_tables, projs, NgramBatch.from_contexts(DIMS, host_ctx, [1, 1, 60])
        )
        dev_ctx = [cp.asarray(c) for c in host_ctx]
        np.testing.assert_array_equal(
            bits(cp.asnumpy(emb.embed_batch(dev_ctx, [1, 1, 60]))), bits(want)
        )
        np.testing.assert_array_equal(
            bits(cp.asnumpy(emb.embed_batch(host_ctx, [1, 1, 60]))), bits(want)
        )
        assert cache.inspect().pinned == 0
        # the stacked gather on its own, unaligned width (d = 12 bf16 = 24 bytes: no vec path)
        st = StackedTables([t.arrays for t in mixed[:3]])
        ids = cp.asarray(np.stack([rng.integers(0, DIMS.table_rows(0), size=99) for _ in range(3)]))
        out = cp.empty((99, 36), dtype=BF16)
        gather_stacked(ids[:, 1:], st, out[:98])
        ref = np.zeros((98, 36), BF16)
        host = StackedTables(
            [(tables[0], None), Fp8Table.quantize(tables[1]).arrays, (tables[2], None)]
        )
        gather_stacked(cp.asnumpy(ids)[:, 1:], host, ref)
        np.testing.assert_array_equal(cp.asnumpy(out[:98]).view(np.uint16), ref.view(np.uint16))
        # the scaled sum is bit-exact; the GEMM agrees with float32 to rounding
        w = cp.asarray(word[:64])
        p32 = cp.asarray(rng.standard_normal((64, 48)).astype(np.float32))
        np.testing.assert_array_equal(
            cp.asnumpy(scale_sum(w, p32, 5.0)).view(np.uint16),
            scale_sum_reference(word[:64], cp.asnumpy(p32), 5.0).view(np.uint16),
        )
        a16 = np.concatenate(
            [t[:64] for t in tables], axis=1
        )  # [64, T*d], as the layer stacks them
        b16 = np.concatenate([pj.T for pj in projs])
        got = cp.asnumpy(gemm_bf16_f32(cp.asarray(a16), cp.asarray(np.ascontiguousarray(b16))))
        want = a16.astype(np.float32) @ b16.astype(np.float32)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    finally:
        store.close()


# --- packed batches (NgramBatch), host hashing of embedded positions, shared caches ---------
def _packed(rng, lens):
    ctxs = [token_stream(rng, L) for L in lens]
    return ctxs, np.concatenate(ctxs), np.array(lens, dtype=np.int64)


def test_hash_positions_matches_full_reference(rng):
    from rowcache.embed.ngram.batch import NgramBatch, hash_positions
    from rowcache.kernels.ngram.hash import ngram_hash_reference

    V, eos = DIMS.vocab_size, DIMS.eos_token_id
    lens = [0, 1, 5, 3, 40, 0, 2, 17]
    _ctxs, tokens, ctx_lens = _packed(rng, lens)
    # edge tokens: EOS first and last, adjacent EOS, token 0 and V - 1
    tokens[:2] = eos
    tokens[-1] = eos
    tokens[10:12] = [0, V - 1]
    seq_lens = np.minimum(ctx_lens, [0, 1, 2, 3, 39, 0, 2, 17])
    batch = NgramBatch(DIMS, tokens, ctx_lens, seq_lens)
    full = ngram_hash_reference(
        tokens, DIMS.multipliers, DIMS.all_table_rows, eos, np.repeat(batch.begin, ctx_lens)
    )
    np.testing.assert_array_equal(batch.host_ids(), full[:, batch.positions])
    assert batch.positions.shape == (int(seq_lens.sum()),)
    for s in range(len(lens)):  # and per sequence against the plain-loop spec reference
        a, L, k = int(batch.begin[s]), lens[s], int(seq_lens[s])
        if L:
            np.testing.assert_array_equal(
                full[:, a + L - k : a + L],
                ngram_ids_loop_reference(DIMS, tokens[a : a + L])[:, L - k :],
            )
    one = hash_positions(tokens, np.array([12]), 11, DIMS.multipliers, DIMS.all_table_rows, eos)
    np.testing.assert_array_equal(one[:, 0], ngram_ids_loop_reference(DIMS, tokens[11:13])[:, 1])


def test_layer_embed_packed_equals_list_and_separate(rng):
    from rowcache.embed.ngram.batch import NgramBatch

    word, tables, projs = random_weights(rng)
    emb = NgramEmbedding(DIMS, word, tables, projs)
    ctxs, tokens, ctx_lens = _packed(rng, [3, 40, 1, 17, 0, 4])
    seq_lens = np.array([1, 25, 1, 0, 0, 4])
    packed = emb.embed_packed(tokens, ctx_lens, seq_lens)
    listed = emb.embed_batch(ctxs, seq_lens.tolist())
    via_batch = emb.embed_packed(NgramBatch(DIMS, tokens.tolist(), ctx_lens, seq_lens))
    assert packed.shape == (31, 48)
    np.testing.assert_array_equal(bits(packed), bits(listed))
    np.testing.assert_array_equal(bits(packed), bits(via_batch))
    _, ids = emb.embed_ids(ctxs, seq_lens.tolist())
    expect = np.concatenate(
        [ngram_ids(DIMS, c)[:, len(c) - k :] for c, k in zip(ctxs, seq_lens) if len(c)], axis=1
    )
    np.testing.assert_array_equal(ids, expect)
    # a decode step: every sequence embeds its last token, rows in sequence order
    dec = emb.embed_packed(tokens, ctx_lens, (ctx_lens > 0).astype(np.int64))
    sep = np.concatenate([emb.embed(c, 1) for c in ctxs if len(c)])
    np.testing.assert_allclose(dec.astype(np.float32), sep.astype(np.float32), rtol=1e-2, atol=1e-6)


def test_layer_embed_packed_bad_input(rng):
    from rowcache.embed.ngram.batch import NgramBatch

    emb = NgramEmbedding(DIMS, *random_weights(rng))
    tokens = np.array([1, 2, 3, 4, 5, 1000, 7])
    with pytest.raises(ConfigError, match=r"tokens\[5\] \(sequence 1, position 2\) = 1000"):
        emb.embed_packed(tokens, [3, 4], [1, 1])
    with pytest.raises(ConfigError, match=r"contexts\[1\]\[2\] = 1000"):
        emb.embed_batch([tokens[:3], tokens[3:]], [1, 1])
    with pytest.raises(ConfigError, match=r"ctx_lens must be >= 0 and sum to len\(tokens\)=7"):
        emb.embed_packed(tokens, [3, 3], [1, 1])
    with pytest.raises(ConfigError, match=r"seq_len=5 for tokens\[1\] must be an int in \[0, 4\]"):
        emb.embed_packed(tokens % 10, [3, 4], [1, 5])
    with pytest.raises(ConfigError, match=r"seq_lens has 1 entries, expected 2"):
        emb.embed_packed(tokens % 10, [3, 4], [1])
    with pytest.raises(ConfigError, match=r"seq_lens\[1\]=True must be an int"):
        emb.embed_batch([tokens[:3], tokens[3:5]], [1, True])
    with pytest.raises(ConfigError, match="needs ctx_lens and seq_lens"):
        emb.embed_packed(tokens % 10)
    with pytest.raises(ConfigError, match="1-D integer"):
        emb.embed_packed(np.zeros((2, 2), np.int64), [2, 2], [1, 1])
    other = NgramDims(
        vocab_size=1000, hidden_size=48, max_ngram=3, splits=2, ratio=3, eos_token_id=2
    )
    with pytest.raises(ConfigError, match="other NgramDims"):
        emb.embed_packed(NgramBatch(other, [1, 2], [2], [1]))


def _count_resolves(monkeypatch, cache):
    calls = []
    real = cache.resolve

    def counting(ids, **kw):
        calls.append(int(np.asarray(ids).shape[0]))
        return real(ids, **kw)

    monkeypatch.setattr(cache, "resolve", counting)
    return calls


def test_layer_shared_cache_equals_resident_bit_for_bit(rng, tmp_path, monkeypatch):
    from rowcache.embed.ngram.context import NgramBatchContext
    from rowcache.embed.tables import CachedTable

    store, shared, word_cache, word, tables, projs = shared_cache_model(rng, tmp_path)
    try:
        T = DIMS.num_tables
        resident = NgramEmbedding(DIMS, word, tables, projs)
        all_cached = NgramEmbedding(DIMS, word, [CachedTable(shared, k) for k in range(T)], projs)
        # mixed: tables 0 and 2 resident, 1 and 3 in the shared cache, word in its own cache
        mixed_tables = [
            Bf16Table(tables[0]),
            CachedTable(shared, 1),
            tables[2],
            CachedTable(shared, 3),
        ]
        mixed = NgramEmbedding(DIMS, CachedTable(word_cache), mixed_tables, projs)
        assert len(all_cached.caches) == 1 and len(mixed.caches) == 2
        calls = _count_resolves(monkeypatch, shared)
        S = 6
        x = [token_stream(rng, 120) for _ in range(S)]
        for emb in (all_cached, mixed):
            ctx_r, ctx_c = NgramBatchContext(DIMS, S), NgramBatchContext(DIMS, S)
            steps = [(0, 30), (30, 31), *[(k, k + 1) for k in range(31, 120)]]
            for a, b in steps:
                new = np.concatenate([s[a:b] for s in x])
                lens = np.full(S, b - a)
                want = resident.embed_packed(ctx_r.step(new, lens))
                got = emb.embed_packed(ctx_c.step(new, lens))
                np.testing.assert_array_equal(bits(got), bits(want))
        # one resolve per step for the shared cache, whatever the number of its tables
        assert len(calls) == 2 * 91
        assert calls[0] == T * S * 30 and calls[-1] == 2 * S
        s = shared.stats()
        assert s.hits > 0 and s.misses > 0 and shared.inspect().pinned == 0 and word_cache.inspect().pinned == 0
        # a shared-cache part gathers exactly its own table
        ids = rng.integers(0, DIMS.table_rows(2), size=50)
        np.testing.assert_array_equal(
            bits(CachedTable(shared, 2).gather(ids)), bits(tables[2][ids])
        )
        shared.end_step()
        # the shared arena is counted once
        assert all_cached.resident_bytes() < resident.resident_bytes()
    finally:
        store.close()


def test_layer_shared_cache_fp8_equals_resident_fp8(rng, tmp_path):
    from rowcache.embed.tables import CachedTable

    store, shared, _, word, tables, projs = shared_cache_model(rng, tmp_path, dtype="fp8")
    try:
        resident = NgramEmbedding(DIMS, word, [Fp8Table.quantize(t) for t in tables], projs)
        emb = NgramEmbedding(DIMS, word, [CachedTable(shared, k) for k in range(4)], projs)
        _ctxs, tokens, ctx_lens = _packed(rng, [30, 4, 60, 4])
        seq_lens = np.array([28, 1, 60, 1])
        np.testing.assert_array_equal(
            bits(emb.embed_packed(tokens, ctx_lens, seq_lens)),
            bits(resident.embed_packed(tokens, ctx_lens, seq_lens)),
        )
    finally:
        store.close()


@pytest.mark.gpu
def test_layer_gpu_packed_and_shared_cache(rng, tmp_path):
    import cupy as cp

    from rowcache.embed.ngram.context import NgramBatchContext
    from rowcache.embed.tables import CachedTable

    store, shared, word_cache, word, tables, projs = shared_cache_model(
        rng, tmp_path, device="cuda"
    )
    try:
        dev_tables = [cp.asarray(t) for t in tables]
        eager = NgramEmbedding(DIMS, cp.asarray(word), dev_tables, projs)
        cached = NgramEmbedding(
            DIMS, cp.asarray(word), [CachedTable(shared, k) for k in range(4)], projs
        )
        # every n-gram table cached and the word table cached too, the device part of
        # each step replayed from a graph (rows looked up in the caches' device maps,
        # resolved on the host meanwhile, the step run again after a fault)
        graphed = NgramEmbedding(
            DIMS,
            CachedTable(word_cache),
            [CachedTable(shared, k) for k in range(4)],
            projs,
            cuda_graphs=True,
        )
        # mixed: resident tables and parts of the shared cache, the word table cached too
        mixed = NgramEmbedding(
            DIMS,
            CachedTable(word_cache),
            [dev_tables[0], CachedTable(shared, 1), dev_tables[2], CachedTable(shared, 3)],
            projs,
        )
        assert graphed.runner == "graphs" and mixed.runner == "eager"
        cpu = NgramEmbedding(DIMS, word, tables, projs)
        S = 5
        x = [token_stream(rng, 80) for _ in range(S)]
        ctx = NgramBatchContext(DIMS, S)
        for a, b in [(0, 20), *[(k, k + 1) for k in range(20, 80)]]:
            batch = ctx.step(np.concatenate([s[a:b] for s in x]), np.full(S, b - a))
            want = cp.asnumpy(eager.embed_packed(batch)).view(np.uint16)
            np.testing.assert_array_equal(
                bits(gpu_reference(DIMS, word, tables, projs, batch)), want
            )
            for emb in (cached, graphed, mixed):
                np.testing.assert_array_equal(
                    cp.asnumpy(emb.embed_packed(batch)).view(np.uint16), want
                )
            # from device tokens: resolved first, gathered by slot
            dev = NgramBatch(DIMS, cp.asarray(batch.tokens), batch.ctx_lens, batch.seq_lens)
            np.testing.assert_array_equal(bits(cp.asnumpy(mixed.embed_packed(dev))), want)
            ref = cpu.embed_packed(batch).astype(np.float32)
            np.testing.assert_allclose(
                want.view(BF16).astype(np.float32), ref, rtol=2e-2, atol=1e-5
            )
        # device tokens are still range-checked in the hash kernel
        with pytest.raises(ConfigError, match=r"contexts\[1\]\[1\] = 1000"):
            eager.embed_batch([cp.asarray(x[0][:3]), cp.asarray(np.array([1, 1000]))], [1, 1])
        assert shared.inspect().pinned == 0 and word_cache.inspect().pinned == 0
        assert any(g.graph is not None for g in graphed._runner.graphs.values())
        assert shared.stats().misses > 0  # the graphed steps faulted rows in as well
    finally:
        store.close()


@pytest.mark.gpu
def test_layer_gpu_cuda_graphs_equal_eager(rng):
    import cupy as cp

    from rowcache.embed.ngram.context import NgramBatchContext

    word, tables, projs = random_weights(rng)
    dev_tables = [cp.asarray(t) for t in tables]
    eager = NgramEmbedding(DIMS, cp.asarray(word), dev_tables, projs)
    graphs = NgramEmbedding(DIMS, cp.asarray(word), dev_tables, projs, cuda_graphs=True)
    S = 5
    x = [token_stream(rng, 80) for _ in range(S)]
    ctx = NgramBatchContext(DIMS, S)
    kept, wants = [], []
    for a, b in [(0, 20), *[(k, k + 1) for k in range(20, 80)]]:
        batch = ctx.step(np.concatenate([s[a:b] for s in x]), np.full(S, b - a))
        wants.append(cp.asnumpy(eager.embed_packed(batch)).view(np.uint16))
        kept.append(graphs.embed_packed(batch))
    # every step bit-identical, and each output its own array (not overwritten by replays)
    for got, want in zip(kept, wants):
        np.testing.assert_array_equal(cp.asnumpy(got).view(np.uint16), want)
    # two shapes (the 20-token prefill once, then decode steps): the decode one replays;
    # a decode context is the kept max_ngram - 1 tokens plus the new one, per sequence
    assert sorted((k, g.graph is not None) for k, g in graphs._runner.graphs.items()) == [
        ((S * DIMS.max_ngram, S, True), True),
        ((100, 100, True), False),
    ]
    # one sequence (a prefill) through a graph, into out=
    out = cp.empty((30, 48), dtype=BF16)
    for k in range(4):
        c = x[k][:40]
        graphs.embed(c, 30, out=out)
        np.testing.assert_array_equal(
            cp.asnumpy(out).view(np.uint16), cp.asnumpy(eager.embed(c, 30)).view(np.uint16)
        )
    assert graphs._runner.graphs[(40, 30, False)].graph is not None


def test_static_step_needs_resident_gpu_tables(rng):
    from rowcache.embed.ngram.batch import NgramBatch

    word, tables, projs = random_weights(rng)
    emb = NgramEmbedding(DIMS, word, tables, projs)
    with pytest.raises(ConfigError, match="static_step needs resident tables on the GPU"):
        emb.static_step(NgramBatch.single(DIMS, token_stream(rng, 10), 4))


@pytest.mark.gpu
# table width 12 (no 16-byte path), 16; word rows in chunks of 256: 3 (the last 88 wide,
# no 16-byte path) and 4
@pytest.mark.parametrize("hidden", [48, 64, 600, 1024])
@pytest.mark.parametrize("word_kind", ["bf16", "fp8"])
def test_hash_gather_gpu_bitexact(rng, hidden, word_kind):
    import cupy as cp

    from rowcache.embed.ngram.batch import NgramBatch
    from rowcache.kernels.ngram.hash import hash_gather, hash_gather_reference
    from rowcache.kernels.ngram.stacked import StackedTables

    dims = NgramDims(
        vocab_size=1000, hidden_size=hidden, max_ngram=3, splits=2, ratio=2.5, eos_token_id=2
    )
    word, tables, _ = random_weights(rng, dims)
    fp8 = Fp8Table.quantize(tables[1])
    host_parts = [(tables[0], None), fp8.arrays, (tables[2], None), (tables[3], None)]
    dev_parts = [(cp.asarray(a), None if s is None else cp.asarray(s)) for a, s in host_parts]
    wparts = (word, None) if word_kind == "bf16" else Fp8Table.quantize(word).arrays
    host_st, dev_st = StackedTables(host_parts), StackedTables(dev_parts)
    host_w = StackedTables([wparts])
    dev_w = StackedTables(
        [(cp.asarray(wparts[0]), None if wparts[1] is None else cp.asarray(wparts[1]))]
    )
    mult, rows = dims.multipliers, dims.all_table_rows
    T, d, D = dims.num_tables, dims.table_dim, hidden
    x = token_stream(rng, 300)
    x[:3] = dims.eos_token_id  # EOS at the start, adjacent EOS
    contexts = [x[:3], x[3:40], x[40:41], x[41:300]]
    cases = [NgramBatch.single(dims, x, n) for n in (1, 77, 300)]
    cases.append(NgramBatch.from_contexts(dims, contexts, [1, 30, 1, 200]))
    for batch in cases:
        n, L = batch.n, batch.length
        multi = batch.num_seqs > 1
        tok = np.asarray(batch.tokens, dtype=np.int64)
        starts = np.asarray(batch.starts, dtype=np.int64) if multi else None
        pos = np.asarray(batch.positions, dtype=np.int64) if multi else np.arange(L - n, L)
        out_ref, words_ref = np.zeros((n, T * d), BF16), np.zeros((n, D), BF16)
        hash_gather_reference(tok, starts, pos, mult, rows, 2, host_st, out_ref, host_w, words_ref)
        # the reference is the composition of the tested pieces: check it once more here
        ids = ngram_ids_loop_reference(dims, tok[: batch.length]) if not multi else None
        if ids is not None:
            np.testing.assert_array_equal(bits(out_ref[:, :d]), bits(tables[0][ids[0, L - n :]]))
        out = cp.full((n + 1, T * d), 7, dtype=cp.uint16).view(BF16)
        words = cp.full((n + 1, D), 7, dtype=cp.uint16).view(BF16)
        hash_gather(
            cp.asarray(tok),
            None if starts is None else cp.asarray(starts),
            None if not multi else cp.asarray(pos),
            cp.asarray(mult),
            cp.asarray(rows),
            2,
            dev_st,
            out[:n],
            dev_w,
            words[:n],
        )
        np.testing.assert_array_equal(bits(cp.asnumpy(out[:n])), bits(out_ref))
        np.testing.assert_array_equal(bits(cp.asnumpy(words[:n])), bits(words_ref))
        assert int(cp.asnumpy(out[n].view(cp.uint16)).max()) == 7  # nothing past n written
        assert int(cp.asnumpy(words[n].view(cp.uint16)).min()) == 7


@pytest.mark.gpu
def test_static_step_replays_bit_identical_to_eager(rng):
    import cupy as cp

    from rowcache.embed.ngram.context import NgramBatchContext

    word, tables, projs = random_weights(rng)
    dev_tables = [cp.asarray(t) for t in tables]
    dev_tables[2] = Fp8Table.quantize(dev_tables[2])
    emb = NgramEmbedding(DIMS, cp.asarray(word), dev_tables, projs)
    S = 4
    x = [token_stream(rng, 40) for _ in range(S)]
    ctx = NgramBatchContext(DIMS, S)
    prefill = ctx.step(np.concatenate([s[:10] for s in x]), np.full(S, 10))
    emb.embed_packed(prefill)
    step = None
    for k in range(10, 40):
        batch = ctx.step(np.array([s[k] for s in x]), np.ones(S, dtype=np.int64))
        want = bits(cp.asnumpy(emb.embed_packed(batch)))
        if step is None:
            step = emb.static_step(batch)
        else:
            step.load(batch)
        step.run()
        np.testing.assert_array_equal(bits(cp.asnumpy(step.out)), want)
    assert step is not None and step.graph is not None and step.runs == 30
    # issue() inside a caller's own capture: the same work, replayed by the caller's graph
    step.load(batch)
    cap = cp.cuda.Stream(non_blocking=True)
    with cap:
        cap.begin_capture()
        step.issue()
        outer = cap.end_capture()
    step.out.fill(0)
    outer.launch(cp.cuda.get_current_stream())
    np.testing.assert_array_equal(bits(cp.asnumpy(step.out)), want)
    with pytest.raises(ConfigError, match="this static step has"):
        step.load(prefill)


def test_gemm_splits_config_and_parts_reference(rng):
    from rowcache.kernels.gemm import gemm_bf16_f32_parts, scale_sum_reference, split_k

    word, tables, projs = random_weights(rng)
    with pytest.raises(ConfigError, match="gemm_splits=5"):
        NgramEmbedding(DIMS, word, tables, projs, gemm_splits=5)  # T*d = 48
    assert split_k(48, 2) and not split_k(48, 4) and not split_k(48, 0)
    a = (rng.standard_normal((7, 48)) * 0.3).astype(np.float32).astype(BF16)
    b = (rng.standard_normal((48, 20)) * 0.3).astype(np.float32).astype(BF16)
    parts = gemm_bf16_f32_parts(a, b, np.empty((2, 7, 20), np.float32))
    np.testing.assert_allclose(
        parts.sum(0), a.astype(np.float64) @ b.astype(np.float64), rtol=1e-5, atol=1e-5
    )
    w = word[:7, :20]
    want = ((w.astype(np.float32) + (parts[0] + parts[1])) / np.float32(13)).astype(BF16)
    np.testing.assert_array_equal(bits(scale_sum_reference(w, parts, 13.0)), bits(want))


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 2, 4, 8])
def test_gemm_parts_and_scale_sum_gpu(rng, splits):
    import cupy as cp

    from rowcache.kernels.gemm import gemm_bf16_f32_parts, scale_sum, scale_sum_reference

    n, k, m = 37, 256, 96
    a = (rng.standard_normal((n, k)) * 0.3).astype(np.float32).astype(BF16)
    b = (rng.standard_normal((k, m)) * 0.3).astype(np.float32).astype(BF16)
    out = cp.full((splits, n, m), np.nan, dtype=cp.float32)
    gemm_bf16_f32_parts(cp.asarray(a), cp.asarray(b), out)
    ks = k // splits
    for j in range(splits):  # each part against float64: fp32 accumulation, rounding only
        ref = a[:, j * ks : (j + 1) * ks].astype(np.float64) @ b[j * ks : (j + 1) * ks].astype(
            np.float64
        )
        np.testing.assert_allclose(cp.asnumpy(out[j]), ref, rtol=1e-4, atol=1e-4)
    word = (rng.standard_normal((n, m)) * 0.3).astype(np.float32).astype(BF16)
    got = scale_sum(cp.asarray(word), out, 13.0)
    np.testing.assert_array_equal(
        bits(cp.asnumpy(got)), bits(scale_sum_reference(word, cp.asnumpy(out), 13.0))
    )


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 1, 2, 4])
def test_layer_gpu_gemm_splits_paths_bit_identical(rng, splits):
    import cupy as cp

    from rowcache.embed.ngram.context import NgramBatchContext

    dims = NgramDims(
        vocab_size=1000, hidden_size=64, max_ngram=3, splits=2, ratio=2.5, eos_token_id=2
    )
    word, tables, projs = random_weights(rng, dims)
    dev = [cp.asarray(t) for t in tables]
    eager = NgramEmbedding(dims, cp.asarray(word), dev, projs, gemm_splits=splits)
    graphs = NgramEmbedding(
        dims, cp.asarray(word), dev, projs, gemm_splits=splits, cuda_graphs=True
    )
    cpu = NgramEmbedding(dims, word, tables, projs)
    S = 3
    x = [token_stream(rng, 40) for _ in range(S)]
    ctx = NgramBatchContext(dims, S)
    for a, b in [(0, 12), *[(k, k + 1) for k in range(12, 20)]]:
        batch = ctx.step(np.concatenate([s[a:b] for s in x]), np.full(S, b - a))
        want = bits(cp.asnumpy(eager.embed_packed(batch)))
        ref = gpu_reference(dims, word, tables, projs, batch, gemm_splits=splits)
        np.testing.assert_array_equal(bits(ref), want)
        np.testing.assert_array_equal(bits(cp.asnumpy(graphs.embed_packed(batch))), want)
        dev = NgramBatch(dims, cp.asarray(batch.tokens), batch.ctx_lens, batch.seq_lens)
        np.testing.assert_array_equal(bits(cp.asnumpy(eager.embed_packed(dev))), want)
        ref = cpu.embed_packed(batch).astype(np.float32)
        np.testing.assert_allclose(want.view(BF16).astype(np.float32), ref, rtol=2e-2, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 7, 640, 70_000])
def test_copy_from_mapped_gpu(rng, n):
    import cupy as cp
    import cupyx

    from rowcache.kernels.ngram.stacked import copy_from_mapped

    host = cupyx.empty_pinned(n, dtype=np.int64)
    host[:] = rng.integers(-(2**62), 2**62, size=n)
    dst = cp.full(n + 1, 5, dtype=cp.int64)
    copy_from_mapped(host.ctypes.data, dst, n)
    np.testing.assert_array_equal(cp.asnumpy(dst[:n]), host)
    assert int(dst[n]) == 5


@pytest.mark.gpu
def test_layer_gpu_cached_with_overlay_and_faults_equals_resident(rng, tmp_path):
    """The GPU step through the device maps with an overlay: steps that fault (resolved
    first, or their device part run again: gathers, overlay, GEMM, sum) still equal the
    resident one."""
    import cupy as cp

    from rowcache.embed.tables import CachedTable

    store, shared, word_cache, word, tables, projs = shared_cache_model(
        rng, tmp_path, device="cuda", slots_frac=0.3
    )
    try:
        adapter = word.copy()
        changed = np.array([5, 17, 999])
        adapter[changed] = (rng.standard_normal((3, 48)) * 0.3).astype(np.float32).astype(BF16)
        ov = TokenOverlay(DIMS.vocab_size, DIMS.hidden_size, 2, device="cuda")
        ov.set_adapter(1, embed_weight=adapter, served_embed=word)
        resident = NgramEmbedding(DIMS, cp.asarray(word), [cp.asarray(t) for t in tables], projs)
        cached = NgramEmbedding(
            DIMS, CachedTable(word_cache), [CachedTable(shared, k) for k in range(4)], projs
        )
        assert cached.runner == "eager"
        faulted = 0
        for _ in range(12):
            x = np.concatenate([token_stream(rng, 40), changed])
            slots = np.array([-1, 1], np.int32)
            before = shared.stats().misses + word_cache.stats().misses
            got = cached.embed_batch([x, x[::-1].copy()], [43, 20], overlay=ov, seq_slots=slots)
            faulted += shared.stats().misses + word_cache.stats().misses - before
            want = resident.embed_batch([x, x[::-1].copy()], [43, 20], overlay=ov, seq_slots=slots)
            np.testing.assert_array_equal(bits(cp.asnumpy(got)), bits(cp.asnumpy(want)))
        assert faulted > 0 and shared.inspect().pinned == 0 and word_cache.inspect().pinned == 0
    finally:
        store.close()


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("check", [True, False])
def test_layer_gpu_cached_step_order_equals_resident(rng, tmp_path, graphs, check, monkeypatch):
    """The one order of a GPU step's host resolve and device part (eager, or replayed from
    a graph), on a decode stream over a small arena where some steps fault and some do
    not; every step equals the resident one. With the check (a step of at most
    CHECK_TOKENS tokens) a step that would fault resolves first and runs its device part
    once, one that would not runs it first and resolves after; without it (CHECK_TOKENS =
    0, as for larger steps) the device part runs first, and again when the resolve
    faulted. The order depends on the call alone: never on the steps before it."""
    import cupy as cp

    import rowcache.embed.step.cached_groups as cached_groups
    from rowcache.embed.tables import CachedTable

    if not check:
        monkeypatch.setattr(cached_groups, "CHECK_TOKENS", 0)
    store, shared, word_cache, word, tables, projs = shared_cache_model(
        rng, tmp_path, device="cuda", slots_frac=0.3
    )
    try:
        resident = NgramEmbedding(DIMS, cp.asarray(word), [cp.asarray(t) for t in tables], projs)
        cached = NgramEmbedding(
            DIMS,
            CachedTable(word_cache),
            [CachedTable(shared, k) for k in range(4)],
            projs,
            cuda_graphs=graphs,
        )
        assert cached.runner == ("graphs" if graphs else "eager")
        groups = cached._groups
        events: list[str] = []
        real_ordered, real_resolve = groups.ordered, groups.rows.resolve

        def ordered(batch, device_part):
            def part():
                events.append("device")
                device_part()

            real_ordered(batch, part)

        def resolve(*args, **kw):
            events.append("resolve")
            return real_resolve(*args, **kw)

        monkeypatch.setattr(groups, "ordered", ordered)
        monkeypatch.setattr(groups.rows, "resolve", resolve)
        x = np.concatenate([token_stream(rng, 30)] * 6)  # repeats: hits after the first pass
        ctx_r, ctx_c = NgramContext(DIMS), NgramContext(DIMS)
        faulted = []
        for k in range(x.size):
            events.clear()
            before = shared.stats().misses + word_cache.stats().misses
            got = cached.embed(ctx_c.step(x[k : k + 1]), 1)
            faulted.append(shared.stats().misses + word_cache.stats().misses > before)
            if check:
                want_events = ["resolve", "device"] if faulted[-1] else ["device", "resolve"]
            else:
                want_events = ["device", "resolve"] + (["device"] if faulted[-1] else [])
            assert events == want_events, (k, faulted[-1])
            want = resident.embed(ctx_r.step(x[k : k + 1]), 1)
            np.testing.assert_array_equal(bits(cp.asnumpy(got)), bits(cp.asnumpy(want)))
        assert any(faulted) and not all(faulted)
        assert shared.inspect().pinned == 0 and word_cache.inspect().pinned == 0
    finally:
        store.close()


@pytest.mark.parametrize("S", [1, 3, 64, 65, 300])  # both sides of the few-sequence checks
def test_batch_checks_on_ints_and_on_arrays_agree(S):
    """NgramBatch checks lengths and tokens on Python ints for a few sequences / tokens
    and by NumPy calls for many: the same batches pass, the same first bad one is named."""
    from rowcache.embed.ngram.batch import NgramBatch

    rng = np.random.default_rng(S)
    for trial in range(60):
        ctx = rng.integers(0, 6, S)
        seq = np.minimum(ctx, rng.integers(0, 3, S))
        tok = rng.integers(0, DIMS.vocab_size, int(ctx.sum()))
        kind = trial % 4
        if kind == 1:  # a seq_len past its context, or negative
            s = int(rng.integers(0, S))
            seq[s] = ctx[s] + 1 if trial % 8 == 1 else -1
        elif kind == 2 and tok.size:  # a token outside the vocabulary
            tok[int(rng.integers(0, tok.size))] = DIMS.vocab_size + trial % 3
        elif kind == 3 and tok.size:
            tok[int(rng.integers(0, tok.size))] = -1
        bad_seq = np.flatnonzero((seq < 0) | (seq > ctx))
        bad_tok = np.flatnonzero((tok < 0) | (tok >= DIMS.vocab_size))
        if bad_seq.size:
            s = int(bad_seq[0])
            with pytest.raises(ConfigError, match=rf"seq_len={seq[s]} for tokens\[{s}\] must"):
                NgramBatch(DIMS, tok, ctx, seq)
        elif bad_tok.size:
            p = int(bad_tok[0])
            with pytest.raises(ConfigError, match=rf"= {tok[p]} is outside the vocabulary"):
                NgramBatch(DIMS, tok, ctx, seq)
        else:
            b = NgramBatch(DIMS, tok, ctx, seq)
            assert (b.n, b.length, b.num_seqs) == (int(seq.sum()), tok.size, S)
    with pytest.raises(ConfigError, match=rf"sum to len\(tokens\)={int(ctx.sum()) + 1}"):
        NgramBatch(DIMS, np.r_[tok, 1], ctx, np.zeros(S, np.int64))


def test_project_and_sum_is_the_gemm_then_the_scaled_sum(rng, xp):
    """The embedding's tail, written once: the same bits as the GEMM in parts and the
    scaled sum called apart, on numpy and on cupy."""
    from rowcache.kernels.gemm import gemm_bf16_f32_parts, project_and_sum, scale_sum

    n, k, d = 9, 48, 20
    stack = xp.asarray(rng.standard_normal((n, k), dtype=np.float32).astype(BF16))
    weights = xp.asarray(rng.standard_normal((k, d), dtype=np.float32).astype(BF16))
    words = xp.asarray(rng.standard_normal((n, d), dtype=np.float32).astype(BF16))
    proj = xp.empty((2, n, d), dtype=xp.float32)
    out = xp.empty((n, d), dtype=BF16)
    got = project_and_sum(stack, weights, words, proj=proj, out=out, denom=13.0)
    assert got is out
    parts = gemm_bf16_f32_parts(stack, weights, xp.empty((2, n, d), dtype=xp.float32))
    want = scale_sum(words, parts, 13.0)
    host = (lambda a: xp.asnumpy(a)) if xp is not np else np.asarray
    np.testing.assert_array_equal(host(got).view(np.uint16), host(want).view(np.uint16))
