"""Fault-rate profile of a trace: one curve per table, one for a shared arena, policies.

Owns :func:`profile_trace` and its frozen :class:`ProfileReport` (what ``rowcache
profile`` prints, plots and dumps as JSON). Per-table curves are the per-table
``NgramRowCache`` (batch = server step by default, so exact curves equal the
cache's fault counts); the shared curve models one arena for all tables (keys
``table << 40 | row``, sizes in rows of the same record size, i.e. bytes).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rowcache.errors import ConfigError
from rowcache.format import reports
from rowcache.format.layout import record_bytes
from rowcache.tools.mrc import MissRatioCurve, json_ready, miss_ratio_curve
from rowcache.tools.trace import Trace

ROW_DTYPES = ("bf16", "fp8", "fp8_block_e8m0")  # the row formats profile and tune size arenas of
BLOCK_SIZE = 32  # fp8_block_e8m0's values a scale byte covers: DeepSeek-V4.1's


@dataclass(frozen=True)
class ProfileReport:
    """Curves of one trace.

    ``sizes`` (int64[k]) are rows per table; the shared curve is sampled at
    ``sizes * num_tables`` rows, the same total memory. ``record_bytes`` is the
    stored row size used to turn rows into bytes.
    """

    trace: str
    tokens: int
    num_tables: int
    record_bytes: int
    dtype: str
    sizes: np.ndarray
    curves: dict[str, MissRatioCurve]
    shared: MissRatioCurve | None = None
    policies: dict[str, MissRatioCurve] = field(default_factory=dict)
    policy_table: int = 0
    table_rows: tuple[int, ...] = ()
    table_orders: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()
    # each dtype's stored row size (what ``tune --dtype`` switches to); empty: LongCat's rule
    row_bytes: dict[str, int] = field(default_factory=dict)

    def faults_per_token(self) -> np.ndarray:
        """Total faults per token with every table at ``sizes`` rows (float64[k])."""
        total = np.zeros(self.sizes.size)
        for c in self.curves.values():
            total = total + c.misses
        return total / max(1, self.tokens)

    def arena_bytes(self) -> np.ndarray:
        """Bytes of all arenas at each size (int64[k])."""
        return self.sizes * self.num_tables * self.record_bytes

    def shape(self) -> dict[str, int]:
        """The tables profiled: name -> rows (empty where the trace did not say)."""
        if len(self.table_rows) != len(self.curves):
            return {}
        return {name: int(r) for name, r in zip(self.curves, self.table_rows)}

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (what ``rowcache profile --json`` prints and ``tune`` reads):
        its format and version first (``rowcache.format.reports``), the tables' shape, the
        method, then the curves."""
        first = next(iter(self.curves.values()), None)
        return {
            **reports.stamp(reports.PROFILE),
            "shape": self.shape(),
            "method": None if first is None else first.method,
            "trace": self.trace,
            "tokens": self.tokens,
            "num_tables": self.num_tables,
            "table_rows": list(self.table_rows),
            "record_bytes": self.record_bytes,
            "dtype": self.dtype,
            "sizes": self.sizes.tolist(),
            "arena_bytes": self.arena_bytes().tolist(),
            "faults_per_token": json_ready(self.faults_per_token()),
            "tables": {k: c.to_dict() for k, c in self.curves.items()},
            "shared": None if self.shared is None else self.shared.to_dict(),
            "policy_table": self.policy_table,
            "policies": {k: c.to_dict() for k, c in self.policies.items()},
            "table_orders": list(self.table_orders),
            "notes": list(self.notes),
            "row_bytes": dict(self.row_bytes),
        }


SPARSE_SAMPLE = 1000  # sampled accesses below which a SHARDS curve gets a note
# Sampled accesses a table at which SHARDS' accuracy was measured (docs/sizing.md: 1 % of a
# 1M-token trace, within 0.7 % of the exact faults in total; 0.3 % on the 8.2M-token stdlib
# trace): the default method is SHARDS from there up, exact (cheap there) below.
SHARDS_MIN_SAMPLED = 10_000
DEFAULT_RATE = 0.01  # SHARDS' fixed rate where none is given
# Peak memory of an exact curve per access it holds (``miss_ratio_curve``: keys, batch ids,
# sorts and the inversion count's words); measured 105-125 B.
EXACT_BYTES_PER_ACCESS = 125


class _Ticker:
    """Redraws a progress bar every second while a long curve computes, so that its elapsed
    time and estimate keep moving between the curves' updates (a thread that only reads)."""

    def __init__(self, bar: Any) -> None:
        self._stop = threading.Event()
        self._thread = None
        if bar is not None:
            self._thread = threading.Thread(target=self._run, args=(bar,), daemon=True)
            self._thread.start()

    def _run(self, bar: Any) -> None:
        while not self._stop.wait(1.0):
            bar.refresh()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def default_method(trace: Trace, *, exact_fits: bool = True) -> str:
    """The method of a profile that names none: ``"shards"`` (at :data:`DEFAULT_RATE`)
    where its sample holds at least :data:`SHARDS_MIN_SAMPLED` accesses a table, the size at
    which its stated accuracy was measured (a trace of 1M tokens and up: the exact method
    took 3.6 min and 12.4 GB on the 8.2M-token stdlib trace, SHARDS seconds), or where the
    exact method does not fit in memory (``exact_fits``); else ``"exact"``, which is cheap
    on such a trace and where a 1 % sample would be rough."""
    if not exact_fits or trace.positions * DEFAULT_RATE >= SHARDS_MIN_SAMPLED:
        return "shards"
    return "exact"


def exact_peak_bytes(trace: Trace, *, shared: bool = True, workers: int = 1) -> int:
    """Peak memory of ``profile_trace(method="exact")`` on ``trace``: the larger of the
    per-table curves computed at once (``workers`` of them) and the shared arena's curve
    (every table's accesses: the largest)."""
    per_table = trace.positions * EXACT_BYTES_PER_ACCESS
    at_once = min(max(1, int(workers)), trace.num_tables) * per_table
    return max(at_once, per_table * trace.num_tables if shared else 0)


def trace_row_bytes(trace: Trace) -> dict[str, int]:
    """Stored bytes of one row of ``trace``'s tables per dtype: the manifest's ``row_bytes``
    where it states them (a Qwen4 trace: FP8 ``dim``, its one scale the table's), else
    ``2 * dim`` BF16 and ``dim + 4`` FP8 (a row's scale), ``dim = hidden_size / tables``;
    and, where ``dim`` splits into blocks of 32, ``fp8_block_e8m0``'s record, ``dim + dim /
    32`` (E4M3 codes and a UE8M0 byte a block: 264 for DeepSeek-V4.1's 256 values), which is
    also what an arena slot of that codec holds (the store packs 15 such records in a 4 KiB
    page, ``rowcache.format.layout``: disk, not arena bytes)."""
    dims = trace.dims
    dim = int(dims["hidden_size"]) // trace.num_tables
    out = {"bf16": 2 * dim, "fp8": dim + 4}
    given = dims.get("row_bytes")
    if given is not None:
        if not isinstance(given, dict) or not all(
            isinstance(given.get(k), int) and not isinstance(given.get(k), bool) and given[k] > 0
            for k in out
        ):
            raise ConfigError(
                f"{trace.path}: the manifest's row_bytes {given!r} is not "
                '{"bf16": bytes, "fp8": bytes} with positive integers'
            )
        out = {k: int(given[k]) for k in out}
    if dim % BLOCK_SIZE == 0:
        out["fp8_block_e8m0"] = record_bytes(dim, "fp8_block_e8m0", {"block_size": BLOCK_SIZE})
    return out


def _label(name: str) -> str:
    return "the shared arena" if name == "shared" else f"table {name}"


def default_sizes(trace: Trace, points: int = 16) -> np.ndarray:
    """A geometric grid of rows per table, from 256 to the largest useful size."""
    hi = max(257, min(max(trace.table_rows), trace.positions))
    return np.unique(np.geomspace(256, hi, points).astype(np.int64))


def _shared_chunks(trace: Trace, batch: bool) -> Iterator[Any]:
    t = trace.num_tables
    tcol = (np.arange(t, dtype=np.int64) << 40)[:, None]
    for rows, steps in trace.iter_chunks():
        keys = (tcol | rows.astype(np.int64)).T.ravel()  # position-major, table-minor
        yield (keys, np.repeat(steps, t)) if batch else keys


def _table_chunks(trace: Trace, table: int, batch: bool) -> Iterator[Any]:
    for rows, steps in trace.iter_chunks(table):
        yield (rows, steps) if batch else rows


def _table_curve(
    path: str, table: int, batch: bool, sizes: np.ndarray, kw: dict[str, Any]
) -> MissRatioCurve:
    """One table's curve in a worker process (opens the trace by path)."""
    return miss_ratio_curve(_table_chunks(Trace.open(path), table, batch), sizes, **kw)


def profile_trace(
    trace: Trace,
    sizes: Sequence[int] | np.ndarray | None = None,
    *,
    method: str = "exact",
    sample_rate: float | None = None,
    sample_size: int | None = None,
    salts: int = 1,
    batch: bool = True,
    shared: bool = True,
    policies: Sequence[str] = (),
    policy_table: int = 0,
    policy_rate: float = 0.01,
    dtype: str = "bf16",
    progress: bool | None = None,
    workers: int = 1,
    dask_client: Any = None,
    heavy: int = 0,
) -> ProfileReport:
    """Curves of every table of ``trace`` (and of one shared arena) at ``sizes`` rows.

    Parameters
    ----------
    trace : Trace
    sizes : int[k], optional
        Rows per table (default :func:`default_sizes`).
    method, sample_rate, sample_size, salts
        As :func:`rowcache.tools.miss_ratio_curve`.
    batch : bool
        Use the cache's batch semantics (one batch = one server step).
    shared : bool
        Also the curve of one arena shared by all tables.
    policies : sequence of "sieve", "opt", "lru"
        Per-access simulations on a SHARDS sample (``policy_rate``) of table
        ``policy_table``; shown beside that table's per-access LRU on the same sample.
    dtype : "bf16", "fp8" or "fp8_block_e8m0"
        Row size: ``2 * dim`` or ``dim + 4`` bytes (LongCat's and Engram's FP8 rows carry
        a scale), or the manifest's ``row_bytes`` where it states them (Qwen4: ``dim``);
        ``dim + dim / 32`` for ``fp8_block_e8m0`` (:func:`trace_row_bytes`).
    workers, dask_client
        Fixed-rate SHARDS samples every table in one pass over the chunk files,
        in ``workers`` processes or on a Dask cluster (``parallel.sample_trace``);
        exact curves run one table per process. Results equal the serial ones.
    heavy : int
        Fixed-rate SHARDS: keep every access of each table's ``heavy`` most frequent
        rows exactly (lower error at small sizes; see ``miss_ratio_curve``).
    progress : bool or None
        A bar on stderr (None, the default: only when stderr is a terminal) counted in
        accesses (the shared arena's curve holds as many as all the tables), naming the
        curve under way, redrawn every second. The exact method's memory is
        :func:`exact_peak_bytes`.
    """
    if dtype not in ROW_DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not supported; allowed: {', '.join(ROW_DTYPES)}")
    row_bytes = trace_row_bytes(trace)
    if dtype not in row_bytes:
        dim = int(trace.dims["hidden_size"]) // trace.num_tables
        raise ConfigError(
            f"dtype={dtype!r}: these tables' rows of {dim} values do not split into blocks of "
            f"{BLOCK_SIZE}; allowed: {', '.join(row_bytes)}"
        )
    record = row_bytes[dtype]
    if policies and not 0 <= policy_table < trace.num_tables:
        raise ConfigError(f"policy_table={policy_table} is outside [0, {trace.num_tables})")
    sizes_arr = default_sizes(trace) if sizes is None else np.asarray(sizes, dtype=np.int64)
    kw: dict[str, Any] = {"method": method, "salts": salts}
    if method == "shards":
        kw.update(sample_rate=sample_rate, sample_size=sample_size)
    # Progress in accesses (a curve's cost grows with them; the shared arena's curve has as
    # many as all the tables together), the bar naming the curve under way.
    n = trace.positions
    t_count = trace.num_tables
    bar = None
    if progress is not False:
        from tqdm import tqdm

        total = n * t_count * (2 if shared else 1) + n * len(policies)
        bar = tqdm(
            total=total,
            desc="profile",
            unit="access",
            unit_scale=True,
            disable=None if progress is None else False,  # None: on a terminal only
        )
        if bar.disable:
            bar = None  # no ticker thread for a bar nobody sees

    def started(what: str) -> None:
        if bar is not None:
            bar.set_description(f"profile: {what}")

    def done(accesses: int) -> None:
        if bar is not None:
            bar.update(accesses)

    curves: dict[str, MissRatioCurve] = {}
    shared_curve = None
    notes: list[str] = []
    pol: dict[str, MissRatioCurve] = {}
    ticker = _Ticker(bar)
    try:
        if method == "shards" and sample_size is None:
            from dataclasses import replace

            from rowcache.tools.mrc import curve_from_samples
            from rowcache.tools.parallel import SHARED, sample_trace

            started("sampling every table" + (" and the shared arena" if shared else ""))
            samples = sample_trace(
                trace,
                DEFAULT_RATE if sample_rate is None else sample_rate,
                salts=salts,
                shared=shared,
                workers=workers,
                dask_client=dask_client,
                heavy=heavy,
            )
            if not batch:
                samples = {k: replace(v, batch_ids=None) for k, v in samples.items()}
            for (name, salt), smp in samples.items():
                if salt == 0 and 0 < smp.keys.size < SPARSE_SAMPLE:
                    notes.append(
                        f"{_label(name)}: the SHARDS sample holds only {smp.keys.size} accesses "
                        f"of {smp.total:,}; its curve is rough (raise the rate, --rate)"
                    )
            names = [str(t) for t in range(t_count)] + ([SHARED] if shared else [])
            for name in names:
                got = [samples[(name, salt)] for salt in range(salts)]
                sz = sizes_arr * t_count if name == SHARED else sizes_arr
                started(_label(name))
                curve = curve_from_samples(got, sz)
                if name == SHARED:
                    shared_curve = curve
                else:
                    curves[name] = curve
                done(n * t_count if name == SHARED else n)
        else:
            if workers > 1 and t_count > 1:
                from rowcache.tools.workers import process_map

                started(f"tables 0..{t_count - 1} in {min(int(workers), t_count)} processes")
                jobs = [(str(trace.path), t, batch, sizes_arr, kw) for t in range(t_count)]
                got_curves = process_map(
                    _table_curve, jobs, workers=int(workers), on_result=lambda i, c: done(n)
                )
                curves = {str(t): c for t, c in enumerate(got_curves)}
            else:
                for t in range(t_count):
                    started(_label(str(t)))
                    curves[str(t)] = miss_ratio_curve(
                        _table_chunks(trace, t, batch), sizes_arr, **kw
                    )
                    done(n)
            if shared:
                started(f"{_label('shared')} ({n * t_count:,} accesses)")
                shared_curve = miss_ratio_curve(
                    _shared_chunks(trace, batch), sizes_arr * t_count, **kw
                )
                done(n * t_count)
        if policies:
            rows, _ = trace.table_accesses(policy_table)
            names = list(dict.fromkeys(["lru", *policies]))
            for p in names:
                started(f"policy {p} on table {policy_table}")
                pol[p] = miss_ratio_curve(
                    rows, sizes_arr, method="shards", sample_rate=policy_rate, policy=p
                )
                if p in policies:
                    done(n)
    finally:
        ticker.stop()
        if bar is not None:
            bar.close()
    for name, c in [*curves.items(), ("shared", shared_curve), *pol.items()]:
        if c is not None and c.accesses and not c.unique > 0:
            # A trace has at least one distinct row: this sample kept nothing.
            what = f"policy {name}" if name in pol and name not in curves else _label(name)
            raise ConfigError(
                f"{what}: the SHARDS sample of {c.accesses:,} accesses at rate "
                f"{c.sample_rate:.3g} kept none, so its curve would be all zeros; raise the "
                "rate (--rate, --policy-rate; rate x accesses >= 1,000 gives a usable "
                "curve), or use the exact method (--method exact)"
            )
    splits = trace.dims.get("splits")
    listed = trace.dims.get("table_orders")  # an Engram trace lists each head's order
    if isinstance(listed, list) and len(listed) == trace.num_tables:
        orders = tuple(int(o) for o in listed)
    elif isinstance(splits, int) and splits > 0:
        orders = tuple(t // int(splits) + 2 for t in range(trace.num_tables))
    else:
        orders = ()
    return ProfileReport(
        trace=str(trace.path),
        tokens=trace.positions,
        num_tables=trace.num_tables,
        record_bytes=record,
        dtype=dtype,
        row_bytes=row_bytes,
        sizes=sizes_arr,
        curves=curves,
        shared=shared_curve,
        policies=pol,
        policy_table=policy_table,
        table_rows=tuple(trace.table_rows),
        table_orders=orders,
        notes=tuple(notes),
    )
