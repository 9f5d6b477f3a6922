"""What the kernels' tests share: independent rules for FP8 (E4M3) values and bf16
rounding, random tables, codes and scales, a cupy array over mapped host memory, and the
host all-hits kernel's arena, call and replay comparison. Not a test module."""

from __future__ import annotations

import ctypes
import math

import numpy as np

import rowcache.kernels.host as host
from rowcache.kernels.reference import BF16


def e4m3_value(code: int) -> float:
    """Exact value of an E4M3 (fn) code from its bits: 1 sign, 4 exponent (bias 7), 3 mantissa."""
    sign = -1.0 if code & 0x80 else 1.0
    exp, man = (code >> 3) & 0xF, code & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * man * 2.0**-9
    return sign * (1.0 + man / 8.0) * 2.0 ** (exp - 7)


def bf16_bits_rne(x: np.float32) -> int:
    """bfloat16 bits of a (non-NaN) float32, round to nearest even, by integer arithmetic."""
    b = int(np.float32(x).view(np.uint32))
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


def non_nan_codes(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random E4M3 codes, every non-NaN code possible (0x7f and 0xff are NaN)."""
    codes = rng.integers(0, 256, size=shape, dtype=np.uint8)
    nan = (codes & 0x7F) == 0x7F
    codes[nan] = rng.integers(0, 0x7F, size=int(nan.sum()), dtype=np.uint8) | (codes[nan] & 0x80)
    return codes


def random_table(rng: np.random.Generator, rows: int, d: int) -> np.ndarray:
    """bf16 [rows, d] of arbitrary non-NaN bit patterns (every exponent, both signs)."""
    bits = rng.integers(0, 1 << 16, size=(rows, d), dtype=np.uint16)
    nan = (bits & 0x7FFF) > 0x7F80
    bits[nan] &= 0x807F  # keep the sign and mantissa, clear the exponent: a subnormal
    return bits.view(BF16)


def random_scales(rng: np.random.Generator, rows: int) -> np.ndarray:
    return (2.0 ** rng.uniform(-40, 40, size=rows)).astype(np.float32)


def mapped_host_array(cp, host: np.ndarray):
    """A cupy array over pinned host memory mapped into the device, holding ``host``'s bytes."""
    nbytes = max(host.nbytes, 1)
    mem = cp.cuda.PinnedMemory(nbytes, cp.cuda.runtime.hostAllocMapped)
    ctypes.memmove(mem.ptr, np.ascontiguousarray(host).ctypes.data, host.nbytes)
    ptr = cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(mem.ptr, nbytes, mem), 0)
    return cp.ndarray(host.shape, dtype=host.dtype, memptr=ptr)


def assert_same_runs(a_states, b_states, a_out, b_out):
    """Two replays agree: every state tuple (arrays and values) and every call's result
    (slots, or an error's message)."""
    for a, b in zip(a_states, b_states, strict=True):
        for u, v in zip(a, b):
            if isinstance(u, np.ndarray):
                np.testing.assert_array_equal(u, v)
            else:
                assert u == v
    for u, v in zip(a_out, b_out, strict=True):
        if isinstance(u, str):
            assert u == v
        else:
            np.testing.assert_array_equal(u, v)


def hits_arrays(rng, rows=120_000, slots=60_000, spare=30_000):
    """A mapped arena: ``slots`` random rows of ``rows`` in random slots, a log with room."""
    row_slot = np.full(rows, -1, dtype=np.int32)
    mapped = rng.choice(rows, slots, replace=False)
    row_slot[mapped] = rng.permutation(slots).astype(np.int32)
    last_used = rng.integers(0, 3, slots).astype(np.int64)  # some already pinned (batch 2)
    log = np.zeros(slots + spare, dtype=np.int32)
    log[:slots] = rng.permutation(slots).astype(np.int32)
    log_pos = np.empty(slots, dtype=np.int32)
    log_pos[log[:slots]] = np.arange(slots, dtype=np.int32)
    return row_slot, last_used, log, log_pos, np.sort(mapped)


def lru_state(row_slot=None, last_used=None, log=None, log_pos=None):
    """The native ``LruState`` over these arrays (the cache's are its slot table's and LRU's),
    the rest made up (as many slots as ``log_pos`` or ``last_used`` has, else one; nothing
    mapped; one part): for calls that read only some of them."""
    S = next((a.size for a in (log_pos, last_used) if a is not None), 1)
    row_slot = np.full(S, -1, np.int32) if row_slot is None else row_slot
    last_used = np.zeros(S, np.int64) if last_used is None else last_used
    log = np.zeros(S, np.int32) if log is None else log
    log_pos = np.zeros(S, np.int32) if log_pos is None else log_pos
    slot_row, state = np.full(S, -1, np.int32), np.zeros(S, np.uint8)
    offsets, part_misses = np.array([0, row_slot.size], np.int64), np.zeros(1, np.int64)
    return host.native.LruState(
        row_slot, slot_row, state, last_used, log, log_pos, offsets, part_misses
    )


def hits_call(ids, arrays, threads, tail):
    row_slot, last_used, log, log_pos = (a.copy() for a in arrays[:4])
    out = np.zeros(ids.size, dtype=np.int32)
    scratch = np.zeros(2 * ids.size, dtype=np.int32)
    res = lru_state(row_slot, last_used, log, log_pos).hits(ids, tail, 2, out, scratch, threads)
    return res, out, last_used, log, log_pos
