"""Helpers shared by the bench scripts: page-cache dropping, test stores, the raw-read ceiling,
and result printing. Not collected by pytest; every script measures its baseline in the same run.
"""

from __future__ import annotations

import json
import os
import platform
import threading
import time
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

PAGE = 4096


def drop_cache(paths: list[str]) -> None:
    """Evict files from the page cache (fsync, then POSIX_FADV_DONTNEED)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def store_files(store: Any) -> list[str]:
    return [os.path.join(store.path, r.file) for recs in store.shards for r in recs]


def make_source(path: str, rows: int, dim: int, seed: int = 0, chunk: int = 1 << 18) -> str:
    """A bf16 .npy table of random values (written in chunks: bounded memory)."""
    if os.path.exists(path) and np.load(path, mmap_mode="r").shape == (rows, dim):
        return path
    rng = np.random.default_rng(seed)
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint16, shape=(rows, dim))
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        out[start:stop] = (
            rng.standard_normal((stop - start, dim), dtype=np.float32)
            .astype(ml_dtypes.bfloat16)
            .view(np.uint16)
        )
    out.flush()
    del out
    return path


def raw_direct_reads(
    files: list[str], offsets: list[np.ndarray], threads: int, size: int = PAGE
) -> float:
    """Seconds for aligned ``size``-byte O_DIRECT reads at ``offsets[i]`` of ``files[i]``,
    split over ``threads`` threads: the random-read ceiling of the disk from Python."""
    fds = [os.open(f, os.O_RDONLY | os.O_DIRECT) for f in files]
    jobs = [(fds[i], int(o) - int(o) % PAGE) for i, offs in enumerate(offsets) for o in offs]
    parts = [jobs[i::threads] for i in range(threads)]

    def work(part: list[tuple[int, int]]) -> None:
        raw = np.empty(size + PAGE, np.uint8)
        shift = (-raw.ctypes.data) % PAGE
        mv = memoryview(raw[shift : shift + size].data)
        for fd, off in part:
            os.preadv(fd, [mv], off)

    ts = [threading.Thread(target=work, args=(p,)) for p in parts]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    for fd in fds:
        os.close(fd)
    return dt


def median_time(
    fn: Callable[[], Any], repeat: int, setup: Callable[[], Any] | None = None
) -> float:
    times = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def machine() -> str:
    try:
        import cupy

        if cupy.cuda.is_available():
            name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
            return f"{platform.node()} ({os.cpu_count()} cores, {name})"
    except Exception:
        pass
    return f"{platform.node()} ({os.cpu_count()} cores, no GPU)"


def report(title: str, rows: list[dict[str, Any]], as_json: bool, settings: dict[str, Any]) -> None:
    if as_json:
        print(
            json.dumps(
                {"bench": title, "machine": machine(), "settings": settings, "results": rows},
                indent=2,
            )
        )
        return
    print(f"# {title} on {machine()}")
    print("settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    if not rows:
        return
    keys = list(dict.fromkeys(k for r in rows for k in r))
    widths = [max(len(k), *(len(fmt_cell(r.get(k))) for r in rows)) for k in keys]
    print("  ".join(k.rjust(w) for k, w in zip(keys, widths)))
    for r in rows:
        print("  ".join(fmt_cell(r.get(k)).rjust(w) for k, w in zip(keys, widths)))


def fmt_cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.3g}" if abs(v) < 100 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


# splitmix64's multipliers: a counter-based generator (each value a function of its index)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX = np.uint64(0xBF58476D1CE4E5B9)


def random_bf16_rows(xp: Any, key: int, start: int, stop: int, dim: int) -> Any:
    """Rows ``[start, stop)`` of a ``[rows, dim]`` table of random bfloat16 values, as their
    uint16 bits (``xp``: numpy or cupy; the same bits from either).

    Counter-based: element ``i = row * dim + column`` is 16 bits of a mix of ``key`` and
    ``i // 4`` (four values a 64-bit word), so any row range of any table is made alone, in
    memory bounded by the range, and equals the same rows of a bigger range. Values: a random
    sign and magnitudes in ``[2**-7, 2)`` (exponents 120..127, random mantissa): finite, never
    zero nor subnormal, so FP8's per-row scales are never the all-zero case.
    """
    if stop < start or dim < 1:
        raise ValueError(f"rows [{start}, {stop}) of dim {dim}: give start <= stop and dim >= 1")
    first, last = start * dim, stop * dim
    words = xp.arange(first // 4, -(-last // 4), dtype=np.uint64)
    words += np.uint64((key * 0xD1B54A32D192ED03) % (1 << 64))
    words *= _GOLDEN
    words ^= words >> np.uint64(29)
    words *= _MIX
    words ^= words >> np.uint64(32)
    bits = words.view(np.uint16)[first % 4 : first % 4 + last - first]
    bits &= np.uint16(0x83FF)  # sign, the exponent's low 3 bits, the mantissa
    bits |= np.uint16(0x3C00)  # the exponent's high bits: 120 + (0..7)
    return bits.reshape(stop - start, dim)


def random_bf16_rows_threaded(
    pool: Any, threads: int, key: int, start: int, stop: int, dim: int
) -> np.ndarray:
    """:func:`random_bf16_rows` on the host, its rows split over ``threads`` of ``pool`` (a
    ``ThreadPoolExecutor``; NumPy's integer ufuncs release the GIL): the same bits."""
    out = np.empty((stop - start, dim), dtype=np.uint16)
    step = max(1, -(-(stop - start) // threads))

    def part(a: int) -> None:
        b = min(stop, a + step)
        out[a - start : b - start] = random_bf16_rows(np, key, a, b, dim)

    for f in [pool.submit(part, a) for a in range(start, stop, step)]:
        f.result()
    return out
