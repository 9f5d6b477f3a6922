"""Kernels of the n-gram embedding: hashed ids, and hash + gather in one launch.

Owns the launchers of ``rowcache/kernels/ngram/ngram.cu``'s hash kernels and their NumPy references
(the specification, and the CPU path): ``ngram_hash`` (the LongCat id of every table
and position, ``docs/ngram-spec.md``) and ``hash_gather``. The stacked tables and
their gather are ``rowcache.kernels.ngram.stacked``; the projection GEMM and the scaled sum are
``rowcache.kernels.gemm``. Does not know about ``embed``'s objects: it takes plain arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rowcache.errors import ConfigError
from rowcache.kernels.loader import get_kernel, is_device_array, launch_1d, require_cupy
from rowcache.kernels.ngram.stacked import (
    StackedTables,
    gather_args,
    gather_stacked_reference,
    item_launch,
)

_SOURCE = "ngram/ngram.cu"


# --- the hash -----------------------------------------------------------------
def ngram_hash_reference(
    tokens: np.ndarray,
    multipliers: np.ndarray,
    rows: np.ndarray,
    eos: int,
    starts: np.ndarray | None = None,
) -> np.ndarray:
    """LongCat n-gram ids of every table at every position, vectorized.

    Parameters
    ----------
    tokens : int[L]
        Token ids, already checked to lie in ``[0, V)``.
    multipliers : int64[T, N]
        ``V**j mod rows[i]`` for ``j < order(i)``, 0 beyond (``NgramDims.multipliers``).
    rows : int64[T]
        Row count ``M_i`` of every table.
    eos : int
        The EOS token: the look-back of position ``t`` stops at an EOS strictly before ``t``.
    starts : int64[L], optional
        First position of the sequence of each position, when several sequences are
        concatenated: the look-back never reaches before ``starts[t]``. Default 0.

    Returns
    -------
    int64[T, L]
        ``(sum_j xt(t - j) * multipliers[i, j]) mod rows[i]``.
    """
    x = np.asarray(tokens).astype(np.int64, copy=False)
    mult = np.asarray(multipliers, dtype=np.int64)
    mod = np.asarray(rows, dtype=np.int64)
    max_n = mult.shape[1]
    length = x.shape[0]
    pos = np.arange(length, dtype=np.int64)
    # start[t] = first position of t's segment: one past the last EOS before t.
    last_eos = np.maximum.accumulate(np.where(x == eos, pos, -1))
    start = np.zeros(length, dtype=np.int64)
    start[1:] = last_eos[:-1] + 1
    if starts is not None:
        np.maximum(start, np.asarray(starts, dtype=np.int64), out=start)
    acc = mult[:, :1] * x[None, :]
    shifted = np.empty(length, dtype=np.int64)
    for j in range(1, max_n):  # loop over orders (<= N), vectorized over positions
        shifted[:j] = 0
        shifted[j:] = x[:-j] if j < length else x[:0]
        shifted[pos - j < start] = 0
        acc += mult[:, j : j + 1] * shifted[None, :]
    acc %= mod[:, None]
    return acc


def _bad_token(tokens: np.ndarray, vocab: int) -> None:
    bad = (tokens < 0) | (tokens >= vocab)
    if tokens.size and bool(bad.any()):
        first = int(np.flatnonzero(bad)[0])
        raise TokenRangeError(first, int(tokens[first]), vocab)


class TokenRangeError(ConfigError):
    """A token id outside ``[0, vocab)``; ``position`` is the first bad one."""

    def __init__(self, position: int, value: int, vocab: int) -> None:
        super().__init__(f"tokens[{position}] = {value} is outside the vocabulary [0, {vocab})")
        self.position, self.value, self.vocab = position, value, vocab


def ngram_hash(
    tokens: Any,
    multipliers: Any,
    rows: Any,
    eos: int,
    starts: Any = None,
    *,
    vocab: int | None = None,
    out: Any = None,
) -> Any:
    """:func:`ngram_hash_reference` on NumPy input, the CUDA kernel on cupy input.

    ``tokens`` decides the device; the result (int64[T, L]) lives on the same device
    and is bit-identical. With ``vocab``, tokens outside ``[0, vocab)`` raise
    :class:`TokenRangeError` (a ConfigError, so a ValueError) naming the first bad
    position; on the GPU the check is fused into the hash kernel (one 8-byte read
    back instead of a separate reduction). ``out`` (int64[T, L], C-contiguous, on the
    tokens' device) receives the ids in place of a new array: what a CUDA graph's fixed
    buffers need; it is returned.
    """
    if not is_device_array(tokens):
        if vocab is not None:
            _bad_token(np.asarray(tokens), vocab)
        ids = ngram_hash_reference(tokens, multipliers, rows, eos, starts)
        if out is None:
            return ids
        _check_out(out, ids.shape, np)
        out[...] = ids
        return out
    cp = require_cupy("ngram_hash")
    tok = cp.ascontiguousarray(tokens, dtype=cp.int64)
    mult = cp.ascontiguousarray(cp.asarray(multipliers), dtype=cp.int64)
    mod = cp.ascontiguousarray(cp.asarray(rows), dtype=cp.int64)
    n_tables, max_n = mult.shape
    length = tok.shape[0]
    first = tok if starts is None else cp.ascontiguousarray(cp.asarray(starts), dtype=cp.int64)
    if first.shape != tok.shape:
        raise ConfigError(f"starts must have the shape of tokens {tok.shape}, got {first.shape}")
    if out is None:
        out = cp.empty((n_tables, length), dtype=cp.int64)
    else:
        _check_out(out, (n_tables, length), cp)
    total = n_tables * length
    if total == 0:
        return out
    bad = cp.full(1, length, dtype=cp.int64) if vocab is not None else mod
    kern = get_kernel(_SOURCE, "ngram_hash")
    grid, block = launch_1d(total)
    kern(
        grid,
        block,
        (
            tok,
            first,
            mult,
            mod,
            out,
            np.int64(length),
            np.int32(n_tables),
            np.int32(max_n),
            np.int64(eos),
            np.int32(starts is not None),
            np.int64(vocab or 0),
            bad,
        ),
    )
    if vocab is not None:
        first = int(bad.get()[0])
        if first < length:
            raise TokenRangeError(first, int(tok[first].get()), vocab)
    return out


def _check_out(out: Any, shape: tuple[int, ...], xp: Any) -> None:
    """Refuse an ``out=`` that is not a C-contiguous int64 array of ``shape`` on ``xp``."""
    on_device = is_device_array(out)
    if (
        on_device != (xp is not np)
        or out.dtype != np.int64
        or tuple(out.shape) != tuple(shape)
        or not out.flags.c_contiguous
    ):
        raise ConfigError(
            f"out must be a C-contiguous int64 array of shape {tuple(shape)} on the tokens' "
            f"device ({'cupy' if xp is not np else 'numpy'}); got "
            f"{type(out).__module__}.{type(out).__name__} {getattr(out, 'dtype', None)} "
            f"{getattr(out, 'shape', None)}"
        )


def hash_gather_reference(
    tokens: np.ndarray,
    starts: np.ndarray | None,
    positions: np.ndarray,
    multipliers: np.ndarray,
    rows: np.ndarray,
    eos: int,
    tables: StackedTables,
    out: np.ndarray,
    word: StackedTables,
    words: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """What :func:`hash_gather` computes: the hash of every position, the embedded
    ``positions`` selected, their T rows stacked into ``out`` and their word rows
    (``tokens[positions]`` of the single table ``word``) into ``words``."""
    ids = ngram_hash_reference(tokens, multipliers, rows, eos, starts)[:, positions]
    gather_stacked_reference(ids, tables, out)
    gather_stacked_reference(np.asarray(tokens)[positions][None, :], word, words)
    return out, words


def hash_gather(
    tokens: Any,
    starts: Any,
    positions: Any,
    multipliers: Any,
    rows: Any,
    eos: int,
    tables: StackedTables,
    out: Any,
    word: StackedTables,
    words: Any,
) -> tuple[Any, Any]:
    """Hash, select, stacked gather and word gather of a step in ONE launch on the GPU.

    Parameters (launcher argument order)
    ----------
    tokens : int64[L], C-contiguous, trusted to lie in ``[0, V)`` (checked by the caller)
    starts : int64[L] or None
        First position of each position's sequence (several sequences packed); None:
        one sequence.
    positions : int64[n] or None
        The embedded positions (with ``starts``); None: the last ``n`` positions.
    multipliers, rows : int64[T, N], int64[T] (``NgramDims.multipliers``, table rows)
    eos : int
    tables : StackedTables of the T tables (width d); out : bfloat16[n, T*d]
    word : StackedTables of the word table alone (width D); words : bfloat16[n, D]

    Bit-identical to :func:`ngram_hash`, the selection, :func:`gather_stacked` and the
    word gather (:func:`hash_gather_reference`); no allocation, no sync: capturable.
    """
    n = int(out.shape[0])
    L = int(tokens.shape[0])
    if positions is None:
        positions_arr = np.arange(L - n, L, dtype=np.int64)
    else:
        positions_arr = positions
    if not tables.device:
        return hash_gather_reference(
            tokens, starts, positions_arr, multipliers, rows, eos, tables, out, word, words
        )
    require_cupy("hash_gather")
    if (starts is None) != (positions is None):
        raise ConfigError("hash_gather: give starts and positions together, or neither")
    if n > L:
        raise ConfigError(f"hash_gather: {n} output rows but only {L} tokens")
    items, tail = gather_args("hash_gather", multipliers, rows, eos, tables, out, word, words)
    if n == 0:
        return out, words
    multi = starts is not None
    get_kernel(_SOURCE, "ngram_hash_gather")(
        *item_launch(items),
        (
            tokens,
            starts if multi else tokens,
            positions if multi else tokens,
            np.int64(L - n),
            np.int32(multi),
            *tail,
        ),
    )
    return out, words


__all__ = [
    "TokenRangeError",
    "hash_gather",
    "hash_gather_reference",
    "ngram_hash",
    "ngram_hash_reference",
]
