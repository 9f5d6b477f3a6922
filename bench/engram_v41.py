"""The judge of DeepSeek-V4.1's Engram tables in their own format, served at steady state:
``python -m bench.engram --format v41``.

The tables: V4.1's hash (``EngramConfig.reported_v41()``: layers 1 and 14 of 43, orders 2..4
of 8 heads, 256 values a head) with each head's prime search started at ``--rows / 24``, so
that a layer has about ``--rows`` rows (V4.1 itself: 384,006,168 and 384,016,682). Default:
the largest tables the work directory's disk holds with both copies the run writes (below),
less a margin of 15 % of its free space or 4 GiB; the log says so. Each row is 256 E4M3
codes and 8 UE8M0 scale bytes (a block of 32 values each), made by counter-based generators
(``bench._common.random_codes`` / ``random_ue8m0``: each byte a function of its layer, row
and column; no NaN code, scale bytes 112..127), a chunk at a time (on the GPU with cupy),
and written twice, nothing table-sized in host memory:

- **the store**: ``build_store`` with the ``fp8_block_e8m0`` codec, both streams in an
  ``Fp8BlockScaleSource`` of two ``GeneratedRows``: a 264-byte record a row, 15 a page;
- **the checkpoint layout**: one ``.safetensors`` file a layer, as V4.1 ships them,
  ``layers.{L}.engram.embed.weight`` (``F8_E4M3 [rows, 256]``) then
  ``layers.{L}.engram.embed.scale`` (``F8_E8M0 [rows, 8]``), the data starting on a page
  (so no row's codes straddle a page): a row's codes and its scales are in two places, two
  pages a row read cold.

The server is warmed with a long history and the arena sized by ``tune`` on the whole text:
the standard library's ``.py`` files tokenized with DeepSeek's tokenizer (8.2M tokens;
``--corpus-tokens N`` takes the first N), an EOS after each file. The modes (``--modes``,
default decode x1, decode x64 and prefill 512) take the text's last tokens, each its own
slice; everything before them is the history (``--history`` takes fewer). ``tune`` sizes
the arena as ``rowcache trace``/``profile --method exact --dtype fp8_block_e8m0``/``tune``
would, on the whole text (history and modes, a file a request) through this hash, with the
codec's 264-byte rows: ``--memory`` less ``--reserve`` (121 GiB less 70 GiB), scaled by
these tables' rows over V4.1's (``--budget-scale rows``, the default: the arena is the same
share of the tables as on a server of V4.1's own; ``none`` takes it whole).

Series, in one run, on the same steps:

- ``resident``: the two tensors of each layer in GPU memory (``Fp8BlockScaleTable``; on the
  CPU, host arrays);
- ``host``: the same in pinned host memory mapped into the device, gathered by the GPU (the
  engines' default; GPU runs only);
- ``cached``: the store behind one ``NgramRowCache`` arena shared by both layers (O_DIRECT,
  ``--queue-depth`` reads in flight), ``EngramMemory`` over ``CachedTable``s: every layer's
  rows prefetched at the step's start (in prefill the next chunk's too, a step ahead), each
  lookup waiting only for its rows. Warmed first: the rows an LRU arena of its size holds
  after serving the history (``bench.modes.History.lru_end``: found from the end of the
  history backwards), read in one sorted pass, then touched chunk by chunk in the history's
  order, so that the arena and its LRU order are what serving the history would have left
  (without reading a row twice);
- ``ckpt``: the checkpoint-layout files memory-mapped (``bench.mapped.FileMap``,
  ``--mmap-advice random``: no read-around), a lookup gathering each row's codes and scales
  from the mapping on the host (``--mmap-threads`` threads of ``np.take``, as torch's CPU
  ``index_select`` runs in parallel), one copy to the GPU and the resident kernel there: the
  engines' disk path. It runs in a child process whose memory cgroup caps its page cache at
  the arena's bytes (``bench.mapped``; ``uncapped`` in every label where no cgroup could be
  made), warmed first with the pages of the history's most recent rows that the cap holds;
- the disk's floor: the pages each timed cached step read (its rows not resident at its
  start, an untimed peek) re-read by ``bench/floor.c`` (O_DIRECT, ``--queue-depth`` reads in
  flight; io_uring and threads of ``pread``, the faster over the mode), and the same rows' two pages each in the checkpoint layout (``ckpt_floor_ms``).

Before timing, the first ``--check-steps`` steps of every mode through every series are
compared bit for bit with the generator's rows dequantized by the NumPy reference
(``rowcache.kernels.batched_embed_fp8_block``); a difference stops the run.

Printed as it goes (to stderr with ``--json``): the sizes and why, each phase's time, each
series' tokens/s per mode, then a row per mode: tokens/s of every series and their ratios to
resident (and cached/ckpt); the reads a token each disk series needs (``cached reads/tok``:
rows read from the store a token, one 4 KiB page each; ``ckpt reads/tok``: major page
faults a token, 4 KiB each, two a row not in the page cache) and the cached hit rate;
``window_ms`` and ``window2_ms``, the modelled time before the first and the second Engram
layer, beside ``*_ready_ms`` and ``*_ready2_ms``, the time from a step's start to each
lookup's return (the window each series needs); ``floor_ms`` and ``ckpt_floor_ms``.

The tables, their generators and the three places they are written are
``bench/v41_tables.py``'s; the modelled server's steps and history ``bench/modes.py``'s; the
capped mapped series ``bench/mapped.py``'s; this module runs the series and reports.

    python -m bench.engram --format v41 --device cuda [--json]
    python -m bench.engram --format v41 --quick      # a tiny CPU run (what the test runs)
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from bench._common import (
    GIB,
    Log,
    drop_cache,
    fmt_cell,
    gib,
    host16,
    jsonable,
    machine,
    print_table,
    store_files,
)
from bench.engram import DISK_PROFILE, EOS, size_store
from bench.mapped import Cgroup, FileMap, run_mapped
from bench.modes import History, Mode, Model, mode_tokens, plan_modes, run_series
from bench.v41_tables import (
    BLOCKS,
    CODEC,
    DIM,
    HEADS,
    PAGE,
    REC,
    CheckpointLayout,
    build_v41_store,
    checkpoint_bytes,
    reference_rows,
    v41_config,
    v41_rows,
    whole_tables,
    write_checkpoint,
)
from rowcache.errors import ConfigError

MODES = "decode x1,decode x64,prefill 512"
SERIES = ("resident", "host", "ckpt", "cached")
DEVICE_RESERVE = 8 * GIB  # GPU memory kept beside an arena (its workspace, cupy's pool)
CORPUS_ALL = 1 << 27  # --corpus-tokens 0: the whole library (8.2M tokens)


# --- the arena ---------------------------------------------------------------------------------
def tune_v41(
    h: Any, text: np.ndarray, budget: int, model: Any, disk: str | None, workdir: str, workers: int
) -> tuple[Any, list[str]]:
    """``rowcache trace`` (the text a file a request, scheduled by ``model``, a
    ``ServerModel``) / ``profile --method exact --dtype fp8_block_e8m0`` (per head table; no
    shared curve, which ``tune`` does not read) / ``tune --arena-bytes budget``: ``(the
    TuneReport, notes)``. A budget below the smallest arena the trace's steps allow (each head
    table's distinct rows of a step) is raised to it, and a note says so. The trace's files
    are removed after."""
    from rowcache.tools.benchio import DeviceProfile
    from rowcache.tools.profile import profile_trace
    from rowcache.tools.trace_build import build_trace
    from rowcache.tools.tune import curves_from_profile, greedy_path, tune

    cuts = np.flatnonzero(text == EOS) + 1
    requests = [r for r in np.split(text, cuts) if r.size]
    where = os.path.join(workdir, "trace")
    try:
        trace = build_trace(requests, h, where, model=model, overwrite=True, progress=False)
        prof = profile_trace(
            trace, method="exact", dtype=CODEC, shared=False, workers=workers, progress=False
        )
    finally:
        shutil.rmtree(where, ignore_errors=True)
    notes = []
    least = int(greedy_path(curves_from_profile(prof)[0], prof.record_bytes)[0][0])
    if budget < least:
        notes.append(
            f"tune's budget raised from {gib(budget)} to the smallest arena the trace's steps "
            f"allow, {gib(least)}"
        )
        budget = least
    device = DeviceProfile.load(disk) if disk else None
    return tune(prof, arena_bytes=budget, dtype=CODEC, device=device), notes


def size_arena(
    args: argparse.Namespace,
    h: Any,
    rows: Rows,
    text: np.ndarray,
    modes: list[Mode],
    xp: Any,
    workdir: str,
    log: Log,
) -> tuple[int, dict[str, Any]]:
    """The arena's rows: ``tune`` on the whole text (:func:`tune_v41`), its budget
    ``--memory`` less ``--reserve`` scaled by these tables' share of V4.1's
    (``--budget-scale rows``), capped by the free GPU memory, at least two steps' rows.
    ``(slots, what the report says of it)``."""
    from rowcache.tools.resources import available_device_memory
    from rowcache.tools.trace import ServerModel
    from rowcache.units import parse_bytes

    layers = len(rows.layers)
    full = v41_rows()
    budget = parse_bytes(args.memory, "--memory") - parse_bytes(args.reserve, "--reserve")
    scale = min(1.0, rows.total / full) if args.budget_scale == "rows" else 1.0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    trace_model = ServerModel(batch=args.trace_batch, chunk=args.chunk)
    rep, notes = tune_v41(
        h,
        text,
        max(1, int(budget * scale)),
        trace_model,
        args.disk_profile,
        workdir,
        min(cores, HEADS * layers),
    )
    slots = min(sum(rep.rows.values()), rows.total)
    least = 2 * max(m.B * m.T for m in modes) * HEADS * layers
    if xp is not np:
        free = available_device_memory(xp)
        most = max(1, (free - DEVICE_RESERVE) // (REC + 32)) if free else slots
        if slots > most:
            notes.append(f"capped from {slots:,} rows by the free GPU memory ({gib(free)})")
            slots = most
    if slots < least:
        notes.append(f"raised from {slots:,} to two steps' rows ({least:,})")
        slots = least
    floor_rate = rep.floor_fault_rate if rep.floor_fault_rate is not None else float("nan")
    log(
        f"tune: {text.size:,} tokens traced through the hash (a file a request, a server of "
        f"{trace_model.batch} slots, prefill chunks of {trace_model.chunk}), exact curves of "
        f"{HEADS * layers} head tables, {rep.record_bytes} B rows ({CODEC}); budget "
        f"{args.memory} - {args.reserve} = {gib(budget)} x {scale:.4f} (--budget-scale "
        f"{args.budget_scale}: these tables' share of V4.1's) = {gib(rep.budget_bytes)}: "
        f"{gib(rep.used_bytes)} used, {sum(rep.rows.values()):,} rows; predicted "
        f"{rep.faults_per_access:.4f} faults a row looked up ({rep.faults_per_token:.2f} a "
        f"token), of which first uses {floor_rate:.4f}"
    )
    log(f"arena: {slots:,} rows, {gib(slots * REC)}" + (f" ({'; '.join(notes)})" if notes else ""))
    return slots, {
        "tune_budget_bytes": rep.budget_bytes,
        "tune_budget_scale": scale,
        "tune_record_bytes": rep.record_bytes,
        "tune_used_bytes": rep.used_bytes,
        "tune_fault_rate": rep.faults_per_access,
        "tune_faults_per_token": rep.faults_per_token,
        "tune_floor_fault_rate": rep.floor_fault_rate,
        "arena_slots": slots,
        "arena_bytes": slots * REC,
        "arena_notes": notes,
    }


# --- the server's steps ----------------------------------------------------------------------
class Rows:
    """The hash's rows as the shared arena numbers them: layer ``k``'s table rows after the
    rows of the layers before it."""

    def __init__(self, h: Any) -> None:
        self.h = h
        self.layers = list(h.layer_ids)
        self.sizes = [h.table_rows(L) for L in self.layers]
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.offsets = {L: h.head_offsets(L) for L in self.layers}

    @property
    def total(self) -> int:
        return int(self.starts[-1])

    def of(self, tokens: np.ndarray, ctx: np.ndarray) -> np.ndarray:
        """int64: every layer's global rows of a step (layer-major)."""
        ids = self.h.hash(tokens, ctx)
        return np.concatenate(
            [
                (ids[L] + self.offsets[L]).reshape(-1) + self.starts[k]
                for k, L in enumerate(self.layers)
            ]
        )

    def reference(self, tokens: np.ndarray, ctx: np.ndarray) -> np.ndarray:
        """The step's lookups of every layer, in layer order, as host uint16 bits: the
        generator's rows dequantized by the reference."""
        ids = self.h.hash(tokens, ctx)
        return np.concatenate(
            [host16(reference_rows(L, (ids[L] + self.offsets[L]).reshape(-1))) for L in self.layers]
        )


def lookups_of(mem: Any, h: Any) -> list[tuple[int, Any]]:
    """``run_series``' lookups of an ``EngramMemory``: each Engram layer's at its layer."""
    return [(L, functools.partial(_lookup_at, mem, L)) for L in h.layer_ids]


def _lookup_at(mem: Any, layer: int, tokens: Any, ctx: Any) -> Any:
    return mem.lookup(layer, tokens, ctx)


def check_series(name: str, outs: list[np.ndarray], refs: list[np.ndarray], mode: str) -> int:
    """Values compared bit for bit (RuntimeError at the first difference)."""
    n = 0
    for i, (got, want) in enumerate(zip(outs, refs)):
        if got.shape != want.shape or not np.array_equal(got, want):
            bad = int((got != want).sum()) if got.shape == want.shape else got.size
            raise RuntimeError(
                f"{name} != the generator's rows dequantized: {mode}, step {i}: {bad:,} of "
                f"{want.size:,} values differ"
            )
        n += want.size
    return n


def run_whole(
    name: str,
    tables: dict[int, Any],
    h: Any,
    modes: list[Mode],
    steps_of: dict,
    refs: dict,
    model: Model,
    args: argparse.Namespace,
    log: Log,
) -> tuple[dict[str, Any], int]:
    """A whole-table series (resident, host): checked, then each mode timed."""
    from rowcache.embed.engram.memory import EngramMemory

    mem = EngramMemory(h, tables)
    checked, out = 0, {}
    for m in modes:
        outs = []
        for p, c in steps_of[m.name][: args.check_steps]:
            outs.append(np.concatenate([host16(mem.lookup(L, p, c)) for L in h.layer_ids]))
        checked += check_series(name, outs, refs[m.name], m.name)
        r = run_series(lookups_of(mem, h), m, steps_of[m.name], model, args.layers)
        out[m.name] = r
        log(f"{name} {m.name}: {r['tok_s']:,.0f} tok/s, ready {r['ready_ms']:.3f} ms")
    return out, checked


def warm_cache(cache: Any, end: list[np.ndarray], log: Log) -> dict[str, Any]:
    """The history's end state into ``cache``: its rows read in one sorted pass (pieces of a
    million rows), then each chunk's touched in the history's order (all resident: no
    reads)."""
    t0 = time.perf_counter()
    rows = np.sort(np.concatenate(end)) if end else np.zeros(0, np.int64)
    for a in range(0, rows.size, 1 << 20):
        cache.prefetch(rows[a : a + (1 << 20)]).wait()
    st = cache.stats()
    read_s = time.perf_counter() - t0
    for r in end:
        cache.prefetch(r).wait()
    info = {
        "rows": int(rows.size),
        "chunks": len(end),
        "read_s": round(read_s, 1),
        "touch_s": round(time.perf_counter() - t0 - read_s, 1),
        "GB_read": st.bytes_read / 1e9,
        "GB_s": st.bytes_read / 1e9 / max(read_s, 1e-9),
        "resident": int(cache.resident),
    }
    log(
        f"cached: arena warmed with the history's end: {info['rows']:,} rows of {info['chunks']:,} "
        f"chunks, {info['GB_read']:.2f} GB read in {read_s:.1f} s ({info['GB_s']:.2f} GB/s), "
        f"touched in order in {info['touch_s']} s"
    )
    return info


def run_cached(
    store: Any,
    h: Any,
    rows: Rows,
    slots: int,
    end: list[np.ndarray],
    modes: list[Mode],
    steps_of: dict,
    refs: dict,
    model: Model,
    floors: tuple[Any, Any],
    layout: CheckpointLayout,
    args: argparse.Namespace,
    log: Log,
) -> tuple[dict[str, Any], dict[str, Any], int]:
    """The cached series: the arena warmed, then each mode (its first steps checked, then
    timed; the pages its timed steps read re-read by the floors). ``(per mode, warm info,
    values checked)``."""
    from rowcache import NgramRowCache
    from rowcache.embed.engram.memory import EngramMemory
    from rowcache.embed.tables import CachedTable

    drop_cache(store_files(store))
    names = [f"engram.{L}" for L in rows.layers]
    cache = NgramRowCache(
        store, names, slots=slots, device=args.device, queue_depth=args.queue_depth, direct=True
    )
    floor, ckpt_floor = floors
    out: dict[str, Any] = {}
    checked = 0
    with cache:
        warmed = warm_cache(cache, end, log)
        mem = EngramMemory(h, {L: CachedTable(cache, i) for i, L in enumerate(rows.layers)})
        looked = HEADS * len(rows.layers)  # rows a token looks up
        for m in modes:
            steps = steps_of[m.name]
            outs = []
            for p, c in steps[: args.check_steps]:
                mem.prefetch(p, c)
                outs.append(np.concatenate([host16(mem.lookup(L, p, c)) for L in rows.layers]))
                mem.end_step()
            checked += check_series("cached", outs, refs[m.name], m.name)
            missed: list[np.ndarray] = []
            own_missed: list[int] = []
            stats: list[Any] = []

            def peek(
                p: Any,
                c: Any,
                nxt: Any,
                missed: list = missed,
                own_missed: list = own_missed,
                stats: list = stats,
            ) -> None:
                """The rows the step's prefetches will read (its own and, in prefill, the next
                chunk's, not mapped now) and how many of its own rows are not mapped. Untimed."""
                if not stats:
                    stats.append(cache.stats())
                own = np.unique(rows.of(p, c))
                view = cache.inspect()
                own_missed.append(int(np.count_nonzero(~view.is_resident(own))))
                u = own if nxt is None else np.unique(np.concatenate([own, rows.of(*nxt)]))
                missed.append(u[~view.is_resident(u)])

            r = run_series(
                lookups_of(mem, h),
                m,
                steps,
                model,
                args.layers,
                prefetch=mem.prefetch,
                end=mem.end_step,
                peek=peek,
            )
            s0, s1 = stats[0], cache.stats()
            timed = m.steps - m.start
            toks = timed * m.B * m.T
            read = (s1.misses + s1.prefetched) - (s0.misses + s0.prefetched)
            r.update(
                hit_rate=1 - sum(own_missed[-timed:]) / (toks * looked),
                reads_tok=read / toks,
                read_ops_step=(s1.read_ops - s0.read_ops) / timed,
            )
            if floor is not None:
                layout_ = (rows.starts, [store.table_index(n) for n in names])
                r["floor_s"] = floor.measure(
                    [floor.pages(layout_, x) for x in missed], args.queue_depth, log
                )
            if ckpt_floor is not None:
                r["ckpt_floor_s"] = ckpt_floor.measure(
                    [layout.pages(x) for x in missed], args.queue_depth, log
                )
                r["ckpt_floor_pages_tok"] = sum(layout.pages(x).shape[0] for x in missed) / toks
            out[m.name] = r
            log(
                f"cached {m.name}: {r['tok_s']:,.0f} tok/s, ready {r['ready_ms']:.3f} ms, hit rate "
                f"{r['hit_rate']:.3f}, {r['reads_tok']:.2f} rows read a token"
                + (
                    f", floor {1e3 * np.mean(r['floor_s']):.2f} ms a step"
                    if r.get("floor_s") is not None
                    else ""
                )
            )
        del mem
    return out, warmed, checked


# --- the checkpoint layout's mapped series (a child process) ----------------------------------
class CheckpointServer:
    """The ``ckpt`` series' side in its child process (``bench.mapped.mapped_worker``): the
    hash, the mapped checkpoint-layout files, the modes. A lookup hashes the step (once for
    both layers), takes each row's codes and scale bytes from the mapping (two pages a row,
    read by page faults) in ``threads`` threads, copies them to the device in one copy each
    and dequantizes them there with the resident kernel."""

    def __init__(self, spec: dict[str, Any], xp: Any) -> None:
        from rowcache.embed.engram.hash import EngramHash
        from rowcache.embed.engram.vocab import CompressedVocab

        self.spec, self.xp = spec, xp
        self.h = EngramHash(
            v41_config(spec["rows_arg"]), CompressedVocab.from_tokenizer(spec["tokenizer"])
        )
        self.layout = CheckpointLayout(*map(tuple, spec["layout"]))
        self.modes = [Mode(**m) for m in spec["modes"]]
        fill = self.h.config.pad_id
        self.steps_of = {m.name: m.pieces(self.h, fill) for m in self.modes}
        self.offsets = {L: self.h.head_offsets(L) for L in self.h.layer_ids}
        self.threads = max(1, int(spec["threads"]))
        self.pool = ThreadPoolExecutor(self.threads) if self.threads > 1 else None
        self.maps: list[FileMap] = []
        self.views: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._last: tuple[Any, Any, dict] | None = None
        self.runs = page_runs(spec["warm_pages"])

    def open(self) -> None:
        """Map each layer's file (``bench.mapped.FileMap``) and view its two tensors."""
        for f, L, n in zip(self.layout.files, self.layout.layers, self.layout.rows):
            fm = FileMap([f], self.spec["advice"])
            self.maps.append(fm)
            raw = fm.raw
            assert raw is not None
            codes = raw[PAGE : PAGE + n * DIM].reshape(n, DIM)
            scales = raw[PAGE + n * DIM : PAGE + n * REC].reshape(n, BLOCKS)
            self.views[L] = (codes, scales)

    def close(self) -> None:
        self.views = {}
        self._last = None
        for fm in self.maps:
            fm.close()
        self.maps = []

    def _take(self, a: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """``a[rows]``, split over the threads (``np.take`` releases the GIL, so the page
        faults of its pieces are served in parallel; ``mode="clip"``: the rows are the hash's,
        in range, and ``"raise"`` would copy through a buffer)."""
        if self.pool is None or rows.size < 4 * self.threads:
            return np.take(a, rows, axis=0, mode="clip")
        out = np.empty((rows.size, a.shape[1]), dtype=a.dtype)
        cuts = np.linspace(0, rows.size, self.threads + 1).astype(np.int64)
        jobs = [
            self.pool.submit(np.take, a, rows[s:e], 0, out[s:e], "clip")
            for s, e in itertools.pairwise(cuts)
            if e > s
        ]
        for j in jobs:
            j.result()
        return out

    def _rows(self, piece: Any, ctx: Any) -> dict:
        last = self._last
        if last is not None and last[0] is piece and last[1] is ctx:
            return last[2]
        ids = self.h.hash(piece, ctx)
        got = {L: (ids[L] + self.offsets[L]).reshape(-1) for L in self.h.layer_ids}
        self._last = (piece, ctx, got)
        return got

    def lookup(self, layer: int, piece: Any, ctx: Any) -> Any:
        from rowcache.kernels import batched_embed_fp8_block

        rows = self._rows(piece, ctx)[layer]
        codes, scales = self.views[layer]
        c, s = self._take(codes, rows), self._take(scales, rows)
        if self.xp is not np:
            c, s = self.xp.asarray(c), self.xp.asarray(s)
        return batched_embed_fp8_block(self.xp.arange(rows.size, dtype=np.int64), c, s)

    def check(self, mode: Mode) -> list[np.ndarray]:
        return [
            np.concatenate([host16(self.lookup(L, p, c)) for L in self.h.layer_ids])
            for p, c in self.steps_of[mode.name][: self.spec["check_steps"]]
        ]

    def warm(self) -> None:
        """Read the warm pages (``spec["warm_pages"]``: (file, offset), the history's most
        recent rows' that the cap holds) into the page cache: runs of adjacent pages (at
        most 64), each one ``preadv``, the runs dealt out to the threads (readahead off: only
        these pages). The runs were found before the cap was set (:meth:`__init__`), so the
        warm-up allocates nothing a run but its buffer."""
        files, offs, lens = self.runs
        if files.size == 0:
            return
        fds = [os.open(f, os.O_RDONLY) for f in self.layout.files]
        try:
            for fd in fds:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)

            def read(k: int) -> None:
                buf = memoryview(bytearray(WARM_RUN * PAGE))
                for a in range(k, files.size, self.threads * 4096):  # its share, in batches
                    sl = slice(a, min(files.size, a + 4096))
                    for f, off, n in zip(files[sl].tolist(), offs[sl].tolist(), lens[sl].tolist()):
                        os.preadv(fds[f], [buf[: n * PAGE]], off)

            if self.pool is None:
                read(0)
            else:
                for j in [self.pool.submit(read, k * 4096) for k in range(self.threads)]:
                    j.result()
        finally:
            for fd in fds:
                os.close(fd)

    def lookups(self) -> list[tuple[int, Any]]:
        return [(L, functools.partial(_lookup_at, self, L)) for L in self.h.layer_ids]


WARM_RUN = 64  # pages a warm-up read at most


def page_runs(pages: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(file, offset, pages)`` of each run of adjacent ``pages`` (int64 ``[k, 2]`` (file,
    offset), sorted), runs cut at :data:`WARM_RUN` pages."""
    if pages.size == 0:
        return (np.zeros(0, np.int64),) * 3
    key = pages[:, 0] * (1 << 40) + pages[:, 1] // PAGE
    new = np.r_[True, np.diff(key) != 1]
    run = np.cumsum(new) - 1
    pos = np.arange(key.size) - np.flatnonzero(new)[run]  # place in its run
    first = new | (pos % WARM_RUN == 0)
    starts = np.flatnonzero(first)
    lens = np.diff(np.r_[starts, key.size])
    return pages[starts, 0].copy(), pages[starts, 1].copy(), lens.astype(np.int64)


def warm_pages(end: list[np.ndarray], layout: CheckpointLayout, budget: int) -> np.ndarray:
    """int64 ``[k, 2]`` (file, offset), sorted: the checkpoint-layout pages of the history's
    most recent rows (``end``: per chunk, oldest first), two a row, as many as ``budget``
    bytes of page cache hold: what a capped page cache keeps of the history (its own order
    aside)."""
    most = budget // PAGE
    seen: set[int] = set()
    keep: list[np.ndarray] = []
    n = 0
    for r in reversed(end):
        if n >= most:
            break
        p = layout.pages(r[::-1])
        key = p[:, 0] * (1 << 40) + p[:, 1]
        new = np.array([k not in seen for k in key.tolist()], dtype=bool)
        p = p[new][: most - n]
        seen.update((p[:, 0] * (1 << 40) + p[:, 1]).tolist())
        keep.append(p)
        n += p.shape[0]
    if not keep:
        return np.zeros((0, 2), np.int64)
    got = np.concatenate(keep)
    return got[np.lexsort((got[:, 1], got[:, 0]))]


def run_ckpt(
    args: argparse.Namespace,
    layout: CheckpointLayout,
    end: list[np.ndarray],
    slots: int,
    rows_arg: int,
    tokenizer: str,
    modes: list[Mode],
    refs: dict,
    log: Log,
) -> tuple[dict[str, Any], str, dict[str, Any], int]:
    """The checkpoint layout's mapped series in its capped child process
    (``bench.mapped.run_mapped`` of a :class:`CheckpointServer`), its page cache capped at
    the arena's bytes and warmed with the history's most recent pages. ``(per mode, its
    label, the cap and warm-up, values checked)``."""
    cg = Cgroup(args.page_cache_cap == "auto")
    label = "ckpt" if cg.version else "ckpt uncapped"
    log(
        f"page cache cap: {cg.why}"
        + ("" if cg.version else "; the ckpt series runs UNCAPPED (its page cache dropped first)")
    )
    budget = slots * REC
    pages = warm_pages(end, layout, budget)
    spec = {
        "server": "bench.engram_v41:CheckpointServer",
        "device": args.device,
        "rows_arg": rows_arg,
        "tokenizer": tokenizer,
        "layout": [list(layout.files), list(layout.layers), list(layout.rows)],
        "files": list(layout.files),
        "advice": args.mmap_advice,
        "threads": args.mmap_threads,
        "slack": args.mmap_slack,
        "budget_bytes": budget,
        "layer_us": args.layer_us,
        "token_us": args.token_us,
        "layers": args.layers,
        "check_steps": args.check_steps,
        "warm_pages": pages,
        "modes": [
            dict(name=m.name, B=m.B, T=m.T, steps=m.steps, start=m.start, toks=m.toks)
            for m in modes
        ],
    }

    def said(name: str, r: dict[str, Any]) -> None:
        log(
            f"{label} {name}: {r['tok_s']:,.0f} tok/s, ready {r['ready_ms']:.3f} ms, "
            f"{r['majflt/tok']:.2f} major faults a token"
        )

    got = run_mapped(spec, cg, "v41", on_mode=said)
    lim = got.get("limit", {})
    done = got.get("done", {})
    info = {**lim, **done, "warm_s": got.get("warm_s"), "warm_pages": int(pages.shape[0])}
    if lim.get("capped"):
        log(
            f"{label}: memory limit {gib(lim['limit_bytes'])} = the arena's {gib(budget)} + the "
            f"process's own {gib(lim['own_bytes'])} + slack {gib(args.mmap_slack)}; warmed with "
            f"{pages.shape[0]:,} pages in {got.get('warm_s') or 0:.1f} s; limit hit "
            f"{done.get('limit_hits')} times"
        )
    if "error" in got:
        raise RuntimeError(f"the {label} series failed:\n{got['error']}")
    checked = sum(
        check_series(label, got["checks"].get(m.name, []), refs[m.name], m.name) for m in modes
    )
    return got["modes"], label, info, checked


def report_row(
    m: Mode, got: dict[str, Any], label: str, layers: list[int], args: argparse.Namespace
) -> dict[str, Any]:
    """Mode ``m``'s row of the report from each series' result (``got``, by series)."""
    n = m.B * m.T
    show = {"ckpt": label}
    row: dict[str, Any] = {"mode": m.name}
    for s, r in got.items():
        row[f"{show.get(s, s)} tok/s"] = r["tok_s"]
    if "resident" in got:
        for s in ("host", "cached", "ckpt"):
            if s in got:
                row[f"{show.get(s, s)}/resident"] = got[s]["tok_s"] / got["resident"]["tok_s"]
    c, k = got.get("cached"), got.get("ckpt")
    if c and k:
        row[f"cached/{label}"] = c["tok_s"] / k["tok_s"]
    if c:
        row["hit_rate"] = c["hit_rate"]
        row["cached reads/tok"] = c["reads_tok"]
    if k:
        row[f"{label} reads/tok"] = k["majflt/tok"]
    row["window_ms"] = layers[0] * (args.layer_us + args.token_us * n) / 1e3
    row["window2_ms"] = layers[1] * (args.layer_us + args.token_us * n) / 1e3
    for s, r in got.items():
        row[f"{show.get(s, s)}_ready_ms"] = r["ready_ms_each"][0]
        row[f"{show.get(s, s)}_ready2_ms"] = r["ready_ms_each"][1]
    if c and c.get("floor_s") is not None:
        row["floor_ms"] = 1e3 * float(np.mean(c["floor_s"]))
    if c and c.get("ckpt_floor_s") is not None:
        row[f"{label}_floor_ms"] = 1e3 * float(np.mean(c["ckpt_floor_s"]))
        row[f"{label}_floor_pages/tok"] = c["ckpt_floor_pages_tok"]
    return row


# --- the run ------------------------------------------------------------------------------------
def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.engram --format v41",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument(
        "--rows",
        type=int,
        default=None,
        help="rows a layer (default: the largest the disk holds with both copies)",
    )
    ap.add_argument(
        "--corpus-tokens",
        type=int,
        default=0,
        help="tokens of the library's text: history, modes and tune's trace (0: all, 8.2M)",
    )
    ap.add_argument(
        "--history",
        type=int,
        default=None,
        help="tokens of history (default: the text before the modes)",
    )
    ap.add_argument("--modes", default=MODES)
    ap.add_argument("--chunk", type=int, default=512, help="a prefill chunk's tokens ('prefill')")
    ap.add_argument("--series", default=",".join(SERIES))
    ap.add_argument("--tokens", type=int, default=32_768, help="tokens of text a mode at most")
    ap.add_argument("--max-steps", type=int, default=600, help="steps a mode at most")
    ap.add_argument("--warm", type=float, default=0.25, help="untimed share of a mode's steps")
    ap.add_argument("--check-steps", type=int, default=2)
    ap.add_argument("--layers", type=int, default=43)
    ap.add_argument("--layer-us", type=float, default=60.0)
    ap.add_argument("--token-us", type=float, default=0.5)
    ap.add_argument("--memory", default="121GiB", help="tune's --memory")
    ap.add_argument("--reserve", default="70GiB", help="tune's --reserve")
    ap.add_argument("--budget-scale", choices=("rows", "none"), default="rows")
    ap.add_argument(
        "--trace-batch", type=int, default=64, help="tune's trace: the modelled server's slots"
    )
    ap.add_argument(
        "--disk-profile",
        default=DISK_PROFILE if os.path.exists(DISK_PROFILE) else None,
        help="tune's --disk (a bench-io profile): the fault I/O it predicts",
    )
    ap.add_argument(
        "--queue-depth", type=int, default=32, help="the cache's and floor's reads in flight"
    )
    ap.add_argument("--mmap-advice", choices=("random", "normal"), default="random")
    ap.add_argument("--mmap-threads", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--mmap-slack", type=int, default=64 << 20)
    ap.add_argument("--page-cache-cap", choices=("auto", "none"), default="auto")
    ap.add_argument("--no-floor", action="store_true")
    ap.add_argument("--workdir", default=None, help="on the disk under test (default: a temp dir)")
    ap.add_argument("--quick", action="store_true", help="a tiny CPU run")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.rows, args.trace_batch = args.rows or 200_000, 4
        args.corpus_tokens = args.corpus_tokens or 40_000
        args.modes, args.chunk = "decode x1,decode x64,prefill 128", 128
        args.tokens, args.max_steps, args.check_steps = 2_048, 24, 2
        args.layer_us, args.token_us, args.mmap_slack = 5.0, 0.1, 4 << 20
        args.mmap_threads = min(args.mmap_threads, 2)
    return args


def main(argv: list[str] | None = None) -> None:
    """The judge (``python -m bench.engram --format v41 ARGS`` hands it ``ARGS``); a
    ``ConfigError`` is one line on stderr and exit status 2."""
    args = _parse(argv)
    try:
        run(args)
    except ConfigError as e:
        print(f"bench.engram --format v41: {e}", file=sys.stderr)
        sys.exit(2)


def run(args: argparse.Namespace) -> None:
    """The run, phase by phase: the sizes, the text, the arena, the history's end, the two
    copies, then the series (resident, host, cached with its floors, ckpt) and the report."""
    t_run = time.perf_counter()
    log = Log(args.json)
    from rowcache.embed.engram.hash import EngramHash
    from rowcache.embed.engram.vocab import CompressedVocab
    from rowcache.tools.demo import text_files, tokenize_text
    from rowcache.tools.resources import available_device_memory, available_memory
    from rowcache.tools.tokens import tokenizer_json_path

    xp: Any = np
    if args.device == "cuda":
        import cupy as cp

        xp = cp
    series = [s.strip() for s in args.series.split(",") if s.strip()]
    for s in series:
        if s not in SERIES:
            raise ConfigError(f"--series {s!r}: give some of {', '.join(SERIES)}")
    if args.device == "cpu" and "host" in series:
        series.remove("host")  # pinned host memory gathered by a GPU: a GPU series
    own = args.workdir is None
    workdir = tempfile.mkdtemp(prefix="rowcache-engram-v41-") if own else args.workdir
    os.makedirs(workdir, exist_ok=True)
    timing: dict[str, float] = {}
    store = None
    try:
        # --- the sizes ---------------------------------------------------------------------------
        st = os.statvfs(workdir)
        layers = 2
        ckpt = "ckpt" in series
        sizing = size_store(
            store_gib="auto",
            layers=layers,
            dim=DIM,
            dtype=CODEC,
            free_disk=st.f_bavail * st.f_frsize,
            device_free=available_device_memory(xp) if xp is not np else None,
            host_free=available_memory(),
            workdir=workdir,
            beside=("the checkpoint-layout copy", lambda r: layers * checkpoint_bytes(r))
            if ckpt
            else None,
            rows_per_layer=args.rows,
        )
        for line in sizing.lines:
            log(line)
        if "resident" in series and not sizing.resident:
            series.remove("resident")
        if "host" in series and not sizing.host:
            series.remove("host")
        cfg = v41_config(sizing.rows_per_layer)
        tok_path = tokenizer_json_path("deepseek")
        h = EngramHash(cfg, CompressedVocab.from_tokenizer(tok_path))
        rows = Rows(h)
        full = v41_rows()
        log(
            f"tables: V4.1's hash, heads from {cfg.vocab_per_ngram[0]:,}: layers {rows.layers} of "
            f"{', '.join(f'{n:,}' for n in rows.sizes)} rows ({rows.total / full:.4f} of V4.1's "
            f"{full:,}), {REC} B a row"
        )

        # --- the text ------------------------------------------------------------------------------
        t0 = time.perf_counter()
        names = [m for m in args.modes.split(",") if m.strip()]
        need = mode_tokens(names, args.tokens, args.max_steps, args.chunk)
        text, files = tokenize_text(
            text_files(None), tok_path, args.corpus_tokens or CORPUS_ALL, EOS, 1 << 40
        )
        history = text.size - need if args.history is None else args.history
        if history < 0 or history + need > text.size:
            raise ConfigError(
                f"the text has {text.size:,} tokens; the modes take {need:,} and the history "
                f"{max(history, 0):,}: give more --corpus-tokens or fewer --tokens/--history"
            )
        modes = plan_modes(names, text, history, args.tokens, args.max_steps, args.warm, args.chunk)
        timing["text_s"] = time.perf_counter() - t0
        log(
            f"text: {text.size:,} tokens of {files} stdlib files (DeepSeek's tokenizer): history "
            f"{history:,}, then " + ", ".join(f"{m.name} {m.steps} steps" for m in modes)
        )

        # --- the arena: tune on the whole text ---------------------------------------------------
        t0 = time.perf_counter()
        slots, arena = size_arena(args, h, rows, text, modes, xp, workdir, log)
        timing["tune_s"] = time.perf_counter() - t0

        # --- the history's end: what serving it left in an arena of these slots ------------------
        t0 = time.perf_counter()
        per = int(np.clip(slots // (2 * HEADS * layers), h.keep, 4096))
        hist = History(h, text[:history], cfg.pad_id, rows.of, per)
        end = hist.lru_end(slots, rows.total)
        timing["history_s"] = time.perf_counter() - t0
        log(
            f"history: {history:,} tokens in {len(hist):,} chunks of {per:,}; an LRU arena of "
            f"{slots:,} rows ends holding {sum(r.size for r in end):,}, last used in its last "
            f"{len(end):,} chunks ({timing['history_s']:.1f} s)"
        )

        # --- the store and the checkpoint layout --------------------------------------------------
        t0 = time.perf_counter()
        store, built = build_v41_store(os.path.join(workdir, "store"), h, xp, log)
        timing["build_s"] = time.perf_counter() - t0
        layout, wrote = None, {}
        if ckpt:
            t0 = time.perf_counter()
            layout, wrote = write_checkpoint(workdir, h, xp, log)
            timing["checkpoint_s"] = time.perf_counter() - t0

        # --- the steps and their references ---------------------------------------------------------
        model = Model(args.device, args.layer_us, args.token_us, args.layers)
        steps_of = {m.name: m.pieces(h, cfg.pad_id) for m in modes}
        refs = {
            m.name: [rows.reference(p, c) for p, c in steps_of[m.name][: args.check_steps]]
            for m in modes
        }
        checks: dict[str, int] = {}
        results: dict[str, dict[str, Any]] = {}

        # --- resident and pinned host -------------------------------------------------------------
        for name in ("resident", "host"):
            if name not in series:
                continue
            t0 = time.perf_counter()
            tables = whole_tables(h, xp, pinned=name == "host")
            log(f"{name}: tables made in {time.perf_counter() - t0:.1f} s")
            results[name], checks[name] = run_whole(
                name, tables, h, modes, steps_of, refs, model, args, log
            )
            del tables
            if xp is not np:
                xp.get_default_memory_pool().free_all_blocks()
            timing[f"{name}_s"] = time.perf_counter() - t0

        # --- the floors -------------------------------------------------------------------------------
        floor = ckpt_floor = None
        if "cached" in series and not args.no_floor:
            try:
                from bench.serve.floor import Floor

                floor = Floor(store, direct=True)
                if layout is not None:
                    ckpt_floor = Floor(None, direct=True, files=list(layout.files))
            except Exception as e:  # no gcc, or its build failed
                log(f"floor: not measured ({e})")

        # --- cached ------------------------------------------------------------------------------
        warmed: dict[str, Any] = {}
        if "cached" in series:
            t0 = time.perf_counter()
            assert layout is not None or not ckpt
            results["cached"], warmed, checks["cached"] = run_cached(
                store,
                h,
                rows,
                slots,
                end,
                modes,
                steps_of,
                refs,
                model,
                (floor, ckpt_floor),
                layout or CheckpointLayout((), (), ()),
                args,
                log,
            )
            if xp is not np:
                xp.get_default_memory_pool().free_all_blocks()
            timing["cached_s"] = time.perf_counter() - t0
        for f in (floor, ckpt_floor):
            if f is not None:
                f.close()

        # --- the checkpoint layout, mapped --------------------------------------------------------
        label, mapped_info = "ckpt", {}
        if ckpt:
            assert layout is not None
            t0 = time.perf_counter()
            results["ckpt"], label, mapped_info, checks["ckpt"] = run_ckpt(
                args, layout, end, slots, sizing.rows_per_layer, tok_path, modes, refs, log
            )
            timing["ckpt_s"] = time.perf_counter() - t0

        # --- the report ------------------------------------------------------------------------------
        rows_out = []
        show = {"ckpt": label}  # the series' names in the report
        for m in modes:
            row = report_row(
                m, {s: r[m.name] for s, r in results.items()}, label, rows.layers, args
            )
            rows_out.append(row)
            log("row: " + "  ".join(f"{k}={fmt_cell(v)}" for k, v in row.items()))
        for s, n in checks.items():
            log(
                f"check: {show.get(s, s)} == the generator's rows (NumPy reference) bit for bit, {n:,} values"
            )
        timing["total_s"] = time.perf_counter() - t_run
        log(f"time: {json.dumps({k: round(v, 1) for k, v in timing.items()})}")
        settings: dict[str, Any] = {
            "format": "v41",
            "codec": CODEC,
            "device": args.device,
            "rows_per_layer": rows.sizes,
            "rows_bound": sizing.bound,
            "v41_rows": full,
            "row_bytes": REC,
            "record_bytes": int(store.tables[0].record_bytes),
            "rows_per_page": int(store.tables[0].rows_per_page),
            **built,
            **wrote,
            "series": [s for s in SERIES if s in results],
            "ckpt_label": label,
            "text_tokens": int(text.size),
            "history_tokens": int(history),
            "history_chunk": per,
            "modes": {
                m.name: {"B": m.B, "T": m.T, "steps": m.steps, "timed": m.steps - m.start}
                for m in modes
            },
            **arena,
            "warmed": warmed,
            "ckpt_mapped": mapped_info,
            "layers": args.layers,
            "engram_layers": rows.layers,
            "layer_us": args.layer_us,
            "token_us": args.token_us,
            "queue_depth": args.queue_depth,
            "mmap_threads": args.mmap_threads,
            "checks": checks,
            "timing": timing,
        }
        if args.json:
            print(
                json.dumps(
                    {
                        "bench": "bench.engram",
                        "machine": machine(),
                        "settings": settings,
                        "results": rows_out,
                        "log": log.lines,
                    },
                    indent=2,
                    default=jsonable,
                )
            )
        else:
            print(f"# bench.engram --format v41 on {machine()}")
            keys = ("rows_per_layer", "store_bytes", "arena_slots", "history_tokens", "ckpt_label")
            print("settings: " + ", ".join(f"{k}={settings[k]}" for k in keys))
            print_table(rows_out)
    finally:
        if store is not None:
            store.close()
        if own:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
