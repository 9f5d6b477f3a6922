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
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..errors import ConfigError
from .benchio import DeviceProfile

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def parse_bytes(text: str | int, name: str = "size") -> int:
    """``"121GiB"``, ``"20 GB"``, ``"1.5TiB"`` or a plain number of bytes -> int."""
    if isinstance(text, (int, np.integer)) and not isinstance(text, bool):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(
            f"{name}={text!r} is not a size; use bytes or a number with B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class TableCurve:
    """Faults of one table at grid sizes (rows); ``min_rows`` is the smallest feasible."""

    name: str
    sizes: np.ndarray
    misses: np.ndarray
    accesses: int
    rows: int


@dataclass(frozen=True)
class TuneReport:
    """The chosen split and its expected cost."""

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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def curves_from_profile(profile: Any) -> tuple[list[TableCurve], dict[str, Any]]:
    """Per-table curves and metadata from a ``ProfileReport`` or its ``to_dict()``."""
    d = profile.to_dict() if hasattr(profile, "to_dict") else profile
    try:
        tables = d["tables"]
        rows_list = d.get("table_rows") or []
        out = []
        for i, (name, c) in enumerate(tables.items()):
            sizes = np.asarray(c["sizes"], dtype=np.int64)
            misses = np.asarray([np.nan if x is None else x for x in c["misses"]], dtype=np.float64)
            rows = int(rows_list[i]) if i < len(rows_list) else int(sizes.max())
            out.append(TableCurve(str(name), sizes, misses, int(c["accesses"]), rows))
        meta = {
            "tokens": int(d["tokens"]),
            "record_bytes": int(d["record_bytes"]),
            "dtype": str(d["dtype"]),
        }
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"not a profile from `rowcache profile --json`: missing {e}") from e
    return out, meta


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
    profile : ProfileReport or its JSON dict
    arena_bytes : budget for all arenas; or ``memory_bytes - reserve_bytes``
    dtype : "bf16" or "fp8" rows (default: the profile's)
    device : DeviceProfile, optional; gives fault seconds per token
    target_fault_rate : faults per access (all tables) to reach
    target_fault_seconds : fault I/O seconds per token to reach (needs ``device``)
    """
    curves, meta = curves_from_profile(profile)
    dtype = dtype or meta["dtype"]
    rec0 = meta["record_bytes"]
    dim = rec0 // 2 if meta["dtype"] == "bf16" else rec0 - 4
    if dtype == "bf16":
        rec = 2 * dim
    elif dtype == "fp8":
        rec = dim + 4
    else:
        raise ConfigError(f"dtype={dtype!r} is not supported; allowed: bf16, fp8")
    if arena_bytes is not None:
        if memory_bytes is not None or reserve_bytes is not None:
            raise ConfigError("give arena_bytes, or memory_bytes with reserve_bytes, not both")
        budget = parse_bytes(arena_bytes, "arena")
    elif memory_bytes is not None:
        budget = parse_bytes(memory_bytes, "memory") - parse_bytes(reserve_bytes or 0, "reserve")
    else:
        raise ConfigError("give a budget: arena_bytes, or memory_bytes (and reserve_bytes)")
    if budget <= 0:
        raise ConfigError(f"the arena budget is {budget} bytes; memory must exceed reserve")
    if target_fault_seconds is not None and device is None:
        raise ConfigError("target_fault_seconds needs a device profile (rowcache bench-io)")
    tokens = max(1, meta["tokens"])
    accesses = sum(c.accesses for c in curves)
    path = greedy_path(curves, rec)
    notes: list[str] = []
    if path[0][0] > budget:
        raise ConfigError(
            f"the budget {budget} B is below the smallest feasible arenas ({path[0][0]} B: every "
            "table's largest batch must fit); raise it or profile smaller batches"
        )
    best = greedy_path(curves, rec, budget)[-1]
    used, misses, rows = best
    rate = rec_rate = None
    qd = None
    if device is not None:
        rate, qd = device.reads_per_s(rec, queue_depth)
        rec_rate = rate

    def seconds(m: float) -> float | None:
        return None if rec_rate is None else (m / tokens) / rec_rate

    target: dict[str, float] = {}
    meets: bool | None = None
    need: int | None = None
    if target_fault_rate is not None or target_fault_seconds is not None:

        def ok(m: float) -> bool:
            good = True
            if target_fault_rate is not None:
                good &= m / max(1, accesses) <= target_fault_rate
            if target_fault_seconds is not None:
                s = seconds(m)
                good &= s is not None and s <= target_fault_seconds
            return good

        if target_fault_rate is not None:
            target["fault_rate"] = float(target_fault_rate)
        if target_fault_seconds is not None:
            target["fault_seconds_per_token"] = float(target_fault_seconds)
        meets = ok(misses)
        first = next((p for p in path if ok(p[1])), None)
        need = None if first is None else int(first[0])
        if first is None:
            notes.append("no profiled size reaches the target; profile larger sizes")
    if rows == path[-1][2]:
        notes.append("the largest profiled sizes fit: more memory gives no measured gain")
    total_rows = sum(c.rows for c in curves)
    fp8_bytes = total_rows * (dim + 4)
    fits = None if memory_bytes is None else fp8_bytes <= budget
    return TuneReport(
        dtype=dtype,
        record_bytes=rec,
        budget_bytes=int(budget),
        used_bytes=int(used),
        tokens=int(meta["tokens"]),
        rows={c.name: int(r) for c, r in zip(curves, rows)},
        fault_rate={
            c.name: float(np.interp(r, c.sizes, np.nan_to_num(c.misses)) / max(1, c.accesses))
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
    )
