"""Row gathers: the references against plain Python, the kernels against the references.

CPU tests run the public functions on NumPy arrays (the CPU path); GPU tests compare
the kernels bit for bit with the references, with poisoned outputs, odd dims,
misaligned and strided arrays, and tables in mapped pinned host memory.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import rowcache.kernels
from rowcache.errors import ConfigError
from rowcache.kernels.reference import BF16, batched_embed_fp8_reference, batched_embed_reference
from tests.kernels.support import (
    bf16_bits_rne,
    e4m3_value,
    mapped_host_array,
    non_nan_codes,
    random_scales,
    random_table,
)

DIMS = (1, 7, 130, 256, 3072)
ID_DTYPES = (np.int32, np.int64)
POISON = 0xFFFF  # a NaN bit pattern no gather of finite data produces


def random_ids(rng: np.random.Generator, n: int, rows: int, dtype) -> np.ndarray:
    """Ids with duplicates and both ends of the table."""
    ids = rng.integers(0, rows, size=n).astype(dtype)
    if n >= 4:
        ids[0], ids[1], ids[2] = 0, rows - 1, ids[3]
    return ids


def bits(a) -> np.ndarray:
    host = a.get() if hasattr(a, "get") else np.asarray(a)
    return np.ascontiguousarray(host).view(np.uint16)


# --- the references against per-element Python -----------------------------------------


def test_batched_embed_reference_matches_python_loop(rng):
    table = random_table(rng, 11, 5)
    ids = np.array([3, 0, 10, 3, 7])
    out = batched_embed_reference(ids, table)
    rows = table.view(np.uint16).tolist()
    assert out.view(np.uint16).tolist() == [rows[i] for i in ids.tolist()]


def test_batched_embed_fp8_reference_matches_python_rule(rng):
    codes = np.arange(256, dtype=np.uint8).reshape(8, 32)
    codes[(codes & 0x7F) == 0x7F] = 0x42  # drop the two NaN codes
    scales = np.array([1.0, 0.5, 3.0e-3, 7.7e5, 1.0e-38, 2.0e30, 0.1, 448.0], dtype=np.float32)
    ids = np.array([7, 0, 5, 2, 2, 4, 1, 6, 3])
    got = batched_embed_fp8_reference(ids, codes, scales)
    tiny = float(np.finfo(np.float32).tiny)

    def ftz(x: np.float32) -> np.float32:  # subnormal -> signed zero, as the GPU multiply does
        return np.float32(math.copysign(0.0, float(x))) if abs(float(x)) < tiny else x

    for i, row in enumerate(ids.tolist()):
        s = ftz(scales[row])
        expect = [bf16_bits_rne(ftz(np.float32(e4m3_value(int(c))) * s)) for c in codes[row]]
        assert got[i].view(np.uint16).tolist() == expect, f"out row {i}"


# --- the CPU path ---------------------------------------------------------------------


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("id_dtype", ID_DTYPES)
def test_batched_embed_cpu_bitexact(rng, d, id_dtype):
    table = random_table(rng, 50, d)
    ids = random_ids(rng, 23, 50, id_dtype)
    out = np.full((23, d), POISON, dtype=np.uint16).view(BF16)
    got = rowcache.kernels.batched_embed(ids, table, out)
    assert got is out
    assert np.array_equal(bits(out), table.view(np.uint16)[ids.astype(np.int64)])
    allocated = rowcache.kernels.batched_embed(ids, table)
    assert allocated.dtype == BF16 and np.array_equal(bits(allocated), bits(out))


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("id_dtype", ID_DTYPES)
def test_batched_embed_fp8_cpu_matches_reference(rng, d, id_dtype):
    codes = non_nan_codes(rng, (40, d))
    scales = random_scales(rng, 40)
    ids = random_ids(rng, 17, 40, id_dtype)
    out = np.full((17, d), POISON, dtype=np.uint16).view(BF16)
    got = rowcache.kernels.batched_embed_fp8(ids, codes, scales, out)
    assert got is out
    assert np.array_equal(bits(out), bits(batched_embed_fp8_reference(ids, codes, scales)))


def test_batched_embed_empty_batch(rng, xp):
    """An empty batch gives an empty ``[0, d]`` result on the table's device (ids on that
    device or on the host), for the bf16 and the FP8 gather."""
    table = xp.asarray(random_table(rng, 5, 8))
    out = rowcache.kernels.batched_embed(xp.zeros(0, xp.int64), table)
    assert isinstance(out, xp.ndarray) and out.shape == (0, 8)
    codes = xp.asarray(non_nan_codes(rng, (5, 8)))
    out = rowcache.kernels.batched_embed_fp8(np.zeros(0, np.int32), codes, xp.ones(5, xp.float32))
    assert isinstance(out, xp.ndarray) and out.shape == (0, 8)
    if xp is np:
        assert out.dtype == BF16


@pytest.mark.parametrize("bad", [-1, 9, 1 << 40])
def test_batched_embed_cpu_rejects_ids_out_of_range(rng, bad):
    table = random_table(rng, 9, 4)
    with pytest.raises(IndexError, match="ids"):
        rowcache.kernels.batched_embed(np.array([0, bad, 1]), table)
    with pytest.raises(IndexError, match="ids"):
        rowcache.kernels.batched_embed_fp8(
            np.array([bad]), np.zeros((9, 4), np.uint8), np.ones(9, np.float32)
        )


def _bf16(shape):
    return np.zeros(shape, dtype=BF16)


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((np.array([0]), np.zeros((4, 3), np.float32)), "table"),
        ((np.array([0]), np.zeros((4, 3), np.uint16)), "table"),
        ((np.array([0]), _bf16(12)), "table"),
        ((np.array([[0]]), _bf16((4, 3))), "ids"),
        ((np.array([0.0]), _bf16((4, 3))), "ids"),
        (([0, 1], _bf16((4, 3))), "ids"),
        ((np.array([0]), _bf16((4, 3)), _bf16((2, 3))), "out"),
        ((np.array([0]), _bf16((4, 3)), _bf16((1, 4))), "out"),
        ((np.array([0]), _bf16((4, 3)), np.zeros((1, 3), np.float32)), "out"),
    ],
)
def test_batched_embed_rejects_bad_arguments(args, name):
    with pytest.raises(ConfigError, match=name):
        rowcache.kernels.batched_embed(*args)


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((np.array([0]), np.zeros((4, 3), np.int8), np.ones(4, np.float32)), "codes"),
        ((np.array([0]), np.zeros(12, np.uint8), np.ones(4, np.float32)), "codes"),
        ((np.array([0]), np.zeros((4, 3), np.uint8), np.ones(4, np.float64)), "scales"),
        ((np.array([0]), np.zeros((4, 3), np.uint8), np.ones(5, np.float32)), "scales"),
        ((np.array([0]), np.zeros((4, 3), np.uint8), np.ones((4, 1), np.float32)), "scales"),
        ((np.array([0.5]), np.zeros((4, 3), np.uint8), np.ones(4, np.float32)), "ids"),
        ((np.array([0]), np.zeros((4, 3), np.uint8), np.ones(4, np.float32), _bf16((1, 2))), "out"),
    ],
)
def test_batched_embed_fp8_rejects_bad_arguments(args, name):
    with pytest.raises(ConfigError, match=name):
        rowcache.kernels.batched_embed_fp8(*args)


# --- the kernels against the references ------------------------------------------------


def poisoned_out(cp, n: int, d: int):
    return cp.full((n, d), POISON, dtype=cp.uint16).view(BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("d", (*DIMS, 2, 4, 8, 12))
@pytest.mark.parametrize("id_dtype", ID_DTYPES)
@pytest.mark.parametrize("ids_on_device", [True, False])
def test_batched_embed_gpu_bitexact(rng, d, id_dtype, ids_on_device):
    import cupy as cp

    table = random_table(rng, 300, d)
    ids = random_ids(rng, 517, 300, id_dtype)
    out = poisoned_out(cp, 517, d)
    got = rowcache.kernels.batched_embed(
        cp.asarray(ids) if ids_on_device else ids, cp.asarray(table), out
    )
    assert got is out
    assert np.array_equal(bits(out), bits(batched_embed_reference(ids, table)))
    allocated = rowcache.kernels.batched_embed(cp.asarray(ids), cp.asarray(table))
    assert isinstance(allocated, cp.ndarray) and allocated.dtype == BF16
    assert np.array_equal(bits(allocated), bits(out))


@pytest.mark.gpu
@pytest.mark.parametrize("d", (5, 8, 256))
def test_batched_embed_gpu_misaligned_and_strided(rng, d):
    import cupy as cp

    full = random_table(rng, 64, d + 3)
    table_host = full[:, 1 : d + 1]  # rows start 2 bytes in, stride (d+3)*2 bytes
    ids = random_ids(rng, 100, 64, np.int64)
    out_full = poisoned_out(cp, 100, d + 1)
    out = out_full[:, 1:]  # misaligned output rows too
    rowcache.kernels.batched_embed(cp.asarray(ids), cp.asarray(full)[:, 1 : d + 1], out)
    assert np.array_equal(bits(out), bits(batched_embed_reference(ids, table_host)))
    assert np.all(bits(out_full)[:, 0] == POISON)  # nothing written outside out


@pytest.mark.gpu
def test_batched_embed_gpu_many_rows_grid_strides(rng):
    import cupy as cp

    table = random_table(rng, 1000, 4)  # 8-byte rows: 32 rows per block
    ids = random_ids(rng, 400_000, 1000, np.int32)
    out = poisoned_out(cp, ids.size, 4)
    rowcache.kernels.batched_embed(cp.asarray(ids), cp.asarray(table), out)
    assert np.array_equal(bits(out), bits(batched_embed_reference(ids, table)))


@pytest.mark.gpu
@pytest.mark.parametrize("d", (7, 256))
def test_batched_embed_gpu_mapped_host_table(rng, d):
    import cupy as cp

    table = random_table(rng, 500, d)
    dev_table = mapped_host_array(cp, table)
    ids = random_ids(rng, 200, 500, np.int64)
    out = poisoned_out(cp, 200, d)
    rowcache.kernels.batched_embed(cp.asarray(ids), dev_table, out)
    assert np.array_equal(bits(out), bits(batched_embed_reference(ids, table)))


@pytest.mark.gpu
@pytest.mark.parametrize("d", (*DIMS, 2, 4, 8, 12, 24))
@pytest.mark.parametrize("id_dtype", ID_DTYPES)
def test_batched_embed_fp8_gpu_bitexact(rng, d, id_dtype):
    import cupy as cp

    codes = non_nan_codes(rng, (300, d))
    scales = random_scales(rng, 300)
    ids = random_ids(rng, 517, 300, id_dtype)
    out = poisoned_out(cp, 517, d)
    got = rowcache.kernels.batched_embed_fp8(
        cp.asarray(ids), cp.asarray(codes), cp.asarray(scales), out
    )
    assert got is out
    assert np.array_equal(bits(out), bits(batched_embed_fp8_reference(ids, codes, scales)))
    allocated = rowcache.kernels.batched_embed_fp8(ids, cp.asarray(codes), cp.asarray(scales))
    assert np.array_equal(bits(allocated), bits(out))


@pytest.mark.gpu
def test_batched_embed_fp8_gpu_every_code_every_scale_exponent(rng):
    import cupy as cp

    codes = np.tile(np.arange(256, dtype=np.uint8), (600, 1))
    codes[(codes & 0x7F) == 0x7F] = 0x01
    scales = (2.0 ** rng.uniform(-149, 126, size=600) * rng.uniform(1, 2, size=600)).astype(
        np.float32
    )
    ids = np.arange(600)
    out = rowcache.kernels.batched_embed_fp8(cp.asarray(ids), cp.asarray(codes), cp.asarray(scales))
    assert np.array_equal(bits(out), bits(batched_embed_fp8_reference(ids, codes, scales)))


@pytest.mark.gpu
@pytest.mark.parametrize("d", (9, 64))
def test_batched_embed_fp8_gpu_misaligned_strided_and_mapped(rng, d):
    import cupy as cp

    full = non_nan_codes(rng, (80, d + 5))
    scales_full = random_scales(rng, 160)
    ids = random_ids(rng, 90, 80, np.int32)
    expect = bits(batched_embed_fp8_reference(ids, full[:, 1 : d + 1], scales_full[::2]))
    out_full = poisoned_out(cp, 90, d + 1)
    dev_codes = cp.asarray(full)[:, 1 : d + 1]
    rowcache.kernels.batched_embed_fp8(
        cp.asarray(ids), dev_codes, cp.asarray(scales_full)[::2], out_full[:, 1:]
    )
    assert np.array_equal(bits(out_full)[:, 1:], expect)
    assert np.all(bits(out_full)[:, 0] == POISON)
    mapped = mapped_host_array(cp, np.ascontiguousarray(full[:, 1 : d + 1]))
    out = rowcache.kernels.batched_embed_fp8(cp.asarray(ids), mapped, cp.asarray(scales_full[::2]))
    assert np.array_equal(bits(out), expect)


@pytest.mark.gpu
def test_gather_gpu_rejects_mixed_devices_and_column_strides(rng):
    import cupy as cp

    table = cp.asarray(random_table(rng, 5, 8))
    with pytest.raises(ConfigError, match="out"):
        rowcache.kernels.batched_embed(np.array([0]), table, np.zeros((1, 8), dtype=BF16))
    with pytest.raises(ConfigError, match="table"):
        rowcache.kernels.batched_embed(np.array([0]), table.T)
    with pytest.raises(ConfigError, match="scales"):
        rowcache.kernels.batched_embed_fp8(
            np.array([0]), cp.zeros((5, 8), cp.uint8), np.ones(5, np.float32)
        )
    with pytest.raises(IndexError, match="table"):
        rowcache.kernels.batched_embed(np.array([0]), cp.zeros((0, 8), dtype=BF16))
