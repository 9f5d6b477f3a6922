"""Host kernels of a cached step: the n-gram ids of a packed batch on the CPU.

Owns :func:`hash_packed` (LongCat ids of the embedded positions of a packed batch,
optionally with per-table offsets added: the global ids of a shared arena) and its
NumPy reference :func:`hash_positions_reference`, plus the loader of the native
module ``rowcache.kernels._host`` (``csrc/host_module.c`` and the files it names), which also holds the row cache's
LRU bookkeeping: the all-hits path, the miss path's plan and commit, compaction
(``rowcache.cache.lru.Lru`` and ``rowcache.cache.faulter`` call them; their reference is the cache's
Python path), and Engram's ``EngramHasher`` (``rowcache.embed.engram.hash``; its reference is
``hash_reference`` there). Without the native module the references run, with the same results.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from rowcache.errors import ConfigError
from rowcache.kernels import extensions

# built by `pip install -e .` (setup.py); without it (no compiler, ROWCACHE_ALLOW_NO_NATIVE=1)
# the references run, and the first use of one warns (extensions.fallback)
native: Any = extensions.load("rowcache.kernels._host")

_I64 = np.dtype(np.int64)


def _host_threads() -> int:
    """Threads a large all-hits resolve or host hash may use (``rowcache.kernels._host.lru_hits``,
    ``hash_packed``): ``ROWCACHE_HOST_THREADS``, else the CPUs this process may run on,
    at most 8.
    Decode-sized calls stay on the caller's thread: the C code splits only calls of
    at least 2 x 4,096 ids (a prefill step's)."""
    env = os.environ.get("ROWCACHE_HOST_THREADS")
    if env is not None:
        try:
            k = int(env)
        except ValueError:
            raise ValueError(f"ROWCACHE_HOST_THREADS={env!r}: give an integer in 1..16") from None
        if not 1 <= k <= 16:
            raise ValueError(f"ROWCACHE_HOST_THREADS={env!r}: give an integer in 1..16")
        return k
    return max(1, min(8, USABLE_CPUS))


def _usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask; the CPU count off Linux)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


USABLE_CPUS = _usable_cpus()
HOST_THREADS = _host_threads()
# Threads of a deferred touch (csrc/lru_touch.c), on a pool of its own beside the step's:
# the CPUs the step's HOST_THREADS leave, at least 2, at most HOST_THREADS.
TOUCH_THREADS = min(HOST_THREADS, max(2, USABLE_CPUS - HOST_THREADS))


def hash_positions_reference(
    tokens: np.ndarray,
    positions: np.ndarray,
    first: np.ndarray | int,
    multipliers: np.ndarray,
    rows: np.ndarray,
    eos: int,
) -> np.ndarray:
    """LongCat ids of every table at ``positions`` only (host, vectorized).

    Parameters
    ----------
    tokens : int64[L]
        Concatenated token ids, already checked to lie in ``[0, V)``.
    positions : int64[n]
        The positions to hash.
    first : int64[n] or int
        First position of each position's sequence: the look-back stops there.
    multipliers : int64[T, N]
        ``NgramDims.multipliers`` (or a subset of its rows).
    rows : int64[T]
        Row count of each of those tables.
    eos : int
        The look-back of ``t`` stops at an EOS strictly before ``t``.

    Returns
    -------
    int64[T, n]
        Equal to ``rowcache.kernels.ngram.hash.ngram_hash_reference(tokens, ..., starts)[:, positions]``
        bit for bit, at ``O(n)`` instead of ``O(L)`` cost: a decode step hashes its
        new tokens, not their look-back.
    """
    mult = np.asarray(multipliers, dtype=_I64)
    n_orders = mult.shape[1]
    # all orders at once (few NumPy calls: a decode step hashes a handful of rows)
    back = positions[None, :] - np.arange(n_orders, dtype=_I64)[:, None]  # [N, n]: t - j
    xs = tokens[np.maximum(back, 0)]
    # term j >= 1 counts while no EOS and no sequence start lies in t - j .. t - 1
    lo = np.asarray(first, dtype=_I64)  # a scalar, or one start per row
    stop = (xs == eos) | (back < (lo if lo.ndim == 0 else lo[None, :]))
    stop[0] = False
    np.logical_or.accumulate(stop, axis=0, out=stop)
    np.invert(stop, out=stop)
    xs *= stop
    # every term is < V * M_i and there are at most N of them: exact in int64
    acc = mult @ xs
    acc %= np.asarray(rows, dtype=_I64)[:, None]
    return acc


def hash_packed(
    tokens: np.ndarray,
    ctx_lens: np.ndarray,
    seq_lens: np.ndarray,
    multipliers: np.ndarray,
    rows: np.ndarray,
    eos: int,
    offsets: np.ndarray | None = None,
    n: int | None = None,
    threads: int | None = None,
) -> np.ndarray:
    """Ids of the last ``seq_lens[s]`` positions of each packed context: int64[T, n].

    ``tokens`` int64[L] (in range: the caller checked them), ``ctx_lens`` and
    ``seq_lens`` int64[S] (validated), ``multipliers`` int64[T, N], ``rows`` int64[T],
    ``offsets`` int64[T] added to table ``i``'s ids when given, ``n`` ``sum(seq_lens)``
    where the caller knows it, ``threads`` the native call's at most (default
    :data:`HOST_THREADS`; it splits only calls of at least 2 x 4,096 ids, by tables).
    Look-back stops at each sequence's start and at an EOS (``hash_positions_reference``'s
    rule); one C call with the native module, else the reference.
    """
    T, N = multipliers.shape
    if n is None:
        n = int(seq_lens.sum())
    if not 0 <= n <= tokens.shape[0]:  # before the allocation; C checks every length
        raise ConfigError(
            f"hash_packed: {n} positions to hash out of {tokens.shape[0]} tokens; "
            "each 0 <= seq_len <= ctx_len, the contexts' lengths summing to len(tokens)"
        )
    if native is not None:
        c = np.ascontiguousarray  # the buffer protocol wants C-contiguous int64 vectors
        tokens, ctx_lens, seq_lens = c(tokens, _I64), c(ctx_lens, _I64), c(seq_lens, _I64)
        out = np.empty((T, n), dtype=_I64)
        k = HOST_THREADS if threads is None else threads
        try:
            native.hash_packed(
                tokens, ctx_lens, seq_lens, multipliers, rows, N, offsets, eos, out, k
            )
        except ValueError as e:  # the extension's checks of shapes, lengths and rows
            raise ConfigError(str(e)) from None
        return out
    if (np.asarray(rows) < 1).any():
        raise ConfigError(
            f"hash_packed: rows {np.asarray(rows).tolist()}; every table has >= 1 row"
        )
    if (
        ctx_lens.shape != seq_lens.shape
        or (seq_lens < 0).any()
        or (seq_lens > ctx_lens).any()
        or int(ctx_lens.sum()) != tokens.shape[0]
    ):
        raise ConfigError(
            "hash_packed: bad ctx_lens/seq_lens (each 0 <= seq_len <= ctx_len, the contexts' "
            "lengths summing to len(tokens))"
        )
    begin = np.zeros(ctx_lens.shape[0], dtype=_I64)
    np.cumsum(ctx_lens[:-1], out=begin[1:])
    end = begin + ctx_lens
    positions = np.repeat(end - seq_lens, seq_lens) + (
        np.arange(n, dtype=_I64) - np.repeat(np.cumsum(seq_lens) - seq_lens, seq_lens)
    )
    first = np.repeat(begin, seq_lens)
    extensions.fallback("rowcache.kernels._host")
    out = hash_positions_reference(tokens, positions, first, multipliers, rows, eos)
    if offsets is not None:
        out += offsets[:, None]
    return out
