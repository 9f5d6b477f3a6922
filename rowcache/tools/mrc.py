"""Miss-ratio curves: exact LRU (per access or with the cache's batch semantics),
SHARDS-sampled LRU with error bars, and SIEVE / OPT by simulation.

Owns :func:`miss_ratio_curve` and its frozen report :class:`MissRatioCurve`. What is
exact: ``method="exact"`` with ``policy="lru"`` (stack distances, per access or per
batch with the cache's tie order, all sizes in one pass); SIEVE and OPT
are exact simulations of the trace they are given. ``method="shards"`` is an
estimate (fixed rate with the adjusted correction, or fixed size), with a standard
deviation over hash salts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from rowcache.errors import ConfigError
from rowcache.tools import shards as _shards
from rowcache.tools.policies import POLICIES, simulate
from rowcache.tools.stack import (
    INF,
    batch_ids_from,
    batch_stack_distances,
    lru_stack_distances,
    weighted_distances,
)

METHODS = ("exact", "shards")


@dataclass(frozen=True)
class MissRatioCurve:
    """A fault-rate curve.

    Attributes
    ----------
    sizes : int64[k]
        Arena sizes in rows (keys).
    miss_ratio : float64[k]
        Faults per access at each size; NaN where the size is below
        ``min_feasible`` (a batch would not fit).
    misses : float64[k]
        Faults at each size (estimated for SHARDS, scaled to the whole trace).
    miss_ratio_std : float64[k]
        Standard deviation over SHARDS salts (zeros when exact).
    accesses : int
        Accesses in the trace.
    unique : float
        Distinct keys (estimated for SHARDS).
    compulsory : float
        Compulsory-miss floor: ``unique / accesses``.
    min_feasible : int
        Smallest arena that runs the trace: the largest batch's unique rows (1 per access).
    method, policy : str
    sample_rate : float
        Effective SHARDS rate (1.0 when exact).
    batched : bool
    exact : bool
        True when every value is exact for the given trace.
    """

    sizes: np.ndarray
    miss_ratio: np.ndarray
    misses: np.ndarray
    miss_ratio_std: np.ndarray
    accesses: int
    unique: float
    compulsory: float
    min_feasible: int
    method: str
    policy: str
    sample_rate: float = 1.0
    batched: bool = False
    exact: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        k = self.sizes.shape
        for name in ("miss_ratio", "misses", "miss_ratio_std"):
            if getattr(self, name).shape != k:
                raise ConfigError(f"MissRatioCurve.{name} must have shape {k}")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: NaN becomes None, floats keep 12 significant digits."""
        return {k: json_ready(v) for k, v in asdict(self).items()}


def json_ready(x: Any) -> Any:
    """``x`` for JSON: arrays as lists, NaN as None, floats rounded to 12 significant digits.

    Estimates such as ``unique / rate`` would otherwise print as 196299.99999999985.
    """
    if isinstance(x, np.ndarray):
        x = x.tolist()
    if isinstance(x, (list, tuple)):
        return [json_ready(v) for v in x]
    if isinstance(x, dict):
        return {k: json_ready(v) for k, v in x.items()}
    if isinstance(x, (float, np.floating)):
        x = float(x)
        return None if np.isnan(x) else float(f"{x:.12g}")
    if isinstance(x, np.integer):
        return int(x)
    return x


def _check_sizes(sizes: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(sizes)
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise ConfigError(f"sizes must be a non-empty 1-D list of ints; got {sizes!r}")
    if np.any(arr < 1):
        raise ConfigError(f"sizes must be >= 1; got min {int(arr.min())}")
    return arr.astype(np.int64)


def _lru_misses_from_distances(dist: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Misses at each size: accesses with distance > size.

    A histogram over the (few) sorted sizes instead of sorting the (many) distances.
    """
    sizes = np.asarray(sizes)
    uniq, back = np.unique(sizes, return_inverse=True)
    # idx = how many sizes lie below each distance; distance d misses at size s iff d > s
    idx = np.searchsorted(uniq, dist, side="left")
    counts = np.bincount(idx, minlength=uniq.size + 1)
    misses_at_uniq = np.cumsum(counts[::-1])[::-1][1:]
    return misses_at_uniq[back].astype(np.float64)


def batch_lru_misses(
    keys: np.ndarray, batch_ids: np.ndarray, sizes: np.ndarray
) -> tuple[np.ndarray, int, int]:
    """Exact faults of the batch cache at each size (``stack.batch_stack_distances``).

    Returns ``(misses float64[k] (NaN below min_feasible), min_feasible, unique_keys)``.
    """
    dist, bsizes = batch_stack_distances(keys, batch_ids)
    min_feasible = int(bsizes.max()) if bsizes.size else 0
    misses = _lru_misses_from_distances(dist, sizes)
    misses[sizes < min_feasible] = np.nan
    unique = int(np.count_nonzero(dist == INF))
    return misses, min_feasible, unique


def _materialize(accesses: _shards.Chunks) -> tuple[np.ndarray, np.ndarray | None]:
    """All keys and, for ``(keys, batch_ids)`` chunk pairs, all batch ids."""
    ks: list[np.ndarray] = []
    bs: list[np.ndarray] = []
    for k, b in _shards.iter_chunks(accesses):
        ks.append(k)
        if b is not None:
            bs.append(b)
    if bs and len(bs) != len(ks):
        raise ConfigError("chunks must all be arrays or all (keys, batch_ids) pairs")
    keys = np.concatenate(ks) if ks else np.zeros(0, np.int64)
    return keys, (np.concatenate(bs) if bs else None)


def _curve_on(
    keys: np.ndarray,
    batch_ids: np.ndarray | None,
    sizes: np.ndarray,
    policy: str,
) -> tuple[np.ndarray, int, int, bool]:
    """Misses at ``sizes`` on one (possibly sampled) trace: (misses, min_feasible, unique, exact)."""
    if batch_ids is not None:
        misses, feas, unique = batch_lru_misses(keys, batch_ids, sizes)
        return misses, feas, unique, True
    if policy == "lru":
        dist = lru_stack_distances(keys)
        unique = int(np.count_nonzero(dist == INF))
        return _lru_misses_from_distances(dist, sizes), 1, unique, True
    unique = int(np.unique(keys).size)
    misses = np.array([float(simulate(policy, keys, int(c))) for c in sizes.tolist()])
    return misses, 1, unique, True


def miss_ratio_curve(
    accesses: _shards.Chunks,
    sizes: Sequence[int] | np.ndarray,
    *,
    method: str = "exact",
    policy: str = "lru",
    sample_rate: float | None = None,
    sample_size: int | None = None,
    batch: int | np.ndarray | None = None,
    salts: int = 1,
    heavy: int = 0,
) -> MissRatioCurve:
    """Fault rate per access at each arena size.

    Parameters
    ----------
    accesses : int[n], iterable of int[n_i], or iterable of (keys, batch_ids) pairs
        Keys (row ids; for one arena shared by tables, combined keys from
        ``combine_keys``); pairs carry the batch index of each access (batch mode).
        Chunks are sampled one at a time with ``method="shards"``.
    sizes : int[k]
        Arena sizes in rows.
    method : "exact" or "shards"
        ``exact`` holds the whole trace: about 125 bytes of peak memory per access
        (``shards`` holds only the sample).
    policy : "lru", "sieve" or "opt"
        ``sieve`` and ``opt`` are simulated per size (use ``shards`` on big traces).
    sample_rate : float, optional
        SHARDS fixed rate (default 0.01 when neither this nor ``sample_size`` is given).
    sample_size : int, optional
        SHARDS fixed size: at most this many distinct keys are kept.
    batch : int or int64[n], optional
        Batch semantics of the row cache: an int ``B`` (consecutive groups of ``B``
        accesses) or a non-decreasing batch index per access. LRU only.
    salts : int
        SHARDS repetitions with different hash salts; the curve is their mean and
        ``miss_ratio_std`` their standard deviation.
    heavy : int
        Fixed-rate SHARDS only: also keep every access of the ``heavy`` most
        frequent keys (exact, weight 1; sampled keys weigh ``1 / rate`` in the
        distances and the counts). Removes most of the error that a sampled or
        missed hot key causes at small sizes; costs one counting pass (keys >= 0).

    Returns
    -------
    MissRatioCurve
    """
    sizes_arr = _check_sizes(sizes)
    if method not in METHODS:
        raise ConfigError(f"method={method!r} is not supported; allowed: {', '.join(METHODS)}")
    if policy not in POLICIES:
        raise ConfigError(f"policy={policy!r} is not supported; allowed: {', '.join(POLICIES)}")
    if batch is not None and policy != "lru":
        raise ConfigError(f"batch mode is implemented for policy='lru' only; got policy={policy!r}")
    if int(salts) < 1:
        raise ConfigError(f"salts must be >= 1; got {salts}")
    if method == "exact":
        if sample_rate is not None or sample_size is not None:
            raise ConfigError("sample_rate/sample_size apply to method='shards' only")
        keys, pair_ids = _materialize(accesses)
        n = keys.size
        bids = _batch_ids(batch, pair_ids, n)
        misses, feas, unique, _ = _curve_on(keys, bids, sizes_arr, policy)
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = misses / n if n else np.zeros(sizes_arr.size)
        return MissRatioCurve(
            sizes=sizes_arr,
            miss_ratio=ratio,
            misses=misses,
            miss_ratio_std=np.zeros(sizes_arr.size),
            accesses=int(n),
            unique=float(unique),
            compulsory=unique / n if n else 0.0,
            min_feasible=feas,
            method=method,
            policy=policy,
            batched=bids is not None,
        )
    if sample_rate is not None and sample_size is not None:
        raise ConfigError("give sample_rate or sample_size, not both")
    if sample_rate is None and sample_size is None:
        sample_rate = 0.01
    if batch is not None and not isinstance(batch, (int, np.integer)):
        if not isinstance(accesses, np.ndarray):
            raise ConfigError(
                "batch as an array needs accesses as one array; for chunks pass "
                "(keys, batch_ids) pairs"
            )
        batch = batch_ids_from(batch, accesses.size)
        accesses = [(accesses, batch)]
        batch = None
    if salts > 1 and not isinstance(accesses, (np.ndarray, list, tuple)):
        keys, pair_ids = _materialize(accesses)  # several passes over one-shot chunks
        accesses = [keys] if pair_ids is None else [(keys, pair_ids)]
    hv = None
    if heavy:
        if sample_size is not None:
            raise ConfigError("heavy applies to fixed-rate SHARDS (sample_rate), not sample_size")
        if not isinstance(accesses, (np.ndarray, list, tuple)):
            keys, pair_ids = _materialize(accesses)
            accesses = [keys] if pair_ids is None else [(keys, pair_ids)]
        hv = _shards.top_keys(accesses, int(heavy))
    samples = []
    for salt in range(int(salts)):
        if sample_size is not None:
            samples.append(_shards.sample_fixed_size(accesses, int(sample_size), salt=salt))
        elif hv is not None:
            samples.append(
                _shards.sample_fixed_rate(accesses, float(sample_rate), salt=salt, heavy=hv)  # type: ignore[arg-type]
            )
        else:
            samples.append(_shards.sample_fixed_rate(accesses, float(sample_rate), salt=salt))  # type: ignore[arg-type]
    return curve_from_samples(
        samples, sizes_arr, policy=policy, batch=batch, sample_size=sample_size
    )


def curve_from_samples(
    samples: Sequence[_shards.Sample],
    sizes: Sequence[int] | np.ndarray,
    *,
    policy: str = "lru",
    batch: int | None = None,
    sample_size: int | None = None,
) -> MissRatioCurve:
    """The SHARDS curve of one or more samples of the same trace (one per salt).

    Each sample gives misses at the scaled sizes ``round(C * rate)``, normalised by
    the expected sample length ``total * rate`` (the adjusted correction); the
    curve is their mean and ``miss_ratio_std`` their standard deviation. Batch mode
    comes from the samples' ``batch_ids`` or from ``batch`` (an int group size).
    """
    sizes_arr = _check_sizes(sizes)
    if not samples:
        raise ConfigError("curve_from_samples needs at least one sample")
    runs: list[np.ndarray] = []
    uniq: list[float] = []
    feas_list: list[int] = []
    rates: list[float] = []
    n = 0
    batched = batch is not None
    for smp in samples:
        n = smp.total
        rate = smp.rate
        if smp.forced is not None:
            m_w, feas_w, unique_w, b_w = _weighted_curve(smp, sizes_arr, batch, policy)
            batched = batched or b_w
            runs.append(m_w / n if n else np.zeros(sizes_arr.size))
            uniq.append(unique_w)
            feas_list.append(feas_w)
            rates.append(rate)
            continue
        scaled = scaled_sizes(sizes_arr, rate)
        if smp.batch_ids is not None:
            bids = smp.batch_ids
            batched = True
        elif batch is not None:
            bids = smp.positions // int(batch)
        else:
            bids = None
        m, feas, unique, _ = _curve_on(smp.keys, bids, scaled, policy)
        expected = n * rate  # the adjusted correction: normalise by the expected count
        runs.append(m / expected if expected > 0 else np.zeros(sizes_arr.size))
        uniq.append(unique / rate if rate > 0 else 0.0)
        # The smallest full size whose scaled size holds the sample's largest batch:
        # scaled_sizes(C) >= feas  <=>  C >= (feas - 1) / rate + 1.
        # (An empty sample needs no arena: 0, never the formula's negative.)
        feas_list.append(int(np.ceil((feas - 1) / rate - 1e-9)) + 1 if rate > 0 and feas else 0)
        rates.append(rate)
    stack_ = np.vstack(runs)
    with np.errstate(invalid="ignore"):
        ratio = np.clip(np.mean(stack_, axis=0), 0.0, 1.0)
        std = np.std(stack_, axis=0) if stack_.shape[0] > 1 else np.zeros(sizes_arr.size)
    unique_est = float(np.mean(uniq))
    return MissRatioCurve(
        sizes=sizes_arr,
        miss_ratio=ratio,
        misses=ratio * n,
        miss_ratio_std=std,
        accesses=int(n),
        unique=unique_est,
        compulsory=unique_est / n if n else 0.0,
        min_feasible=max(feas_list),
        method="shards",
        policy=policy,
        sample_rate=float(np.mean(rates)),
        batched=batched,
        exact=False,
        extra={"salts": len(samples), "sample_size": sample_size},
    )


def scaled_sizes(sizes: np.ndarray, rate: float) -> np.ndarray:
    """Sample cache sizes equivalent to full sizes ``C`` at a SHARDS ``rate`` (int64[k]).

    A distance counts the reused key itself plus the distinct other keys since its
    previous use, and only the others are sampled at ``rate``. A full-trace miss is
    ``1 + others > C``; in the sample ``others ~ rate * others_full``, so a sampled
    distance ``d`` misses when ``d - 1 > (C - 1) * rate``, i.e. ``d > floor((C - 1) *
    rate) + 1``. (Scaling the key's own 1 as well, ``round(C * rate)``, makes the
    sample's cache ``1 / rate - 1`` rows too small: a bias towards misses.)
    """
    return (np.floor((sizes - 1) * rate + 1e-9) + 1).astype(np.int64)


def _weighted_curve(
    smp: _shards.Sample, sizes: np.ndarray, batch: int | None, policy: str
) -> tuple[np.ndarray, int, float, bool]:
    """Full-scale misses of a sample with exact heavy keys (weights 1 and 1/rate)."""
    if policy != "lru":
        raise ConfigError("heavy keys are supported for policy='lru' only")
    assert smp.forced is not None
    w = np.where(smp.forced, 1.0, 1.0 / smp.rate)
    if smp.batch_ids is not None:
        bids: np.ndarray | None = smp.batch_ids
    elif batch is not None:
        bids = smp.positions // int(batch)
    else:
        bids = None
    dist, uw, bw = weighted_distances(smp.keys, w, bids)
    dist = dist - (uw - 1.0)  # the reused key counts 1 itself, not its weight (scaled_sizes)
    order = np.argsort(dist, kind="stable")
    d_sorted = dist[order]
    tail = np.concatenate((np.cumsum(uw[order][::-1])[::-1], [0.0]))
    misses = tail[np.searchsorted(d_sorted, sizes.astype(np.float64), side="right")]
    feas = int(np.ceil(bw.max())) if bw.size else 1
    misses = misses.astype(np.float64)
    misses[sizes < feas] = np.nan
    unique = float(uw[np.isinf(dist)].sum())
    return misses, feas, unique, bids is not None


def _batch_ids(
    batch: int | np.ndarray | None, pair_ids: np.ndarray | None, n: int
) -> np.ndarray | None:
    if pair_ids is not None:
        if batch is not None:
            raise ConfigError(
                "give batch ids either as (keys, batch_ids) chunks or as batch=, not both"
            )
        return batch_ids_from(pair_ids, n)
    return None if batch is None else batch_ids_from(batch, n)


def combine_keys(table: int | np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Keys of one arena shared by several tables: ``table << 40 | row`` (int64[n])."""
    rows = np.asarray(rows, dtype=np.int64)
    if rows.size and (rows.min() < 0 or rows.max() >= (1 << 40)):
        raise ConfigError("rows must be in [0, 2**40) to combine with a table index")
    return (np.asarray(table, dtype=np.int64) << 40) | rows
