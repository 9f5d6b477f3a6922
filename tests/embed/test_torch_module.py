"""rowcache.embed.TorchNgramEmbedding: the reference module's forward over NgramEmbedding (CPU; GPU marked)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import rowcache.embed  # noqa: E402
from rowcache import NgramRowCache, build_store  # noqa: E402
from rowcache.embed import NgramDims, NgramEmbedding, TokenOverlay, TorchNgramEmbedding  # noqa: E402
from rowcache.embed.checkpoint import load_pretrained  # noqa: E402
from rowcache.embed.tables import CachedTable  # noqa: E402
from rowcache.errors import ConfigError  # noqa: E402
from rowcache.kernels.reference import BF16  # noqa: E402
from tests.embed.support import corrupt_tables, restore  # noqa: E402

DIMS = NgramDims(vocab_size=300, hidden_size=48, max_ngram=4, splits=2, ratio=2.5, eos_token_id=2)
KEEP = DIMS.max_ngram - 1


def _weights(rng):
    T, d, D = DIMS.num_tables, DIMS.table_dim, DIMS.hidden_size
    bf = lambda a: a.astype(np.float32).astype(BF16)  # noqa: E731
    word = bf(rng.standard_normal((DIMS.vocab_size, D)) * 0.1)
    tables = [bf(rng.standard_normal((DIMS.table_rows(i), d))) for i in range(T)]
    projs = [bf(rng.standard_normal((D, d)) * 0.2) for _ in range(T)]
    return word, tables, projs


@pytest.fixture
def weights(rng):
    return _weights(rng)


@pytest.fixture
def emb(weights):
    return NgramEmbedding(DIMS, *weights)


def _bits(t):
    """uint16 bits of a bf16 torch tensor or ml_dtypes array."""
    if isinstance(t, torch.Tensor):
        return t.cpu().view(torch.int16).numpy().view(np.uint16)
    return np.asarray(t).view(np.uint16)


def _ids(rng, shape):
    x = rng.integers(3, DIMS.vocab_size, size=shape)
    x.flat[::11] = DIMS.eos_token_id
    return torch.from_numpy(x)


def _row(emb, ctx, ids):
    """The embedding of one row, from NgramEmbedding directly (the ground truth)."""
    return emb.embed(
        np.concatenate([np.asarray(ctx, dtype=np.int64)[-KEEP:], ids.numpy()]), len(ids)
    )


def test_import_embed_does_not_import_torch():
    code = "import sys, rowcache.embed; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    assert rowcache.embed.TorchNgramEmbedding is TorchNgramEmbedding
    with pytest.raises(AttributeError, match="no attribute"):
        rowcache.embed.NoSuchThing  # noqa: B018


def test_forward_single_row_equals_embed(emb, rng):
    mod = TorchNgramEmbedding(emb)
    ids = _ids(rng, (1, 40))
    out = mod(ids)
    assert out.dtype == torch.bfloat16 and out.shape == (1, 40, DIMS.hidden_size)
    assert out.device.type == "cpu" and not out.requires_grad
    np.testing.assert_array_equal(_bits(out[0]), _bits(emb.embed(ids[0].numpy(), 40)))


def test_forward_batch_with_context_uses_last_keep_tokens(emb, rng):
    mod = TorchNgramEmbedding(emb)
    ids, ctx = _ids(rng, (3, 5)), _ids(rng, (3, 9))
    out = mod(ids, ctx)
    for b in range(3):
        np.testing.assert_array_equal(_bits(out[b]), _bits(_row(emb, ctx[b], ids[b])))
    # only the last max_ngram - 1 context tokens matter (the reference keeps those)
    np.testing.assert_array_equal(_bits(mod(ids, ctx[:, -KEEP:])), _bits(out))
    # a shorter context than max_ngram - 1 is used whole
    short = mod(ids, ctx[:, -1:])
    np.testing.assert_array_equal(_bits(short[1]), _bits(_row(emb, ctx[1, -1:], ids[1])))


def test_forward_prefill_then_decode_equals_one_prefill(emb, rng):
    """The reference NgramCache contract: prefill + decode steps == one pass."""
    mod = TorchNgramEmbedding(emb)
    seq = _ids(rng, (2, 30))
    whole = mod(seq)
    parts, ctx = [mod(seq[:, :17])], seq[:, :17][:, -KEEP:]
    for t in range(17, 30):
        parts.append(mod(seq[:, t : t + 1], ctx))
        ctx = torch.cat([ctx, seq[:, t : t + 1]], 1)[:, -KEEP:]
    np.testing.assert_array_equal(_bits(torch.cat(parts, 1)), _bits(whole))


def test_forward_matches_reference_formula_in_torch(emb, weights, rng):
    """``(E0[x] + sum_i W_i E_i[id_i]) / (1 + T)`` computed with torch ops."""
    word, tables, projs = weights
    mod = TorchNgramEmbedding(emb)
    ctx, ids = _ids(rng, (1, 3)), _ids(rng, (1, 20))
    full = np.concatenate([ctx[0].numpy(), ids[0].numpy()])
    nid = torch.from_numpy(rowcache.embed.ngram_ids(DIMS, full)[:, -20:])
    f = lambda a: torch.from_numpy(np.asarray(a, dtype=np.float32))  # noqa: E731
    x = f(word)[ids[0]]
    for i in range(DIMS.num_tables):
        x = x + f(tables[i])[nid[i]] @ f(projs[i]).T
    want = x / (1 + DIMS.num_tables)
    got = mod(ids, ctx)[0].float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)


def test_forward_ragged_list_contexts(emb, rng):
    mod = TorchNgramEmbedding(emb)
    ids = _ids(rng, (3, 4))
    ctxs = [torch.zeros(0, dtype=torch.int64), _ids(rng, (1,))[0:1], _ids(rng, (7,))]
    out = mod(ids, ctxs)
    for b in range(3):
        np.testing.assert_array_equal(_bits(out[b]), _bits(_row(emb, ctxs[b], ids[b])))


@pytest.mark.parametrize("full_mask", [False, True])
def test_forward_attention_mask_left_padding(emb, rng, full_mask):
    """Padded rows are embedded as if alone; their padding positions are zero."""
    mod = TorchNgramEmbedding(emb)
    lens = [6, 2, 4]
    ids = _ids(rng, (3, 6))
    mask = torch.zeros(3, 6, dtype=torch.long)
    for b, n in enumerate(lens):
        mask[b, 6 - n :] = 1
        ids[b, : 6 - n] = 0  # pad id: must not enter any look-back
    ctx = None
    if full_mask:  # HF's mask over past and current tokens, context = last 3 past ones
        ctx = _ids(rng, (3, 3))
        mask = torch.cat([torch.tensor([[1, 1, 1], [0, 0, 1], [0, 1, 1]]), mask], 1)
    out = mod(ids, ctx, attention_mask=mask)
    for b, n in enumerate(lens):
        c = [] if ctx is None else ctx[b][mask[b, :3].bool()]
        np.testing.assert_array_equal(_bits(out[b, 6 - n :]), _bits(_row(emb, c, ids[b, 6 - n :])))
        assert not out[b, : 6 - n].any()
    # an all-ones mask is the unmasked forward
    np.testing.assert_array_equal(_bits(mod(ids, attention_mask=torch.ones(3, 6))), _bits(mod(ids)))


def test_forward_accepts_int32_and_views(emb, rng):
    mod = TorchNgramEmbedding(emb)
    ids = _ids(rng, (2, 12))
    want = mod(ids)
    np.testing.assert_array_equal(_bits(mod(ids.to(torch.int32))), _bits(want))
    wide = torch.cat([ids, ids], 1)[:, ::2]  # a non-contiguous view of other tokens
    np.testing.assert_array_equal(_bits(mod(wide)), _bits(mod(wide.contiguous())))


def test_forward_rejects_bad_input(emb, rng):
    mod = TorchNgramEmbedding(emb)
    ids = _ids(rng, (2, 4))
    with pytest.raises(ConfigError, match="integer token ids"):
        mod(ids.float())
    with pytest.raises(ConfigError, match="2-D"):
        mod(ids[0])
    with pytest.raises(ConfigError, match="one context per row"):
        mod(ids, ids[:1])
    with pytest.raises(ConfigError, match="ngram_context has 1 rows, input_ids 2"):
        mod(ids, [ids[0]])
    with pytest.raises(ConfigError, match="attention_mask has 5 columns"):
        mod(ids, ids, attention_mask=torch.ones(2, 5))
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        mod(torch.full((1, 3), DIMS.vocab_size))
    with pytest.raises(ConfigError, match="overlay"):
        mod(ids, seq_slot=0)
    with pytest.raises(ConfigError, match="must be a tensor"):
        mod(ids.numpy())
    with pytest.raises(ConfigError, match="NgramEmbedding"):
        TorchNgramEmbedding(object())


def test_forward_cached_tables_bit_identical(weights, rng, tmp_path):
    word, tables, projs = weights
    store = build_store(tmp_path / "s", {str(i): t for i, t in enumerate(tables)}, progress=False)
    caches = [CachedTable(NgramRowCache(store, str(i), slots=40)) for i in range(DIMS.num_tables)]
    res = TorchNgramEmbedding(NgramEmbedding(DIMS, word, tables, projs))
    cac = TorchNgramEmbedding(NgramEmbedding(DIMS, word, caches, projs))
    for _ in range(3):  # more distinct rows than slots: evictions between calls
        ids, ctx = _ids(rng, (2, 16)), _ids(rng, (2, 3))
        np.testing.assert_array_equal(_bits(cac(ids, ctx)), _bits(res(ids, ctx)))
    assert sum(c.cache.stats().evictions for c in caches) > 0


def test_forward_overlay_seq_slot(emb, weights, rng):
    word = weights[0]
    ov = TokenOverlay(DIMS.vocab_size, DIMS.hidden_size, 2)
    adapter = word.copy()
    adapter[:150] = (np.asarray(word[:150], dtype=np.float32) + 1).astype(BF16)
    ov.set_adapter(1, embed_weight=adapter, served_embed=word)
    mod = TorchNgramEmbedding(emb, overlay=ov)
    ids = _ids(rng, (2, 6))
    out = mod(ids, seq_slot=torch.tensor([1, -1]))
    want = emb.embed_batch([ids[0].numpy(), ids[1].numpy()], [6, 6], overlay=ov, seq_slots=[1, -1])
    np.testing.assert_array_equal(_bits(out.reshape(-1, DIMS.hidden_size)), _bits(want))
    np.testing.assert_array_equal(_bits(out[1]), _bits(TorchNgramEmbedding(emb)(ids)[1]))
    assert not torch.equal(out[0], TorchNgramEmbedding(emb)(ids)[0])
    one = mod(ids[:1], seq_slot=1)  # a scalar routes every row
    np.testing.assert_array_equal(_bits(one[0]), _bits(out[0]))
    np.testing.assert_array_equal(_bits(mod(ids[:1], seq_slot=np.array([1]))), _bits(one))
    with pytest.raises(ConfigError, match="seq_slot must be"):
        mod(ids, seq_slot=[1, 0, 1])


# --- from_pretrained on a small HF-style checkpoint directory ---------------------
def _checkpoint(tmp_path, weights):
    """A sharded checkpoint: real tensor names, index, config.json (safetensors files)."""
    from safetensors.numpy import save_file

    word, tables, projs = weights
    u16 = lambda a: np.ascontiguousarray(a)  # noqa: E731
    first = {"model.embed_tokens.weight": u16(word), "model.norm.weight": np.ones(48, np.float32)}
    second = {}
    for i in range(DIMS.num_tables):
        second[f"model.ngram_embeddings.embedders.{i}.weight"] = u16(tables[i])
        second[f"model.ngram_embeddings.post_projs.{i}.weight"] = u16(projs[i])
    path = tmp_path / "ckpt"
    path.mkdir()
    wm = {}
    for fn, tensors in (
        ("model-00001-of-00002.safetensors", first),
        ("model-00002-of-00002.safetensors", second),
    ):
        _save_bf16(save_file, tensors, path / fn)
        wm.update(dict.fromkeys(tensors, fn))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    (path / "config.json").write_text(
        json.dumps({**DIMS.to_config(), "model_type": "longcat_flash_ngram"})
    )
    return path


def _save_bf16(save_file, tensors, file):
    """safetensors.numpy has no bfloat16: save through torch's bf16 (same bits)."""
    from safetensors.torch import save_file as save_torch

    out = {}
    for k, a in tensors.items():
        if a.dtype == BF16:
            out[k] = torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
        else:
            out[k] = torch.from_numpy(a)
    save_torch(out, str(file))


def test_from_pretrained_resident_cached_and_tuned(weights, rng, tmp_path, monkeypatch):
    monkeypatch.setenv("ROWCACHE_CACHE_DIR", str(tmp_path / "cache"))
    path = _checkpoint(tmp_path, weights)
    ref = TorchNgramEmbedding(NgramEmbedding(DIMS, *weights))
    res = TorchNgramEmbedding.from_pretrained(path)
    assert not res.emb.cached_tables
    cac = TorchNgramEmbedding.from_pretrained(path, cached=[0, 3, 5], arena_bytes="4KiB")
    assert [t.info.name for t in cac.emb.tables if isinstance(t, CachedTable)] == ["0", "3", "5"]
    # the default store: in the user's cache directory, keyed by the checkpoint, not beside it
    (store,) = (tmp_path / "cache" / "stores").glob("*/rowcache-bf16-tables-0-3-5")
    assert store.is_dir() and not list(path.glob("rowcache-*"))
    ids, ctx = _ids(rng, (2, 10)), _ids(rng, (2, 3))
    want = _bits(ref(ids, ctx))
    np.testing.assert_array_equal(_bits(res(ids, ctx)), want)
    np.testing.assert_array_equal(_bits(cac(ids, ctx)), want)

    # reuse: the store is opened, not built again
    import rowcache.store.builder

    def no_build(*a, **k):
        raise AssertionError("store rebuilt")

    monkeypatch.setattr(rowcache.store.builder, "build_store", no_build)
    report = tmp_path / "tune.json"
    report.write_text(json.dumps({"rows": {"0": 30, "3": 25}, "dtype": "bf16"}))
    with pytest.warns(UserWarning, match="without a format version.*slots unchecked"):
        tuned = TorchNgramEmbedding.from_pretrained(path, tune=report)  # an older report
    assert [c.num_slots for c in tuned.emb.caches] == [30, 25]
    np.testing.assert_array_equal(_bits(tuned(ids, ctx)), want)
    shared = TorchNgramEmbedding.from_pretrained(path, cached=[0, 3], tune={"rows": {"shared": 64}})
    assert len(shared.emb.caches) == 1 and shared.emb.caches[0].num_slots == 64
    np.testing.assert_array_equal(_bits(shared(ids, ctx)), want)
    # a table a given store lacks: a clear error, nothing rebuilt or removed
    with pytest.raises(ConfigError, match="does not hold table 4"):
        load_pretrained(path, cached=[4], arena_bytes=4096, store=store)
    assert store.is_dir()


def test_from_pretrained_fp8_store_and_bad_arguments(weights, rng, tmp_path, monkeypatch):
    monkeypatch.setenv("ROWCACHE_CACHE_DIR", str(tmp_path / "cache"))
    path = _checkpoint(tmp_path, weights)
    fp8 = TorchNgramEmbedding.from_pretrained(path, cached="all", dtype="fp8", arena_bytes="8KiB")
    direct = load_pretrained(path, dtype="fp8")  # resident FP8 tables: the same codes
    ids = _ids(rng, (1, 12))
    np.testing.assert_array_equal(_bits(fp8(ids)), _bits(TorchNgramEmbedding(direct)(ids)))
    assert len(list((tmp_path / "cache" / "stores").glob("*/rowcache-fp8"))) == 1
    with pytest.raises(ConfigError, match="arena size"):
        load_pretrained(path, cached="all")
    with pytest.raises(ConfigError, match="outside"):
        load_pretrained(path, cached=[99], arena_bytes=4096)
    with pytest.raises(ConfigError, match="no slot"):
        load_pretrained(path, cached="all", store=tmp_path / "s2", arena_bytes=20)
    assert not (tmp_path / "s2").exists()  # refused before building anything
    with pytest.raises(ConfigError, match="no 'rows'"):
        load_pretrained(path, tune={"tables": {}})
    with pytest.raises(ConfigError, match="dtype"):
        load_pretrained(path, dtype="f16")


def test_from_pretrained_defer_reads_on_the_cpu_reads_at_once(weights, rng, tmp_path):
    """defer_reads reaches the embedding; on the CPU a step reads its rows before it
    returns (deferral is a GPU stream-order feature), so ``settle`` has nothing to do."""
    path = _checkpoint(tmp_path, weights)
    mod = TorchNgramEmbedding.from_pretrained(
        path, cached="all", arena_bytes="8KiB", defer_reads=True
    )
    assert not mod.emb.defer_reads  # the CPU path: ignored, as NgramEmbedding documents
    ref = TorchNgramEmbedding(NgramEmbedding(DIMS, *weights))
    ids, ctx = _ids(rng, (2, 6)), _ids(rng, (2, 3))
    out = mod(ids, ctx)
    mod.settle()
    np.testing.assert_array_equal(_bits(out), _bits(ref(ids, ctx)))
    assert not any(c.inspect().pending for c in mod.emb.caches)


def test_settle_settles_every_cache_and_raises_the_first_failure(weights, tmp_path):
    """Reads deferred on several caches (through the embedding's step rows) that all fail:
    one ``settle`` raises, and leaves no cache with a failed read pending (each as before
    its call)."""
    from rowcache.errors import CorruptDataError

    path = _checkpoint(tmp_path, weights)
    mod = TorchNgramEmbedding.from_pretrained(path, cached=[0, 2, 4], arena_bytes="8KiB")
    caches = mod.emb.caches
    assert len(caches) == 3
    saved = corrupt_tables(caches[0].store, ["0", "2", "4"])
    try:
        rows = mod.emb.step_rows
        assert rows.resolve([np.arange(5)] * len(rows), defer=True) is None
        assert rows.faults == 5 * len(caches) and rows.pending
        assert all(c.inspect().pending for c in caches)
        with pytest.raises(CorruptDataError, match="checksum"):
            mod.settle()
        assert not rows.pending and not any(c.inspect().pending for c in caches)
        assert all(c.stats().misses == 0 and c.inspect().slot_map()[0].max() < 0 for c in caches)
    finally:
        restore(saved)
    mod.settle()  # nothing pending: no error


# --- GPU (skipped without one) ----------------------------------------------------
def _gpu_emb(weights, cached=False, tmp_path=None):
    import cupy as cp

    word, tables, projs = weights
    if cached:
        store = build_store(
            tmp_path / "g", {str(i): t for i, t in enumerate(tables)}, progress=False
        )
        tabs = [
            CachedTable(NgramRowCache(store, str(i), slots=64, device="cuda"))
            for i in range(DIMS.num_tables)
        ]
    else:
        tabs = [cp.asarray(t) for t in tables]
    return NgramEmbedding(DIMS, cp.asarray(word), tabs, projs)


@pytest.mark.gpu
@pytest.mark.parametrize("cached", [False, True])
def test_gpu_forward_equals_cpu_path_on_torch_stream(weights, rng, tmp_path, cached):
    mod = TorchNgramEmbedding(_gpu_emb(weights, cached, tmp_path))
    ref = TorchNgramEmbedding(NgramEmbedding(DIMS, *weights))
    ids, ctx = _ids(rng, (3, 9)), _ids(rng, (3, 4))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # a non-default stream: the work must follow it
        out = mod(ids.cuda(), ctx.cuda())
        mask = torch.ones(3, 9, dtype=torch.long, device="cuda")
        mask[1, :4] = 0
        padded = mod(ids.cuda(), ctx.cuda(), attention_mask=mask)
    side.synchronize()
    assert out.is_cuda and out.dtype == torch.bfloat16
    # the GPU GEMM sums in another order than the CPU one: equal within bf16 rounding
    torch.testing.assert_close(out.cpu().float(), ref(ids, ctx).float(), rtol=2e-2, atol=2e-3)
    # another row count may take another cuBLAS kernel: equal within rounding
    torch.testing.assert_close(padded[0].float(), out[0].float(), rtol=1e-2, atol=1e-3)
    assert not padded[1, :4].any()


@pytest.mark.gpu
@pytest.mark.parametrize("cached", [False, True])
def test_gpu_forward_strides_and_known_tensors(weights, rng, tmp_path, cached):
    """The GPU rows step (ids and context read in place at their strides) gives the
    direct call's bits, for contexts that are slices of a longer history, non-contiguous
    ids, short contexts, no context, expanded rows; and again for the same tensors with
    new contents (the checked-tensor fast path: fresh contents read, a new dtype at
    the same address checked again)."""
    import cupy as cp

    emb = _gpu_emb(weights, cached, tmp_path)
    mod = TorchNgramEmbedding(emb)

    def direct(ids, ctx):
        B, L = ids.shape
        c = 0 if ctx is None else min(ctx.shape[1], KEEP)
        full = ids if c == 0 else torch.cat([ctx[:, ctx.shape[1] - c :], ids], 1)
        tok = cp.asarray(full.reshape(-1).cpu().numpy())
        got = emb.embed_packed(tok, np.full(B, c + L), np.full(B, L))
        return got.get()

    hist = _ids(rng, (4, 40)).cuda()
    wide = _ids(rng, (4, 12)).cuda()
    cases = [
        (_ids(rng, (1, 1)).cuda(), _ids(rng, (1, 7)).cuda()),  # decode x1
        (_ids(rng, (4, 1)).cuda(), hist[:, 10:30]),  # context: a slice, row stride 40
        (_ids(rng, (4, 3)).cuda(), hist[:, 5:7]),  # a short context: c = 2
        (wide[:, ::3], hist[:, :9]),  # non-contiguous ids: the torch.cat path
        (_ids(rng, (4, 5)).cuda(), hist[:, ::2]),  # non-contiguous context
        (_ids(rng, (3, 6)).cuda(), None),  # no context
        (hist[:, 20:21], hist[:, 17:20]),  # both slices of one history
        (_ids(rng, (1, 1)).cuda().expand(4, 1), hist[:, 3:6]),  # an expanded row
    ]
    for _ in range(2):  # the second pass: every tensor known, with new contents
        outs = [mod(ids, ctx) for ids, ctx in cases]  # queued back to back
        for (ids, ctx), out in zip(cases, outs):
            want = direct(ids, ctx)
            np.testing.assert_array_equal(_bits(out.reshape(-1, DIMS.hidden_size)), _bits(want))
        for ids, _ in cases:
            ids = ids[:1] if 0 in ids.stride() else ids  # an expanded row: its one element
            ids.copy_(torch.randint(3, DIMS.vocab_size, ids.shape, device="cuda"))
        hist.copy_(torch.randint(3, DIMS.vocab_size, hist.shape, device="cuda"))
    ids, ctx = cases[1]
    ids.copy_(torch.full_like(ids, DIMS.vocab_size))  # a known tensor, now out of range
    with pytest.raises(ConfigError, match=rf"input_ids\[0, 0\] = {DIMS.vocab_size} is outside"):
        mod(ids, ctx)
    narrow = ids.view(torch.int32)[:, :1]  # the same address, another dtype: checked again
    narrow.fill_(5)
    want = direct(narrow.to(torch.int64), ctx)
    np.testing.assert_array_equal(
        _bits(mod(narrow, ctx).reshape(-1, DIMS.hidden_size)), _bits(want)
    )


@pytest.mark.gpu
def test_gpu_static_step_in_torch_cuda_graph(weights, rng):
    mod = TorchNgramEmbedding(_gpu_emb(weights))
    B, L = 4, 1
    ids, ctx = _ids(rng, (B, L)).cuda(), _ids(rng, (B, 5)).cuda()
    step = mod.static_step(B, L, context_len=3)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        eager = step(ids, ctx).clone()  # warm-up: compiles, loads cuBLAS
    torch.cuda.current_stream().wait_stream(s)
    np.testing.assert_array_equal(_bits(eager), _bits(mod(ids, ctx)))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step(ids, ctx)
        with pytest.raises(ConfigError, match="not capturable"):
            mod(ids, ctx)
    for _ in range(3):
        new, nctx = _ids(rng, (B, L)).cuda(), _ids(rng, (B, 5)).cuda()
        ids.copy_(new)
        ctx.copy_(nctx)
        g.replay()
        torch.cuda.synchronize()
        np.testing.assert_array_equal(_bits(out), _bits(mod(new, nctx)))


@pytest.mark.gpu
def test_gpu_forward_overlay_seq_slot(weights, rng):
    import cupy as cp

    word = weights[0]
    emb = _gpu_emb(weights)
    ov = TokenOverlay(DIMS.vocab_size, DIMS.hidden_size, 2, device="cuda")
    adapter = (np.asarray(word, dtype=np.float32) + 1).astype(BF16)
    ov.set_adapter(1, embed_weight=cp.asarray(adapter), served_embed=cp.asarray(word))
    mod = TorchNgramEmbedding(emb, overlay=ov)
    ids = _ids(rng, (2, 5))
    out = mod(ids.cuda(), seq_slot=torch.tensor([1, -1], device="cuda"))
    want = emb.embed_batch(
        [cp.asarray(ids[0].numpy()), cp.asarray(ids[1].numpy())],
        [5, 5],
        overlay=ov,
        seq_slots=np.array([1, -1], np.int32),
    )
    np.testing.assert_array_equal(_bits(out.reshape(-1, DIMS.hidden_size)), _bits(want.get()))


@pytest.mark.gpu
def test_gpu_static_step_refuses_cached_tables(weights, tmp_path):
    mod = TorchNgramEmbedding(_gpu_emb(weights, True, tmp_path))
    with pytest.raises(ConfigError, match="resident"):
        mod.static_step(1, 1)


def test_mask_over_input_ids_only_keeps_the_whole_context(emb, rng):
    """A [B, L] mask with a [B, C] context: the context counts in full, the masked
    positions of input_ids are padding (zero rows, never in a look-back)."""
    mod = TorchNgramEmbedding(emb)
    ids, ctx = _ids(rng, (2, 5)), _ids(rng, (2, 3))
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, :2] = 0
    out = mod(ids, ctx, attention_mask=mask)
    np.testing.assert_array_equal(_bits(out[0]), _bits(_row(emb, ctx[0], ids[0])))
    np.testing.assert_array_equal(_bits(out[1, 2:]), _bits(_row(emb, ctx[1], ids[1, 2:])))
    assert not out[1, :2].any()


def test_static_step_checks_its_arguments_on_the_cpu(emb):
    """``static_step`` (``rowcache.embed.torch.static``) refuses bad shapes and a CPU embedding."""
    mod = TorchNgramEmbedding(emb)
    with pytest.raises(ConfigError, match="batch_size=0 must be an int >= 1"):
        mod.static_step(0, 1)
    with pytest.raises(ConfigError, match="context_len=-1"):
        mod.static_step(1, 1, context_len=-1)
    with pytest.raises(ConfigError, match="needs an embedding on cuda"):
        mod.static_step(2, 1, context_len=3)
    assert rowcache.embed.TorchStaticStep.__module__ == "rowcache.embed.torch.static"


def test_forward_reads_any_layout_in_place(rng, emb):
    """Strided, sliced and expanded (zero-stride) ids and contexts: the rows step reads
    them at their strides and gives what contiguous copies give."""
    mod = TorchNgramEmbedding(emb)
    hist = _ids(rng, (4, 40))
    one = _ids(rng, (1, 1))
    cases = [
        (hist[:, 20:21], hist[:, 17:20]),  # both slices of one history
        (_ids(rng, (4, 12))[:, ::3], hist[:, ::2]),  # strided columns
        (one.expand(4, 1), hist[:, :3]),  # an expanded row
        (_ids(rng, (4, 1)), _ids(rng, (1, 3)).expand(4, 3)),
        (_ids(rng, (3, 5)).t(), _ids(rng, (3, 5)).t()),  # transposed
    ]
    for ids, ctx in cases:
        want = mod(ids.contiguous(), ctx.contiguous())
        np.testing.assert_array_equal(_bits(mod(ids, ctx)), _bits(want))
        np.testing.assert_array_equal(_bits(want[-1]), _bits(_row(emb, ctx[-1], ids[-1])))


@pytest.mark.gpu
def test_gpu_forward_defer_reads_settles_and_raises_a_failed_read(weights, rng, tmp_path):
    """from_pretrained(defer_reads=True) on the GPU: decode forwards return while their
    rows are read, their outputs (on torch's stream) equal the resident tables' bit for
    bit once settled; a failed read raises at ``settle``, the caches unchanged, and the
    dropped step done again equals resident."""
    import cupy as cp

    from rowcache.errors import CorruptDataError

    path = _checkpoint(tmp_path, weights)
    mod = TorchNgramEmbedding.from_pretrained(
        path, cached="all", arena_bytes="64KiB", device="cuda", defer_reads=True
    )
    assert mod.emb.defer_reads
    res = _gpu_emb(weights)
    caches = mod.emb.caches
    B, D = 4, DIMS.hidden_size
    hist = _ids(rng, (B, 80))

    def step(k):
        ids, ctx = hist[:, k : k + 1], hist[:, k - KEEP : k]
        out = mod(ids.cuda(), ctx.cuda())
        pending = any(c.inspect().pending for c in caches)
        tok = cp.asarray(torch.cat([ctx, ids], 1).reshape(-1).numpy())
        want = res.embed_packed(tok, np.full(B, KEEP + 1), np.full(B, 1)).get()
        return out, want, pending

    deferred = 0
    for k in range(KEEP, 60):
        out, want, pending = step(k)
        deferred += pending
        mod.settle()
        np.testing.assert_array_equal(_bits(out.reshape(-1, D)), _bits(want))
    assert deferred > 5  # forwards did return before their reads ended
    store = caches[0].store
    saved = corrupt_tables(store, [str(i) for i in range(DIMS.num_tables)])
    before = [(c.inspect().slot_map(), c.stats()) for c in caches]
    try:
        step(60)
        with pytest.raises(CorruptDataError, match="checksum"):
            mod.settle()
        for c, (maps, st) in zip(caches, before):
            np.testing.assert_array_equal(c.inspect().slot_map()[0], maps[0])
            assert (c.stats().misses, c.stats().rows_read) == (st.misses, st.rows_read)
    finally:
        restore(saved)
    out, want, _ = step(60)  # the dropped step again
    mod.settle()
    np.testing.assert_array_equal(_bits(out.reshape(-1, D)), _bits(want))
