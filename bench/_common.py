"""Helpers shared by the bench scripts: page-cache dropping, test stores, the raw-read ceiling,
result printing, a run's log and progress lines, and the counter-based generators of the rows
the judges stream into their stores (bfloat16 values, E4M3 codes, UE8M0 scale bytes). Not
collected by pytest; every script measures its baseline in the same run.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

PAGE = 4096
GIB = 1 << 30


def gib(n: float) -> str:
    """Bytes as GiB (MiB below one GiB), one decimal."""
    return f"{n / GIB:.1f} GiB" if abs(n) >= GIB else f"{n / (1 << 20):.1f} MiB"


class Log:
    """What the run says as it goes: printed (to stderr when the report is JSON on stdout, so
    a run cut short still shows how far it came) and kept for the report."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.lines: list[str] = []

    def __call__(self, line: str) -> None:
        self.lines.append(line)
        print(line, file=sys.stderr if self.quiet else sys.stdout, flush=True)


class Progress:
    """A line on stderr every 5 % (at least every GiB) of a long build, with its rate."""

    def __init__(self, what: str, total: int) -> None:
        self.what, self.total, self.done = what, total, 0
        self.step = max(GIB, total // 20)
        self.next = self.step
        self.t0 = time.perf_counter()

    def add(self, n: int) -> None:
        self.done += n
        if self.done >= self.next and self.total >= 2 * GIB:
            dt = time.perf_counter() - self.t0
            print(
                f"{self.what}: {gib(self.done)} of {gib(self.total)} "
                f"({100 * self.done / self.total:.0f} %), {self.done / dt / 1e9:.2f} GB/s",
                file=sys.stderr,
                flush=True,
            )
            self.next += self.step


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
    print_table(rows)


def pinned_mapped(shape: tuple[int, ...], dtype: Any) -> tuple[np.ndarray, Any]:
    """``(host view, device view)`` of one new allocation of pinned host memory mapped into
    the device (``cudaHostAllocMapped``): a kernel reads it over PCIe, as the engines' pinned
    host tables are read. The device view keeps the allocation alive."""
    import cupy as cp

    count = int(np.prod(shape))
    nbytes = max(1, count * np.dtype(dtype).itemsize)
    mem = cp.cuda.PinnedMemory(nbytes, cp.cuda.runtime.hostAllocMapped)
    host = np.frombuffer(cp.cuda.PinnedMemoryPointer(mem, 0), dtype=dtype, count=count)
    um = cp.cuda.UnownedMemory(mem.ptr, nbytes, mem)
    dev = cp.ndarray(shape, dtype=dtype, memptr=cp.cuda.MemoryPointer(um, 0))
    return host.reshape(shape), dev


def print_table(rows: list[dict[str, Any]]) -> None:
    """Rows of dicts as a right-aligned text table (every key a column, in first-seen order)."""
    if not rows:
        return
    keys = list(dict.fromkeys(k for r in rows for k in r))
    widths = [max(len(k), *(len(fmt_cell(r.get(k))) for r in rows)) for k in keys]
    print("  ".join(k.rjust(w) for k, w in zip(keys, widths)))
    for r in rows:
        print("  ".join(fmt_cell(r.get(k)).rjust(w) for k, w in zip(keys, widths)))


def jsonable(x: Any) -> Any:
    """``json.dumps``'s ``default``: NumPy scalars and arrays as Python values, else ``str``."""
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def host16(x: Any) -> np.ndarray:
    """A bf16 result (numpy or cupy) as flat host uint16 bits, for bit-for-bit checks."""
    x = x.get() if hasattr(x, "get") else np.asarray(x)
    return np.ascontiguousarray(x).view(np.uint16).reshape(-1)


def fmt_cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.3g}" if abs(v) < 100 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


# splitmix64's multipliers: a counter-based generator (each value a function of its index)
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
MIX = np.uint64(0xBF58476D1CE4E5B9)


def _mixed(words: Any, key: int) -> Any:
    """splitmix64 of ``words`` (uint64, numpy or cupy, changed in place) keyed by ``key``."""
    words += np.uint64((key * 0xD1B54A32D192ED03) % (1 << 64))
    words *= GOLDEN
    words ^= words >> np.uint64(29)
    words *= MIX
    words ^= words >> np.uint64(32)
    return words


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
    words = _mixed(xp.arange(first // 4, -(-last // 4), dtype=np.uint64), key)
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


def random_codes(xp: Any, key: int, rows: Any, dim: int) -> Any:
    """uint8 ``[n, dim]``: E4M3 codes of ``rows`` (numpy or cupy int64 ``[n]``) of the table
    keyed ``key``. Counter-based: byte ``c`` of row ``r`` is a byte of the splitmix64 mix of
    word ``r * dim / 8 + c / 8``, so any rows are made alone; the NaN codes 0x7F/0xFF become
    0x7E/0xFE (448, -448). ``dim`` a multiple of 8 (a ``ValueError`` otherwise)."""
    if dim % 8:
        raise ValueError(f"row width {dim}: the generator makes rows of a multiple of 8 bytes")
    w = dim // 8
    words = xp.asarray(rows, dtype=np.int64).astype(np.uint64)[:, None] * np.uint64(w)
    words = _mixed(words + xp.arange(w, dtype=np.uint64)[None, :], key)
    b = xp.ascontiguousarray(words).view(np.uint8).reshape(-1, dim)
    b ^= ((b & np.uint8(0x7F)) == np.uint8(0x7F)).astype(np.uint8)
    return b


UE8M0_RANGE = (112, 127)  # the generated scale bytes: 2**-15 .. 2**0, never 0 nor 255 (NaN)


def random_ue8m0(xp: Any, key: int, rows: Any, blocks: int) -> Any:
    """uint8 ``[n, blocks]``: UE8M0 scale bytes of ``rows`` (numpy or cupy int64 ``[n]``) of
    the table keyed ``key``, one a block: byte ``k`` of row ``r`` is ``112 + (mix(r * blocks +
    k) mod 16)`` (scales ``2**-15 .. 2**0``, as a checkpoint's block scales of values below
    448 are), counter-based as :func:`random_codes`."""
    lo, hi = UE8M0_RANGE
    idx = xp.asarray(rows, dtype=np.int64).astype(np.uint64)[:, None] * np.uint64(blocks)
    words = _mixed(idx + xp.arange(blocks, dtype=np.uint64)[None, :], key)
    return (words % np.uint64(hi - lo + 1)).astype(np.uint8) + np.uint8(lo)
