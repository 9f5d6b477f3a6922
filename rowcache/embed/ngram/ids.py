"""The LongCat n-gram ids: which row of each table a token position reads.

Owns :func:`ngram_ids` (validated, vectorized over tables and positions; NumPy on
the CPU, the ``rowcache.kernels.ngram.hash`` CUDA kernel for cupy input) and
:func:`ngram_ids_loop_reference`, a plain loop written straight from the formula of
``docs/ngram-spec.md`` that both are tested against. Does not gather any rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rowcache.embed.ngram.dims import NgramDims
from rowcache.errors import ConfigError
from rowcache.kernels.loader import is_device_array
from rowcache.kernels.ngram.hash import ngram_hash


def check_tokens(
    dims: NgramDims, tokens: Any, name: str = "ctx_tokens", *, check_range: bool = True
) -> Any:
    """Validate a 1-D integer token array against ``[0, vocab_size)``; return it.

    ``check_range=False`` checks only the dtype and shape (for a caller that checks
    the range inside its hash kernel, e.g. ``NgramEmbedding`` on the GPU).

    Raises
    ------
    ConfigError (a ValueError)
        For a non-1-D or non-integer array, or a token outside the vocabulary; the
        message names the first bad position and its value.
    """
    if is_device_array(tokens):
        xp: Any = __import__("cupy")
    else:
        xp = np
        tokens = np.asarray(tokens)
        if tokens.size == 0 and tokens.dtype.kind == "f":
            tokens = tokens.astype(np.int64)  # np.asarray([]) is float64
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise ConfigError(
            f"{name} must be a 1-D integer array of token ids, got {tokens.dtype}{list(tokens.shape)}"
        )
    if check_range and tokens.size:
        bad = (tokens < 0) | (tokens >= dims.vocab_size)
        if bool(bad.any()):
            first = int(xp.flatnonzero(bad)[0])
            raise ConfigError(
                f"{name}[{first}] = {int(tokens[first])} is outside the vocabulary "
                f"[0, {dims.vocab_size})"
            )
    return tokens


def ngram_ids(dims: NgramDims, ctx_tokens: Any) -> Any:
    """The id of every n-gram table at every position of ``ctx_tokens``.

    Parameters
    ----------
    dims : NgramDims
    ctx_tokens : int[L], numpy or cupy
        Token ids in ``[0, vocab_size)``; position 0 has no look-back.

    Returns
    -------
    int64[num_tables, L]
        ``ids[i, t] = (sum_j xt(t - j) * (V**j mod M_i)) mod M_i`` with the spec's EOS
        rule; on the device of ``ctx_tokens``. CPU and GPU results are bit-identical.
    """
    tokens = check_tokens(dims, ctx_tokens)
    mult = dims.multipliers
    rows = dims.all_table_rows
    return ngram_hash(tokens, mult, rows, dims.eos_token_id)


def ngram_ids_loop_reference(dims: NgramDims, ctx_tokens: Any) -> np.ndarray:
    """Plain-loop ids straight from the spec's formula (slow; tests only).

    Uses Python integers and the unreduced base ``V**j``; a look-back position
    ``t - j`` (``j >= 1``) contributes its token only if it exists and no EOS lies in
    positions ``t - j .. t - 1``.
    """
    x = [int(v) for v in np.asarray(ctx_tokens).reshape(-1)]
    v = dims.vocab_size
    out = np.zeros((dims.num_tables, len(x)), dtype=np.int64)
    for i in range(dims.num_tables):
        n = dims.table_order(i)
        m_i = dims.table_rows(i)
        for t in range(len(x)):
            total = 0
            for j in range(n):
                if j == 0:
                    xt = x[t]
                elif t - j >= 0 and all(x[p] != dims.eos_token_id for p in range(t - j, t)):
                    xt = x[t - j]
                else:
                    xt = 0
                total += xt * v**j
            out[i, t] = total % m_i
    return out


__all__ = ["check_tokens", "ngram_ids", "ngram_ids_loop_reference"]
