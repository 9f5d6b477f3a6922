"""SHARDS spatial sampling of key traces: fixed rate and fixed size.

Owns the salted 64-bit key hash and the filters that keep every access of a key
whose hash falls under a threshold (so a sampled key keeps all its reuses and the
sample is a hash partition: partitions of a trace by hash range merge exactly).
Works over an iterable of chunks with memory bounded by the sample. Does not
compute distances (``stack``) nor curves (``mrc``).

Reference: Waldspurger et al., "Efficient MRC Construction with SHARDS", FAST 2015.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from rowcache.errors import ConfigError

#: Hash values are 53-bit integers (exact in float64): rate R keeps ``h < R * 2**53``.
HASH_BITS = 53
HASH_SPACE = 1 << HASH_BITS

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def key_hash(keys: np.ndarray, salt: int = 0) -> np.ndarray:
    """SplitMix64 finaliser of ``key + salt * golden``, top 53 bits.

    Parameters
    ----------
    keys : int[n]
    salt : int

    Returns
    -------
    int64[n] in ``[0, 2**53)``
    """
    x = np.asarray(keys).astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x += _GOLDEN * np.uint64((salt + 1) & 0xFFFFFFFFFFFFFFFF)
        x ^= x >> np.uint64(30)
        x *= _M1
        x ^= x >> np.uint64(27)
        x *= _M2
        x ^= x >> np.uint64(31)
    return (x >> np.uint64(64 - HASH_BITS)).astype(np.int64)


@dataclass(frozen=True)
class Sample:
    """A spatially hashed sample of a trace.

    ``keys`` and ``positions`` (int64[s]) are the kept accesses and their positions
    in the full trace; ``total`` the full trace's length; ``rate`` the effective
    sampling rate (``threshold / 2**53``); ``batch_ids`` the kept accesses' batch
    indices when the chunks were ``(keys, batch_ids)`` pairs; ``forced`` (bool[s])
    marks accesses of heavy keys kept whatever their hash (they weigh 1, the
    others ``1 / rate``).
    """

    keys: np.ndarray
    positions: np.ndarray
    total: int
    rate: float
    threshold: int
    batch_ids: np.ndarray | None = None
    forced: np.ndarray | None = None


Chunks = np.ndarray | Iterable[np.ndarray] | Iterable[tuple[np.ndarray, np.ndarray]]


def _check_chunk(chunk: np.ndarray) -> np.ndarray:
    chunk = np.asarray(chunk)
    if chunk.ndim != 1 or (chunk.size and not np.issubdtype(chunk.dtype, np.integer)):
        raise ConfigError(
            f"accesses must be a 1-D int array or an iterable of them; got a chunk of "
            f"shape {chunk.shape} and dtype {chunk.dtype}"
        )
    return chunk.astype(np.int64, copy=False)


def iter_chunks(accesses: Chunks) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
    """``(keys int64[n], batch_ids int64[n] or None)`` per chunk of ``accesses``.

    ``accesses`` is one array, an iterable of arrays, or an iterable of
    ``(keys, batch_ids)`` pairs.
    """
    if isinstance(accesses, np.ndarray):
        yield _check_chunk(accesses), None
        return
    for item in accesses:
        if isinstance(item, tuple):
            if len(item) != 2:
                raise ConfigError("a chunk pair must be (keys, batch_ids)")
            k, b = _check_chunk(item[0]), _check_chunk(item[1])
            if k.size != b.size:
                raise ConfigError(
                    f"chunk keys ({k.size}) and batch_ids ({b.size}) differ in length"
                )
            yield k, b
        else:
            yield _check_chunk(item), None


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def rate_threshold(rate: float) -> int:
    """The hash threshold of a fixed sampling rate in (0, 1]."""
    if not (0.0 < float(rate) <= 1.0):
        raise ConfigError(f"sample_rate must be in (0, 1]; got {rate}")
    return min(HASH_SPACE, round(float(rate) * HASH_SPACE))


def sample_fixed_rate(
    accesses: Chunks, rate: float, *, salt: int = 0, heavy: np.ndarray | None = None
) -> Sample:
    """Keep the accesses whose key hash is below ``rate * 2**53``.

    Parameters
    ----------
    accesses : int[n] or iterable of int[n_i]
    rate : float in (0, 1]
    salt : int
    heavy : int64[k], optional
        Keys kept at every access whatever their hash (see :func:`top_keys`); the
        sample then marks them in ``forced``.
    """
    threshold = rate_threshold(rate)
    hv = None if heavy is None else np.unique(np.asarray(heavy, dtype=np.int64))
    kept_k: list[np.ndarray] = []
    kept_p: list[np.ndarray] = []
    kept_b: list[np.ndarray] = []
    kept_f: list[np.ndarray] = []
    has_b = False
    offset = 0
    for chunk, bids in iter_chunks(accesses):
        mask = key_hash(chunk, salt) < threshold
        if hv is not None:
            forced = is_member(chunk, hv)
            mask |= forced
        keep = np.flatnonzero(mask)
        kept_k.append(chunk[keep])
        kept_p.append(keep + offset)
        if hv is not None:
            kept_f.append(forced[keep])
        if bids is not None:
            has_b = True
            kept_b.append(bids[keep])
        offset += chunk.size
    forced_all = None
    if hv is not None:
        forced_all = np.concatenate(kept_f) if kept_f else np.zeros(0, dtype=bool)
    return Sample(
        _cat(kept_k),
        _cat(kept_p),
        offset,
        threshold / HASH_SPACE,
        threshold,
        _cat(kept_b) if has_b else None,
        forced_all,
    )


def is_member(keys: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """``keys[i] in sorted_set`` for a sorted unique int64 set (bool[n]).

    A dense lookup table when the set's values are small non-negative ints (row
    ids), else a binary search.
    """
    if sorted_set.size == 0 or keys.size == 0:
        return np.zeros(keys.size, dtype=bool)
    top = int(sorted_set[-1])
    if int(sorted_set[0]) >= 0 and top < (1 << 28):
        lut = np.zeros(top + 2, dtype=bool)
        lut[sorted_set] = True
        return lut[np.clip(keys, -1, top + 1)]  # -1 and top+1 map to False entries
    pos = np.minimum(np.searchsorted(sorted_set, keys), sorted_set.size - 1)
    return sorted_set[pos] == keys


def top_keys(accesses: Chunks, k: int) -> np.ndarray:
    """The ``k`` most frequent keys (int64[<= k], sorted), one pass over the chunks.

    Counts with ``np.bincount`` over batches of chunks (keys must be ``>= 0``;
    memory: 8 bytes per value up to the largest key), so use it on row ids, not
    on combined keys.
    """
    if int(k) < 1:
        raise ConfigError(f"heavy must be >= 1 keys; got {k}")
    counts = np.zeros(0, dtype=np.int64)
    pending: list[np.ndarray] = []
    held = 0

    def add(parts: list[np.ndarray]) -> np.ndarray:
        block = np.concatenate(parts)
        if int(block.min()) < 0:
            raise ConfigError("top_keys needs keys >= 0")
        c = np.bincount(block)
        if c.size > counts.size:
            c[: counts.size] += counts
            return c
        counts[: c.size] += c
        return counts

    for chunk, _ in iter_chunks(accesses):
        if chunk.size:
            pending.append(chunk)
            held += chunk.size
        if held >= 1 << 25:
            counts = add(pending)
            pending, held = [], 0
    if pending:
        counts = add(pending)
    if counts.size == 0:
        return np.zeros(0, dtype=np.int64)
    k = min(int(k), int(np.count_nonzero(counts)))
    top = np.argpartition(counts, counts.size - k)[counts.size - k :]
    return np.sort(top[counts[top] > 0]).astype(np.int64)


def sample_fixed_size(accesses: Chunks, max_keys: int, *, salt: int = 0) -> Sample:
    """Keep the accesses of the ``max_keys`` distinct keys of smallest hash.

    One pass; the threshold only decreases as keys arrive, so the kept accesses are
    refiltered whenever the buffer doubles. This is the offline form of fixed-size
    SHARDS: one rate (the final threshold) for the whole trace, memory bounded by
    about twice the sample.

    Parameters
    ----------
    accesses : int[n] or iterable of int[n_i]
    max_keys : int >= 1
    salt : int
    """
    if int(max_keys) < 1:
        raise ConfigError(f"sample_size must be >= 1; got {max_keys}")
    max_keys = int(max_keys)
    threshold = HASH_SPACE
    best = np.zeros(0, dtype=np.int64)  # smallest distinct hashes seen, sorted
    kept: list[tuple[np.ndarray, ...]] = []
    has_b = False
    buffered = 0
    offset = 0

    def squeeze(parts: list[tuple[np.ndarray, ...]]) -> tuple[np.ndarray, ...]:
        cols = [_cat([p[i] for p in parts]) for i in range(4)]
        m = cols[1] < threshold
        return tuple(c[m] if c.size == m.size else c for c in cols)

    for chunk, bids in iter_chunks(accesses):
        h = key_hash(chunk, salt)
        keep = np.flatnonzero(h < threshold)
        if keep.size:
            best = np.unique(np.concatenate((best, h[keep])))[: max_keys + 1]
            if best.size > max_keys:
                threshold = int(best[max_keys])
            b = bids[keep] if bids is not None else np.zeros(0, np.int64)
            has_b = has_b or bids is not None
            kept.append((chunk[keep], h[keep], keep + offset, b))
            buffered += keep.size
            if buffered > 4 * max_keys + (1 << 16):
                kept = [squeeze(kept)]
                buffered = kept[0][0].size
        offset += chunk.size
    kk, _, pp, bb = squeeze(kept)
    rate = threshold / HASH_SPACE
    return Sample(kk, pp, offset, rate, threshold, bb if has_b else None)
