"""Per-access simulations of other replacement policies: SIEVE and Belady's OPT.

Owns the reference simulators used on (sampled) traces to show what a better policy
than LRU would buy, OPT being the lower bound of every policy. They loop per access
in Python, so callers run them on SHARDS samples (10^5–10^6 accesses). Exact LRU
curves live in ``stack``; these do not handle batches.
"""

from __future__ import annotations

import heapq

import numpy as np

from rowcache.errors import ConfigError

POLICIES = ("lru", "sieve", "opt")


def next_use(keys: np.ndarray) -> np.ndarray:
    """Position of the next use of each access's key; ``n`` when none (int64[n])."""
    n = keys.size
    nxt = np.full(n, n, dtype=np.int64)
    if n < 2:
        return nxt
    order = np.argsort(keys, kind="stable")
    sk = keys[order]
    same = sk[1:] == sk[:-1]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def simulate_opt(keys: np.ndarray, size: int) -> int:
    """Misses of Belady's OPT (evict the key used farthest in the future).

    Parameters
    ----------
    keys : int[n]
    size : int >= 1

    Returns
    -------
    int
    """
    keys = np.asarray(keys, dtype=np.int64)
    nxt = next_use(keys).tolist()
    resident: dict[int, int] = {}  # key -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, key), lazily invalidated
    misses = 0
    for i, k in enumerate(keys.tolist()):
        nu = nxt[i]
        if k in resident:
            resident[k] = nu
            heapq.heappush(heap, (-nu, k))
            continue
        misses += 1
        if len(resident) >= size:
            while True:
                neg, victim = heapq.heappop(heap)
                if resident.get(victim) == -neg:
                    del resident[victim]
                    break
        resident[k] = nu
        heapq.heappush(heap, (-nu, k))
    return misses


def simulate_sieve(keys: np.ndarray, size: int) -> int:
    """Misses of SIEVE (Zhang et al., NSDI 2024): a FIFO queue with a visited bit and
    a hand that moves from the tail to the head, sparing and clearing visited keys.

    Parameters
    ----------
    keys : int[n]
    size : int >= 1

    Returns
    -------
    int
    """
    keys = np.asarray(keys, dtype=np.int64)
    # Doubly linked list over slots; head = newest, tail = oldest.
    slot_of: dict[int, int] = {}
    key_at = [0] * size
    visited = [False] * size
    newer = [-1] * size  # towards the head
    older = [-1] * size  # towards the tail
    head = tail = hand = -1
    free = list(range(size - 1, -1, -1))
    misses = 0
    for k in keys.tolist():
        s = slot_of.get(k)
        if s is not None:
            visited[s] = True
            continue
        misses += 1
        if not free:
            h = hand if hand != -1 else tail
            while visited[h]:
                visited[h] = False
                h = newer[h] if newer[h] != -1 else tail
            hand = newer[h]  # may be -1: wraps to the tail next time
            # unlink h
            if newer[h] != -1:
                older[newer[h]] = older[h]
            else:
                head = older[h]
            if older[h] != -1:
                newer[older[h]] = newer[h]
            else:
                tail = newer[h]
            del slot_of[key_at[h]]
            free.append(h)
        s = free.pop()
        key_at[s] = k
        visited[s] = False
        slot_of[k] = s
        newer[s] = -1
        older[s] = head
        if head != -1:
            newer[head] = s
        head = s
        if tail == -1:
            tail = s
    return misses


def simulate_lru(keys: np.ndarray, size: int) -> int:
    """Misses of per-access LRU (a reference; ``stack`` computes all sizes at once)."""
    from collections import OrderedDict

    cache: OrderedDict[int, None] = OrderedDict()
    misses = 0
    for k in np.asarray(keys, dtype=np.int64).tolist():
        if k in cache:
            cache.move_to_end(k)
            continue
        misses += 1
        if len(cache) >= size:
            cache.popitem(last=False)
        cache[k] = None
    return misses


def simulate(policy: str, keys: np.ndarray, size: int) -> int:
    """Misses of ``policy`` (one of :data:`POLICIES`) at ``size`` keys."""
    if size < 1:
        raise ConfigError(f"size must be >= 1; got {size}")
    if policy == "lru":
        return simulate_lru(keys, size)
    if policy == "sieve":
        return simulate_sieve(keys, size)
    if policy == "opt":
        return simulate_opt(keys, size)
    raise ConfigError(f"policy={policy!r} is not supported; allowed: {', '.join(POLICIES)}")
