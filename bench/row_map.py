"""The host row map's cost: dense against hash, memory and time, on the same calls.

A row cache maps each of its rows to a slot on the host (``rowcache.cache.row_map``): a
dense int32 a table row, or a native hash of 16-32 bytes an arena slot. This script
measures, for a table of ``--rows`` rows and an arena of ``--slots`` slots, each kind's
bookkeeping bytes (its map, and the per-slot arrays beside it) and the time of the LRU's
C on the same calls: the all-hits path (``Lru.hits``) and a resolve with misses (its plan
and commit, ``Lru.plan`` / ``Lru.commit``: the host's work around a fault's read; no read).
Calls: ``--ids`` ids a step (a decode step of 64 sequences reads 64 x 48 Engram rows at the
V4.1 shape), drawn from a hot set of ``--slots // 2`` rows (hits) or the whole table (misses).
Both kinds run in one process on the same ids; the ratio hash / dense is the result.

    python -m bench.row_map                     # 384M rows (the reported V4.1's table), 4M slots
    python -m bench.row_map --rows 20000000 --slots 1000000 --json
    python -m bench.row_map --quick             # seconds (what the test runs)
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from bench._common import report


def _rss() -> int:
    """Resident bytes of this process now (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _build(kind: str, rows: int, slots: int, native: Any) -> tuple[Any, int]:
    from rowcache.cache.lru import Lru
    from rowcache.cache.row_map import DenseRowMap, HashRowMap
    from rowcache.cache.slots import SlotTable
    from rowcache.cache.stats import Counters

    before = _rss()
    m = (
        DenseRowMap(rows) if kind == "dense" else HashRowMap(rows, slots, native)
    )  # filled: resident
    t = SlotTable(rows, slots, m)
    lru = Lru(t, Counters(1), native, np.array([0, rows], np.int64), defer_min=1 << 62)
    return lru, _rss() - before


def _time(lru: Any, calls: list[np.ndarray], miss: bool) -> float:
    """Seconds a call: all hits (``hits``), or a plan and commit of a call with misses."""
    from rowcache.cache.lru import HIT

    t0 = time.perf_counter()
    for ids in calls:
        if miss:
            plan = lru.plan(ids)
            lru.commit(plan, np.empty(ids.size, np.int32))
        else:
            found, _ = lru.hits(ids)
            assert found == HIT
        lru.end_step()
    return (time.perf_counter() - t0) / len(calls)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", type=int, default=384 << 20, help="table rows (< 2**31)")
    ap.add_argument("--slots", type=int, default=4 << 20, help="arena slots")
    ap.add_argument("--ids", type=int, default=64 * 48, help="ids a call")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5, help="rounds of both kinds in turn")
    ap.add_argument(
        "--record-bytes", type=int, default=264, help="a stored row's bytes (the share)"
    )
    ap.add_argument("--quick", action="store_true", help="a small run (seconds)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.rows, args.slots, args.ids, args.calls, args.rounds = 2_000_000, 50_000, 1024, 30, 2
    from rowcache.kernels.host import native

    if native is None:
        raise SystemExit("bench.row_map: the native module (rowcache.kernels._host) is not built")
    rng = np.random.default_rng(0)
    hot = rng.choice(args.rows, size=args.slots // 2, replace=False).astype(np.int64)
    hit_calls = [rng.choice(hot, args.ids) for _ in range(args.calls)]
    miss_calls = [
        rng.integers(0, args.rows, args.ids, dtype=np.int64)
        for _ in range(args.calls * args.rounds)
    ]
    table_bytes = args.rows * args.record_bytes
    lrus: dict[str, Any] = {}
    out: list[dict[str, Any]] = []
    for kind in ("dense", "hash"):
        lru, grew = _build(kind, args.rows, args.slots, native)
        for s in range(0, hot.size, 1 << 16):  # the hot set resident
            part = hot[s : s + (1 << 16)]
            lru.commit(lru.plan(part), np.empty(part.size, np.int32))
            lru.end_step()
        lrus[kind] = lru
        per_slot = sum(a.nbytes for a in (lru.slots.slot_row, lru.slots.state, lru.last_used,
                                          lru.log, lru.log_pos))  # fmt: skip
        out.append({
            "map": kind,
            "map_bytes": lru.slots.row_map.nbytes,
            "rss_grew": grew,
            "per_slot_bytes": per_slot,
            "map_share_of_table": lru.slots.row_map.nbytes / table_bytes,
            "hits_ns_id": float("inf"),
            "miss_plan_commit_ns_id": float("inf"),
        })  # fmt: skip
    for r in range(args.rounds):  # the kinds in turn, the best round of each (a shared machine)
        for row, kind in zip(out, lrus):
            hit = 1e9 * _time(lrus[kind], hit_calls, False) / args.ids
            miss = 1e9 * _time(lrus[kind], miss_calls[r :: args.rounds], True) / args.ids
            row["hits_ns_id"] = min(row["hits_ns_id"], hit)
            row["miss_plan_commit_ns_id"] = min(row["miss_plan_commit_ns_id"], miss)
    for lru in lrus.values():
        assert lru.slots.check() == [], lru.slots.check()
    d, h = out
    out.append({
        "map": "hash / dense",
        "map_bytes": h["map_bytes"] / d["map_bytes"],
        "rss_grew": None,
        "per_slot_bytes": None,
        "map_share_of_table": None,
        "hits_ns_id": h["hits_ns_id"] / d["hits_ns_id"],
        "miss_plan_commit_ns_id": h["miss_plan_commit_ns_id"] / d["miss_plan_commit_ns_id"],
    })  # fmt: skip
    settings = {
        k: getattr(args, k) for k in ("rows", "slots", "ids", "calls", "rounds", "record_bytes")
    }
    report("row map: dense vs hash (the host bookkeeping of a cache)", out, args.json, settings)


if __name__ == "__main__":
    main()
