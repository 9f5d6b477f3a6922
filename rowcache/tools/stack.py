"""Exact LRU stack distances, per access and per batch, vectorized with NumPy.

Owns the offline counting of distinct keys between consecutive uses of a key (the
LRU stack distance) in O(n log n) NumPy work and O(n) memory, with no Python loop
per access. Does not build curves (``mrc``) nor sample (``shards``).

The counting behind it (how many earlier elements are larger, for all elements at once)
is ``rowcache.tools.inversions``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rowcache.errors import ConfigError
from rowcache.tools.inversions import count_greater_before, count_prev_at_least, stable_argsort

#: Distance of a first use (a compulsory miss at every size).
INF = np.iinfo(np.int64).max


def _as_keys(keys: np.ndarray, name: str = "accesses") -> np.ndarray:
    arr = np.asarray(keys)
    if arr.ndim != 1:
        raise ConfigError(f"{name} must be 1-D; got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ConfigError(f"{name} must be integers; got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def previous_use(keys: np.ndarray) -> np.ndarray:
    """Position of the previous use of each access's key, ``-1`` for a first use.

    Parameters
    ----------
    keys : int[n]

    Returns
    -------
    int64[n]
    """
    keys = _as_keys(keys)
    n = keys.size
    prev = np.full(n, -1, dtype=np.int64)
    if n < 2:
        return prev
    order = stable_argsort(keys)
    sk = keys[order]
    same = sk[1:] == sk[:-1]
    # np.extract: several times faster than boolean indexing on NumPy 2.
    prev[np.extract(same, order[1:])] = np.extract(same, order[:-1])
    return prev


def lru_stack_distances(keys: np.ndarray) -> np.ndarray:
    """LRU stack distance of every access: a hit at every size ``>= d``.

    ``d`` is 1 + the number of distinct other keys used since the previous use of
    the same key; a first use gets :data:`INF`.

    Parameters
    ----------
    keys : int[n]

    Returns
    -------
    int64[n]
    """
    keys = _as_keys(keys)
    prev = previous_use(keys)
    dist = np.full(keys.size, INF, dtype=np.int64)
    reuse = np.flatnonzero(prev >= 0)
    if reuse.size:
        p = prev[reuse]
        # Rank of each previous use among all previous uses (they are distinct).
        is_prev = np.zeros(keys.size, dtype=np.int64)
        is_prev[p] = 1
        rank = np.cumsum(is_prev)
        rank -= 1
        larger_before = count_greater_before(rank[p])
        dist[reuse] = reuse - p - larger_before
    return dist


def batch_ids_from(batch: object, n: int) -> np.ndarray:
    """Normalise the ``batch`` argument to a non-decreasing batch index per access.

    ``batch`` is an int ``B`` (consecutive groups of ``B`` accesses) or an int array
    of length ``n`` with a non-decreasing batch index per access.
    """
    if isinstance(batch, (int, np.integer)) and not isinstance(batch, bool):
        if int(batch) < 1:
            raise ConfigError(f"batch must be >= 1 when an int; got {batch}")
        return np.arange(n, dtype=np.int64) // int(batch)
    arr = np.asarray(batch)
    if arr.ndim != 1 or arr.size != n or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ConfigError(
            f"batch must be an int or an int array of one batch index per access "
            f"(length {n}); got {type(batch).__name__} with shape {getattr(arr, 'shape', None)}"
        )
    arr = arr.astype(np.int64, copy=False)
    if arr.size > 1 and np.any(arr[1:] < arr[:-1]):
        raise ConfigError("batch indices must be non-decreasing (batches are served in order)")
    return arr


def _key_major_entries(
    keys: np.ndarray, batch_ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The unique (batch, key) pairs in key order, then batch order.

    Returns ``(ekeys, ebatch, index)``: ``ebatch`` renumbered ``0..nb-1`` in batch
    order, ``index`` the position of the first access of each pair. Non-decreasing
    batch ids (the usual case) cost one radix sort by key: a stable sort keeps each
    key's accesses in time order, hence batch order.
    """
    b = np.asarray(batch_ids).astype(np.int64, copy=False).reshape(-1)
    n = keys.size
    undo: np.ndarray | None = None
    if n > 1 and bool(np.any(b[1:] < b[:-1])):
        undo = stable_argsort(b)
        keys = keys[undo]
        b = b[undo]
    step = np.zeros(n, dtype=np.int64)
    np.not_equal(b[1:], b[:-1], out=step[1:], casting="unsafe")
    dense = np.cumsum(step)
    order = stable_argsort(keys)
    sk = keys[order]
    sb = dense[order]
    keep = np.ones(n, dtype=bool)
    keep[1:] = (sk[1:] != sk[:-1]) | (sb[1:] != sb[:-1])
    index = np.extract(keep, order)
    if undo is not None:
        index = undo[index]
    return np.extract(keep, sk), np.extract(keep, sb), index


def dedup_batches(keys: np.ndarray, batch_ids: np.ndarray, *, return_index: bool = False) -> Any:
    """The unique keys of each batch, in batch order then key order.

    Returns
    -------
    ukeys : int64[u]
    ubatch : int64[u]
        Batch index of each unique (batch, key) pair, renumbered ``0..nb-1``.
    index : int64[u]
        With ``return_index``: the position of one access of each pair.
    """
    keys = _as_keys(keys)
    if keys.size == 0:
        return (keys, keys.copy(), keys.copy()) if return_index else (keys, keys.copy())
    ek, eb, index = _key_major_entries(keys, batch_ids)
    to_stream = stable_argsort(eb)
    if return_index:
        return ek[to_stream], eb[to_stream], index[to_stream]
    return ek[to_stream], eb[to_stream]


def batch_stack_distances(keys: np.ndarray, batch_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Stack distance of every unique (batch, key) under the row cache's batch LRU.

    The cache (``rowcache.NgramRowCache``) looks a batch's unique rows up before it
    evicts anything, gives all of them the batch as recency, and evicts the least
    recent first; rows last used in the same batch leave in the order they were
    logged, which is ascending row id (``np.unique`` order). Recency is therefore the
    total order (batch, key), fixed by the trace alone, so batch LRU is a stack
    algorithm: at arena size ``C`` a row last used in batch ``p`` and wanted in batch
    ``b`` hits iff ``C >= d``, ``d`` = 1 + the rows ranked above it just before batch
    ``b`` = 1 + the distinct keys of the (batch, key)-ordered unique stream strictly
    after its previous entry and before the start of batch ``b``.

    With ``s`` the stream position of the previous entry and ``c`` the start of batch
    ``b``: ``d = c - s - #{reuses of an earlier batch whose previous entry is after
    s}``; ordering the reuses by (batch, previous entry) makes that count an
    inversion count (:func:`count_greater_before`), since reuses of the same batch
    then come in increasing previous entry.

    Parameters
    ----------
    keys : int[n]
    batch_ids : int[n]
        Batch index per access (served in increasing batch index).

    Returns
    -------
    dist : int64[u]
        One per unique (batch, key), in (batch, key) order; :data:`INF` for a first use.
    batch_sizes : int64[nb]
        Unique rows per batch (the smallest feasible arena is their max).
    """
    keys = _as_keys(keys)
    if keys.size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    ek, eb, _ = _key_major_entries(keys, batch_ids)
    u = ek.size
    dist = np.full(u, INF, dtype=np.int64)
    batch_sizes = np.bincount(eb)
    starts = np.zeros(batch_sizes.size, dtype=np.int64)
    np.cumsum(batch_sizes[:-1], out=starts[1:])
    to_stream = stable_argsort(eb)  # stream position -> key-major entry
    stream_pos = np.empty(u, dtype=np.int64)
    stream_pos[to_stream] = np.arange(u, dtype=np.int64)
    # Key-major entry e has its next use at e + 1 when the key is the same.
    is_prev = np.zeros(u, dtype=bool)
    is_prev[np.extract(ek[1:] == ek[:-1], stream_pos[:-1])] = True
    prev_pos = np.flatnonzero(is_prev)  # ascending: index = rank of the previous entry
    if prev_pos.size:
        nxt = to_stream[prev_pos] + 1
        nbatch = eb[nxt]
        query_order = stable_argsort(nbatch)  # (batch, previous entry), as ranks
        larger = count_greater_before(query_order, by_rank=True)
        dist[stream_pos[nxt]] = starts[nbatch] - prev_pos - larger
    return dist, batch_sizes


def weighted_distances(
    keys: np.ndarray, weights: np.ndarray, batch_ids: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stack distances in which each key counts ``weights`` (a per-access copy of a
    per-key weight), per access or per (batch, key) as :func:`batch_stack_distances`.

    Used by SHARDS with exact heavy keys: a sampled key stands for ``1 / rate``
    keys, a key kept exactly for one. ``d = w_self + sum of the weights of the
    distinct other keys ranked above it``; a hit at size ``C`` iff ``d <= C``.

    Returns
    -------
    dist : float64[u]
        ``inf`` for a first use; ``u`` = accesses, or unique (batch, key) pairs.
    entry_weights : float64[u]
    batch_weights : float64[nb]
        Weighted unique rows per batch (empty without batches).
    """
    keys = _as_keys(keys)
    w = np.asarray(weights, dtype=np.float64)
    if batch_ids is None:
        ukeys, uw = keys, w
        starts_of = None
        bw: np.ndarray = np.zeros(0)
    else:
        ukeys, ub, idx = dedup_batches(keys, batch_ids, return_index=True)
        uw = w[idx]
        counts = np.bincount(ub) if ub.size else np.zeros(0, np.int64)
        starts = np.concatenate(([0], np.cumsum(counts)))
        starts_of = starts[ub] if ub.size else ub
        bw = np.bincount(ub, weights=uw) if ub.size else np.zeros(0)
    u = ukeys.size
    dist = np.full(u, np.inf)
    if u == 0:
        return dist, uw, bw
    prev = previous_use(ukeys)
    reuse = np.flatnonzero(prev >= 0)
    if reuse.size:
        c = reuse if starts_of is None else starts_of[reuse]
        a = prev[reuse] + 1
        cw = np.concatenate(([0.0], np.cumsum(uw)))
        window = cw[c] - cw[a]
        repeats = count_prev_at_least(prev, c, a, uw)
        dist[reuse] = uw[reuse] + window - repeats
    return dist, uw, bw
