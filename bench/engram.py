"""The judge of Engram served from disk: a modelled server step, cached against resident.

A step of a model with Engram memory at two layers (docs/engram-spec.md): at its start the
host hashes the step's tokens (``EngramHash``) and, for the cached series, starts every Engram
layer's reads (``EngramMemory.prefetch``); the GPU then runs the layers before the first
Engram layer (modelled: a kernel that spins for ``--layer-us`` plus ``--token-us`` per token a
layer), the first lookup, the layers up to the second Engram layer, its lookup, and the rest;
the step ends synchronized (a decode token is sampled from it). Tokens: real text (the
stdlib, DeepSeek's tokenizer), as 64 decode streams, one, or prefill chunks.

The store (``--store-gib auto``, the default on the GPU): the rows a layer that make the
largest store the work directory's file system holds (its free space less a margin of 15 % or
4 GiB, whichever is larger). The series that hold the whole tables must fit too: resident in
GPU memory (free less 8 GiB) and the pinned copy in host memory (available less 8 GiB). Where
one does not at the disk's size, the disk's size is kept and that series is skipped, saying
why (serving from disk is what this bench measures). ``--workdir`` (default: a temporary
directory) must be on that disk, not a tmpfs. ``--store-gib G`` asks for G GiB
(refused, naming the flag, beyond what the disk holds); ``--rows-per-layer N`` for N rows.

The rows are random bfloat16 values made by a counter-based generator
(``bench._common.random_bf16_rows``: each value a function of its layer, row and column), a
chunk at a time: streamed into ``build_store`` (a ``GeneratedRows`` source, no table-size
array anywhere) and into the resident and pinned tables (on the GPU, FP8 quantized there by
``rowcache.kernels.quantize_fp8``, the store's rule). Before timing, a few steps of every mode
are looked up through the cached memory and each whole-table one and compared bit for bit
(cached == resident, cached == pinned host).

The arena (``--arena tune``, the default on the GPU): sized by rowcache's own tools from the
hash alone, as ``rowcache trace``/``profile``/``tune --memory M --reserve R`` would: the bench's
text (a file a request) traced through ``EngramHash``, exact LRU curves of every head table,
``tune`` splitting ``--memory`` less ``--reserve``; the shared arena gets the rows of the split,
capped by the free device memory and at least two steps' rows. ``--arena fraction`` takes
``--arena-fraction`` of the rows instead.

Series, in one run on the same tokens:
- ``resident``: the tables in GPU memory (``Bf16Table``/``Fp8Table``);
- ``host``: the tables in pinned host memory mapped into the device, gathered by the GPU
  (what the engines do by default);
- ``cached``: the store behind one ``NgramRowCache`` arena shared by both layers,
  prefetched at the step's start;
- ``lookahead`` (prefill): the same, with the next chunk's rows prefetched a step ahead too
  (a prefill chunk's tokens are known before its step; a decode token is not).
Columns, for each mode (at most ``--max-steps`` steps, the first ``--warm`` of them untimed):
tokens/s of each series and their ratios to resident (to host where resident is skipped);
``window_ms``,
the modelled time before the first Engram layer; ``wait_ms`` the time a cached step still
waited for reads after it (so the window it would need: window + wait); ``floor_ms`` the
disk's floor for the step's reads (as many O_DIRECT 4 KiB ``pread`` at random offsets of the
store's files, 16 threads, in the same run); ``faults/tok`` rows read from the store a token
(prefetched or faulted; of the heads x layers rows a token looks up), ``fault_rate`` the same
a row looked up and ``hit_rate`` its complement, over the timed steps, and ``run_fault_rate`` over every step from a
cold arena (what ``tune`` predicts, printed beside it); ``reads/step`` the 4 KiB reads.

    python -m bench.engram --device cuda --config v41 [--store-gib auto|G] [--json]
    python -m bench.engram --quick          # a tiny CPU run (what the test runs)

``--format v41`` runs DeepSeek-V4.1's tables in their own format instead (the
``fp8_block_e8m0`` store beside a checkpoint-layout copy, a server warmed by a long history,
the arena tuned on the whole library's trace): ``bench/engram_v41.py``.

    python -m bench.engram --format v41 --device cuda [--json]
    python -m bench.engram --format v41 --quick
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench._common import (
    GIB,
    Log,
    Progress,
    drop_cache,
    gib,
    pinned_mapped,
    random_bf16_rows,
    random_bf16_rows_threaded,
    raw_direct_reads,
    report,
    store_files,
)
from bench.modes import Model
from rowcache.errors import ConfigError

MODES = {"decode x1": (1, 1), "decode x64": (64, 1), "prefill 512": (1, 512)}
FORMATS = ("rowcache", "v41")  # --format: the tables as rowcache stores generated values, or V4.1's
DISK_MARGIN = 0.15  # of the free space, or DISK_MARGIN_MIN, whichever is larger
DISK_MARGIN_MIN = 4 * GIB
DEVICE_RESERVE = 8 * GIB  # GPU memory kept for the arena's workspace, the steps, cupy's pool
HOST_RESERVE = 8 * GIB
MIN_STORE = 64 << 20
MAP_BYTES = 4  # the cache's row map: 4 bytes a row on the host, 4 more on the GPU
CHUNK_BYTES = 32 << 20  # generated bf16 bytes a chunk
V41_BLOCK = 32  # DeepSeek-V4.1's values a UE8M0 scale byte covers
EOS = 1  # the token the text puts after each file (DeepSeek's end of sentence)
DISK_PROFILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "h200-io.json")


def _config(name: str, rows_per_layer: int | None) -> Any:
    from rowcache.embed.engram.config import EngramConfig

    if name == "demo":
        if rows_per_layer is None:
            return EngramConfig()
        per_head = max(2, rows_per_layer // 16)
        return EngramConfig(vocab_per_ngram=(per_head, per_head))
    # the reported V4.1 shape: 3 orders x 8 heads of 256 values, layers 1 and 14 of 43
    per_head = max(2, (rows_per_layer or 8_000_000) // 24)
    return EngramConfig(
        vocab_per_ngram=(per_head,) * 3,
        max_ngram=4,
        n_embed_per_ngram=2048,
        n_head_per_ngram=8,
        layer_ids=(1, 14),
    )


# --- the store's size ----------------------------------------------------------------------
def codec_params(dtype: str) -> dict[str, Any]:
    """The store's table params of codec ``dtype``: V4.1's blocks of 32 values for
    ``fp8_block_e8m0``, none for the others."""
    return {"block_size": V41_BLOCK} if dtype == "fp8_block_e8m0" else {}


def store_bytes(rows: int, layers: int, dim: int, dtype: str) -> int:
    """Disk a build of ``layers`` tables of ``rows`` x ``dim`` needs (the builder's figure)."""
    from rowcache import TableInfo
    from rowcache.store.builder import needed_bytes

    params = codec_params(dtype)
    infos = [TableInfo.make(f"engram.{i}", rows, dim, dtype, GIB, params) for i in range(layers)]
    return needed_bytes(infos)


def resident_row_bytes(dim: int, dtype: str) -> int:
    """Bytes a row of a resident table: FP8 codes and a float32 scale, FP8 codes and a
    UE8M0 byte a block (``fp8_block_e8m0``, the checkpoint's two tensors), or bf16 values."""
    if dtype == "fp8_block_e8m0":
        return dim + dim // V41_BLOCK
    return dim + 4 if dtype == "fp8" else 2 * dim


@dataclass(frozen=True)
class Sizing:
    """The store's rows a layer, what bounded them, and which whole-table series fit."""

    rows_per_layer: int
    store_bytes: int
    bound: str  # "disk", "--store-gib" or "--rows"
    resident: bool
    host: bool
    lines: tuple[str, ...]


def size_store(
    *,
    store_gib: str | float,
    layers: int,
    dim: int,
    dtype: str,
    free_disk: int,
    device_free: int | None,
    host_free: int | None,
    workdir: str = "the work directory",
    beside: tuple[str, Callable[[int], int]] | None = None,
    rows_per_layer: int | None = None,
) -> Sizing:
    """The rows a layer of the largest store that ``free_disk`` holds (``store_gib="auto"``)
    or of ``store_gib`` GiB, and whether the resident and pinned-host series fit.

    ``beside``: ``(what, bytes(rows a layer))``, a file the run writes on the same disk
    beside the store (``bench/engram_v41.py``'s checkpoint-layout copy of the tables), which
    the budget holds too. ``rows_per_layer`` (``--rows``): those rows, not a size (refused,
    naming the flag, beyond what the disk holds).

    The disk keeps a margin of 15 % of its free space or 4 GiB, whichever is larger. The
    resident tables (and the cache's device row map) must fit ``device_free`` less 8 GiB
    (``device_free=None``: a CPU run, whose resident tables are in host memory); the pinned
    host copy (and the cache's host row map) ``host_free`` less 8 GiB (None: not asked). A
    series that does not fit is skipped (``resident``/``host`` False, the line says why); the
    store keeps the disk's size. A store below 64 MiB, or more than the disk holds, is a
    ``ConfigError`` naming ``--store-gib``.
    """
    margin = max(int(DISK_MARGIN * free_disk), DISK_MARGIN_MIN)
    room = free_disk - margin
    disk = (
        f"{workdir}'s file system has {gib(free_disk)} free, less a margin of {gib(margin)} "
        f"(15 % or {gib(DISK_MARGIN_MIN)}, whichever is larger): {gib(max(room, 0))}"
    )
    other = beside[1] if beside else (lambda rows: 0)

    def on_disk(rows: int) -> int:
        return store_bytes(rows, layers, dim, dtype) + other(rows)

    if rows_per_layer is not None:
        budget, bound = room, "--rows"
        if on_disk(rows_per_layer) > room:
            raise ConfigError(
                f"--rows {rows_per_layer:,}: {gib(on_disk(rows_per_layer))} on disk, but {disk}; "
                "give fewer rows, or --workdir on a larger disk"
            )
    elif store_gib == "auto":
        budget, bound = room, "disk"
        if budget < MIN_STORE:
            raise ConfigError(
                f"--store-gib auto: {disk}, less than the smallest store this bench builds "
                f"({MIN_STORE >> 20} MiB): free space, or give --workdir on a larger disk"
            )
    else:
        try:
            g = float(store_gib)
        except ValueError:
            g = float("nan")
        if not np.isfinite(g) or g * GIB < MIN_STORE:
            raise ConfigError(
                f"--store-gib {store_gib}: give auto or at least {MIN_STORE / GIB:.3f} GiB"
            )
        budget, bound = int(g * GIB), "--store-gib"
        if budget > room:
            raise ConfigError(
                f"--store-gib {store_gib}: {disk}; give at most --store-gib "
                f"{max(room, 0) / GIB:.1f}, auto, or --workdir on a larger disk"
            )
    lo, hi = 1, max(2, budget // max(1, layers * dim))  # a row takes at least `dim` bytes
    while lo < hi and rows_per_layer is None:  # the largest rows whose store (and beside) fit
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if on_disk(mid) <= budget else (lo, mid - 1)
    rows = lo if rows_per_layer is None else rows_per_layer
    need = store_bytes(rows, layers, dim, dtype)
    why = {"disk": disk, "--rows": f"--rows {rows:,} ({disk})"}.get(
        bound, f"--store-gib {store_gib} ({disk})"
    )
    lines = [
        f"store: {layers} x {rows:,} rows of {dim} {dtype} values, {gib(need)} on disk"
        + (f", and {beside[0]} beside it, {gib(other(rows))}" if beside else "")
        + f"; bound: {why}"
    ]
    table = layers * rows * resident_row_bytes(dim, dtype)
    maps = layers * rows * MAP_BYTES

    def fits(what: str, need: int, free: int | None, where: str, reserve: int) -> bool:
        if free is None:
            return True
        ok = need <= free - reserve
        lines.append(
            f"{what}: {gib(need)} (tables and the cache's row map) in {where} "
            f"({gib(free)} free, {gib(reserve)} kept): "
            + ("fits" if ok else "does not fit: series skipped (the store keeps the disk's size)")
        )
        return ok

    if device_free is None:  # a CPU run: the resident tables are host arrays
        resident = fits("resident", table + maps, host_free, "host memory", HOST_RESERVE)
        host = False
    else:
        resident = fits("resident", table + maps, device_free, "GPU memory", DEVICE_RESERVE)
        host = fits("host", table + maps, host_free, "pinned host memory", HOST_RESERVE)
    return Sizing(rows, need, bound, resident, host, tuple(lines))


# --- the tables -----------------------------------------------------------------------------
def _chunk_rows(dim: int) -> int:
    return max(1, CHUNK_BYTES // (2 * dim))


def build_generated_store(
    path: str, h: Any, dtype: str, xp: Any, log: Log
) -> tuple[Any, dict[str, Any]]:
    """The store of every Engram layer's table, its rows generated a chunk at a time (on the
    GPU with cupy as ``xp``, else by host threads) and streamed into ``build_store``."""
    from rowcache import build_store
    from rowcache.kernels.reference import BF16
    from rowcache.store.sources import GeneratedRows

    cfg = h.config
    dim = cfg.head_dim
    rows = {layer: h.table_rows(layer) for layer in cfg.layer_ids}
    need = store_bytes(max(rows.values()), len(rows), dim, dtype)
    bar = Progress("build", need)
    per_row = need / (len(rows) * max(rows.values()))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    threads = max(1, cores - 2)  # the builder's write and page-CRC threads keep two busy
    pool = ThreadPoolExecutor(threads) if xp is np and threads > 1 else None

    def source(layer: int) -> Any:
        def make(start: int, stop: int) -> np.ndarray:
            if xp is not np:
                bits = random_bf16_rows(xp, layer, start, stop, dim).get()
            elif pool is not None:
                bits = random_bf16_rows_threaded(pool, threads, layer, start, stop, dim)
            else:
                bits = random_bf16_rows(np, layer, start, stop, dim)
            bar.add(int((stop - start) * per_row))
            return bits.view(BF16)

        return GeneratedRows(rows[layer], dim, make)

    t0 = time.perf_counter()
    try:
        store = build_store(
            path,
            {f"engram.{layer}": source(layer) for layer in cfg.layer_ids},
            dtype=dtype,
            overwrite=True,
            progress=False,
        )
    finally:
        if pool is not None:
            pool.shutdown()
    seconds = time.perf_counter() - t0
    written = sum(int(r.length) for recs in store.shards for r in recs)
    generated = sum(rows.values()) * dim * 2
    log(
        f"build: {gib(written)} {dtype} store ({', '.join(f'{n:,}' for n in rows.values())} "
        f"rows) in {seconds:.1f} s: {written / seconds / 1e9:.2f} GB/s written, "
        f"{generated / seconds / 1e9:.2f} GB/s of bf16 rows generated"
        + (" and quantized" if dtype == "fp8" else "")
    )
    return store, {
        "store_bytes": written,
        "build_s": round(seconds, 1),
        "build_GB_s": written / seconds / 1e9,
        "generated_GB_s": generated / seconds / 1e9,
    }


def _table_chunks(xp: Any, dtype: str, key: int, rows: int, dim: int) -> Iterator[Any]:
    """``(start, stop, parts)``: the rows of one table a chunk at a time on ``xp``, as the
    store holds them (FP8: codes and scales by ``quantize_fp8``, the store's rule)."""
    from rowcache.kernels import quantize_fp8
    from rowcache.kernels.reference import BF16

    step = _chunk_rows(dim)
    for s in range(0, rows, step):
        e = min(rows, s + step)
        bits = random_bf16_rows(xp, key, s, e, dim)
        yield s, e, (quantize_fp8(bits.view(BF16)) if dtype == "fp8" else (bits,))


def _table(dtype: str, parts: list[Any]) -> Any:
    from rowcache.embed.tables import Bf16Table, Fp8Table

    return Fp8Table(*parts) if dtype == "fp8" else Bf16Table(parts[0])


def _part_shapes(dtype: str, rows: int, dim: int) -> list[tuple[tuple[int, ...], Any]]:
    if dtype == "fp8":
        return [((rows, dim), np.uint8), ((rows,), np.float32)]
    return [((rows, dim), np.uint16)]


def resident_table(xp: Any, dtype: str, key: int, rows: int, dim: int) -> Any:
    """A layer's whole table in ``xp``'s memory (the GPU's for cupy), filled a chunk at a time."""
    parts = [xp.empty(shape, dtype=dt) for shape, dt in _part_shapes(dtype, rows, dim)]
    for s, e, chunk in _table_chunks(xp, dtype, key, rows, dim):
        for dst, src in zip(parts, chunk):
            dst[s:e] = src
    return _table(dtype, parts)


def pinned_table(dtype: str, key: int, rows: int, dim: int) -> Any:
    """A layer's whole table in pinned host memory mapped into the device (read over PCIe),
    made on the GPU a chunk at a time and copied down."""
    import cupy as cp

    host, dev = [], []
    for shape, dt in _part_shapes(dtype, rows, dim):
        h, d = pinned_mapped(shape, dt)
        host.append(h)
        dev.append(d)
    for s, e, chunk in _table_chunks(cp, dtype, key, rows, dim):
        for dst, src in zip(host, chunk):
            src.get(out=dst[s:e])
    return _table(dtype, dev)


# --- the arena ------------------------------------------------------------------------------
def tune_arena(
    h: Any,
    text: np.ndarray,
    dtype: str,
    memory: int,
    reserve: int,
    disk_profile: str | None,
    workdir: str,
) -> Any:
    """``rowcache tune --memory M --reserve R`` over the bench's text traced through the hash
    (a file a request, the CLI's modelled server) and profiled exactly: a ``TuneReport``."""
    from rowcache.tools.benchio import DeviceProfile
    from rowcache.tools.profile import profile_trace
    from rowcache.tools.trace_build import build_trace
    from rowcache.tools.tune import tune

    cuts = np.flatnonzero(text == EOS) + 1
    requests = [r for r in np.split(text, cuts) if r.size]
    trace = build_trace(requests, h, os.path.join(workdir, "trace"), overwrite=True, progress=False)
    prof = profile_trace(trace, method="exact", dtype=dtype, progress=False)
    disk = DeviceProfile.load(disk_profile) if disk_profile else None
    return tune(prof, memory_bytes=memory, reserve_bytes=reserve, dtype=dtype, device=disk)


def step_rows(cfg: Any, modes: list[str]) -> int:
    """The most rows two steps of ``modes`` pin in a shared arena (a prefill step prefetches
    the next chunk's rows too): every head of every layer at each token."""
    tokens = max(MODES[m][0] * MODES[m][1] for m in modes)
    return 2 * tokens * cfg.heads_per_layer * len(cfg.layer_ids)


# --- the run --------------------------------------------------------------------------------
def check_equal(h: Any, a: Any, b: Any, toks: np.ndarray, T: int, steps: int) -> int:
    """Look up ``steps`` steps through memories ``a`` and ``b`` (as a server does: prefetch,
    lookups, end of step) and compare every layer's rows bit for bit: the values compared."""
    B = toks.shape[0]
    kept = np.full((B, h.keep), h.config.pad_id, dtype=np.int64)
    compared = 0
    for s in range(steps):
        piece = toks[:, s * T : (s + 1) * T]
        for mem in (a, b):
            mem.prefetch(piece, kept)
        for layer in h.layer_ids:
            x, y = a.lookup(layer, piece, kept), b.lookup(layer, piece, kept)
            bad = int((x.view(np.uint16) != y.view(np.uint16)).sum())  # numpy or cupy
            if bad or x.shape != y.shape:
                raise RuntimeError(
                    f"cached != resident: layer {layer}, step {s} of a {B}x{T} mode: "
                    f"{bad:,} of {x.size:,} values differ"
                )
            compared += int(x.size)
        for mem in (a, b):
            mem.end_step()
        kept = np.concatenate([kept, piece], axis=1)[:, -h.keep :]
    return compared


def time_series(
    name: str,
    mem: Any,
    h: Any,
    model: Model,
    toks: np.ndarray,
    T: int,
    steps: int,
    start: int,
    layers: int,
) -> tuple[float, float, Any]:
    """Run ``steps`` steps of ``mem``; ``(tokens/s of the steps from start on, seconds the
    lookups of those steps waited, the cache's stats at start)``."""
    first, second = h.layer_ids[0], h.layer_ids[1]
    cache = mem.tables[first].cache if name in ("cached", "lookahead") else None
    B = toks.shape[0]
    kept = np.full((B, h.keep), h.config.pad_id, dtype=np.int64)
    t_steps = waited = 0.0
    stats0 = None
    for s in range(steps):
        if s == start:
            model.sync()
            stats0 = cache.stats() if cache is not None else None
            t_steps = waited = 0.0
        piece = toks[:, s * T : (s + 1) * T]
        t0 = time.perf_counter()
        if cache is not None:
            mem.prefetch(piece, kept)
        if name == "lookahead" and s + 1 < steps:
            after = np.concatenate([kept, piece], axis=1)[:, -h.keep :]
            mem.prefetch(toks[:, (s + 1) * T : (s + 2) * T], after)
        model.run(first, B * T)  # the layers before the first Engram layer
        w0 = time.perf_counter()
        mem.lookup(first, piece, kept)
        w1 = time.perf_counter()
        model.run(second - first, B * T)
        w2 = time.perf_counter()
        mem.lookup(second, piece, kept)
        w3 = time.perf_counter()
        model.run(layers - second, B * T)
        model.sync()
        mem.end_step()
        t_steps += time.perf_counter() - t0
        waited += (w1 - w0) + (w3 - w2)
        kept = np.concatenate([kept, piece], axis=1)[:, -h.keep :]
    return (steps - start) * B * T / t_steps, waited, stats0


def _faults(st: Any) -> int:
    """Rows read from the store: faulted by a lookup or read by a prefetch."""
    return int(st.misses + st.prefetched)


def cached_columns(
    cache: Any,
    stats0: Any,
    tokens: tuple[int, int],
    row_reads: int,
    timed_steps: int,
    waited: float,
    store: Any,
) -> dict[str, Any]:
    """The cached series' reads, faults and the disk's floor for the same reads.

    ``tokens``: the timed steps' tokens and the whole run's; ``row_reads``: rows a token
    looks up (every head of every layer). A fault rate is faults over those lookups, as
    ``tune`` counts its ``faults_per_access``."""
    st = cache.stats()
    faults = _faults(st) - _faults(stats0)
    reads = st.read_ops - stats0.read_ops
    rate = faults / (tokens[0] * row_reads)
    cols: dict[str, Any] = {
        "wait_ms": 1e3 * waited / timed_steps,
        "hit_rate": 1.0 - rate,
        "faults/tok": faults / tokens[0],
        "fault_rate": rate,
        "run_fault_rate": _faults(st) / (tokens[1] * row_reads),
        "reads/step": reads / timed_steps,
    }
    if reads:
        files = store_files(store)
        sizes = [os.path.getsize(f) for f in files]
        r = np.random.default_rng(1)
        per = [r.integers(0, max(1, sz // 4096), reads // len(files) + 1) * 4096 for sz in sizes]
        drop_cache(files)
        cols["floor_ms"] = 1e3 * raw_direct_reads(files, per, 16) / timed_steps
    return cols


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--format",
        choices=FORMATS,
        default="rowcache",
        help="rowcache: generated bf16 rows stored as --dtype; v41: DeepSeek-V4.1's own format "
        "at steady state (bench/engram_v41.py; python -m bench.engram --format v41 --help)",
    )
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--config", choices=("demo", "v41"), default="demo")
    size = ap.add_mutually_exclusive_group()
    size.add_argument(
        "--store-gib",
        default=None,
        help="auto (the largest store the disk holds; the default on cuda) or GiB",
    )
    size.add_argument("--rows-per-layer", type=int, default=None)
    ap.add_argument("--dtype", choices=("bf16", "fp8"), default=None, help="demo: bf16, v41: fp8")
    ap.add_argument(
        "--arena", choices=("tune", "fraction"), default=None, help="cuda: tune, cpu: fraction"
    )
    ap.add_argument("--arena-fraction", type=float, default=0.25)
    ap.add_argument("--memory", default="121GiB", help="tune's --memory")
    ap.add_argument("--reserve", default="70GiB", help="tune's --reserve")
    ap.add_argument(
        "--disk-profile",
        default=DISK_PROFILE if os.path.exists(DISK_PROFILE) else None,
        help="tune's --disk (a bench-io profile): the fault I/O it predicts",
    )
    ap.add_argument("--tokens", type=int, default=60_000, help="tokens of text per mode")
    ap.add_argument("--max-steps", type=int, default=2000, help="steps a mode at most")
    ap.add_argument("--check-steps", type=int, default=3, help="steps compared bit for bit")
    ap.add_argument("--warm", type=float, default=0.3, help="fraction of steps run untimed first")
    ap.add_argument("--layers", type=int, default=43, help="layers of the modelled model")
    ap.add_argument("--layer-us", type=float, default=60.0, help="modelled time a layer a step")
    ap.add_argument("--token-us", type=float, default=0.5, help="and per token of the step")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--quick", action="store_true", help="a tiny CPU run")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.rows_per_layer, args.tokens, args.layers = 20_000, 800, 20
        args.layer_us, args.token_us, args.max_steps = 5.0, 0.1, 200
        args.arena = args.arena or "tune"
    if args.store_gib is None and args.rows_per_layer is None and args.device == "cuda":
        args.store_gib = "auto"
    args.arena = args.arena or ("tune" if args.device == "cuda" else "fraction")
    return args


def main(argv: list[str] | None = None) -> None:
    """The judge; ``--format v41`` hands the other arguments to ``bench.engram_v41.main``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--format", choices=FORMATS, default="rowcache")
    known, rest = pre.parse_known_args(argv)
    if known.format == "v41":
        from bench.engram_v41 import main as v41

        v41(rest)
        return
    args = _parse(argv)
    log = Log(args.json)
    from rowcache import NgramRowCache
    from rowcache.embed.engram.hash import EngramHash
    from rowcache.embed.engram.memory import EngramMemory
    from rowcache.embed.engram.vocab import CompressedVocab
    from rowcache.embed.tables import CachedTable
    from rowcache.tools.demo import text_files, tokenize_text
    from rowcache.tools.resources import available_device_memory, available_memory
    from rowcache.tools.tokens import tokenizer_json_path
    from rowcache.units import parse_bytes

    xp: Any = np
    if args.device == "cuda":
        import cupy as cp

        xp = cp
    own = args.workdir is None
    workdir = tempfile.mkdtemp(prefix="rowcache-engram-") if own else args.workdir
    try:
        dtype = args.dtype or ("bf16" if args.config == "demo" else "fp8")
        sizing = None
        rows_per_layer = args.rows_per_layer
        if args.store_gib is not None:
            shape = _config(args.config, None)
            st = os.statvfs(workdir)
            sizing = size_store(
                store_gib=args.store_gib,
                layers=len(shape.layer_ids),
                dim=shape.head_dim,
                dtype=dtype,
                free_disk=st.f_bavail * st.f_frsize,
                device_free=available_device_memory(xp) if xp is not np else None,
                host_free=available_memory(),
                workdir=workdir,
            )
            for line in sizing.lines:
                log(line)
            rows_per_layer = sizing.rows_per_layer
        cfg = _config(args.config, rows_per_layer)
        tok_path = tokenizer_json_path("deepseek")
        h = EngramHash(cfg, CompressedVocab.from_tokenizer(tok_path))
        layers = list(cfg.layer_ids)
        rows = [h.table_rows(layer) for layer in layers]
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        need = max(MODES[m][0] * MODES[m][1] for m in modes) * 10
        text, _ = tokenize_text(text_files(None), tok_path, max(args.tokens, need), EOS, 1 << 40)

        store, built = build_generated_store(os.path.join(workdir, "store"), h, dtype, xp, log)
        record = store.tables[0].record_bytes
        keep_resident = sizing.resident if sizing else True
        keep_host = (sizing.host if sizing else True) and args.device == "cuda"
        t0 = time.perf_counter()
        res = {}
        if keep_resident:
            res = {L: resident_table(xp, dtype, L, n, cfg.head_dim) for L, n in zip(layers, rows)}
        pinned = {}
        if keep_host:
            pinned = {L: pinned_table(dtype, L, n, cfg.head_dim) for L, n in zip(layers, rows)}
        log(
            f"tables: resident {'made' if res else 'skipped'}, pinned host "
            f"{'made' if pinned else 'skipped'} in {time.perf_counter() - t0:.1f} s"
        )

        arena: dict[str, Any] = {"arena": args.arena}
        least = step_rows(cfg, modes)
        if args.arena == "tune":
            t0 = time.perf_counter()
            memory = parse_bytes(args.memory, "--memory")
            reserve = parse_bytes(args.reserve, "--reserve")
            rep = tune_arena(h, text, dtype, memory, reserve, args.disk_profile, workdir)
            slots = sum(rep.rows.values())
            arena.update(
                tune_s=round(time.perf_counter() - t0, 1),
                tune_budget_bytes=rep.budget_bytes,
                tune_used_bytes=rep.used_bytes,
                tune_fault_rate=rep.faults_per_access,
                tune_faults_per_token=rep.faults_per_token,
                tune_fault_us_per_token=None
                if rep.fault_seconds_per_token is None
                else rep.fault_seconds_per_token * 1e6,
            )
            log(
                f"tune: --memory {args.memory} --reserve {args.reserve} over {rep.tokens:,} "
                f"tokens of the text: {gib(rep.used_bytes)} of {gib(rep.budget_bytes)} used, "
                f"{slots:,} rows; predicted {rep.faults_per_access:.4f} faults a row looked "
                f"up, {rep.faults_per_token:.2f} a token"
                + (
                    f", {rep.fault_seconds_per_token * 1e6:.1f} µs of fault I/O a token"
                    if rep.fault_seconds_per_token is not None
                    else ""
                )
            )
        else:
            slots = max(1, int(args.arena_fraction * sum(rows)))
            log(f"arena: --arena-fraction {args.arena_fraction} of {sum(rows):,} rows: {slots:,}")
        free = available_device_memory(xp) if xp is not np else available_memory()
        if free is not None:
            most = max(1, (free - DEVICE_RESERVE) // (record + 32))
            if slots > most:
                log(f"arena: {slots:,} rows capped to {most:,} by the free memory ({gib(free)})")
                slots = most
        if slots > sum(rows):
            log(f"arena: {slots:,} rows capped to the tables' {sum(rows):,}")
            slots = sum(rows)
        if slots < least:
            log(f"arena: {slots:,} rows raised to {least:,}: two steps' rows of every head")
            slots = least
        arena.update(arena_slots=slots, arena_bytes=slots * record)
        log(f"arena: {slots:,} rows, {gib(slots * record)}, shared by the layers")

        said: list[str] = []

        def cached_memory() -> Any:
            names = [f"engram.{layer}" for layer in layers]
            cache = NgramRowCache(store, names, slots=slots, device=args.device)
            if not said:  # the host row map the cache chose (rowcache.cache.row_map)
                said.append(cache.row_map_kind)
                log(
                    f"row map: {cache.row_map_kind}, {gib(cache.inspect().overhead_bytes()['row_map'])}"
                )
            return EngramMemory(h, {layer: CachedTable(cache, i) for i, layer in enumerate(layers)})

        series: dict[str, Callable[[], Any]] = {}
        if res:
            series["resident"] = lambda: EngramMemory(h, res)
        if pinned:
            series["host"] = lambda: EngramMemory(h, pinned)
        series["cached"] = cached_memory
        series["lookahead"] = cached_memory  # prefill: the next chunk's rows read a step ahead
        base = "resident" if res else "host" if pinned else None
        model = Model(args.device, args.layer_us, args.token_us, args.layers)
        results = []
        checked: dict[str, int] = {}  # values compared bit for bit with cached, by series
        for mode in modes:
            B, T = MODES[mode]
            steps = min(len(text) // (B * T), max(20, args.tokens // (B * T)), args.max_steps)
            toks = text[: steps * B * T].reshape(B, steps * T) if B > 1 else text[: steps * T][None]
            wholes = [n for n in ("resident", "host") if n in series] if args.check_steps else []
            for whole in wholes:
                checked[whole] = checked.get(whole, 0) + check_equal(
                    h, series[whole](), cached_memory(), toks, T, min(args.check_steps, steps)
                )
            start = int(args.warm * steps)
            timed: dict[str, float] = {}
            row: dict[str, Any] = {"mode": mode}
            cols: dict[str, Any] = {}
            for name, make in series.items():
                if name == "lookahead" and T == 1:
                    continue  # a decode step's next token is not known before it
                drop_cache(store_files(store))
                mem = make()
                rate, waited, stats0 = time_series(
                    name, mem, h, model, toks, T, steps, start, args.layers
                )
                timed[name] = rate
                if name == "cached":
                    cols = cached_columns(
                        mem.tables[layers[0]].cache,
                        stats0,
                        ((steps - start) * B * T, steps * B * T),
                        cfg.heads_per_layer * len(layers),
                        steps - start,
                        waited,
                        store,
                    )
                elif name == "lookahead":
                    cols["lookahead_wait_ms"] = 1e3 * waited / (steps - start)
                del mem
            row.update({f"{k} tok/s": v for k, v in timed.items()})
            for name in ("cached", "lookahead", "host"):
                if base is not None and name in timed and name != base:
                    row[f"{name}/{base}"] = timed[name] / timed[base]
            row["window_ms"] = layers[0] * (args.layer_us + args.token_us * B * T) / 1e3
            row.update(cols)
            results.append(row)
        for compared, n in checked.items():
            log(
                f"check: cached == {compared} bit for bit, {n:,} values over the modes' first steps"
            )
        settings: dict[str, Any] = {
            "config": args.config,
            "device": args.device,
            "dtype": dtype,
            "rows_per_layer": rows,
            "row_bytes": record,
            "store_bound": sizing.bound if sizing else "--rows-per-layer",
            **built,
            **arena,
            "layers": args.layers,
            "engram_layers": layers,
            "layer_us": args.layer_us,
            "token_us": args.token_us,
            "text_tokens": int(text.size),
        }
        if args.json:
            settings["log"] = log.lines
        report("bench.engram", results, args.json, settings)
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
