"""Hash + gather of tokens laid out as rows: ``[B, L]`` ids after ``[B, C]`` contexts.

Owns :func:`hash_gather_rows` (``rowcache/kernels/ngram/ngram.cu``'s ``ngram_hash_gather_rows``: each
row of ``ids`` a sequence that follows the last ``c`` tokens of its row of ``ctx``,
read in place at any strides, tokens range-checked in the same launch) and its NumPy
reference. This is the embedding step of device tensors as a serving engine holds them
(``rowcache.embed.TorchNgramEmbedding``): no packing of context and ids into one array, no copy.
The packed-token kernel and the shared tables are ``rowcache.kernels.ngram.hash``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rowcache.errors import ConfigError
from rowcache.kernels.loader import get_kernel, require_cupy
from rowcache.kernels.ngram.hash import hash_gather_reference
from rowcache.kernels.ngram.stacked import StackedTables, gather_args, item_launch

_SOURCE = "ngram/ngram.cu"


def rows_packed(ids: np.ndarray, ctx: np.ndarray | None, c: int) -> np.ndarray:
    """``[ctx[:, C - c:] | ids]`` as one int64[B * (c + L)] array (each row a sequence)."""
    ids = np.asarray(ids, dtype=np.int64)
    if c == 0 or ctx is None:
        return np.ascontiguousarray(ids).reshape(-1)
    tail = np.asarray(ctx, dtype=np.int64)[:, ctx.shape[1] - c :]
    return np.concatenate([tail, ids], axis=1).reshape(-1)


def first_bad_token(ids: np.ndarray, ctx: np.ndarray | None, c: int, vocab: int) -> str | None:
    """The first token outside ``[0, vocab)`` as ``"input_ids[b, l] = x"`` (the
    context's last ``c`` columns first, row by row), or None."""
    for name, a, first in (
        ("ngram_context", ctx, 0 if ctx is None else ctx.shape[1] - c),
        ("input_ids", ids, 0),
    ):
        if a is None or (name == "ngram_context" and c == 0):
            continue
        part = np.asarray(a)[:, first:]
        bad = (part < 0) | (part >= vocab)
        if bad.any():
            b, j = map(int, np.argwhere(bad)[0])
            return f"{name}[{b}, {first + j}] = {int(part[b, j])}"
    return None


def hash_gather_rows_reference(
    ids: np.ndarray,
    ctx: np.ndarray | None,
    c: int,
    multipliers: np.ndarray,
    rows: np.ndarray,
    eos: int,
    tables: StackedTables,
    out: np.ndarray,
    word: StackedTables,
    words: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """What :func:`hash_gather_rows` computes for in-range tokens: the packed
    :func:`rowcache.kernels.ngram.hash.hash_gather_reference` of ``[ctx[:, C - c:] | ids]``, each
    row its own sequence, every position of ``ids`` embedded (row ``b * L + l``)."""
    B, L = ids.shape
    W = c + L
    tokens = rows_packed(ids, ctx, c)
    starts = np.repeat(np.arange(B, dtype=np.int64) * W, W)
    positions = (np.arange(B, dtype=np.int64)[:, None] * W + c + np.arange(L)).reshape(-1)
    return hash_gather_reference(
        tokens, starts, positions, multipliers, rows, eos, tables, out, word, words
    )


def hash_gather_rows(
    ids: Any,
    ctx: Any,
    c: int,
    multipliers: Any,
    rows: Any,
    eos: int,
    vocab: int,
    flag: np.ndarray,
    seq: int,
    tables: StackedTables,
    out: Any,
    word: StackedTables,
    words: Any,
) -> None:
    """Hash, stacked gather and word gather of ``B * L`` rows in ONE launch on the GPU.

    Parameters (launcher argument order)
    ----------
    ids : int64[B, L] (cupy, any strides)
        Output row ``b * L + l`` embeds ``ids[b, l]``.
    ctx : int64[B, C] (cupy, any strides), or None
        The tokens before each row; the last ``c`` (``c <= C``) are its look-back.
    multipliers, rows : int64[T, N], int64[T] (``NgramDims.multipliers``, table rows)
    eos, vocab : int
        Tokens outside ``[0, vocab)`` (those of ``ids`` and ``ctx[:, C - c:]``) are not
        read as rows: their output rows are zeros and ``flag[0]`` is set to ``seq``.
    flag : int64[1] pinned host memory (``cupyx.empty_pinned``), mapped
        Written by the kernel; read it once the stream's work ran (a sync), and treat
        ``flag[0] == seq`` as an error (:func:`first_bad_token` names the token).
    tables, out, word, words : as :func:`rowcache.kernels.ngram.hash.hash_gather` (n = B * L)

    Bit-identical to :func:`hash_gather_rows_reference` for in-range tokens; no
    allocation, no sync.
    """
    require_cupy("hash_gather_rows")
    if ids.ndim != 2 or ids.dtype != np.int64:
        raise ConfigError(f"hash_gather_rows: ids must be int64[B, L], got {ids.dtype}{ids.shape}")
    B, L = (int(x) for x in ids.shape)
    C = 0 if ctx is None else int(ctx.shape[1])
    if ctx is not None and (ctx.ndim != 2 or ctx.dtype != np.int64 or int(ctx.shape[0]) != B):
        raise ConfigError(
            f"hash_gather_rows: ctx must be int64[{B}, C], got {ctx.dtype}{ctx.shape}"
        )
    if not 0 <= c <= C:
        raise ConfigError(f"hash_gather_rows: c = {c} context columns of {C}")
    if int(out.shape[0]) != B * L:
        raise ConfigError(f"hash_gather_rows: out has {out.shape[0]} rows for {B} x {L} ids")
    items, tail = gather_args("hash_gather_rows", multipliers, rows, eos, tables, out, word, words)
    if items == 0:
        return
    if c:
        cs0, cs1 = ctx.strides[0] // 8, ctx.strides[1] // 8
        cptr = ctx.data.ptr + (C - c) * ctx.strides[1]
    else:
        cs0 = cs1 = 0
        cptr = ids.data.ptr
    get_kernel(_SOURCE, "ngram_hash_gather_rows")(
        *item_launch(items),
        (
            np.uint64(ids.data.ptr),
            np.int64(ids.strides[0] // 8),
            np.int64(ids.strides[1] // 8),
            np.uint64(cptr),
            np.int64(cs0),
            np.int64(cs1),
            np.int64(L),
            np.int32(c),
            np.int64(vocab),
            np.uint64(flag.ctypes.data),
            np.int64(seq),
            *tail,
        ),
    )


__all__ = ["first_bad_token", "hash_gather_rows", "hash_gather_rows_reference", "rows_packed"]
