"""Counting, for every element at once, the earlier elements that are larger.

Owns the inversion counts behind ``rowcache.tools.stack``'s exact LRU stack distances:
:func:`count_greater_before` (ranks) and :func:`count_prev_at_least` (weighted, for
SHARDS), and the stable radix argsort they and the stack distances use. No Python loop
per element.

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

import numpy as np

from rowcache.errors import ConfigError

#: :func:`count_greater_before` packs a count and a rank in one int64, so an exact pass
#: takes fewer reuses than this (at 2**31 its arrays alone would need ~100 GB; sample).
PACKED_LIMIT = 1 << 31


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
