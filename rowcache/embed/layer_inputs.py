"""The checks of ``NgramEmbedding``'s constructor inputs, and the stacked projections.

Owns the table checks (variants, shapes, one device), the projections stacked into one
bfloat16 ``[T*d, D]`` GEMM operand and the ``gemm_splits`` check; each raises
``ConfigError`` naming the argument. Does not hold state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rowcache.embed.ngram.dims import NgramDims
from rowcache.embed.tables import Bf16Table, CachedTable, Fp8Table
from rowcache.errors import ConfigError
from rowcache.kernels.gemm import split_k
from rowcache.kernels.loader import is_device_array
from rowcache.kernels.reference import BF16

_TABLE_TYPES = (Bf16Table, Fp8Table, CachedTable)


def _as_table(name: str, t: Any) -> Any:
    if isinstance(t, _TABLE_TYPES):
        return t
    if hasattr(t, "ndim") and hasattr(t, "dtype"):
        return Bf16Table(t)
    raise ConfigError(
        f"{name} must be a Bf16Table, Fp8Table, CachedTable or a bf16 array, got {type(t).__name__}"
    )


def check_tables(dims: NgramDims, word: Any, tables: Sequence[Any]) -> tuple[Any, list[Any], str]:
    """``(word table, n-gram tables, device)``: bf16 arrays wrapped as ``Bf16Table``,
    shapes checked against ``dims``, one device for all."""
    T, d, D = dims.num_tables, dims.table_dim, dims.hidden_size
    word = _as_table("word", word)
    if (word.rows, word.dim) != (dims.vocab_size, D):
        raise ConfigError(
            f"word table is [{word.rows}, {word.dim}], expected "
            f"[vocab_size {dims.vocab_size}, hidden_size {D}]"
        )
    if len(tables) != T:
        raise ConfigError(f"tables has {len(tables)} entries, expected num_tables={T}")
    tables = [_as_table(f"tables[{i}]", t) for i, t in enumerate(tables)]
    for i, t in enumerate(tables):
        if (t.rows, t.dim) != (dims.table_rows(i), d):
            raise ConfigError(
                f"tables[{i}] is [{t.rows}, {t.dim}], expected "
                f"[{dims.table_rows(i)}, {d}] (table_rows({i}), table_dim)"
            )
    devices = {word.device, *(t.device for t in tables)}
    if len(devices) != 1:
        raise ConfigError(
            f"the word table and the n-gram tables must share one device, got "
            f"{sorted(devices)}; move resident tables with .to(device)"
        )
    return word, tables, devices.pop()


def stack_projs(dims: NgramDims, projs: Any) -> np.ndarray:
    """The projections ``W_i`` (bfloat16/float32 ``[D, d]`` each, or one ``[T, D, d]``)
    stacked transposed: bfloat16[T*d, D] on the host."""
    T, d, D = dims.num_tables, dims.table_dim, dims.hidden_size
    if hasattr(projs, "ndim"):
        if projs.shape != (T, D, d):
            raise ConfigError(f"projs must be [{T}, {D}, {d}], got {list(projs.shape)}")
        projs = [projs[i] for i in range(T)]
    if len(projs) != T:
        raise ConfigError(f"projs has {len(projs)} entries, expected num_tables={T}")
    out = np.empty((T * d, D), dtype=BF16)
    for i, w in enumerate(projs):
        w = w.get() if is_device_array(w) else np.asarray(w)
        if w.shape != (D, d) or w.dtype not in (BF16, np.dtype(np.float32)):
            raise ConfigError(
                f"projs[{i}] must be bfloat16/float32 [{D}, {d}] (nn.Linear layout), "
                f"got {w.dtype}{list(w.shape)}"
            )
        out[i * d : (i + 1) * d] = w.T.astype(BF16)
    return out


def check_gemm_splits(dims: NgramDims, gemm_splits: Any) -> int | None:
    """``gemm_splits`` as an int (or None), checked against ``T*d``."""
    T, d = dims.num_tables, dims.table_dim
    if gemm_splits is not None and (
        isinstance(gemm_splits, bool) or not split_k(T * d, int(gemm_splits))
    ):
        raise ConfigError(
            f"gemm_splits={gemm_splits!r}: give a count that divides T*d = {T * d} "
            "into chunks of a multiple of 8, or None"
        )
    return None if gemm_splits is None else int(gemm_splits)
