"""TokenOverlay: adapters found by rowdiff, routed per row, on CPU and GPU; the layer hook."""

from __future__ import annotations

import importlib.util
import os
import sys

import ml_dtypes
import numpy as np
import pytest

from rowcache.embed.overlay.overlay import TokenOverlay
from rowcache.errors import ConfigError, GpuUnavailableError
from rowcache.kernels.loader import gpu_available
from rowcache.kernels.overlay.routed import DEFAULT_MMA_CONFIG, MMA_CONFIGS
from rowcache.kernels.reference import batched_embed_reference

BF16 = np.dtype(ml_dtypes.bfloat16)
V, H = 96, 64


def bf16(rng, *shape):
    return rng.standard_normal(shape, dtype=np.float32).astype(BF16)


def adapter_from(rng, served, changed, extra_rows=0, keep_rows=None):
    """A copy of ``served`` with rows ``changed`` replaced, ``extra_rows`` new rows appended,
    or truncated to ``keep_rows``."""
    a = served.copy()
    a[changed] = bf16(rng, len(changed), served.shape[1])
    if extra_rows:
        a = np.concatenate([a, bf16(rng, extra_rows, served.shape[1])])
    if keep_rows is not None:
        a = a[:keep_rows].copy()
    return a


@pytest.fixture
def model(rng):
    """Served embedding/LM head and three adapters of different vocab sizes."""
    emb = bf16(rng, V, H)
    head = bf16(rng, V, H)
    adapters = {
        0: (adapter_from(rng, emb, [1, 5, 40]), adapter_from(rng, head, [5, 7])),
        2: (
            adapter_from(rng, emb, [3, 5], extra_rows=8),
            adapter_from(rng, head, [0], extra_rows=8),
        ),
        3: (
            adapter_from(rng, emb, [2, 70], keep_rows=64),
            adapter_from(rng, head, [70], keep_rows=64),
        ),
    }
    return emb, head, adapters


def make_overlay(model, device="cpu", vocab=V + 8):
    emb, head, adapters = model
    ov = TokenOverlay(vocab, H, 4, device=device)
    for slot, (ae, ah) in adapters.items():
        ov.set_adapter(
            slot, embed_weight=ae, lm_head_weight=ah, served_embed=emb, served_lm_head=head
        )
    return ov


def expected_rows(model, ids, slots):
    """Plain-loop expectation: adapter row where it differs from served or is new."""
    emb, _, adapters = model
    out = []
    for tok, s in zip(ids, slots):
        served_row = emb[tok] if 0 <= tok < V else np.zeros(H, BF16)
        row = served_row
        if s in adapters and 0 <= tok < adapters[s][0].shape[0]:
            a = adapters[s][0][tok]
            if tok >= V or (a.view(np.uint16) != served_row.view(np.uint16)).any():
                row = a
        out.append(row)
    return np.stack(out)


def gather_served(emb, ids):
    rows = np.zeros((len(ids), H), BF16)
    ok = (ids >= 0) & (ids < V)
    rows[ok] = emb[ids[ok]]
    return rows


# ----------------------------------------------------------------------- set_adapter
def test_set_adapter_finds_changed_and_new_rows(model):
    ov = make_overlay(model)
    info = ov.adapter_info(0)
    assert info.embed_ids.tolist() == [1, 5, 40] and info.lm_head_ids.tolist() == [5, 7]
    info = ov.adapter_info(2)  # 8 new tokens beyond the served 96 rows are always overridden
    assert info.embed_ids.tolist() == [3, 5, *range(V, V + 8)]
    assert info.lm_head_ids.tolist() == [0, *range(V, V + 8)] and info.embed_vocab == V + 8
    info = ov.adapter_info(3)  # a smaller adapter: row 70 lies beyond its vocabulary
    assert info.embed_ids.tolist() == [2] and info.lm_head_ids.size == 0 and info.embed_vocab == 64
    assert ov.adapter_info(1).empty and ov.num_adapters == 3


def test_set_adapter_thresh_and_partial_parts(rng):
    emb = bf16(rng, V, H)
    a = emb.copy()
    a[4, 0] = emb[4, 0] + BF16.type(0.25)
    a[9] = bf16(rng, H)
    ov = TokenOverlay(V, H, 2)
    assert ov.set_adapter(0, embed_weight=a, served_embed=emb).embed_ids.tolist() == [4, 9]
    info = ov.set_adapter(0, embed_weight=a, served_embed=emb, thresh=0.5)
    assert info.embed_ids.tolist() == [9] and info.lm_head_ids.size == 0
    # only an LM head: the embedding side is left alone
    info = ov.set_adapter(1, lm_head_weight=a, served_lm_head=emb, served_embed=emb)
    assert info.embed_ids.size == 0 and info.lm_head_ids.tolist() == [4, 9]
    rows = emb[[4, 9]].copy()
    ov.apply_embed(np.array([4, 9]), rows, active=1)
    np.testing.assert_array_equal(rows.view(np.uint16), emb[[4, 9]].view(np.uint16))


def test_empty_adapter_and_clear(model, rng):
    emb, _head, _ = model
    ov = make_overlay(model)
    assert ov.set_adapter(1, embed_weight=emb.copy(), served_embed=emb).empty  # no change
    ids = rng.integers(0, V, size=32)
    rows = emb[ids].copy()
    ov.apply_embed(ids, rows, active=1)
    np.testing.assert_array_equal(rows.view(np.uint16), emb[ids].view(np.uint16))
    ov.clear_adapter(0)
    ids = np.array([1, 5, 40])
    rows = emb[ids].copy()
    ov.apply_embed(ids, rows, active=0)
    np.testing.assert_array_equal(rows.view(np.uint16), emb[ids].view(np.uint16))
    hidden = bf16(rng, 3, H)
    logits = np.zeros((3, V + 8), np.float32)
    ov.apply_lmhead(hidden, logits, active=0)
    assert not logits.any() and ov.adapter_info(0).empty


# ----------------------------------------------------------------------- routing
def test_apply_embed_mixed_slots_matches_loop(model, rng):
    ov = make_overlay(model)
    n = 300
    ids = rng.integers(-2, V + 12, size=n)
    ids[:6] = [V - 1, V, V + 7, V + 8, 63, 64]  # at and beyond the vocabularies
    slots = rng.integers(-1, 4, size=n).astype(np.int32)
    rows = gather_served(model[0], ids)
    got = ov.apply_embed(ids, rows, seq_slot=slots)
    assert got is rows
    want = expected_rows(model, ids, slots)
    np.testing.assert_array_equal(rows.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("active", [-1, 0, 2, 3])
def test_apply_embed_active_fallback_and_scalar_slot(model, rng, active):
    ov = make_overlay(model)
    ids = np.concatenate([np.arange(V + 8), rng.integers(0, V, size=40)]).astype(np.int32)
    want = expected_rows(model, ids, [active] * len(ids))
    rows = gather_served(model[0], ids)
    ov.apply_embed(ids, rows, active=active)
    np.testing.assert_array_equal(rows.view(np.uint16), want.view(np.uint16))
    rows = gather_served(model[0], ids)
    ov.apply_embed(ids, rows, seq_slot=np.int64(active))  # a scalar slot == active
    np.testing.assert_array_equal(rows.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("logit_dtype", [np.float32, BF16])
def test_apply_lmhead_mixed_slots_matches_loop(model, rng, logit_dtype):
    _emb, head, adapters = model
    ov = make_overlay(model)
    n, cols = 40, V + 4  # logits narrower than adapter 2's vocabulary: ids >= cols skipped
    hidden = bf16(rng, n, H)
    slots = rng.integers(-1, 4, size=n).astype(np.int32)
    base = np.concatenate(
        [
            hidden.astype(np.float32) @ head.astype(np.float32).T,
            np.zeros((n, cols - V), np.float32),
        ],
        axis=1,
    )
    logits = base.astype(logit_dtype)
    ov.apply_lmhead(hidden, logits, seq_slot=slots)
    for r in range(n):
        s = int(slots[r])
        want = base[r].copy()
        if s in adapters:
            ah = adapters[s][1]
            for tok in ov.adapter_info(s).lm_head_ids:
                if tok < cols:
                    want[tok] = float(
                        np.dot(hidden[r].astype(np.float64), ah[tok].astype(np.float64))
                    )
        rtol = 1e-5 if logit_dtype == np.float32 else 2.0**-8
        np.testing.assert_allclose(logits[r].astype(np.float64), want, rtol=rtol, atol=1e-4)
    assert ov.adapter_info(2).lm_head_ids.max() >= cols


def test_adapter_with_thousands_of_overrides(rng):
    vocab, hidden = 8192, 64
    emb, head = bf16(rng, vocab, hidden), bf16(rng, vocab, hidden)
    ov = TokenOverlay(vocab, hidden, 2)
    changed = np.sort(rng.choice(vocab, size=3000, replace=False))
    ae = adapter_from(rng, emb, changed)
    ah = adapter_from(rng, head, changed)
    info = ov.set_adapter(
        1, embed_weight=ae, lm_head_weight=ah, served_embed=emb, served_lm_head=head
    )
    assert info.embed_ids.tolist() == changed.tolist() == info.lm_head_ids.tolist()
    ids = rng.integers(0, vocab, size=256)
    slots = (np.arange(256) % 2).astype(np.int32)
    rows = emb[ids].copy()
    ov.apply_embed(ids, rows, seq_slot=slots)
    want = np.where((slots == 1)[:, None], ae[ids], emb[ids])
    np.testing.assert_array_equal(rows.view(np.uint16), want.view(np.uint16))
    hs = bf16(rng, 8, hidden)
    logits = (hs.astype(np.float32) @ head.astype(np.float32).T).astype(BF16)
    ov.apply_lmhead(hs, logits, active=1)
    want = (hs.astype(np.float32) @ ah.astype(np.float32).T).astype(BF16)
    np.testing.assert_allclose(logits.astype(np.float32), want.astype(np.float32), rtol=2.0**-7)


# ----------------------------------------------------------------------- bad inputs
def test_bad_construction():
    with pytest.raises(ConfigError, match="device"):
        TokenOverlay(V, H, 2, device="tpu")
    with pytest.raises(ConfigError, match="max_adapters"):
        TokenOverlay(V, H, 0)
    with pytest.raises(ConfigError, match="hidden_size"):
        TokenOverlay(V, 2.5, 1)
    ov = TokenOverlay(V, H, 1)
    assert ov.lmhead_tile == (4, 4)
    ov.lmhead_tile = [2, 4]
    assert ov.lmhead_tile == (2, 4)
    for bad in [(3, 3), 4, "x"]:
        with pytest.raises(ConfigError, match="lmhead_tile"):
            ov.lmhead_tile = bad


def test_lmhead_path_knob_and_reserve():
    ov = TokenOverlay(V, H, 2)
    assert ov.lmhead_path == "auto" and ov.lmhead_generation == 0
    for path in ("gemm", "mma", "warp", "auto"):
        ov.lmhead_path = path
        assert ov.lmhead_path == path
    for bad in ("cublas", None, 1):
        with pytest.raises(ConfigError, match="lmhead_path"):
            ov.lmhead_path = bad
    assert ov.lmhead_mma_config == DEFAULT_MMA_CONFIG
    for config in MMA_CONFIGS:
        ov.lmhead_mma_config = list(config)
        assert ov.lmhead_mma_config == config
    for bad in ((3, 8, 4), (1, 8), (1.0, 8, 4), (1, 8, 5), (1, 4, 8), None, "x"):
        with pytest.raises(ConfigError, match="lmhead_mma_config"):
            ov.lmhead_mma_config = bad
    ov.reserve_lmhead(rows=4000, batch=64)  # the CPU path has no GEMM buffers
    assert ov.lmhead_capacity == (0, 0) and ov.lmhead_generation == 0
    with pytest.raises(ConfigError, match="rows"):
        ov.reserve_lmhead(rows=-1)
    with pytest.raises(ConfigError, match="batch"):
        ov.reserve_lmhead(batch=2.5)


@pytest.mark.skipif(gpu_available(), reason="checks the error raised where no GPU is usable")
def test_cuda_without_gpu_raises_at_construction():
    with pytest.raises(GpuUnavailableError, match="TokenOverlay"):
        TokenOverlay(V, H, 2, device="cuda")


def test_set_adapter_rejects_bad_inputs(model, rng):
    emb, head, _ = model
    ov = TokenOverlay(V, H, 2)
    with pytest.raises(ConfigError, match="slot"):
        ov.set_adapter(2, embed_weight=emb, served_embed=emb)
    with pytest.raises(ConfigError, match="slot"):
        ov.set_adapter(-1, embed_weight=emb, served_embed=emb)
    with pytest.raises(ConfigError, match="embed_weight and/or lm_head_weight"):
        ov.set_adapter(0, served_embed=emb)
    with pytest.raises(ConfigError, match="served_embed"):
        ov.set_adapter(0, embed_weight=emb)
    with pytest.raises(ConfigError, match="embed_weight"):
        ov.set_adapter(0, embed_weight=emb.astype(np.float32), served_embed=emb)
    with pytest.raises(ConfigError, match="hidden_size"):
        ov.set_adapter(0, lm_head_weight=bf16(rng, V, H + 1), served_lm_head=head)
    with pytest.raises(ConfigError, match="vocab_size"):
        ov.set_adapter(0, embed_weight=bf16(rng, V + 1, H), served_embed=emb)
    with pytest.raises(ConfigError, match="thresh"):
        ov.set_adapter(0, embed_weight=emb, served_embed=emb, thresh=-1)
    assert ov.num_adapters == 0  # nothing installed by the failures


def test_apply_rejects_bad_inputs(model, rng):
    emb = model[0]
    ov = make_overlay(model)
    ids = np.arange(4)
    rows = emb[ids].copy()
    with pytest.raises(ConfigError, match="rows"):
        ov.apply_embed(ids, rows.astype(np.float32))
    with pytest.raises(ConfigError, match="rows"):
        ov.apply_embed(ids, bf16(rng, 4, H + 1))
    with pytest.raises(ConfigError, match="ids"):
        ov.apply_embed(ids[:3], rows)
    with pytest.raises(ConfigError, match="ids"):
        ov.apply_embed(ids.astype(np.float32), rows)
    with pytest.raises(ConfigError, match="seq_slot"):
        ov.apply_embed(ids, rows, seq_slot=np.array([0, 1, 2, 4]))
    with pytest.raises(ConfigError, match="seq_slot"):
        ov.apply_embed(ids, rows, seq_slot=np.zeros(5, np.int32))
    with pytest.raises(ConfigError, match="active"):
        ov.apply_embed(ids, rows, active=4)
    with pytest.raises(ConfigError, match="active"):
        ov.apply_embed(ids, rows, active=None)
    hidden = bf16(rng, 4, H)
    with pytest.raises(ConfigError, match="logits"):
        ov.apply_lmhead(hidden, np.zeros((4, V), np.float16))
    with pytest.raises(ConfigError, match="logits"):
        ov.apply_lmhead(hidden, np.zeros((3, V), np.float32))
    with pytest.raises(ConfigError, match="logits"):
        ov.apply_lmhead(hidden, np.zeros((4, V), np.float32)[:, ::2])
    with pytest.raises(ConfigError, match="hidden"):
        ov.apply_lmhead(hidden[:, :-1].copy(), np.zeros((4, V), np.float32))
    np.testing.assert_array_equal(rows.view(np.uint16), emb[ids].view(np.uint16))


# ----------------------------------------------------------------------- integration
def test_overlay_on_word_row_gather(model, rng):
    """The served word-row gather followed by apply_embed equals the adapter's rows for its
    overridden tokens and the served rows for every other token."""
    emb, _, adapters = model
    ov = make_overlay(model)
    ids = rng.integers(0, V, size=128)
    ids[:3] = [1, 5, 40]
    slots = np.repeat(np.array([0, -1, 2, 3], np.int32), 32)
    rows = batched_embed_reference(ids, emb)
    ov.apply_embed(ids, rows, seq_slot=slots)
    for s in (0, 2, 3):
        sel = slots == s
        over = np.isin(ids, ov.adapter_info(s).embed_ids) & sel
        np.testing.assert_array_equal(
            rows[over].view(np.uint16), adapters[s][0][ids[over]].view(np.uint16)
        )
        np.testing.assert_array_equal(
            rows[sel & ~over].view(np.uint16), emb[ids[sel & ~over]].view(np.uint16)
        )
    assert np.isin(ids[:3], ov.adapter_info(0).embed_ids).all()
    np.testing.assert_array_equal(
        rows[slots == -1].view(np.uint16), emb[ids[slots == -1]].view(np.uint16)
    )


def test_overlay_in_ngram_embedding(rng):
    """NgramEmbedding(overlay=...): a sequence routed to the adapter embeds exactly like the
    model whose word table is the adapter's; other sequences like the served model."""
    layer = pytest.importorskip("rowcache.embed.layer")
    from rowcache.embed.ngram.dims import NgramDims

    dims = NgramDims(vocab_size=V, hidden_size=H, max_ngram=3, splits=2, ratio=2, eos_token_id=2)
    T, d = dims.num_tables, dims.table_dim
    word = bf16(rng, V, H)
    tables = [bf16(rng, dims.table_rows(i), d) for i in range(T)]
    projs = [bf16(rng, H, d) for _ in range(T)]
    changed = [5, 6, 17, 80]
    adapter_word = adapter_from(rng, word, changed)
    ov = TokenOverlay(V, H, 2)
    ov.set_adapter(1, embed_weight=adapter_word, served_embed=word)
    served = layer.NgramEmbedding(dims, word, tables, projs)
    tuned = layer.NgramEmbedding(dims, adapter_word, tables, projs)
    ctx = np.array([7, 5, 6, 9, 17, 80, 2, 5, 11, 80, 33], np.int64)
    got = served.embed(ctx, 8, overlay=ov, seq_slot=1)
    np.testing.assert_array_equal(got.view(np.uint16), tuned.embed(ctx, 8).view(np.uint16))
    got = served.embed(ctx, 8, overlay=ov, seq_slot=-1)
    np.testing.assert_array_equal(got.view(np.uint16), served.embed(ctx, 8).view(np.uint16))
    assert (tuned.embed(ctx, 8) != served.embed(ctx, 8)).any()  # the adapter matters here
    # two sequences in one batch, routed differently
    ctx2 = np.array([5, 6, 40, 17], np.int64)
    got = served.embed_batch([ctx, ctx2], [8, 4], overlay=ov, seq_slots=[-1, 1])
    want = np.concatenate([served.embed(ctx, 8), tuned.embed(ctx2, 4)])
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


# ----------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_token_overlay_gpu_matches_cpu(model, rng):
    import cupy as cp

    emb, _head, _ = model
    cpu = make_overlay(model)
    gpu = make_overlay(model, device="cuda")
    for s in range(4):
        a, b = cpu.adapter_info(s), gpu.adapter_info(s)
        assert a.embed_ids.tolist() == b.embed_ids.tolist()
        assert a.lm_head_ids.tolist() == b.lm_head_ids.tolist()
    n = 200
    ids = rng.integers(-2, V + 12, size=n)
    slots = rng.integers(-1, 4, size=n).astype(np.int32)
    rows = gather_served(emb, ids)
    want = cpu.apply_embed(ids, rows.copy(), seq_slot=slots)
    for d_ids, d_slots in [(cp.asarray(ids), cp.asarray(slots)), (ids, slots)]:
        d_rows = cp.asarray(rows)
        gpu.apply_embed(d_ids, d_rows, seq_slot=d_slots)
        np.testing.assert_array_equal(d_rows.get().view(np.uint16), want.view(np.uint16))
    hidden = bf16(rng, n, H)
    for dtype in (np.float32, BF16):
        logits = bf16(rng, n, V + 8).astype(dtype)
        want = cpu.apply_lmhead(hidden, logits.copy(), seq_slot=slots)
        d_logits = cp.asarray(logits)
        gpu.apply_lmhead(cp.asarray(hidden), d_logits, seq_slot=cp.asarray(slots))
        got = d_logits.get().astype(np.float64)
        rtol = 2.0**-7 if dtype == BF16 else 1e-5
        np.testing.assert_allclose(got, want.astype(np.float64), rtol=rtol, atol=1e-4)
    # clearing an adapter reaches the device tables
    gpu.clear_adapter(0)
    d_rows = cp.asarray(emb[[1, 5, 40]])
    gpu.apply_embed(cp.asarray([1, 5, 40]), d_rows, active=0)
    np.testing.assert_array_equal(d_rows.get().view(np.uint16), emb[[1, 5, 40]].view(np.uint16))


@pytest.mark.gpu
def test_token_overlay_cuda_graph_sees_later_adapters_and_slots(model, rng):
    """Capture both overlays in a CUDA graph with no adapter set, then install adapters and
    rewrite seq_slot in place: the replay applies them (tables are read through pointers)."""
    import cupy as cp

    emb, head, adapters = model
    cpu = TokenOverlay(V + 8, H, 4)
    gpu = TokenOverlay(V + 8, H, 4, device="cuda")
    n = 100
    ids = rng.integers(-1, V + 10, size=n)
    hidden = bf16(rng, n, H)
    rows0 = gather_served(emb, ids)
    d_ids, d_hidden, d_rows = cp.asarray(ids), cp.asarray(hidden), cp.asarray(rows0)
    d_slots = cp.full(n, -1, dtype=cp.int32)
    d_logits = cp.zeros((n, V + 8), dtype=cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        gpu.apply_embed(d_ids, d_rows, seq_slot=d_slots)
        gpu.apply_lmhead(d_hidden, d_logits, seq_slot=d_slots)
        graph = stream.end_capture()
    for slot, (ae, ah) in adapters.items():
        for ov in (cpu, gpu):
            ov.set_adapter(
                slot, embed_weight=ae, lm_head_weight=ah, served_embed=emb, served_lm_head=head
            )
    slots = rng.integers(-1, 4, size=n).astype(np.int32)
    d_slots.set(slots)
    cp.cuda.Device().synchronize()
    graph.launch(stream)
    stream.synchronize()
    want_rows = cpu.apply_embed(ids, rows0.copy(), seq_slot=slots)
    np.testing.assert_array_equal(d_rows.get().view(np.uint16), want_rows.view(np.uint16))
    assert (want_rows.view(np.uint16) != rows0.view(np.uint16)).any()
    want = cpu.apply_lmhead(hidden, np.zeros((n, V + 8), np.float32), seq_slot=slots)
    np.testing.assert_allclose(d_logits.get(), want, rtol=1e-5, atol=1e-4)
    assert (want != 0).any()


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["gemm", "mma", "auto", "warp"])
def test_token_overlay_lmhead_paths_match_cpu(model, rng, path):
    """Every GPU LM-head path against the CPU reference: mixed slots (-1, empty slot 1,
    adapters of other vocab sizes), logits narrower than an adapter, bf16 and f32."""
    import cupy as cp

    cpu = make_overlay(model)
    gpu = make_overlay(model, device="cuda")
    gpu.lmhead_path = path
    if path == "mma":  # the other config; the other tests run the default
        gpu.lmhead_mma_config = (1, 8, 4)
    cap, _ = gpu.lmhead_capacity
    total = sum(gpu.adapter_info(s).lm_head_ids.size for s in range(4))
    assert cap % 256 == 0 and cap >= total > 0
    for n, cols in [(200, V + 8), (3, V + 4), (1, V + 8)]:
        hidden = bf16(rng, n, H)
        slots = rng.integers(-1, 4, size=n).astype(np.int32)
        for dtype in (np.float32, BF16):
            logits = bf16(rng, n, cols).astype(dtype)
            want = cpu.apply_lmhead(hidden, logits.copy(), seq_slot=slots)
            d_logits = cp.asarray(logits)
            gpu.apply_lmhead(cp.asarray(hidden), d_logits, seq_slot=cp.asarray(slots))
            got = d_logits.get().astype(np.float64)
            rtol = 2.0**-7 if dtype == BF16 else 1e-5
            np.testing.assert_allclose(got, want.astype(np.float64), rtol=rtol, atol=1e-4)
    # clearing and replacing adapters repacks the table in place (addresses kept)
    gen = gpu.lmhead_generation
    gpu.clear_adapter(0)
    cpu.clear_adapter(0)
    _, head, adapters = model
    gpu.set_adapter(1, lm_head_weight=adapters[0][1], served_lm_head=head)
    cpu.set_adapter(1, lm_head_weight=adapters[0][1], served_lm_head=head)
    assert gpu.lmhead_generation == gen
    hidden = bf16(rng, 64, H)
    slots = np.repeat(np.arange(-1, 4, dtype=np.int32), 13)[:64]
    want = cpu.apply_lmhead(hidden, np.zeros((64, V + 8), np.float32), seq_slot=slots)
    d_logits = cp.zeros((64, V + 8), dtype=cp.float32)
    gpu.apply_lmhead(cp.asarray(hidden), d_logits, seq_slot=cp.asarray(slots))
    np.testing.assert_allclose(d_logits.get(), want, rtol=1e-5, atol=1e-4)
    assert (want[slots == 1] != 0).any() and not want[slots == 0].any()


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["gemm", "mma"])
def test_token_overlay_packed_paths_thousands_of_overrides(rng, path):
    import cupy as cp

    vocab, hidden = 8192, 256
    head = bf16(rng, vocab, hidden)
    cpu = TokenOverlay(vocab, hidden, 3)
    gpu = TokenOverlay(vocab, hidden, 3, device="cuda")
    gpu.lmhead_path = path
    for slot, count in ((0, 3000), (2, 5000)):
        ah = adapter_from(rng, head, np.sort(rng.choice(vocab, size=count, replace=False)))
        for ov in (cpu, gpu):
            ov.set_adapter(slot, lm_head_weight=ah, served_lm_head=head)
    assert gpu.lmhead_capacity[0] == 8192
    n = 96
    hs = bf16(rng, n, hidden)
    slots = (np.arange(n) % 4 - 1).astype(np.int32)  # -1, 0, empty 1, 2
    for dtype in (np.float32, BF16):
        logits = (hs.astype(np.float32) @ head.astype(np.float32).T).astype(dtype)
        want = cpu.apply_lmhead(hs, logits.copy(), seq_slot=slots)
        d_logits = cp.asarray(logits)
        gpu.apply_lmhead(cp.asarray(hs), d_logits, seq_slot=cp.asarray(slots))
        rtol = 2.0**-7 if dtype == BF16 else 1e-5
        np.testing.assert_allclose(
            d_logits.get().astype(np.float64), want.astype(np.float64), rtol=rtol, atol=1e-3
        )
        assert (want.view(np.uint8) != logits.view(np.uint8)).any()


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["gemm", "mma"])
def test_token_overlay_packed_path_in_cuda_graph(model, rng, path):
    """reserve_lmhead, capture the GEMM or mma path, then change adapters within the
    capacity and seq_slot's contents: the replay applies them and the generation does not
    move."""
    import cupy as cp

    emb, head, adapters = model
    cpu = TokenOverlay(V + 8, H, 4)
    gpu = TokenOverlay(V + 8, H, 4, device="cuda")
    gpu.lmhead_path = path
    n = 48
    gpu.reserve_lmhead(rows=20, batch=n)
    assert gpu.lmhead_capacity == (256, n)
    gen = gpu.lmhead_generation
    ids = rng.integers(-1, V + 10, size=n)
    hidden = bf16(rng, n, H)
    rows0 = gather_served(emb, ids)
    d_ids, d_hidden, d_rows = cp.asarray(ids), cp.asarray(hidden), cp.asarray(rows0)
    d_slots = cp.full(n, -1, dtype=cp.int32)
    d_logits = cp.zeros((n, V + 8), dtype=cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        gpu.apply_lmhead(d_hidden, d_logits, seq_slot=d_slots)  # eager first
        stream.synchronize()
        stream.begin_capture()
        try:
            gpu.apply_embed(d_ids, d_rows, seq_slot=d_slots)
            gpu.apply_lmhead(d_hidden, d_logits, seq_slot=d_slots)
        finally:
            graph = stream.end_capture()
    for slot, (ae, ah) in adapters.items():
        for ov in (cpu, gpu):
            ov.set_adapter(
                slot, embed_weight=ae, lm_head_weight=ah, served_embed=emb, served_lm_head=head
            )
    assert gpu.lmhead_generation == gen
    slots = rng.integers(-1, 4, size=n).astype(np.int32)
    d_slots.set(slots)
    cp.cuda.Device().synchronize()
    graph.launch(stream)
    stream.synchronize()
    want_rows = cpu.apply_embed(ids, rows0.copy(), seq_slot=slots)
    np.testing.assert_array_equal(d_rows.get().view(np.uint16), want_rows.view(np.uint16))
    want = cpu.apply_lmhead(hidden, np.zeros((n, V + 8), np.float32), seq_slot=slots)
    np.testing.assert_allclose(d_logits.get(), want, rtol=1e-5, atol=1e-4)
    assert (want != 0).any()
    # outgrowing the reservation moves the buffers: the generation says so
    big = bf16(rng, V + 8, H)  # every row changed or new: 4 x 104 rows > 256
    for slot in range(4):
        gpu.set_adapter(slot, lm_head_weight=big, served_lm_head=head)
    assert gpu.lmhead_generation > gen and gpu.lmhead_capacity[0] == 512


@pytest.mark.gpu
def test_token_overlay_gpu_rejects_host_rows(model):
    gpu = make_overlay(model, device="cuda")
    with pytest.raises(ConfigError, match="cupy"):
        gpu.apply_embed(np.arange(2), model[0][:2].copy())


# ----------------------------------------------------------------------- bench
def test_bench_overlay_quick(capsys):
    path = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "overlay.py")
    spec = importlib.util.spec_from_file_location("bench_overlay", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_overlay"] = mod
    spec.loader.exec_module(mod)
    result = mod.main(["--quick", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "ratio" in out and result["ratio"] > 0 and result["overlay_s"] > 0
