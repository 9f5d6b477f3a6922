"""The pieces of V4.1's judge (``bench/engram_v41.py``, ``bench/v41_tables.py``) its quick
run cannot show alone: the warm-up that loads the history's end state (checked against
serving the history chunk by chunk), the checkpoint-layout files (a real safetensors
checkpoint of V4.1's tensor names, two pages a row) and the generated rows (the store's
records are the generator's bytes)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from bench._common import UE8M0_RANGE, Log, random_ue8m0
from bench.engram_v41 import Rows, page_runs, warm_cache, warm_pages
from bench.modes import History
from bench.v41_tables import (
    BLOCKS,
    DIM,
    PAGE,
    REC,
    build_v41_store,
    codes_of,
    reference_rows,
    scales_of,
    v41_config,
    write_checkpoint,
)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """``(hash, its rows, the fp8_block_e8m0 store, the checkpoint layout)`` of V4.1's shape
    with about 12,000 rows a layer."""
    from rowcache.embed.engram.hash import EngramHash
    from rowcache.embed.engram.vocab import CompressedVocab
    from rowcache.tools.tokens import tokenizer_json_path

    tmp = tmp_path_factory.mktemp("v41")
    vocab = CompressedVocab.from_tokenizer(tokenizer_json_path("deepseek"), cache_dir=tmp)
    h = EngramHash(v41_config(12_000), vocab)
    log = Log(quiet=True)
    store, _ = build_v41_store(str(tmp / "store"), h, np, log)
    layout, _ = write_checkpoint(str(tmp), h, np, log)
    yield h, Rows(h), store, layout
    store.close()


def test_store_records_are_the_generators_codes_then_scale_bytes(small):
    h, _, store, _ = small
    info = store.tables[0]
    assert (info.dtype, info.record_bytes, info.rows_per_page) == ("fp8_block_e8m0", REC, 15)
    assert info.params == {"block_size": 32}
    ids = np.array([0, 7, 12_001, h.table_rows(14) - 1], dtype=np.int64)
    codes, scales = store.read_rows("engram.14", ids)
    assert np.array_equal(codes, codes_of(np, 14, 0, h.table_rows(14))[ids])
    assert np.array_equal(scales, scales_of(np, 14, 0, h.table_rows(14))[ids])
    assert not np.array_equal(codes, codes_of(np, 1, 0, h.table_rows(14))[ids])  # per layer
    lo, hi = UE8M0_RANGE
    s = random_ue8m0(np, 3, np.arange(5000), BLOCKS)
    assert s.min() == lo and s.max() == hi and s.shape == (5000, BLOCKS)


def test_checkpoint_layout_is_v41s_tensors_two_pages_a_row(small, tmp_path):
    from rowcache import build_store
    from rowcache.store.sources import Fp8BlockScaleSource, safetensors_tensor

    h, rows, store, layout = small
    k, L = 1, 14
    path = layout.files[k]
    w = safetensors_tensor(path, f"layers.{L}.engram.embed.weight")
    s = safetensors_tensor(path, f"layers.{L}.engram.embed.scale")
    n = h.table_rows(L)
    assert (w.shape, str(w.dtype), s.shape, str(s.dtype)) == (
        (n, DIM),
        "float8_e4m3fn",
        (n, BLOCKS),
        "float8_e8m0fnu",
    )
    assert w.offset == PAGE and s.offset == PAGE + n * DIM  # the data starts on a page
    # a store built from the checkpoint file, as load_engram_memory builds V4.1's, holds the
    # same records as the one streamed from the generator
    again = build_store(
        tmp_path / "s",
        {
            "t": Fp8BlockScaleSource(
                (path, f"layers.{L}.engram.embed.weight"), (path, f"layers.{L}.engram.embed.scale")
            )
        },
        progress=False,
    )
    ids = np.random.default_rng(0).integers(0, n, 500)
    for a, b in zip(again.read_rows("t", ids), store.read_rows("engram.14", ids)):
        assert np.array_equal(a, b)
    again.close()
    # pages(): a row's codes page and its scales page, at the bytes the file holds there
    g = rows.starts[k] + np.array([5, 5000], dtype=np.int64)
    pages = layout.pages(g)
    assert pages.shape == (4, 2) and set(pages[:, 0]) == {k}
    raw = np.fromfile(path, dtype=np.uint8)
    for r in (5, 5000):
        c, sc = PAGE + r * DIM, PAGE + n * DIM + r * BLOCKS
        assert {c - c % PAGE, sc - sc % PAGE} <= set(pages[:, 1].tolist())
        assert np.array_equal(raw[c : c + DIM], codes_of(np, L, r, r + 1)[0])
        assert np.array_equal(raw[sc : sc + BLOCKS], scales_of(np, L, r, r + 1)[0])


def test_history_end_state_is_what_serving_the_history_leaves(small, rng):
    """An arena warmed with ``History.lru_end`` (its rows read once, sorted, then touched in
    order) holds the rows an arena that served the history chunk by chunk holds, and goes on
    to evict the same rows step after step (the same LRU order); it read each row once."""
    from rowcache import NgramRowCache

    h, rows, store, _ = small
    text = rng.integers(0, 129_280, 3_000)
    hist = History(h, text[:2_400], h.config.pad_id, rows.of, per=48)
    slots = 9_000
    names = ["engram.1", "engram.14"]
    with (
        NgramRowCache(store, names, slots=slots) as served,
        NgramRowCache(store, names, slots=slots) as warmed,
    ):
        for r in hist:
            served.prefetch(r).wait()
        end = hist.lru_end(slots, rows.total)
        assert sum(r.size for r in end) == slots < sum(np.unique(r).size for r in hist)
        info = warm_cache(warmed, end, Log(quiet=True))
        assert info["rows"] == slots and warmed.stats().prefetched == slots
        assert served.stats().prefetched > slots  # it evicted and read again

        def resident(c):
            return np.flatnonzero(c.inspect().slot_map()[0] >= 0)

        assert np.array_equal(resident(served), resident(warmed))
        ctx = np.full((1, h.keep), h.config.pad_id, dtype=np.int64)
        ctx[0] = text[2_400 - h.keep : 2_400]
        for a in range(2_400, 3_000, 40):  # further steps: the same victims
            p = text[a : a + 40][None]
            for c in (served, warmed):
                c.prefetch(rows.of(p, ctx)).wait()
            assert np.array_equal(resident(served), resident(warmed))
            ctx = text[a + 40 - h.keep : a + 40][None]


def test_warm_pages_are_the_most_recent_rows_pages_within_the_budget(small):
    layout = small[3]
    end = [np.array([3, 4], dtype=np.int64), np.array([20_000, 9], dtype=np.int64)]
    every = warm_pages(end, layout, 10 * PAGE)
    assert np.array_equal(every, layout.pages(np.concatenate(end)))  # all fit: sorted
    two = warm_pages(end, layout, 2 * PAGE)  # the newest chunk's first pages only
    assert two.shape == (2, 2)
    assert {tuple(p) for p in two} <= {tuple(p) for p in layout.pages(end[1])}


def test_reference_rows_dequantize_the_generators_bytes_by_the_rule():
    """bf16(e4m3 * 2**(e - 127)) of the generated bytes, computed here in float64."""
    rows = np.array([0, 1, 99], dtype=np.int64)
    got = reference_rows(1, rows).astype(np.float64)
    values = codes_of(np, 1, 0, 100)[rows].view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    e = np.repeat(scales_of(np, 1, 0, 100)[rows].astype(np.float64), 32, axis=1)
    want = (values * 2.0 ** (e - 127)).astype(ml_dtypes.bfloat16).astype(np.float64)
    assert np.array_equal(got, want)


def test_page_runs_join_adjacent_pages_of_a_file_in_reads_of_at_most_64():
    p = np.array([[0, 0], [0, 4096], [0, 8192], [0, 40960], [1, 0], [1, 4096]], dtype=np.int64)
    files, offs, lens = page_runs(p)
    assert list(zip(files.tolist(), offs.tolist(), lens.tolist())) == [
        (0, 0, 3),
        (0, 40960, 1),
        (1, 0, 2),
    ]
    long = np.stack([np.zeros(130, np.int64), np.arange(130) * PAGE], axis=1)
    files, offs, lens = page_runs(long)
    assert lens.tolist() == [64, 64, 2] and offs.tolist() == [0, 64 * PAGE, 128 * PAGE]
    assert all(x.size == 0 for x in page_runs(np.zeros((0, 2), np.int64)))
