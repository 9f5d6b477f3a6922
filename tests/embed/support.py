"""What the embedding layer's tests share: a small LongCat-shaped ``DIMS``, random weights,
token streams, the bits of a bf16 array, the GPU step's reference (NumPy ids and gathers,
then the one GEMM-and-sum tail), models over cached tables (one cache per table, or one
shared arena, with the resident model beside it for lookahead tests), and corrupting a
store's tables to fail their reads. Not a test module."""

from __future__ import annotations

import os

import numpy as np

from rowcache.cache.row_cache import NgramRowCache
from rowcache.embed.layer import NgramEmbedding
from rowcache.embed.ngram.dims import NgramDims
from rowcache.embed.tables import CachedTable
from rowcache.kernels.reference import BF16
from rowcache.store.builder import build_store

# small but LongCat-shaped: orders 2..3, 2 splits, 4 tables of 12
DIMS = NgramDims(vocab_size=1000, hidden_size=48, max_ngram=3, splits=2, ratio=2.5, eos_token_id=2)


def random_weights(rng, dims=DIMS):
    T, d, D = dims.num_tables, dims.table_dim, dims.hidden_size
    word = (rng.standard_normal((dims.vocab_size, D)) * 0.02).astype(np.float32).astype(BF16)
    tables = [
        (rng.standard_normal((dims.table_rows(i), d)) * 0.05).astype(np.float32).astype(BF16)
        for i in range(T)
    ]
    projs = [
        (rng.standard_normal((D, d)) / np.sqrt(d)).astype(np.float32).astype(BF16) for _ in range(T)
    ]
    return word, tables, projs


def bits(a):
    return np.asarray(a).view(np.uint16)


def gpu_reference(dims, word, tables, projs, batch, gemm_splits=None):
    """What every GPU runner must give for ``batch`` (host tokens), bit for bit: the ids by
    the NumPy hash reference, every row gathered by the NumPy references
    (``rowcache.kernels.reference``) from host copies of the resident ``word`` and
    ``tables`` (bf16 arrays, or ``Bf16Table`` / ``Fp8Table``), then ``project_and_sum`` on
    the GPU (the one tail; its GEMM rounds as cuBLAS does, so the tail runs there) with
    the embedding's K-parts rule. Returns the bfloat16 rows as a NumPy array."""
    import cupy as cp

    from rowcache.embed.layer_inputs import stack_projs
    from rowcache.embed.step.staging import gemm_parts
    from rowcache.embed.tables import Bf16Table
    from rowcache.kernels.gemm import project_and_sum
    from rowcache.kernels.ngram.hash import ngram_hash_reference
    from rowcache.kernels.ngram.stacked import StackedTables, gather_stacked_reference

    def host(t):
        t = t if hasattr(t, "arrays") else Bf16Table(np.asarray(t))
        a, s = t.arrays
        return (cp.asnumpy(a), None if s is None else cp.asnumpy(s))

    T, D, n = dims.num_tables, dims.hidden_size, batch.n
    tokens = np.asarray(batch.tokens)
    ids = ngram_hash_reference(
        tokens, np.asarray(dims.multipliers), np.asarray(dims.all_table_rows),
        dims.eos_token_id, batch.starts,
    )[:, batch.selection]  # fmt: skip
    stack = np.empty((n, T * dims.table_dim), dtype=BF16)
    gather_stacked_reference(ids, StackedTables([host(t) for t in tables]), stack)
    words = np.empty((n, D), dtype=BF16)
    word_ids = tokens[batch.selection][None, :]
    gather_stacked_reference(word_ids, StackedTables([host(word)]), words)
    S = gemm_parts(dims, gemm_splits, n, True)
    out = project_and_sum(
        cp.asarray(stack),
        cp.asarray(stack_projs(dims, projs)),
        cp.asarray(words),
        proj=cp.empty((S, n, D), dtype=cp.float32),
        out=cp.empty((n, D), dtype=BF16),
        denom=float(1 + T),
    )
    return cp.asnumpy(out)


def token_stream(rng, n):
    x = rng.integers(0, DIMS.vocab_size, size=n)
    x[rng.random(n) < 0.05] = DIMS.eos_token_id
    return x


def cached_model(rng, tmp_path, *, slots_frac=0.25, dtype="bf16", device="cpu", word_cached=False):
    word, tables, projs = random_weights(rng)
    named = {f"t{i}": t for i, t in enumerate(tables)}
    if word_cached:
        named["word"] = word
    store = build_store(tmp_path / "store", named, dtype=dtype, progress=False)
    caches = {
        name: NgramRowCache(
            store, name, slots=max(1, int(arr.shape[0] * slots_frac)), device=device
        )
        for name, arr in named.items()
    }
    cached = [CachedTable(caches[f"t{i}"]) for i in range(len(tables))]
    return store, caches, word, tables, projs, cached


def shared_cache_model(
    rng, tmp_path, *, slots_frac=0.3, dtype="bf16", device="cpu", shared_kw=None
):
    """A store of four tables and a word table; a shared arena over the four
    (``NgramRowCache.assemble(..., **shared_kw)``: e.g. ``tuning``, ``part_reader``) and a
    cache of the word table."""
    word, tables, projs = random_weights(rng)
    named = {f"t{i}": t for i, t in enumerate(tables)}
    named["word"] = word
    store = build_store(tmp_path / f"shared-{dtype}-{device}", named, dtype=dtype, progress=False)
    total = sum(t.shape[0] for t in tables)
    shared = NgramRowCache.assemble(
        store,
        [f"t{i}" for i in range(len(tables))],
        slots=int(total * slots_frac),
        device=device,
        **(shared_kw or {}),
    )
    word_cache = NgramRowCache(store, "word", slots=DIMS.vocab_size // 2, device=device)
    return store, shared, word_cache, word, tables, projs


def lookahead_models(rng, tmp_path, device="cpu", shared_kw=None, **kw):
    store, shared, word_cache, word, tables, projs = shared_cache_model(
        rng, tmp_path, device=device, slots_frac=0.6, shared_kw=shared_kw
    )
    if device == "cuda":
        import cupy as cp

        resident = NgramEmbedding(DIMS, cp.asarray(word), [cp.asarray(t) for t in tables], projs)
    else:
        resident = NgramEmbedding(DIMS, word, tables, projs)
    cached = NgramEmbedding(
        DIMS, CachedTable(word_cache), [CachedTable(shared, k) for k in range(4)], projs, **kw
    )
    return store, shared, word_cache, resident, cached


def corrupt_tables(store, names):
    """Flip a bit in every page of the shards of tables ``names``: any read of their rows
    fails its page check. Returns the files' bytes, for :func:`restore`."""
    saved = {}
    for name in names:
        for rec in store.shards[store.table_index(name)]:
            path = os.path.join(store.path, rec.file)
            with open(path, "rb") as f:
                saved[path] = f.read()
            bad = bytearray(saved[path])
            bad[::4096] = bytes(b ^ 0x20 for b in bad[::4096])
            with open(path, "wb") as f:
                f.write(bad)
    return saved


def restore(saved):
    for path, data in saved.items():
        with open(path, "wb") as f:
            f.write(data)
