"""scatter_records (the cache's fault path): reference against plain Python, kernel against reference.

Records are built with ``rowcache.format.layout.encode_records``, the store's own encoder, so
the tests also pin the record layout the kernel decodes (FP8: codes then a
little-endian float32 scale at byte ``dim``, usually not 4-byte aligned).
"""

from __future__ import annotations

import struct

import ml_dtypes
import numpy as np
import pytest

import rowcache.kernels
from rowcache.errors import ConfigError
from rowcache.format.layout import encode_records
from rowcache.kernels.reference import BF16, scatter_records_reference
from tests.kernels.support import mapped_host_array, non_nan_codes, random_scales, random_table

DIMS = (1, 7, 130, 256, 3072)
SLOT_DTYPES = (np.int32, np.int64)
POISON16 = 0xFFFF
POISON8 = 0x7F


def bf16_case(rng, n: int, slots: int, d: int, slot_dtype=np.int64):
    """(records, slots, arena) for a bf16 arena poisoned with NaN bits."""
    rows = random_table(rng, n, d)
    records = encode_records("bf16", rows)
    dest = rng.permutation(slots)[:n].astype(slot_dtype)
    arena = np.full((slots, d), POISON16, dtype=np.uint16).view(BF16)
    return records, dest, arena


def fp8_case(rng, n: int, slots: int, d: int, slot_dtype=np.int64):
    """(records, slots, codes arena, scales arena), the arenas poisoned with NaNs."""
    records = encode_records("fp8", (non_nan_codes(rng, (n, d)), random_scales(rng, n)))
    dest = rng.permutation(slots)[:n].astype(slot_dtype)
    arena = np.full((slots, d), POISON8, dtype=np.uint8)
    scales = np.full(slots, np.nan, dtype=np.float32)
    return records, dest, arena, scales


# --- the reference against per-element Python ---------------------------------------------


def test_scatter_reference_bf16_matches_python_loop(rng):
    records, dest, arena = bf16_case(rng, 5, 9, 3)
    expect = arena.view(np.uint16).copy()
    for rec, slot in zip(records.tolist(), dest.tolist()):
        expect[slot] = [rec[2 * j] | (rec[2 * j + 1] << 8) for j in range(3)]
    scatter_records_reference(records, dest, arena)
    assert np.array_equal(arena.view(np.uint16), expect)


def test_scatter_reference_fp8_matches_python_loop(rng):
    records, dest, arena, scales = fp8_case(rng, 6, 10, 5)
    expect_codes = arena.copy()
    expect_scales = scales.copy()
    for rec, slot in zip(records.tolist(), dest.tolist()):
        expect_codes[slot] = rec[:5]
        expect_scales[slot] = struct.unpack("<f", bytes(rec[5:9]))[0]
    scatter_records_reference(records, dest, arena, scales)
    assert np.array_equal(arena, expect_codes)
    assert np.array_equal(scales.view(np.uint32), expect_scales.view(np.uint32))


# --- the CPU path -----------------------------------------------------------------------


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("slot_dtype", SLOT_DTYPES)
def test_scatter_records_cpu_bf16(rng, d, slot_dtype):
    records, dest, arena = bf16_case(rng, 20, 50, d, slot_dtype)
    before = arena.view(np.uint16).copy()
    rowcache.kernels.scatter_records(records, dest, arena)
    got = arena.view(np.uint16)
    assert np.array_equal(got[dest], records.view(np.uint16))
    untouched = np.setdiff1d(np.arange(50), dest)
    assert np.array_equal(got[untouched], before[untouched])


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("slot_dtype", SLOT_DTYPES)
def test_scatter_records_cpu_fp8(rng, d, slot_dtype):
    records, dest, arena, scales = fp8_case(rng, 20, 50, d, slot_dtype)
    rowcache.kernels.scatter_records(records, dest, arena, scales)
    assert np.array_equal(arena[dest], records[:, :d])
    assert np.array_equal(scales[dest], records[:, d:].copy().view("<f4").ravel())
    untouched = np.setdiff1d(np.arange(50), dest)
    assert np.all(arena[untouched] == POISON8) and np.all(np.isnan(scales[untouched]))


def test_scatter_records_cpu_padded_records_and_empty_batch(rng):
    records, dest, arena, scales = fp8_case(rng, 4, 8, 6)
    padded = np.concatenate([records, np.full((4, 3), 0xAB, np.uint8)], axis=1)
    rowcache.kernels.scatter_records(padded, dest, arena, scales)
    assert np.array_equal(arena[dest], records[:, :6])
    rowcache.kernels.scatter_records(
        np.zeros((0, 10), np.uint8), np.zeros(0, np.int64), arena, scales
    )
    assert np.array_equal(arena[dest], records[:, :6])


@pytest.mark.parametrize("bad", [-1, 8])
def test_scatter_records_cpu_rejects_slots_out_of_range(rng, bad):
    records, dest, arena = bf16_case(rng, 3, 8, 4)
    dest[1] = bad
    before = arena.view(np.uint16).copy()
    with pytest.raises(IndexError, match="slots"):
        rowcache.kernels.scatter_records(records, dest, arena)
    assert np.array_equal(arena.view(np.uint16), before)


def _fp8_arena():
    return np.zeros((4, 3), np.uint8), np.ones(4, np.float32)


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((np.zeros((2, 6), np.int8), np.arange(2), np.zeros((4, 3), BF16)), "records"),
        ((np.zeros(12, np.uint8), np.arange(2), np.zeros((4, 3), BF16)), "records"),
        ((np.zeros((2, 5), np.uint8), np.arange(2), np.zeros((4, 3), BF16)), "records"),
        ((np.zeros((2, 6), np.uint8), np.arange(3), np.zeros((4, 3), BF16)), "slots"),
        ((np.zeros((2, 6), np.uint8), np.array([0.0, 1.0]), np.zeros((4, 3), BF16)), "slots"),
        ((np.zeros((2, 6), np.uint8), np.arange(2), np.zeros((4, 3), np.float32)), "table"),
        ((np.zeros((2, 6), np.uint8), np.arange(2), np.zeros(12, BF16)), "table"),
        (
            (
                np.zeros((2, 6), np.uint8),
                np.arange(2),
                np.zeros((4, 3), BF16),
                np.ones(4, np.float32),
            ),
            "scales",
        ),
        # a uint8 arena without scales holds table-scaled codes verbatim: d bytes a record
        ((np.zeros((2, 2), np.uint8), np.arange(2), np.zeros((4, 3), np.uint8)), "records"),
        (
            (
                np.zeros((2, 7), np.uint8),
                np.arange(2),
                np.zeros((4, 3), np.uint8),
                np.ones(3, np.float32),
            ),
            "scales",
        ),
        (
            (
                np.zeros((2, 7), np.uint8),
                np.arange(2),
                np.zeros((4, 3), np.uint8),
                np.ones(4, np.float64),
            ),
            "scales",
        ),
        ((np.zeros((2, 6), np.uint8), np.arange(2), *_fp8_arena()), "records"),
    ],
)
def test_scatter_records_rejects_bad_arguments(args, name):
    with pytest.raises(ConfigError, match=name):
        rowcache.kernels.scatter_records(*args)


# --- the kernel against the reference ---------------------------------------------------


def _records_on(cp, records: np.ndarray, where: str):
    if where == "device":
        return cp.asarray(records)
    if where == "mapped":
        return mapped_host_array(cp, records)
    return records  # numpy: the launcher copies it to the device


@pytest.mark.gpu
@pytest.mark.parametrize("d", (*DIMS, 8, 16))
@pytest.mark.parametrize("slot_dtype", SLOT_DTYPES)
@pytest.mark.parametrize("where", ["device", "host", "mapped"])
def test_scatter_records_gpu_bf16_bitexact(rng, d, slot_dtype, where):
    import cupy as cp

    records, dest, arena = bf16_case(rng, 150, 400, d, slot_dtype)
    dev_arena = cp.asarray(arena)
    rowcache.kernels.scatter_records(_records_on(cp, records, where), cp.asarray(dest), dev_arena)
    scatter_records_reference(records, dest, arena)
    assert np.array_equal(dev_arena.get().view(np.uint16), arena.view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize("d", (*DIMS, 12, 28, 252, 0))
@pytest.mark.parametrize("slot_dtype", SLOT_DTYPES)
@pytest.mark.parametrize("where", ["device", "host", "mapped"])
def test_scatter_records_gpu_fp8_bitexact(rng, d, slot_dtype, where):
    import cupy as cp

    records, dest, arena, scales = fp8_case(rng, 150, 400, d, slot_dtype)
    dev_arena, dev_scales = cp.asarray(arena), cp.asarray(scales)
    rowcache.kernels.scatter_records(_records_on(cp, records, where), dest, dev_arena, dev_scales)
    scatter_records_reference(records, dest, arena, scales)
    assert np.array_equal(dev_arena.get(), arena)
    assert np.array_equal(dev_scales.get().view(np.uint32), scales.view(np.uint32))


@pytest.mark.gpu
@pytest.mark.parametrize("d", (8, 61, 256))
def test_scatter_records_gpu_misaligned_padded_records(rng, d):
    import cupy as cp

    records, dest, arena, scales = fp8_case(rng, 33, 90, d)
    buf = np.full((33, d + 4 + 5), 0xCD, dtype=np.uint8)
    buf[:, 1 : d + 5] = records  # records start 1 byte in, stride d + 9
    dev_arena, dev_scales = cp.asarray(arena), cp.asarray(scales)
    rowcache.kernels.scatter_records(
        cp.asarray(buf)[:, 1:], cp.asarray(dest), dev_arena, dev_scales
    )
    scatter_records_reference(records, dest, arena, scales)
    assert np.array_equal(dev_arena.get(), arena)
    assert np.array_equal(dev_scales.get().view(np.uint32), scales.view(np.uint32))


@pytest.mark.gpu
def test_scatter_records_gpu_many_records_grid_strides(rng):
    import cupy as cp

    records, dest, arena = bf16_case(rng, 300_000, 400_000, 2, np.int32)
    dev_arena = cp.asarray(arena)
    rowcache.kernels.scatter_records(cp.asarray(records), cp.asarray(dest), dev_arena)
    scatter_records_reference(records, dest, arena)
    assert np.array_equal(dev_arena.get().view(np.uint16), arena.view(np.uint16))


@pytest.mark.gpu
def test_scatter_records_gpu_empty_and_mixed_devices(rng):
    import cupy as cp

    records, dest, arena, scales = fp8_case(rng, 3, 8, 4)
    dev_arena = cp.asarray(arena)
    rowcache.kernels.scatter_records(
        cp.zeros((0, 8), cp.uint8), cp.zeros(0, cp.int32), dev_arena, cp.asarray(scales)
    )
    assert np.array_equal(dev_arena.get(), arena)
    with pytest.raises(ConfigError, match="scales"):
        rowcache.kernels.scatter_records(records, dest, dev_arena, scales)


def _pinned(cp, shape, dtype):
    """(memory, NumPy view) of pinned host memory mapped into the device (flag 2)."""
    mem = cp.cuda.PinnedMemory(int(np.prod(shape)) * np.dtype(dtype).itemsize, 2)
    view = np.frombuffer(cp.cuda.PinnedMemoryPointer(mem, 0), dtype, int(np.prod(shape)))
    return mem, view.reshape(shape)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize(
    "n, n_evicted, n_out", [(1, 0, 0), (1, 0, 12), (7, 3, 0), (300, 300, 5000)]
)
def test_fault_commit_gpu_equals_reference(rng, fp8, n, n_evicted, n_out):
    """One launch: records from mapped pinned memory into slots, the row map update and
    a resolve's slots (``out``) copied from the side buffer; nothing written past them."""
    import cupy as cp

    from rowcache.kernels.scatter import FaultCommit, fault_commit_reference

    S, d, R = 512, 64, 5000
    rec = d + 4 if fp8 else 2 * d
    table = (
        cp.asarray(rng.integers(0, 255, (S, d), dtype=np.uint8))
        if fp8
        else cp.asarray(rng.standard_normal((S, d)).astype(np.float32).astype(ml_dtypes.bfloat16))
    )
    scales = cp.asarray(rng.random(S, dtype=np.float32)) if fp8 else None

    m1, records = _pinned(cp, (n, rec), np.uint8)
    records[:] = rng.integers(0, 255, (n, rec), dtype=np.uint8)
    if fp8:  # finite scales in the records
        records[:, d : d + 4] = rng.random((n, 1), dtype=np.float32).view(np.uint8)
    m2, side = _pinned(cp, (2 * n + n_evicted + n_out,), np.int32)
    rows = rng.choice(R, n + n_evicted, replace=False).astype(np.int32)
    side[:n] = rng.choice(S, n, replace=False)
    side[n : 2 * n] = rows[:n]
    side[2 * n : 2 * n + n_evicted] = rows[n:]
    side[2 * n + n_evicted :] = rng.integers(0, S, n_out)
    row_map = cp.asarray(rng.integers(-1, S, R).astype(np.int32))
    want_t, want_s, want_m = table.get(), None if scales is None else scales.get(), row_map.get()
    want_o = np.full(n_out + 8, -7, dtype=np.int32)
    ref_out = want_o[:n_out] if n_out else None
    fault_commit_reference(records.copy(), side.copy(), n_evicted, want_t, want_s, want_m, ref_out)
    commit = FaultCommit(table, scales, rec, records.ctypes.data)
    stream = cp.cuda.Stream()
    out = cp.full(n_out + 8, -7, dtype=cp.int32)
    commit(records.ctypes.data, side.ctypes.data, n, n_evicted, row_map, stream,
           out[:n_out] if n_out else None)  # fmt: skip
    stream.synchronize()
    np.testing.assert_array_equal(table.get().view(np.uint8), want_t.view(np.uint8))
    np.testing.assert_array_equal(row_map.get(), want_m)
    np.testing.assert_array_equal(out.get(), want_o)
    if fp8:
        np.testing.assert_array_equal(scales.get(), want_s)
    del m1, m2


@pytest.mark.gpu
@pytest.mark.parametrize("clean", [True, False])
def test_fault_commit_deferred_waits_for_the_flag_and_writes_only_after_a_clean_read(rng, clean):
    """A deferred fault's launch (``ctl_ptr``): the stream holds until the host sets the
    flag, the records staged after the launch are the ones written; a flag that says the
    read failed leaves table, row map and out as they were."""
    import time

    import cupy as cp

    from rowcache.kernels.scatter import FaultCommit, fault_commit_reference

    S, d, R, n, ev = 256, 64, 3000, 40, 5
    table = cp.asarray(rng.integers(0, 255, (S, d), dtype=np.uint8))
    scales = cp.asarray(rng.random(S, dtype=np.float32))
    rec = d + 4

    m1, records = _pinned(cp, (n, rec), np.uint8)
    m2, side = _pinned(cp, (2 * n + ev + n,), np.int32)
    m3, ctl = _pinned(cp, (2,), np.int32)
    ctl[:] = 0
    records[:] = 0
    rows = rng.choice(R, n + ev, replace=False).astype(np.int32)
    side[:n] = rng.choice(S, n, replace=False)
    side[n : 2 * n] = rows[:n]
    side[2 * n : 2 * n + ev] = rows[n:]
    side[2 * n + ev :] = rng.integers(0, S, n)
    row_map = cp.asarray(rng.integers(-1, S, R).astype(np.int32))
    before = table.get(), scales.get(), row_map.get()
    commit = FaultCommit(table, scales, rec, records.ctypes.data)
    stream = cp.cuda.Stream(non_blocking=True)
    out = cp.full(n, -7, dtype=cp.int32)
    commit(records.ctypes.data, side.ctypes.data, n, ev, row_map, stream, out,
           ctl_ptr=ctl.ctypes.data, seq=9)  # fmt: skip
    done = stream.record()
    time.sleep(0.05)
    assert not done.done  # held by fault_wait
    staged = rng.integers(0, 255, (n, rec), dtype=np.uint8)
    staged[:, d : d + 4] = rng.random((n, 1), dtype=np.float32).view(np.uint8)
    records[:] = staged  # the "read", after the launch
    ctl[1] = 9 if clean else 8
    ctl[0] = 9
    stream.synchronize()
    if clean:
        want_t, want_s, want_m = before[0].copy(), before[1].copy(), before[2].copy()
        want_o = np.empty(n, np.int32)
        fault_commit_reference(staged, side.copy(), ev, want_t, want_s, want_m, want_o)
    else:
        want_t, want_s, want_m, want_o = *before, np.full(n, -7, np.int32)
    np.testing.assert_array_equal(table.get(), want_t)
    np.testing.assert_array_equal(scales.get(), want_s)
    np.testing.assert_array_equal(row_map.get(), want_m)
    np.testing.assert_array_equal(out.get(), want_o)
    del m1, m2, m3


def test_scatter_records_verbatim_codes(rng):
    """A uint8 arena without scales (the fp8_table_scale codec) takes each record's first
    ``d`` bytes as they are; padding after them is ignored."""
    records = rng.integers(0, 256, size=(5, 9), dtype=np.uint8)
    arena = np.zeros((8, 7), np.uint8)
    dest = np.array([6, 0, 3, 7, 1])
    rowcache.kernels.scatter_records(records, dest, arena)
    np.testing.assert_array_equal(arena[dest], records[:, :7])
    assert not arena[[2, 4, 5]].any()


@pytest.mark.gpu
def test_scatter_records_verbatim_codes_gpu(rng):
    import cupy as cp

    records = rng.integers(0, 256, size=(300, 161), dtype=np.uint8)
    dest = rng.permutation(512)[:300]
    arena = np.zeros((512, 160), np.uint8)
    dev = cp.asarray(arena)
    rowcache.kernels.scatter_records(records, dest, arena)
    rowcache.kernels.scatter_records(cp.asarray(records), cp.asarray(dest), dev)
    np.testing.assert_array_equal(dev.get(), arena)
