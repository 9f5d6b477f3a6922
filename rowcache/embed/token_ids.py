"""Token-id arrays as the hosts' n-gram hashes take them: the checks Engram's and
Qwen3.8-Flash-Next's hashes share (``rowcache.embed.engram.hash``, ``rowcache.embed.qwen4.hash``).

Owns :func:`token_ids_2d` (a call's tokens or context as C-contiguous int64 ``[B, T]``, a
server's own array taken as it is), :func:`checked_ids_out` (an ``out=`` array of row ids) and
:func:`padded_history` (tokens after their look-back, as the NumPy references read them).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rowcache.errors import ConfigError

_I64 = np.dtype(np.int64)


def checked_ids_out(out: Any, shape: tuple[int, ...]) -> np.ndarray:
    """``out`` checked to be a writable C-contiguous int64 array of ``shape``."""
    if (
        not isinstance(out, np.ndarray)
        or out.dtype != _I64
        or out.shape != shape
        or not out.flags.c_contiguous
        or not out.flags.writeable
    ):
        got = f"{out.dtype} {out.shape}" if isinstance(out, np.ndarray) else type(out).__name__
        raise ConfigError(
            f"out: give a writable C-contiguous int64 array of shape {shape}, got {got}"
        )
    return out


def token_ids_2d(name: str, value: Any) -> np.ndarray:
    """``value`` as C-contiguous int64 [B, T] (1-D: one sequence); ConfigError naming ``name``
    where it is not integer token ids."""
    if (
        type(value) is np.ndarray
        and value.dtype == _I64
        and value.ndim == 2
        and value.flags.c_contiguous
    ):  # a server's own array: taken as it is (a decode step's call costs microseconds)
        return value
    a = np.asarray(value)
    if a.size == 0 and a.dtype.kind == "f":  # [] or [[]]: no tokens, not float ones
        a = a.astype(np.int64)
    if a.dtype.kind not in "iu":
        raise ConfigError(f"{name}: give integer token ids, got {a.dtype}")
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2:
        raise ConfigError(f"{name}: give [batch, tokens] ids, got shape {a.shape}")
    if a.dtype == np.uint64 and a.size and int(a.max()) > np.iinfo(np.int64).max:
        raise ConfigError(f"{name}: {int(a.max())} is not a token id")
    return np.ascontiguousarray(a, dtype=np.int64)


def padded_history(tokens: Any, context: Any, keep: int, fill: int) -> np.ndarray:
    """int64 [B, keep + T]: ``tokens`` after ``keep`` columns of look-back, the last of
    ``context`` (int [B, C], or None) with ``fill`` before it: the history a hash's NumPy
    reference reads."""
    t = token_ids_2d("tokens", tokens)
    x = np.full((t.shape[0], keep + t.shape[1]), fill, dtype=np.int64)
    x[:, keep:] = t
    if context is not None:
        c = token_ids_2d("context", context)
        if c.shape[0] != t.shape[0]:
            raise ConfigError(
                f"context has {c.shape[0]} rows and tokens {t.shape[0]}: one per sequence"
            )
        c = c[:, max(0, c.shape[1] - keep) :]
        x[:, keep - c.shape[1] : keep] = c
    return x


def first_bad_token(
    tokens: Any, context: Any, keep: int, vocab: int, ids_name: str
) -> ConfigError | None:
    """The error naming the first token a hash reads outside ``[0, vocab)``: in ``tokens``,
    or in the last ``keep`` columns of ``context`` (the look-back it reads), as
    ``"{name}[b, c] = v is outside {ids_name} [0, vocab)"``; None where every one is in range."""
    for name, value in (("tokens", tokens), ("context", context)):
        if value is None:
            continue
        a = token_ids_2d(name, value)
        skip = max(0, a.shape[1] - keep) if name == "context" else 0  # not read
        bad = np.argwhere((a[:, skip:] < 0) | (a[:, skip:] >= vocab))
        if bad.size:
            b, c = int(bad[0][0]), int(bad[0][1]) + skip
            return ConfigError(
                f"{name}[{b}, {c}] = {int(a[b, c])} is outside {ids_name} [0, {vocab})"
            )
    return None


__all__ = ["checked_ids_out", "first_bad_token", "padded_history", "token_ids_2d"]
