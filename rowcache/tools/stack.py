"""Exact LRU stack distances, per access and per batch, vectorized with NumPy.

Owns the offline counting of distinct keys between consecutive uses of a key (the
LRU stack distance) in O(n log n) NumPy work and O(n) memory, with no Python loop
per access. Does not build curves (``mrc``) nor sample (``shards``).

Method. The distinct keys in the position window ``(p, c)`` number
``(c - p - 1) - #{j < c : prev[j] > p}`` (every repeat inside the window has its
previous use inside it too). For a reuse at ``t`` with previous use ``p`` the count
is an inversion count: order the reuses by the time of the query (``t``, or the
start of ``t``'s batch, ties by ``p``) and count, for each, the earlier ones whose
``p`` is larger. :func:`count_greater_before` answers that for all elements at once
with a bit-sliced (wavelet-tree) pass per bit of the ranks: a stable split of
aligned rank blocks by one bit, in which each 0 counts the 1s before it in its
block. Sorts are LSD radix sorts on 16-bit digits (NumPy's stable sort of
``uint16`` is a counting sort), so the whole pass is about a dozen O(n) array
operations per bit. The weighted variant (SHARDS) keeps the older divide and
conquer of :func:`count_prev_at_least`.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ..errors import ConfigError

#: Distance of a first use (a compulsory miss at every size).
INF = np.iinfo(np.int64).max

#: :func:`count_greater_before` packs a count and a rank in one int64, so an exact pass
#: takes fewer reuses than this (at 2**31 its arrays alone would need ~100 GB; sample).
PACKED_LIMIT = 1 << 31


def _as_keys(keys: np.ndarray, name: str = "accesses") -> np.ndarray:
    arr = np.asarray(keys)
    if arr.ndim != 1:
        raise ConfigError(f"{name} must be 1-D; got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ConfigError(f"{name} must be integers; got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _offset_bits(vals: np.ndarray) -> tuple[np.ndarray, int]:
    """``vals - vals.min()`` and its bit width (Python ints, so no overflow)."""
    if vals.size == 0:
        return vals, 0
    lo, hi = int(vals.min()), int(vals.max())
    bits = (hi - lo).bit_length()
    if bits > 62:
        return vals, 64
    return (vals - np.int64(lo) if lo else vals), bits


def stable_argsort(vals: np.ndarray) -> np.ndarray:
    """Stable argsort of an integer array by LSD radix on 16-bit digits.

    NumPy's stable sort of ``uint8``/``uint16`` is a counting sort, several times
    faster than its merge sort of ``int64``; keys spanning more than 48 bits fall back
    to ``np.argsort(kind="stable")``.

    Parameters
    ----------
    vals : int[n]

    Returns
    -------
    int64[n]
        The permutation that sorts ``vals``, equal keys in position order.
    """
    v, bits = _offset_bits(np.asarray(vals).astype(np.int64, copy=False))
    if bits > 48:
        return np.argsort(v, kind="stable").astype(np.int64, copy=False)
    order: np.ndarray | None = None
    for shift in range(0, max(bits, 1), 16):
        digit_dtype = np.uint8 if bits - shift <= 8 else np.uint16
        cur = v if order is None else v[order]
        digit = (cur >> shift if shift else cur).astype(digit_dtype)
        step = np.argsort(digit, kind="stable")
        order = step if order is None else order[step]
    assert order is not None
    return order.astype(np.int64, copy=False)


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


def _small_blocks(cur: np.ndarray, block: int) -> np.ndarray:
    """The last ``log2(block)`` levels of :func:`count_greater_before` at once.

    ``cur`` (packed ``count << 32 | rank``) is grouped in aligned rank blocks of
    ``block`` in sequence order; each element gains the earlier elements of its block
    with a larger rank (``block - 1`` vectorized comparisons of ``int8`` columns).
    Returns the counts indexed by rank.
    """
    m = cur.size
    ranks = cur & np.int64(0xFFFFFFFF)
    acc = cur >> 32
    low = (ranks & (block - 1)).astype(np.int8)
    nf = m // block
    full = nf * block
    if nf and block > 1:
        v = low[:full].reshape(nf, block)
        add = np.zeros((nf, block), np.int8)
        for j in range(block - 1):
            add[:, j + 1 :] += v[:, j : j + 1] > v[:, j + 1 :]
        acc[:full] += add.reshape(-1)
    if full < m:
        v = low[full:]
        earlier = np.tri(v.size, v.size, -1, dtype=bool)
        acc[full:] += (earlier & (v[None, :] > v[:, None])).sum(axis=1)
    out = np.empty(m, np.int64)
    out[ranks] = acc
    return out


def count_greater_before(ranks: np.ndarray, *, by_rank: bool = False) -> np.ndarray:
    """For each element ``i``: ``#{j < i : ranks[j] > ranks[i]}`` (its inversions).

    A wavelet tree built top-down, one level per bit of the rank: at level ``L``
    the sequence is stably grouped by ``rank >> (L + 1)``, which (``ranks`` being a
    permutation) makes aligned blocks of ``2**(L + 1)`` positions; splitting each
    block stably by bit ``L`` puts its 0s first, and a 0 that moves back by ``k``
    places had ``k`` larger ranks before it. Counts ride in the high 32 bits of the
    moved words. The last levels run as one small-block comparison.

    Parameters
    ----------
    ranks : int[m]
        A permutation of ``0 .. m-1``, ``m <`` :data:`PACKED_LIMIT`.
    by_rank : bool
        Return the counts indexed by rank instead of by position.

    Returns
    -------
    int64[m]
    """
    m = int(ranks.size)
    if m < 2:
        return np.zeros(m, np.int64)
    if m >= PACKED_LIMIT:
        raise ConfigError(
            f"exact stack distances take fewer than {PACKED_LIMIT} reuses; got {m} "
            "(use method='shards' for traces this large)"
        )
    top = (m - 1).bit_length()
    small = min(top, 4)
    cur = ranks.astype(np.int64)  # a copy: packed (count << 32) | rank
    new = np.empty_like(cur)
    bits = np.empty(m, dtype=np.uint8)
    zero = np.empty(m, dtype=bool)
    one = np.empty(m, dtype=bool)
    q = np.arange(m, dtype=np.int64)
    dest = np.empty(m, dtype=np.int64)
    for level in range(top - 1, small - 1, -1):
        half = 1 << level
        # Test the bit on the one byte of each word that holds it (less to write).
        byte = level >> 3 if sys.byteorder == "little" else 7 - (level >> 3)
        np.bitwise_and(cur.view(np.uint8)[byte::8], np.uint8(1 << (level & 7)), out=bits)
        np.equal(bits, 0, out=zero)
        np.logical_not(zero, out=one)
        zeros = np.extract(zero, cur)
        ones = np.extract(one, cur)
        # The q-th 0 was at flatnonzero(zero)[q] and lands at q + (q & -half), its
        # block's start plus the 0s before it there: the difference is the 1s before it.
        moved = np.flatnonzero(zero)
        k = zeros.size
        qz = q[:k]
        dz = dest[:k]
        np.bitwise_and(qz, -half, out=dz)
        dz += qz
        moved -= dz
        moved <<= 32
        zeros += moved
        nf = m >> (level + 1)
        full = nf << (level + 1)
        if nf:
            blocks = new[:full].reshape(nf, 2, half)
            blocks[:, 0, :] = zeros[: nf * half].reshape(nf, half)
            blocks[:, 1, :] = ones[: nf * half].reshape(nf, half)
        if full < m:
            z_tail = min(half, m - full)
            new[full : full + z_tail] = zeros[nf * half :]
            new[full + z_tail :] = ones[nf * half :]
        cur, new = new, cur
    out = _small_blocks(cur, 1 << small)
    return out if by_rank else out[ranks]


def count_prev_at_least(
    prev: np.ndarray, c: np.ndarray, a: np.ndarray, weights: np.ndarray | None = None
) -> np.ndarray:
    """For each query ``q``: ``#{j < c[q] : prev[j] >= a[q]}`` (or the sum of ``weights[j]``).

    Parameters
    ----------
    prev : int64[n]
        Previous-use positions (``-1`` for none); ``prev[j] < j``.
    c : int64[m]
        Query times in ``[0, n]``.
    a : int64[m]
        Thresholds, ``a >= 0``.
    weights : float64[n], optional
        Point weights; the counts become weight sums.

    Returns
    -------
    int64[m], or float64[m] with ``weights``
    """
    n = int(prev.size)
    m = int(c.size)
    out = np.zeros(m, dtype=np.int64 if weights is None else np.float64)
    if n == 0 or m == 0:
        return out
    shift = np.int64(max(1, int(n + 1).bit_length()))
    mask = (np.int64(1) << shift) - 1
    # Points: composite key (block << shift) | (prev + 1), sorted; level 0 has
    # blocks of one position. prev + 1 == 0 (no previous use) is never counted
    # since every threshold a + 1 >= 1.
    keys = (np.arange(n, dtype=np.int64) << shift) | (prev + 1)
    w = None if weights is None else np.asarray(weights, dtype=np.float64)
    # Queries: the same composite (c >> level, a + 1), kept sorted so that the
    # needles of searchsorted are sorted (several times faster); qidx maps back.
    qkeys = (c.astype(np.int64) << shift) | (a.astype(np.int64) + 1)
    qidx = np.argsort(qkeys, kind="stable")
    qkeys = qkeys[qidx]
    one = np.int64(1) << shift
    level = 0
    while (1 << level) <= n and qkeys.size:
        # A query whose window [a, c) starts at or after the end of the block
        # before c's block gets nothing here nor at any higher level: drop it.
        alive = ((qkeys >> shift) << level) >= (qkeys & mask)
        if not alive.all():
            qkeys = qkeys[alive]
            qidx = qidx[alive]
        # Queries whose bit `level` is 1 look into the block just before theirs,
        # which holds positions [(blk) << level, (blk + 1) << level).
        sel = np.flatnonzero((qkeys >> shift) & 1)
        if sel.size:
            needles = qkeys[sel] - one
            blk = needles >> shift
            lo = np.searchsorted(keys, needles, side="left")
            end = np.minimum((blk + 1) << level, n)
            if w is None:
                out[qidx[sel]] += end - lo
            else:
                cw = np.concatenate(([0.0], np.cumsum(w)))
                out[qidx[sel]] += cw[end] - cw[lo]
        # Merge sibling blocks: the new composite keys form sorted runs.
        keys = ((keys >> (shift + 1)) << shift) | (keys & mask)
        if w is None:
            keys.sort(kind="stable")
        else:
            order_k = np.argsort(keys, kind="stable")
            keys = keys[order_k]
            w = w[order_k]
        qkeys = ((qkeys >> (shift + 1)) << shift) | (qkeys & mask)
        order = np.argsort(qkeys, kind="stable")
        qkeys = qkeys[order]
        qidx = qidx[order]
        level += 1
    return out


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
