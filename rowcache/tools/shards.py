"""SHARDS spatial sampling of key traces: fixed rate and fixed size.

Owns the salted 64-bit key hash and the filters that keep every access of a key
whose hash falls under a threshold (so a sampled key keeps all its reuses and the
sample is a hash partition: partitions of a trace by hash range merge exactly).
Works over an iterable of chunks with memory bounded by the sample. Does not
compute distances (``stack``) nor curves (``mrc``).

Reference: Waldspurger et al., "Efficient MRC Construction with SHARDS", FAST 2015.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError

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
    sampling rate (``threshold / 2**53``).
    """

    keys: np.ndarray
    positions: np.ndarray
    total: int
    rate: float
    threshold: int


def _chunks(accesses: np.ndarray | Iterable[np.ndarray]) -> Iterable[np.ndarray]:
    if isinstance(accesses, np.ndarray):
        yield accesses
        return
    for chunk in accesses:
        yield np.asarray(chunk)


def _check_chunk(chunk: np.ndarray) -> np.ndarray:
    if chunk.ndim != 1 or (chunk.size and not np.issubdtype(chunk.dtype, np.integer)):
        raise ConfigError(
            f"accesses must be a 1-D int array or an iterable of them; got a chunk of "
            f"shape {chunk.shape} and dtype {chunk.dtype}"
        )
    return chunk.astype(np.int64, copy=False)


def sample_fixed_rate(
    accesses: np.ndarray | Iterable[np.ndarray], rate: float, *, salt: int = 0
) -> Sample:
    """Keep the accesses whose key hash is below ``rate * 2**53``.

    Parameters
    ----------
    accesses : int[n] or iterable of int[n_i]
    rate : float in (0, 1]
    salt : int
    """
    if not (0.0 < float(rate) <= 1.0):
        raise ConfigError(f"sample_rate must be in (0, 1]; got {rate}")
    threshold = min(HASH_SPACE, int(round(float(rate) * HASH_SPACE)))
    kept_k: list[np.ndarray] = []
    kept_p: list[np.ndarray] = []
    offset = 0
    for raw in _chunks(accesses):
        chunk = _check_chunk(raw)
        keep = np.flatnonzero(key_hash(chunk, salt) < threshold)
        kept_k.append(chunk[keep])
        kept_p.append(keep + offset)
        offset += chunk.size
    keys = np.concatenate(kept_k) if kept_k else np.zeros(0, np.int64)
    pos = np.concatenate(kept_p) if kept_p else np.zeros(0, np.int64)
    return Sample(keys, pos, offset, threshold / HASH_SPACE, threshold)


def sample_fixed_size(
    accesses: np.ndarray | Iterable[np.ndarray], max_keys: int, *, salt: int = 0
) -> Sample:
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
    kept_k: list[np.ndarray] = []
    kept_h: list[np.ndarray] = []
    kept_p: list[np.ndarray] = []
    buffered = 0
    offset = 0
    for raw in _chunks(accesses):
        chunk = _check_chunk(raw)
        h = key_hash(chunk, salt)
        keep = np.flatnonzero(h < threshold)
        if keep.size:
            best = np.unique(np.concatenate((best, h[keep])))[: max_keys + 1]
            if best.size > max_keys:
                threshold = int(best[max_keys])
            kept_k.append(chunk[keep])
            kept_h.append(h[keep])
            kept_p.append(keep + offset)
            buffered += keep.size
            if buffered > 4 * max_keys + (1 << 16):
                kk, hh, pp = (np.concatenate(x) for x in (kept_k, kept_h, kept_p))
                m = hh < threshold
                kept_k, kept_h, kept_p = [kk[m]], [hh[m]], [pp[m]]
                buffered = int(m.sum())
        offset += chunk.size
    if not kept_k:
        return Sample(np.zeros(0, np.int64), np.zeros(0, np.int64), offset, 1.0, threshold)
    kk, hh, pp = (np.concatenate(x) for x in (kept_k, kept_h, kept_p))
    m = hh < threshold
    return Sample(kk[m], pp[m], offset, threshold / HASH_SPACE, threshold)
