"""The token-overlay kernels: NumPy references against plain loops, GPU against references."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from rowcache.errors import ConfigError
from rowcache.kernels.overlay.routed import (
    MMA_ALIGN,
    MMA_CONFIGS,
    embed_overlay_routed_reference,
    embed_rowdiff,
    embed_rowdiff_reference,
    lmhead_overlay_gemm_reference,
    lmhead_overlay_mma_reference,
    lmhead_overlay_routed_reference,
    mma_tile_adapters,
    pack_overrides,
)

BF16 = np.dtype(ml_dtypes.bfloat16)


# ----------------------------------------------------------------------- plain loops
def rowdiff_loop(base, served, thresh):
    flags = []
    for r in range(base.shape[0]):
        hit = False
        for i in range(base.shape[1]):
            a, b = float(base[r, i]), float(served[r, i])
            d = abs(np.float32(a) - np.float32(b))
            if d > np.float32(thresh) or (np.isnan(a) != np.isnan(b)):
                hit = True
        flags.append(hit)
    return np.array(flags, dtype=bool)


def embed_loop(ids, seq_slot, active, maps, rows, out):
    out = out.copy()
    for r in range(len(ids)):
        s = int(seq_slot[r]) if seq_slot is not None else active
        if s < 0 or s >= len(maps) or maps[s] is None:
            continue
        tok = int(ids[r])
        if tok < 0 or tok >= len(maps[s]):
            continue
        j = int(maps[s][tok])
        if j < 0 or j >= rows[s].shape[0]:
            continue
        out[r] = rows[s][j]
    return out


def lmhead_loop(hidden, seq_slot, active, ids, rows, logits):
    """float64 logits for overridden entries (NaN elsewhere) and the touched mask."""
    want = np.full(logits.shape, np.nan)
    for r in range(hidden.shape[0]):
        s = int(seq_slot[r]) if seq_slot is not None else active
        if s < 0 or s >= len(ids) or ids[s] is None:
            continue
        for j, tok in enumerate(ids[s]):
            if 0 <= tok < logits.shape[1]:
                want[r, tok] = sum(
                    float(hidden[r, i]) * float(rows[s][j, i]) for i in range(hidden.shape[1])
                )
    return want


def bf16(rng, *shape):
    return rng.standard_normal(shape, dtype=np.float32).astype(BF16)


def random_adapters(rng, vocabs, counts, hidden):
    """Per adapter: slot map int32[vocab] with `count` entries set (some junk), rows, ids."""
    maps, rows, ids = [], [], []
    for v, c in zip(vocabs, counts):
        if v is None:
            maps.append(None), rows.append(None), ids.append(None)
            continue
        tok = np.sort(rng.choice(v, size=c, replace=False)).astype(np.int32)
        m = np.full(v, -1, np.int32)
        m[tok] = np.arange(c, dtype=np.int32)
        maps.append(m)
        rows.append(bf16(rng, c, hidden))
        ids.append(tok)
    return maps, rows, ids


# ----------------------------------------------------------------------- rowdiff
def test_embed_rowdiff_reference_matches_loop(rng):
    base = bf16(rng, 40, 24)
    served = base.copy()
    served[3, 5] = base[3, 5] + BF16.type(0.5)
    served[7] = bf16(rng, 24)
    served[11, 0] = base[11, 0] + BF16.type(0.01)  # small change: caught at thresh 0 only
    served[13, 2] = np.nan
    base[14, 2] = np.nan
    served[14, 2] = np.nan  # NaN on both sides: equal
    served[15, 1] = np.inf
    base[16, 3] = -0.0
    served[16, 3] = 0.0  # -0 == +0
    for t in (0.0, 0.05, 1.0, 100.0):
        got = embed_rowdiff_reference(base, served, t)
        assert got.dtype == bool and got.shape == (40,)
        np.testing.assert_array_equal(got, rowdiff_loop(base, served, t))
    assert set(np.flatnonzero(embed_rowdiff_reference(base, served, 0.0))) == {3, 7, 11, 13, 15}
    assert not embed_rowdiff_reference(base, base.copy()).any()


def test_embed_rowdiff_reference_chunks_large_tables(rng):
    base = bf16(rng, 10_000, 8)
    served = base.copy()
    changed = rng.choice(10_000, size=3_000, replace=False)
    served[changed, rng.integers(0, 8, size=3_000)] += BF16.type(1.0)
    got = embed_rowdiff_reference(base, served, 0.0)
    np.testing.assert_array_equal(np.flatnonzero(got), np.sort(changed))
    assert embed_rowdiff(base, served).dtype == bool  # numpy input runs the reference


@pytest.mark.parametrize(
    ("base", "served", "thresh", "match"),
    [
        (np.zeros((4, 8), np.float32), np.zeros((4, 8), BF16), 0.0, "base"),
        (np.zeros((4, 8), BF16), np.zeros((5, 8), BF16), 0.0, "same shape"),
        (np.zeros(8, BF16), np.zeros(8, BF16), 0.0, "2-D"),
        (np.zeros((4, 8), BF16), np.zeros((4, 8), BF16), -1.0, "thresh"),
        (np.zeros((4, 8), BF16), np.zeros((4, 8), BF16), float("nan"), "thresh"),
    ],
)
def test_embed_rowdiff_rejects_bad_inputs(base, served, thresh, match):
    with pytest.raises(ConfigError, match=match):
        embed_rowdiff_reference(base, served, thresh)


# ----------------------------------------------------------------------- embed overlay
def test_embed_overlay_reference_matches_loop_mixed_slots(rng):
    hidden, n = 32, 200
    maps, rows, _ = random_adapters(rng, [50, None, 80, 30], [10, 0, 40, 30], hidden)
    maps[3][5] = 99  # a junk entry >= count: guarded
    ids = rng.integers(-3, 90, size=n)
    ids[:4] = [49, 50, 79, 80]  # at and beyond the adapters' vocabularies
    seq_slot = rng.integers(-2, 6, size=n).astype(np.int32)  # -2, -1, empty 1, 4 and 5 >= L
    out = bf16(rng, n, hidden)
    want = embed_loop(ids, seq_slot, -1, maps, rows, out)
    got = embed_overlay_routed_reference(ids, seq_slot, -1, maps, rows, out.copy())
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    assert (want != out).any(axis=1).sum() > 10  # the test exercised overrides


@pytest.mark.parametrize("active", [-1, 0, 2, 7])
def test_embed_overlay_reference_active_fallback(rng, active):
    maps, rows, _ = random_adapters(rng, [60, 60, 60], [20, 5, 60], 16)
    ids = rng.integers(0, 70, size=64).astype(np.int32)
    out = bf16(rng, 64, 16)
    want = embed_loop(ids, None, active, maps, rows, out)
    got = embed_overlay_routed_reference(ids, None, active, maps, rows, out.copy())
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    if active in (-1, 7):
        np.testing.assert_array_equal(got.view(np.uint16), out.view(np.uint16))


def test_embed_overlay_reference_thousands_of_overrides(rng):
    maps, rows, _ids_s = random_adapters(rng, [8192, 8192], [3000, 5000], 64)
    ids = rng.integers(0, 8192, size=512)
    seq_slot = (np.arange(512) % 3 - 1).astype(np.int32)
    out = bf16(rng, 512, 64)
    want = embed_loop(ids, seq_slot, -1, maps, rows, out)
    got = embed_overlay_routed_reference(ids, seq_slot, -1, maps, rows, out.copy())
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def test_embed_overlay_reference_rejects_bad_inputs(rng):
    maps, rows, _ = random_adapters(rng, [10], [3], 8)
    out = bf16(rng, 4, 8)
    ids = np.arange(4)
    with pytest.raises(ConfigError, match="ids"):
        embed_overlay_routed_reference(ids.astype(np.float32), None, 0, maps, rows, out)
    with pytest.raises(ConfigError, match="out"):
        embed_overlay_routed_reference(ids, None, 0, maps, rows, out.astype(np.float32))
    with pytest.raises(ConfigError, match="out"):
        embed_overlay_routed_reference(ids[:3], None, 0, maps, rows, out)
    with pytest.raises(ConfigError, match="seq_slot"):
        embed_overlay_routed_reference(ids, np.zeros(3, np.int32), 0, maps, rows, out)
    with pytest.raises(ConfigError, match="active"):
        embed_overlay_routed_reference(ids, None, 0.5, maps, rows, out)
    with pytest.raises(ConfigError, match="one entry per adapter"):
        embed_overlay_routed_reference(ids, None, 0, maps, rows + rows, out)
    with pytest.raises(ConfigError, match=r"override_rows\[0\]"):
        embed_overlay_routed_reference(ids, None, 0, maps, [bf16(rng, 3, 9)], out)


# ----------------------------------------------------------------------- LM-head overlay
@pytest.mark.parametrize("logit_dtype", [np.float32, BF16])
def test_lmhead_overlay_reference_matches_loop(rng, logit_dtype):
    hidden_size, n, n_cols = 24, 20, 70
    _, rows, ids = random_adapters(rng, [60, None, 80, 40], [12, 0, 30, 40], hidden_size)
    seq_slot = rng.integers(-1, 5, size=n).astype(np.int32)
    hidden = bf16(rng, n, hidden_size)
    logits = bf16(rng, n, n_cols).astype(logit_dtype)
    want = lmhead_loop(hidden, seq_slot, -1, ids, rows, logits)
    got = lmhead_overlay_routed_reference(hidden, seq_slot, -1, ids, rows, logits.copy())
    touched = ~np.isnan(want)
    assert touched.sum() > 20 and (np.asarray(ids[2]) >= n_cols).any()  # ids beyond n_cols
    np.testing.assert_array_equal(
        got[~touched].view(np.uint8), logits[~touched].view(np.uint8)
    )  # others untouched
    rtol = 1e-5 if logit_dtype == np.float32 else 2.0**-8
    np.testing.assert_allclose(got[touched].astype(np.float64), want[touched], rtol=rtol, atol=1e-5)


@pytest.mark.parametrize("active", [-1, 0, 1])
def test_lmhead_overlay_reference_active_and_empty(rng, active):
    _, rows, ids = random_adapters(rng, [50, 50], [7, 0], 16)
    hidden = bf16(rng, 5, 16)
    logits = np.zeros((5, 50), np.float32)
    got = lmhead_overlay_routed_reference(hidden, None, active, ids, rows, logits.copy())
    touched = (got != 0).any(axis=0)
    if active == 0:
        assert set(np.flatnonzero(touched)) == set(ids[0].tolist())
        want = hidden.astype(np.float32) @ rows[0].astype(np.float32).T
        np.testing.assert_allclose(got[:, ids[0]], want, rtol=1e-6)
    else:  # no adapter, or an adapter with zero overrides
        assert not touched.any()


def test_lmhead_overlay_reference_rejects_bad_inputs(rng):
    _, rows, ids = random_adapters(rng, [10], [3], 8)
    hidden = bf16(rng, 4, 8)
    logits = np.zeros((4, 10), np.float32)
    with pytest.raises(ConfigError, match="logits"):
        lmhead_overlay_routed_reference(hidden, None, 0, ids, rows, logits.astype(np.float16))
    with pytest.raises(ConfigError, match="logits"):
        lmhead_overlay_routed_reference(hidden, None, 0, ids, rows, logits[:3])
    with pytest.raises(ConfigError, match="hidden"):
        lmhead_overlay_routed_reference(hidden.astype(np.float32), None, 0, ids, rows, logits)
    with pytest.raises(ConfigError, match=r"override_rows\[0\]"):
        lmhead_overlay_routed_reference(hidden, None, 0, ids, [bf16(rng, 4, 8)], logits)


# ----------------------------------------------------------------------- GEMM path
def packed(ids, rows, hidden, cap=None, xp=np, align=1):
    total = sum(0 if i is None else len(i) for i in ids)
    cap = total if cap is None else cap
    rows_all = xp.asarray(np.full((cap, hidden), 7, np.uint16)).view(BF16)  # junk to overwrite
    ids_all = xp.full(cap, 5, dtype=xp.int32)
    d_ids = [None if a is None else xp.asarray(a) for a in ids]
    d_rows = [None if a is None else xp.asarray(a) for a in rows]
    bases, counts = pack_overrides(d_ids, d_rows, rows_all, ids_all, align=align)
    return rows_all, ids_all, bases, counts


def test_pack_overrides_layout(rng):
    _, rows, ids = random_adapters(rng, [60, None, 80, 40, 50], [12, 0, 30, 40, 0], 8)
    rows_all, ids_all, bases, counts = packed(ids, rows, 8, cap=100)
    assert counts.tolist() == [12, 0, 30, 40, 0] and bases.tolist() == [0, 12, 12, 42, 82]
    assert bases.dtype == counts.dtype == np.int32
    for s in (0, 2, 3):
        b, c = bases[s], counts[s]
        np.testing.assert_array_equal(ids_all[b : b + c], ids[s])
        np.testing.assert_array_equal(rows_all[b : b + c].view(np.uint16), rows[s].view(np.uint16))
    assert (ids_all[82:] == -1).all() and not rows_all[82:].view(np.uint16).any()
    with pytest.raises(ConfigError, match="rows_all has 50 rows"):
        packed(ids, rows, 8, cap=50)
    with pytest.raises(ConfigError, match="ids_all"):
        pack_overrides(ids, rows, rows_all, ids_all.astype(np.int64))
    with pytest.raises(ConfigError, match="one entry per adapter"):
        pack_overrides(ids, rows[:2], rows_all, ids_all)
    with pytest.raises(ConfigError, match=r"override_rows\[0\]"):
        pack_overrides(ids, [bf16(rng, 12, 9), *rows[1:]], rows_all, ids_all)


@pytest.mark.parametrize("logit_dtype", [np.float32, BF16])
def test_lmhead_gemm_reference_matches_loop_mixed_slots(rng, logit_dtype):
    hidden_size, n, n_cols = 24, 40, 70
    _, rows, ids = random_adapters(rng, [60, None, 80, 40], [12, 0, 30, 40], hidden_size)
    rows_all, ids_all, bases, counts = packed(ids, rows, hidden_size, cap=90)
    seq_slot = rng.integers(-2, 6, size=n).astype(np.int32)  # -2, -1, empty 1, 4, 5 >= L
    hidden = bf16(rng, n, hidden_size)
    logits = bf16(rng, n, n_cols).astype(logit_dtype)
    want = lmhead_loop(hidden, seq_slot, -1, ids, rows, logits)
    got = lmhead_overlay_gemm_reference(
        hidden, seq_slot, -1, rows_all, ids_all, bases, counts, logits.copy()
    )
    touched = ~np.isnan(want)
    assert touched.sum() > 20 and (ids[2] >= n_cols).any()  # ids beyond n_cols are skipped
    np.testing.assert_array_equal(got[~touched].view(np.uint8), logits[~touched].view(np.uint8))
    rtol = 1e-5 if logit_dtype == np.float32 else 2.0**-8
    np.testing.assert_allclose(got[touched].astype(np.float64), want[touched], rtol=rtol, atol=1e-5)


@pytest.mark.parametrize("active", [-1, 0, 1, 3])
def test_lmhead_gemm_reference_active_empty_and_thousands(rng, active):
    _, rows, ids = random_adapters(rng, [8192, 100, 8192], [3000, 0, 5000], 16)
    rows_all, ids_all, bases, counts = packed(ids, rows, 16)
    hidden = bf16(rng, 6, 16)
    logits = np.zeros((6, 8192), np.float32)
    want = lmhead_overlay_routed_reference(hidden, None, active, ids, rows, logits.copy())
    got = lmhead_overlay_gemm_reference(
        hidden, None, active, rows_all, ids_all, bases, counts, logits.copy()
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert (got != 0).any() == (active == 0)
    # bases/counts reaching past the table are clipped, never read out of bounds
    got = lmhead_overlay_gemm_reference(
        hidden, None, 2, rows_all, ids_all, bases, counts + 100, logits.copy()
    )
    want = lmhead_overlay_routed_reference(hidden, None, 2, ids, rows, logits.copy())
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------- mma path
def packed_mma(ids, rows, hidden, extra=0, align=MMA_ALIGN, xp=np):
    """The mma path's tables: rows packed with `align`, `extra` spare rows, tile table."""
    sizes = [0 if i is None else -(-len(i) // align) * align for i in ids]
    cap = -(-(sum(sizes) + extra) // 16) * 16
    rows_all, ids_all, bases, counts = packed(ids, rows, hidden, cap=cap, xp=xp, align=align)
    return rows_all, ids_all, mma_tile_adapters(bases, counts, cap), bases, counts


def test_pack_overrides_aligned_blocks_and_tile_table(rng):
    _, rows, ids = random_adapters(rng, [60, None, 80, 40, 50], [12, 0, 30, 40, 0], 8)
    rows_all, ids_all, bases, counts = packed(ids, rows, 8, cap=160, align=32)
    assert bases.tolist() == [0, 32, 32, 64, 128] and counts.tolist() == [12, 0, 30, 40, 0]
    for s in (0, 2, 3):
        b, c = bases[s], counts[s]
        np.testing.assert_array_equal(ids_all[b : b + c], ids[s])
        np.testing.assert_array_equal(rows_all[b : b + c].view(np.uint16), rows[s].view(np.uint16))
    pad = np.ones(160, bool)
    for s in (0, 2, 3):
        pad[bases[s] : bases[s] + counts[s]] = False
    assert (ids_all[pad] == -1).all() and not rows_all[pad].view(np.uint16).any()
    tiles = mma_tile_adapters(bases, counts, 160)
    # tile 1 (rows 16..31) is adapter 0's padding only; 7..9 are past the last block
    assert tiles.tolist() == [0, -1, 2, 2, 3, 3, 3, -1, -1, -1] and tiles.dtype == np.int32
    with pytest.raises(ConfigError, match="aligned to 32 rows"):
        packed(ids, rows, 8, cap=120, align=32)  # 12 + 30 + 40 rows fit, the padding does not
    with pytest.raises(ConfigError, match="align"):
        pack_overrides(ids, rows, rows_all, ids_all, align=0)
    with pytest.raises(ConfigError, match="multiple of 16"):
        mma_tile_adapters(bases, counts, 150)
    with pytest.raises(ConfigError, match="adapter 2"):
        mma_tile_adapters(bases + np.array([0, 0, 8, 8, 8]), counts, 160)


def mma_adapters(rng, hidden):
    """Adapters of 1000 (some ids >= 3000), none, 1, 15, 16, 17 and 1100 overrides."""
    return random_adapters(
        rng,
        [4096, None, 2000, 2000, 2000, 2000, 3000],
        [1000, 0, 1, 15, 16, 17, 1100],
        hidden,
    )


@pytest.mark.parametrize("logit_dtype", [np.float32, BF16])
def test_lmhead_mma_reference_matches_loop_mixed_slots(rng, logit_dtype):
    hidden_size, n, n_cols = 24, 40, 70
    _, rows, ids = random_adapters(rng, [60, None, 80, 40], [12, 0, 30, 40], hidden_size)
    rows_all, ids_all, tiles, _, _ = packed_mma(ids, rows, hidden_size, extra=40)
    seq_slot = rng.integers(-2, 6, size=n).astype(np.int32)  # -2, -1, empty 1, 4, 5 >= L
    hidden = bf16(rng, n, hidden_size)
    logits = bf16(rng, n, n_cols).astype(logit_dtype)
    want = lmhead_loop(hidden, seq_slot, -1, ids, rows, logits)
    got = lmhead_overlay_mma_reference(
        hidden, seq_slot, -1, rows_all, ids_all, tiles, 4, logits.copy()
    )
    touched = ~np.isnan(want)
    assert touched.sum() > 20 and (ids[2] >= n_cols).any()  # ids beyond n_cols are skipped
    np.testing.assert_array_equal(got[~touched].view(np.uint8), logits[~touched].view(np.uint8))
    rtol = 1e-5 if logit_dtype == np.float32 else 2.0**-8
    np.testing.assert_allclose(got[touched].astype(np.float64), want[touched], rtol=rtol, atol=1e-5)


@pytest.mark.parametrize("active", [-1, 0, 1, 2, 3, 5, 6, 7])
def test_lmhead_mma_reference_active_and_block_sizes(rng, active):
    _, rows, ids = mma_adapters(rng, 16)
    for align in (16, MMA_ALIGN):
        rows_all, ids_all, tiles, _, _ = packed_mma(ids, rows, 16, extra=50, align=align)
        hidden = bf16(rng, 6, 16)
        logits = np.zeros((6, 3000), np.float32)
        want = lmhead_overlay_routed_reference(hidden, None, active, ids, rows, logits.copy())
        got = lmhead_overlay_mma_reference(
            hidden, None, active, rows_all, ids_all, tiles, 7, logits.copy()
        )
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert (got != 0).any() == (active in (0, 2, 3, 5, 6))
        # fewer adapters than the tile table names: the others' tiles are skipped
        got = lmhead_overlay_mma_reference(
            hidden, None, active, rows_all, ids_all, tiles, 3, logits.copy()
        )
        assert (got != 0).any() == (active in (0, 2))


def test_lmhead_mma_reference_rejects_bad_inputs(rng):
    _, rows, ids = random_adapters(rng, [10], [3], 8)
    rows_all, ids_all, tiles, _, _ = packed_mma(ids, rows, 8)
    h, lg = bf16(rng, 4, 8), np.zeros((4, 10), np.float32)
    with pytest.raises(ConfigError, match="multiple of 16"):
        lmhead_overlay_mma_reference(h, None, 0, rows_all[:20], ids_all[:20], tiles, 1, lg)
    with pytest.raises(ConfigError, match="tile_adapter"):
        lmhead_overlay_mma_reference(h, None, 0, rows_all, ids_all, tiles[:1], 1, lg)
    with pytest.raises(ConfigError, match="ids_all"):
        lmhead_overlay_mma_reference(h, None, 0, rows_all, ids_all[:5], tiles, 1, lg)
    with pytest.raises(ConfigError, match="rows_all"):
        lmhead_overlay_mma_reference(h, None, 0, bf16(rng, 32, 9), ids_all, tiles, 1, lg)
    with pytest.raises(ConfigError, match="seq_slot"):
        lmhead_overlay_mma_reference(h, np.zeros(3, np.int32), 0, rows_all, ids_all, tiles, 1, lg)


# ----------------------------------------------------------------------- GPU
def _device_tables(maps_or_ids, rows):
    import cupy as cp

    from rowcache.kernels.overlay.routed import device_pointer_table

    d_first = [None if a is None else cp.asarray(a) for a in maps_or_ids]
    d_rows = [None if a is None else cp.asarray(a) for a in rows]
    counts = cp.asarray(np.array([0 if a is None else a.shape[0] for a in rows], np.int32))
    vocabs = cp.asarray(np.array([0 if a is None else a.shape[0] for a in maps_or_ids], np.int32))
    keep = (d_first, d_rows)  # the pointer tables do not own the arrays
    return device_pointer_table(d_first), device_pointer_table(d_rows), counts, vocabs, keep


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [256, 3072, 100, 7])
def test_embed_rowdiff_gpu_bit_exact(rng, hidden):
    import cupy as cp

    base = bf16(rng, 3000, hidden)
    served = base.copy()
    served[rng.choice(3000, 500, replace=False), rng.integers(0, hidden, 500)] += BF16.type(0.01)
    served[10, 0], served[11, 0], base[11, 0] = np.nan, np.nan, np.nan
    served[12, hidden - 1] = -np.inf
    served[13, 0] = np.float32(1e-40)  # subnormal (bf16 keeps it)
    for t in (0.0, 0.001, 0.5):
        want = embed_rowdiff_reference(base, served, t)
        got = embed_rowdiff(cp.asarray(base), cp.asarray(served), t)
        assert got.dtype == cp.bool_
        np.testing.assert_array_equal(got.get(), want)
    # views at a row offset (not 16-byte aligned for hidden=100: the scalar path)
    got = embed_rowdiff(cp.asarray(base)[1:], cp.asarray(served)[1:], 0.0)
    np.testing.assert_array_equal(got.get(), embed_rowdiff_reference(base[1:], served[1:], 0.0))


@pytest.mark.gpu
@pytest.mark.parametrize(("hidden", "id_dtype"), [(64, np.int64), (3072, np.int32), (36, np.int64)])
def test_embed_overlay_routed_gpu_bit_exact(rng, hidden, id_dtype):
    import cupy as cp

    from rowcache.kernels.overlay.routed import embed_overlay_routed

    maps, rows, _ = random_adapters(rng, [5000, None, 8192, 300], [1000, 0, 4000, 300], hidden)
    maps[3][7] = 1_000_000  # junk entry: guarded
    map_ptrs, row_ptrs, counts, vocabs, keep = _device_tables(maps, rows)
    n = 700
    ids = rng.integers(-5, 9000, size=n).astype(id_dtype)
    out = bf16(rng, n, hidden)
    for seq_slot, active in [
        (rng.integers(-1, 6, size=n).astype(np.int32), -1),
        (None, 2),
        (None, -1),
        (None, 9),
    ]:
        want = embed_overlay_routed_reference(ids, seq_slot, active, maps, rows, out.copy())
        d_out = cp.asarray(out)
        d_seq = None if seq_slot is None else cp.asarray(seq_slot)
        embed_overlay_routed(
            cp.asarray(ids), d_seq, active, map_ptrs, row_ptrs, counts, vocabs, d_out
        )
        np.testing.assert_array_equal(d_out.get().view(np.uint16), want.view(np.uint16))
    del keep


@pytest.mark.gpu
@pytest.mark.parametrize(("hidden", "logit_dtype"), [(3072, BF16), (256, np.float32), (40, BF16)])
def test_lmhead_overlay_routed_gpu_within_bf16_rounding(rng, hidden, logit_dtype):
    import cupy as cp

    from rowcache.kernels.overlay.routed import lmhead_overlay_routed

    _, rows, ids = random_adapters(rng, [4096, None, 2000, 1000], [1000, 0, 2000, 7], hidden)
    id_ptrs, row_ptrs, counts, _, keep = _device_tables(ids, rows)
    n, n_cols = 150, 3000  # adapter 0 overrides ids >= n_cols: skipped
    h = bf16(rng, n, hidden)
    logits = bf16(rng, n, n_cols).astype(logit_dtype)
    seq_slot = rng.integers(-1, 5, size=n).astype(np.int32)
    abs_rows = [None if r is None else np.abs(r) for r in rows]
    for seq, active in [(seq_slot, -1), (None, 0), (None, -1)]:
        want = lmhead_overlay_routed_reference(h, seq, active, ids, rows, logits.copy())
        d_logits = cp.asarray(logits)
        d_seq = None if seq is None else cp.asarray(seq)
        lmhead_overlay_routed(cp.asarray(h), d_seq, active, id_ptrs, row_ptrs, counts, d_logits)
        got = d_logits.get()
        # Every tile sums in the same order: the same bits, whatever the block size.
        for tile, block in [((1, 1), 32), ((2, 2), 256), ((2, 4), 128), ((4, 4), 64)]:
            d_other = cp.asarray(logits)
            lmhead_overlay_routed(
                cp.asarray(h), d_seq, active, id_ptrs, row_ptrs, counts, d_other,
                max_count=7, tile=tile, block=block,
            )  # fmt: skip
            np.testing.assert_array_equal(d_other.get().view(np.uint8), got.view(np.uint8))
        # Which entries the overlay writes: the reference run on NaN logits.
        probe = np.full(logits.shape, np.nan, np.float32)
        touched = ~np.isnan(lmhead_overlay_routed_reference(h, seq, active, ids, rows, probe))
        assert touched.any() == (active != -1 or seq is not None)
        np.testing.assert_array_equal(got[~touched].view(np.uint8), logits[~touched].view(np.uint8))
        # f32 sums in another order differ by a few f32 ulps of sum|h*w|; bf16 logits may
        # then round to the neighbouring bf16 value (one step = 2^-7 relative at most).
        absdot = lmhead_overlay_routed_reference(
            np.abs(h), seq, active, ids, abs_rows, np.zeros(logits.shape, np.float32)
        ).astype(np.float64)
        g, w = got[touched].astype(np.float64), want[touched].astype(np.float64)
        rel = 2.0**-7 if logit_dtype == BF16 else 0.0
        tol = np.abs(w) * rel + absdot[touched] * 2.0**-16 + 1e-30
        assert (np.abs(g - w) <= tol).all(), float(np.max(np.abs(g - w) - tol))
    del keep


@pytest.mark.gpu
def test_overlay_kernels_reject_host_arrays(rng):
    import cupy as cp

    from rowcache.kernels.overlay.routed import embed_overlay_routed, lmhead_overlay_routed

    maps, rows, _ids = random_adapters(rng, [10], [3], 8)
    map_ptrs, row_ptrs, counts, vocabs, keep = _device_tables(maps, rows)
    with pytest.raises(ConfigError, match="ids"):
        embed_overlay_routed(
            np.arange(4), None, 0, map_ptrs, row_ptrs, counts, vocabs, bf16(rng, 4, 8)
        )
    h, lg = cp.asarray(bf16(rng, 4, 8)), cp.zeros((4, 10), np.float32)
    with pytest.raises(ConfigError, match="tile"):
        lmhead_overlay_routed(h, None, 0, map_ptrs, row_ptrs, counts, lg, tile=(3, 3))
    with pytest.raises(ConfigError, match="block"):
        lmhead_overlay_routed(h, None, 0, map_ptrs, row_ptrs, counts, lg, block=100)
    with pytest.raises(ConfigError, match="hidden and logits"):
        lmhead_overlay_routed(
            bf16(rng, 4, 8), None, 0, map_ptrs, row_ptrs, counts, np.zeros((4, 10), np.float32)
        )
    del keep


def _within_rounding(got, want, h, seq, active, ids, rows, logits, logit_dtype):
    """The existing GPU tolerance: f32 sums in another order (a few f32 ulps of
    sum|h*w|), then possibly one bf16 step for bf16 logits; untouched entries bit-equal."""
    probe = np.full(logits.shape, np.nan, np.float32)
    touched = ~np.isnan(lmhead_overlay_routed_reference(h, seq, active, ids, rows, probe))
    np.testing.assert_array_equal(got[~touched].view(np.uint8), logits[~touched].view(np.uint8))
    abs_rows = [None if r is None else np.abs(r) for r in rows]
    absdot = lmhead_overlay_routed_reference(
        np.abs(h), seq, active, ids, abs_rows, np.zeros(logits.shape, np.float32)
    ).astype(np.float64)
    g, w = got[touched].astype(np.float64), want[touched].astype(np.float64)
    rel = 2.0**-7 if logit_dtype == BF16 else 0.0
    tol = np.abs(w) * rel + absdot[touched] * 2.0**-16 + 1e-30
    assert (np.abs(g - w) <= tol).all(), float(np.max(np.abs(g - w) - tol))
    return touched


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("hidden", "logit_dtype", "pad"), [(3072, BF16, 0), (256, np.float32, 37), (40, BF16, 256)]
)
def test_lmhead_overlay_gemm_gpu_within_bf16_rounding(rng, hidden, logit_dtype, pad):
    import cupy as cp

    from rowcache.kernels.overlay.routed import lmhead_overlay_gemm

    _, rows, ids = random_adapters(rng, [4096, None, 2000, 1000], [1000, 0, 2000, 7], hidden)
    total = 3007
    rows_all, ids_all, bases, counts = packed(ids, rows, hidden, cap=total + pad, xp=cp)
    d_bases, d_counts = cp.asarray(bases), cp.asarray(counts)
    n, n_cols = 150, 3000  # adapter 0 overrides ids >= n_cols: skipped
    h = bf16(rng, n, hidden)
    logits = bf16(rng, n, n_cols).astype(logit_dtype)
    p = cp.full((n + 5, total + pad), np.nan, dtype=cp.float32)  # more rows than needed
    seq_slot = rng.integers(-1, 6, size=n).astype(np.int32)  # 4 and 5 >= L: untouched
    for seq, active in [(seq_slot, -1), (None, 0), (None, 2), (None, -1), (None, 7)]:
        want = lmhead_overlay_routed_reference(h, seq, active, ids, rows, logits.copy())
        d_logits = cp.asarray(logits)
        d_seq = None if seq is None else cp.asarray(seq)
        lmhead_overlay_gemm(
            cp.asarray(h), d_seq, active, rows_all, ids_all, d_bases, d_counts, d_logits,
            p=p, max_count=int(counts.max()),
        )  # fmt: skip
        got = d_logits.get()
        touched = _within_rounding(got, want, h, seq, active, ids, rows, logits, logit_dtype)
        assert touched.any() == (seq is not None or active in (0, 2))
        # a grid smaller than the largest adapter loops over the rest: same bits
        d_other = cp.asarray(logits)
        lmhead_overlay_gemm(
            cp.asarray(h), d_seq, active, rows_all, ids_all, d_bases, d_counts, d_other,
            p=p, max_count=7,
        )  # fmt: skip
        np.testing.assert_array_equal(d_other.get().view(np.uint8), got.view(np.uint8))


@pytest.mark.gpu
def test_lmhead_overlay_gemm_gpu_captured_in_graph(rng):
    """The GEMM and the scatter replay from a CUDA graph; only seq_slot's contents change."""
    import cupy as cp

    from rowcache.kernels.overlay.routed import lmhead_overlay_gemm

    hidden = 512
    _, rows, ids = random_adapters(rng, [5000, 5000, 5000], [1500, 0, 2500], hidden)
    rows_all, ids_all, bases, counts = packed(ids, rows, hidden, cap=4096, xp=cp)
    d_bases, d_counts = cp.asarray(bases), cp.asarray(counts)
    n = 64
    h = bf16(rng, n, hidden)
    logits = np.zeros((n, 5000), np.float32)
    d_h, d_logits = cp.asarray(h), cp.asarray(logits)
    d_seq = cp.full(n, -1, dtype=cp.int32)
    p = cp.zeros((n, 4096), dtype=cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)

    def step():
        lmhead_overlay_gemm(
            d_h, d_seq, -1, rows_all, ids_all, d_bases, d_counts, d_logits, p=p, max_count=2500
        )

    with stream:
        step()  # eager first: cuBLAS picks and loads its kernel outside the capture
        stream.synchronize()
        stream.begin_capture()
        try:
            step()
        finally:
            graph = stream.end_capture()
    for _ in range(2):
        seq = rng.integers(-1, 3, size=n).astype(np.int32)
        d_seq.set(seq)
        d_logits.fill(0)
        cp.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
        want = lmhead_overlay_routed_reference(h, seq, -1, ids, rows, logits.copy())
        _within_rounding(d_logits.get(), want, h, seq, -1, ids, rows, logits, np.float32)
        assert (want != 0).any()


@pytest.mark.gpu
def test_lmhead_overlay_gemm_rejects_bad_workspace(rng):
    import cupy as cp

    from rowcache.kernels.overlay.routed import lmhead_overlay_gemm

    _, rows, ids = random_adapters(rng, [10], [3], 8)
    rows_all, ids_all, bases, counts = packed(ids, rows, 8, xp=cp)
    h, lg = cp.asarray(bf16(rng, 4, 8)), cp.zeros((4, 10), np.float32)
    tables = (rows_all, ids_all, cp.asarray(bases), cp.asarray(counts))
    for bad in (cp.zeros((3, 3), np.float32), cp.zeros((4, 4), np.float32), None):
        with pytest.raises(ConfigError, match="p must be"):
            lmhead_overlay_gemm(h, None, 0, *tables, lg, p=bad)
    with pytest.raises(ConfigError, match="bases"):
        lmhead_overlay_gemm(
            h, None, 0, rows_all, ids_all, bases, tables[3], lg, p=cp.zeros((4, 3), np.float32)
        )  # host bases


def _expected(h, seq, active, ids, rows, logits, logit_dtype):
    """Reference logits, the entries the overlay writes, and the per-entry tolerance of
    `_within_rounding` (computed once, to check many launches against)."""
    want = lmhead_overlay_routed_reference(h, seq, active, ids, rows, logits.copy())
    probe = np.full(logits.shape, np.nan, np.float32)
    touched = ~np.isnan(lmhead_overlay_routed_reference(h, seq, active, ids, rows, probe))
    abs_rows = [None if r is None else np.abs(r) for r in rows]
    absdot = lmhead_overlay_routed_reference(
        np.abs(h), seq, active, ids, abs_rows, np.zeros(logits.shape, np.float32)
    ).astype(np.float64)
    w = want[touched].astype(np.float64)
    rel = 2.0**-7 if logit_dtype == BF16 else 0.0
    tol = np.abs(w) * rel + absdot[touched] * 2.0**-16 + 1e-30
    return want, touched, tol


def _check_close(got, logits, want, touched, tol, what=""):
    np.testing.assert_array_equal(
        got[~touched].view(np.uint8), logits[~touched].view(np.uint8), err_msg=what
    )
    err = np.abs(got[touched].astype(np.float64) - want[touched].astype(np.float64))
    assert (err <= tol).all(), (what, int((err > tol).sum()), float(np.max(err - tol)))


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("hidden", "logit_dtype"),
    [(3072, BF16), (256, np.float32), (40, BF16), (20, np.float32), (4136, BF16)],
)
def test_lmhead_overlay_mma_gpu_within_bf16_rounding(rng, hidden, logit_dtype):
    """Every config against the reference: adapters of 0/1/15/16/17/1000/1100 rows, ids
    beyond n_cols, mixed slots (-1, empty 1, 7 and 8 >= L), the active fallback, batches
    1..300 (several chunks and passes of routed rows); hidden 40 has a ragged k-block and
    fewer k-blocks than the ring holds, hidden 20 takes the scalar (non-16-byte) path,
    hidden 4136 ends on a ragged k-block."""
    import cupy as cp

    from rowcache.kernels.overlay.routed import lmhead_overlay_mma

    _, rows, ids = mma_adapters(rng, hidden)
    tables = {}
    for align in (16, MMA_ALIGN):  # 16: a 2-tile block may straddle two adapters
        rows_all, ids_all, tiles, _, _ = packed_mma(ids, rows, hidden, extra=70, align=align)
        tables[align] = (cp.asarray(rows_all), cp.asarray(ids_all), cp.asarray(tiles))
    n_cols = 3000  # adapter 0 overrides ids >= n_cols: skipped
    for n in (1, 7, 64, 300):
        h = bf16(rng, n, hidden)
        d_h = cp.asarray(h)
        logits = bf16(rng, n, n_cols).astype(logit_dtype)
        seq_slot = rng.integers(-1, 9, size=n).astype(np.int32)
        cases = [(seq_slot, -1), (None, 0), (None, 5), (None, -1), (None, 7)]
        for seq, active in cases if n != 7 else cases[:2]:
            want, touched, tol = _expected(h, seq, active, ids, rows, logits, logit_dtype)
            assert touched.any() == (seq is not None or active in (0, 5))
            d_seq = None if seq is None else cp.asarray(seq)
            bits = {}
            for align, (rows_all, ids_all, tiles) in tables.items():
                for config in MMA_CONFIGS:
                    d_logits = cp.asarray(logits)
                    lmhead_overlay_mma(
                        d_h, d_seq, active, rows_all, ids_all, tiles, 7, d_logits, config=config
                    )
                    got = d_logits.get()
                    what = f"config {config}, align {align}, n {n}, active {active}"
                    _check_close(got, logits, want, touched, tol, what)
                    bits[align, config] = got.view(np.uint8)
            # The k split depends on the warps only: tiles per block, ring depth and the
            # packing change nothing in the sums.
            first = {}
            for (_align, (_t, w, _st)), b in bits.items():
                np.testing.assert_array_equal(b, first.setdefault(w, b))


@pytest.mark.gpu
def test_lmhead_overlay_mma_gpu_captured_in_graph(rng):
    """The mma kernel replays from a CUDA graph; only seq_slot's contents change."""
    import cupy as cp

    from rowcache.kernels.overlay.routed import DEFAULT_MMA_CONFIG, lmhead_overlay_mma

    hidden = 512
    _, rows, ids = random_adapters(rng, [5000, 5000, 5000], [1500, 0, 2500], hidden)
    rows_all, ids_all, tiles, _, _ = packed_mma(ids, rows, hidden, extra=100, xp=cp)
    tiles = cp.asarray(tiles)
    n = 64
    h = bf16(rng, n, hidden)
    logits = np.zeros((n, 5000), np.float32)
    d_h, d_logits = cp.asarray(h), cp.asarray(logits)
    d_seq = cp.full(n, -1, dtype=cp.int32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        lmhead_overlay_mma(d_h, d_seq, -1, rows_all, ids_all, tiles, 3, d_logits)  # compiles
        stream.synchronize()
        stream.begin_capture()
        try:
            lmhead_overlay_mma(
                d_h, d_seq, -1, rows_all, ids_all, tiles, 3, d_logits, config=DEFAULT_MMA_CONFIG
            )
        finally:
            graph = stream.end_capture()
    for _ in range(2):
        seq = rng.integers(-1, 3, size=n).astype(np.int32)
        d_seq.set(seq)
        d_logits.fill(0)
        cp.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
        want, touched, tol = _expected(h, seq, -1, ids, rows, logits, np.float32)
        _check_close(d_logits.get(), logits, want, touched, tol)
        assert (want != 0).any()


@pytest.mark.gpu
def test_lmhead_overlay_mma_rejects_bad_inputs(rng):
    import cupy as cp

    from rowcache.kernels.overlay.routed import lmhead_overlay_mma

    _, rows, ids = random_adapters(rng, [10], [3], 8)
    rows_all, ids_all, tiles, _, _ = packed_mma(ids, rows, 8, xp=cp)
    tiles = cp.asarray(tiles)
    h, lg = cp.asarray(bf16(rng, 4, 8)), cp.zeros((4, 10), np.float32)
    with pytest.raises(ConfigError, match="config"):
        lmhead_overlay_mma(h, None, 0, rows_all, ids_all, tiles, 1, lg, config=(4, 8, 4))
    with pytest.raises(ConfigError, match="multiple of 16"):
        lmhead_overlay_mma(h, None, 0, rows_all[:20], ids_all[:20], tiles, 1, lg)
    with pytest.raises(ConfigError, match="tile_adapter"):
        lmhead_overlay_mma(h, None, 0, rows_all, ids_all, tiles.get(), 1, lg)  # host table
    with pytest.raises(ConfigError, match="num_adapters"):
        lmhead_overlay_mma(h, None, 0, rows_all, ids_all, tiles, -1, lg)
    with pytest.raises(ConfigError, match="logits"):
        lmhead_overlay_mma(h, None, 0, rows_all, ids_all, tiles, 1, np.zeros((4, 10), np.float32))
