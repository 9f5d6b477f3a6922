"""Arena sizing: split a memory budget across tables to minimise faults.

Owns :func:`tune`, which takes per-table curves (a ``ProfileReport`` or its JSON),
an optional device profile (``bench-io``), a budget and an optional target, and
returns a frozen :class:`TuneReport`: rows per table, expected faults per token,
expected fault I/O time per token, the smallest arena that meets the target, and
whether the tables fit in host RAM whole as FP8. The split is greedy on marginal
gain (faults saved per byte) over each table's lower convex hull, which is optimal
for the hull; sizes stay on the profiled grid.
"""

from __future__ import annotations

import heapq
import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from rowcache.errors import ConfigError
from rowcache.format import reports
from rowcache.store.safeopen import read_regular_text
from rowcache.tools.benchio import PAGE, DeviceProfile
from rowcache.tools.profile import BLOCK_SIZE, ROW_DTYPES
from rowcache.units import MAX_BYTES, parse_bytes  # noqa: F401  (tools.tune.parse_bytes, as documented)


@dataclass(frozen=True)
class TableCurve:
    """Faults of one table at grid sizes (rows); NaN below its smallest feasible size.

    ``unique``: the distinct rows of the trace (its compulsory faults), None where the
    profile does not say.
    """

    name: str
    sizes: np.ndarray
    misses: np.ndarray
    accesses: int
    rows: int
    unique: float | None = None


@dataclass(frozen=True)
class TuneReport:
    """The chosen split and its expected cost.

    ``shape``: the tables the profile was made for (name -> rows), which a reader of the
    report checks against the tables it applies it to (``rowcache.embed.tune_report``);
    None where the profile did not say. ``to_dict`` puts the report's format and version
    (``rowcache.format.reports``) first.
    """

    dtype: str
    record_bytes: int
    budget_bytes: int
    used_bytes: int
    tokens: int
    rows: dict[str, int]
    fault_rate: dict[str, float]
    faults_per_token: float
    fault_seconds_per_token: float | None
    reads_per_s: float | None
    queue_depth: int | None
    target: dict[str, float]
    meets_target: bool | None
    min_bytes_for_target: int | None
    fp8_host_bytes: int
    fp8_host_fits: bool | None
    notes: list[str] = field(default_factory=list)
    # Where the budget came from: "arena", "memory" (memory - reserve) or "target" (the
    # smallest arena that meets it); the faults per access no arena avoids (each row's first
    # use; None where the profile does not say) and whether a target can be met at all.
    budget_from: str = "arena"
    faults_per_access: float = 0.0
    floor_fault_rate: float | None = None
    target_reachable: bool | None = None
    shape: dict[str, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON of ``tune --json`` and ``-o``: format and version first."""
        return {**reports.stamp(reports.TUNE), **asdict(self)}


def load_profile(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON dict of a ``rowcache profile -o`` (or ``--json``) file, checked: another
    report or a newer version refused; one from before reports were versioned read as
    version 1, with a warning."""
    try:
        d = json.loads(read_regular_text(path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not a profile JSON (from `rowcache profile -o`): {e}") from e
    except RecursionError:
        raise ConfigError(
            f"{path}: not a profile JSON (from `rowcache profile -o`): nested too deeply to read"
        ) from None
    curves_from_profile(d, source=str(path))
    if not reports.check_report(d, reports.PROFILE, str(path)):
        reports.warn_unversioned(str(path), reports.PROFILE, "its curves taken as they are")
    return d


def _fail(source: str, what: str) -> ConfigError:
    return ConfigError(f"{source}: not a profile from `rowcache profile -o`: {what}")


def curves_from_profile(
    profile: Any, source: str = "profile"
) -> tuple[list[TableCurve], dict[str, Any]]:
    """Per-table curves and metadata from a ``ProfileReport`` or its ``to_dict()``, checked.

    ``source`` names the profile in errors (e.g. its file).
    """
    d = profile.to_dict() if hasattr(profile, "to_dict") else profile
    if not isinstance(d, dict):
        raise _fail(source, f"a JSON object is expected; got {type(d).__name__}")
    reports.check_report(d, reports.PROFILE, source)  # another report, or a newer version
    for key in ("tokens", "record_bytes", "dtype", "tables"):
        if key not in d:
            raise _fail(source, f"missing {key!r}")
    tokens, rec, dtype = d["tokens"], d["record_bytes"], d["dtype"]
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise _fail(source, f"'tokens' must be an integer >= 1; got {tokens!r}")
    if dtype not in ROW_DTYPES:
        raise _fail(source, f"'dtype' must be one of {', '.join(ROW_DTYPES)}; got {dtype!r}")
    least = {"bf16": 2, "fp8": 5, "fp8_block_e8m0": BLOCK_SIZE + 1}[dtype]
    if (
        isinstance(rec, bool)
        or not isinstance(rec, int)
        or rec < least
        or (dtype == "bf16" and rec % 2)
        or (dtype == "fp8_block_e8m0" and rec % (BLOCK_SIZE + 1))
    ):
        raise _fail(
            source,
            f"'record_bytes' {rec!r} is not a {dtype} row size (bf16: 2 x dim, fp8: dim + 4, "
            f"fp8_block_e8m0: dim + dim / {BLOCK_SIZE})",
        )
    row_bytes = d.get("row_bytes") or {}  # absent in older profiles: LongCat's rule
    if row_bytes:
        if not isinstance(row_bytes, dict) or not all(
            isinstance(row_bytes.get(k), int)
            and not isinstance(row_bytes.get(k), bool)
            and row_bytes[k] > 0
            for k in ("bf16", "fp8")
        ):
            raise _fail(
                source,
                f"'row_bytes' {row_bytes!r} must map bf16 and fp8 to positive integers",
            )
        block = row_bytes.get("fp8_block_e8m0")  # in profiles since the codec came
        if block is not None and (
            isinstance(block, bool) or not isinstance(block, int) or block < 1
        ):
            raise _fail(
                source, f"'row_bytes' {row_bytes!r}: fp8_block_e8m0 must be a positive integer"
            )
        if row_bytes.get(dtype, rec) != rec:
            raise _fail(
                source,
                f"'record_bytes' {rec!r} is not its 'row_bytes' for {dtype} ({row_bytes[dtype]})",
            )
        row_bytes = {k: int(row_bytes[k]) for k in ROW_DTYPES if k in row_bytes}
    tables = d["tables"]
    if not isinstance(tables, dict) or not tables:
        raise _fail(source, "'tables' must map table names to curves")
    rows_list = d.get("table_rows") or []
    if not isinstance(rows_list, list):
        raise _fail(source, "'table_rows' must be a list")
    out = []
    for i, (name, c) in enumerate(tables.items()):
        where = f"table {name}"
        if not isinstance(c, dict) or not {"sizes", "misses", "accesses"} <= set(c):
            raise _fail(source, f"{where} needs 'sizes', 'misses' and 'accesses'")
        try:
            sizes = np.asarray(c["sizes"], dtype=np.int64)
            misses = np.asarray([np.nan if x is None else x for x in c["misses"]], dtype=np.float64)
        except (TypeError, ValueError, OverflowError) as e:
            raise _fail(source, f"{where}: sizes and misses must be lists of numbers") from e
        if sizes.ndim != 1 or sizes.size == 0 or misses.shape != sizes.shape:
            raise _fail(source, f"{where}: 'sizes' and 'misses' must be equal, non-empty lists")
        if np.any(sizes < 1) or np.any(np.diff(sizes) <= 0):
            raise _fail(source, f"{where}: 'sizes' must increase from >= 1")
        if np.any(misses[~np.isnan(misses)] < 0) or np.any(np.isinf(misses)):
            raise _fail(source, f"{where}: 'misses' must be finite and >= 0 (or null)")
        acc = c["accesses"]
        if isinstance(acc, bool) or not isinstance(acc, int) or acc < 1:
            raise _fail(source, f"{where}: 'accesses' must be an integer >= 1; got {acc!r}")
        rows = rows_list[i] if i < len(rows_list) else int(sizes.max())
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise _fail(source, f"'table_rows'[{i}] must be an integer >= 1; got {rows!r}")
        if np.isnan(misses).all():
            feas = c.get("min_feasible")
            raise _fail(
                source,
                f"{where}: every size is below its smallest feasible arena"
                + (f" ({feas} rows)" if isinstance(feas, int) else "")
                + "; profile larger sizes",
            )
        uniq = c.get("unique")
        unique: float | None = None
        if isinstance(uniq, (int, float)) and not isinstance(uniq, bool):
            if math.isfinite(uniq) and uniq >= 0:
                unique = float(uniq)
        out.append(TableCurve(str(name), sizes, misses, acc, rows, unique))
    # the tables' shape: the report's, else its table_rows (older profiles), else unknown
    shape = reports.read_shape(d, source) or (
        {c.name: c.rows for c in out} if len(rows_list) == len(out) else None
    )
    meta = {"tokens": tokens, "record_bytes": rec, "dtype": dtype, "row_bytes": row_bytes}
    return out, {**meta, "shape": shape}


def _hull(sizes: np.ndarray, misses: np.ndarray) -> list[tuple[int, float]]:
    """Lower convex hull of (size, misses), from the smallest feasible size on."""
    ok = ~np.isnan(misses)
    pts = sorted(zip(sizes[ok].tolist(), misses[ok].tolist()))
    hull: list[tuple[int, float]] = []
    for p in pts:
        if hull and p[1] >= hull[-1][1]:
            continue  # no gain: never worth its bytes
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            # Keep hull[-1] only if its slope from hull[-2] is steeper than p's.
            if (y2 - y1) * (p[0] - x1) >= (p[1] - y1) * (x2 - x1):
                hull.pop()
            else:
                break
        hull.append(p)
    return hull


def greedy_path(
    curves: list[TableCurve], row_bytes: int, budget: int | None = None
) -> list[tuple[int, float, tuple[int, ...]]]:
    """``(bytes, total misses, rows per table)`` after each greedy step, best gain first.

    With ``budget``, a step that does not fit is skipped (and that table stops
    growing) while smaller steps of other tables are still taken.
    """
    hulls = [_hull(c.sizes, c.misses) for c in curves]
    for c, h in zip(curves, hulls):
        if not h:
            raise ConfigError(f"table {c.name}: no feasible size in its curve")
    at = [0] * len(curves)
    rows = [h[0][0] for h in hulls]
    misses = [h[0][1] for h in hulls]
    heap: list[tuple[float, int]] = []

    def push(i: int) -> None:
        h = hulls[i]
        if at[i] + 1 < len(h):
            (x1, y1), (x2, y2) = h[at[i]], h[at[i] + 1]
            heapq.heappush(heap, (-(y1 - y2) / ((x2 - x1) * row_bytes), i))

    for i in range(len(curves)):
        push(i)
    path = [(sum(rows) * row_bytes, float(sum(misses)), tuple(rows))]
    while heap:
        _, i = heapq.heappop(heap)
        if budget is not None:
            grow = (hulls[i][at[i] + 1][0] - rows[i]) * row_bytes
            if sum(rows) * row_bytes + grow > budget:
                continue
        at[i] += 1
        rows[i], misses[i] = hulls[i][at[i]]
        path.append((sum(rows) * row_bytes, float(sum(misses)), tuple(rows)))
        push(i)
    return path


def tune(
    profile: Any,
    *,
    arena_bytes: int | str | None = None,
    memory_bytes: int | str | None = None,
    reserve_bytes: int | str | None = None,
    dtype: str | None = None,
    device: DeviceProfile | None = None,
    queue_depth: int | None = None,
    target_fault_rate: float | None = None,
    target_fault_seconds: float | None = None,
) -> TuneReport:
    """Split an arena budget across tables.

    Parameters
    ----------
    profile : ProfileReport, its JSON dict, or the path of that JSON (``profile -o``)
    arena_bytes : budget for all arenas; or ``memory_bytes - reserve_bytes`` (both
        needed: ``reserve_bytes=0`` budgets the whole memory). With neither but a
        target, the budget is the smallest arena that meets the target.
    dtype : "bf16", "fp8" or "fp8_block_e8m0" rows (default: the profile's)
    device : DeviceProfile, optional; gives fault seconds per token
    target_fault_rate : faults per access (all tables) to reach, in (0, 1]
    target_fault_seconds : fault I/O seconds per token to reach, > 0 (needs ``device``)
    """
    if isinstance(profile, (str, os.PathLike)):
        profile = load_profile(profile)
    curves, meta = curves_from_profile(profile)
    dtype = dtype or meta["dtype"]
    rec0 = meta["record_bytes"]
    dim = {
        "bf16": rec0 // 2,
        "fp8": rec0 - 4,
        "fp8_block_e8m0": rec0 * BLOCK_SIZE // (BLOCK_SIZE + 1),
    }[meta["dtype"]]
    # each dtype's row: the profile's row_bytes (a Qwen4 trace: FP8 rows of dim bytes, one
    # scale for the table), else LongCat's 2 x dim and dim + 4 (a row's scale); the
    # block-scaled codec's dim + dim / 32 where its dim splits into blocks
    sizes_of = dict(meta["row_bytes"] or {"bf16": 2 * dim, "fp8": dim + 4})
    if meta["row_bytes"]:
        dim = sizes_of["bf16"] // 2
    if "fp8_block_e8m0" not in sizes_of and dim % BLOCK_SIZE == 0:
        sizes_of["fp8_block_e8m0"] = dim + dim // BLOCK_SIZE
    if dtype not in sizes_of:
        allowed = ", ".join(sizes_of)
        raise ConfigError(f"dtype={dtype!r} is not supported for these rows; allowed: {allowed}")
    rec = sizes_of[dtype]
    for name, v, hi in (
        ("target_fault_rate", target_fault_rate, 1.0),
        ("target_fault_seconds", target_fault_seconds, math.inf),
    ):
        if v is not None and not (isinstance(v, (int, float)) and 0 < v <= hi):
            allowed = "(0, 1] faults per access" if hi == 1.0 else "> 0 seconds"
            raise ConfigError(f"{name}={v!r} must be {allowed}")
    has_target = target_fault_rate is not None or target_fault_seconds is not None
    if arena_bytes is not None:
        if memory_bytes is not None or reserve_bytes is not None:
            raise ConfigError("give arena_bytes, or memory_bytes with reserve_bytes, not both")
        budget: int | None = parse_bytes(arena_bytes, "arena_bytes")
        if budget == 0:
            raise ConfigError("arena_bytes=0: the arena budget must be > 0 bytes")
        budget_from = "arena"
    elif memory_bytes is not None:
        if reserve_bytes is None:
            raise ConfigError(
                "memory_bytes needs reserve_bytes (what weights and KV cache keep); "
                "reserve_bytes=0 budgets all of it"
            )
        mem = parse_bytes(memory_bytes, "memory_bytes")
        res = parse_bytes(reserve_bytes, "reserve_bytes")
        if mem <= res:
            raise ConfigError(
                f"memory_bytes={mem} must exceed reserve_bytes={res}: the arena budget is "
                "what the reserve leaves of the memory"
            )
        budget = mem - res
        budget_from = "memory"
    elif reserve_bytes is not None:
        raise ConfigError("reserve_bytes needs memory_bytes")
    elif has_target:
        budget = None
        budget_from = "target"
    else:
        raise ConfigError(
            "give a budget (arena_bytes, or memory_bytes with reserve_bytes) or a target"
        )
    if target_fault_seconds is not None and device is None:
        raise ConfigError("target_fault_seconds needs a device profile (rowcache bench-io)")
    tokens = meta["tokens"]
    accesses = sum(c.accesses for c in curves)
    path = greedy_path(curves, rec)
    notes: list[str] = []
    rate = None
    qd = None
    if device is not None:
        rate, qd = device.reads_per_s(rec, queue_depth)
        measured = device.read_size(rec)
        same = -(-measured // PAGE) == -(-rec // PAGE) if device.direct else measured == rec
        if not same:  # the disk profile was made for another row size: say whose rate
            notes.append(
                f"the disk profile measured reads of {', '.join(sorted(device.random, key=int))} "
                f"bytes, not these {rec}-byte rows: their fault time uses the {measured}-byte "
                f"rate (bench-io --record-bytes {rec} measures theirs)"
            )

    def seconds(m: float) -> float | None:
        return None if rate is None else (m / tokens) / rate

    def ok(m: float) -> bool:
        good = True
        if target_fault_rate is not None:
            good &= m / accesses <= target_fault_rate
        if target_fault_seconds is not None:
            s = seconds(m)
            good &= s is not None and s <= target_fault_seconds
        return good

    first = next((p for p in path if ok(p[1])), None) if has_target else None
    need = None if first is None else int(first[0])
    # Each row's first use faults at any arena size: the floor of every curve.
    uniques = [c.unique for c in curves if c.unique is not None]
    floor = sum(uniques) if len(uniques) == len(curves) else None
    best = path[-1][1]  # every table at its largest profiled size
    flat = floor is not None and best <= floor * 1.01 + 1e-9
    unreachable = ""
    if has_target and first is None:
        unreachable = _unreachable(
            floor, best, flat, accesses, target_fault_rate, seconds, target_fault_seconds
        )
    if budget is None:
        if first is None:
            raise ConfigError(unreachable)
        budget = need
        notes.append("no budget given: the arena is the smallest that meets the target")
    assert budget is not None
    if path[0][0] > budget:
        raise ConfigError(
            f"the budget of {budget:,} byte{'' if budget == 1 else 's'} is below the smallest "
            "feasible arenas "
            f"({path[0][0]:,} bytes: each table's arena must hold a server step's distinct "
            "rows); raise the budget, or trace with fewer concurrent requests or smaller "
            "prefill chunks"
        )
    used, misses, rows = greedy_path(curves, rec, budget)[-1]
    target: dict[str, float] = {}
    meets: bool | None = None
    if has_target:
        if target_fault_rate is not None:
            target["fault_rate"] = float(target_fault_rate)
        if target_fault_seconds is not None:
            target["fault_seconds_per_token"] = float(target_fault_seconds)
        meets = ok(misses)
        if unreachable:
            notes.append(unreachable)
    if rows == path[-1][2] and budget > used:
        notes.append(
            "every table is at its largest profiled size, where the curves are flat at the "
            "compulsory floor: more memory gains nothing"
            if flat
            else "every table is at its largest profiled size and the curves still fall: "
            "profile larger sizes to see what more memory gains"
        )
    total_rows = sum(c.rows for c in curves)
    fp8_bytes = total_rows * sizes_of["fp8"]
    fits = None if memory_bytes is None else fp8_bytes <= budget
    return TuneReport(
        dtype=dtype,
        record_bytes=rec,
        budget_bytes=int(budget),
        used_bytes=int(used),
        tokens=int(tokens),
        rows={c.name: int(r) for c, r in zip(curves, rows)},
        fault_rate={
            c.name: float(np.interp(r, c.sizes, np.nan_to_num(c.misses)) / c.accesses)
            for c, r in zip(curves, rows)
        },
        faults_per_token=misses / tokens,
        fault_seconds_per_token=seconds(misses),
        reads_per_s=rate,
        queue_depth=qd,
        target=target,
        meets_target=meets,
        min_bytes_for_target=need,
        fp8_host_bytes=int(fp8_bytes),
        fp8_host_fits=fits,
        notes=notes,
        budget_from=budget_from,
        faults_per_access=misses / accesses,
        floor_fault_rate=None if floor is None else floor / accesses,
        target_reachable=None if not has_target else first is not None,
        shape=meta["shape"],
    )


def _unreachable(
    floor: float | None,
    best: float,
    flat: bool,
    accesses: int,
    target_rate: float | None,
    seconds: Any,
    target_seconds: float | None,
) -> str:
    """Why no profiled size meets the target, and what would help (never "profile larger
    sizes" when no arena, however large, can meet it)."""
    low = floor if floor is not None else best
    if target_rate is not None and floor is not None and floor / accesses > target_rate:
        return (
            "no profiled size reaches the target: it is below this trace's compulsory floor "
            f"of {floor / accesses:.4g} faults per access (each row's first use faults at "
            "any arena size), so no arena reaches it"
        )
    s_floor = seconds(low)
    if target_seconds is not None and floor is not None and s_floor > target_seconds:
        return (
            "no profiled size reaches the target: it is below this trace's compulsory floor "
            f"of {s_floor * 1e6:.4g} µs of fault I/O per token (each row's first use "
            "faults at any arena size), so no arena reaches it on this disk"
        )
    if flat:
        return (
            "no profiled size reaches the target: the curves are flat at the largest "
            f"profiled sizes ({best / accesses:.4g} faults per access)"
        )
    return (
        "no profiled size reaches the target: the largest profiled sizes give "
        f"{best / accesses:.4g} faults per access and the curves still fall; profile "
        "larger sizes"
    )
