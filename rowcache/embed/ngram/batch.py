"""Several sequences packed for one n-gram embedding step.

Owns :class:`NgramBatch` (one concatenated int64 token array, per-sequence context
and embed lengths, validated once, with the derived positions computed by
``np.repeat``/``cumsum`` and never a Python loop per sequence) and
:func:`hash_positions` (``rowcache.kernels.host``), the LongCat ids of chosen positions only,
on the host.
Does not gather rows or keep state between steps (``rowcache.embed.ngram.context`` does).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from rowcache.embed.ngram.dims import NgramDims
from rowcache.embed.ngram.ids import check_tokens
from rowcache.errors import ConfigError
from rowcache.kernels.host import hash_packed
from rowcache.kernels.host import hash_positions_reference as hash_positions
from rowcache.kernels.loader import is_device_array

_I64 = np.dtype(np.int64)
# up to these many sequences / tokens are checked on Python ints: each NumPy call costs
# ~1.5 us (a reduction) to ~7 us (an elementwise test and any), a list's min far less
_FEW_SEQS, _FEW_TOKENS = 64, 32


def _int_vector(name: str, value: Any, count: int | None) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ConfigError(
            f"{name} must be a 1-D sequence of ints, got {arr.dtype}{list(arr.shape)}"
        )
    if count is not None and arr.shape[0] != count:
        raise ConfigError(f"{name} has {arr.shape[0]} entries, expected {count} (one per sequence)")
    return arr.astype(_I64, copy=False)


class NgramBatch:
    """Contexts of ``S`` sequences packed into one token array.

    Parameters
    ----------
    dims : NgramDims
    tokens : int[L_total], numpy, cupy or list
        Every sequence's context (kept look-back + new tokens), concatenated in
        sequence order. Host tokens are range-checked here once; device tokens keep
        their range check for the hash kernel (no host sync here).
    ctx_lens : int[S]
        Context length of each sequence (sums to ``L_total``).
    seq_lens : int[S]
        How many trailing positions of each context to embed (``0 <= seq_lens <= ctx_lens``).

    Attributes
    ----------
    tokens : int64[L_total], numpy (host) or cupy (device)
    ctx_lens, seq_lens : int64[S], numpy
    n : int, ``sum(seq_lens)``: the output rows, sequence by sequence.
    length : int, ``L_total``.

    Notes
    -----
    The derived arrays (``begin``, ``starts``, ``positions``, ``row_first``,
    ``word_ids``) are computed once, on first use, with ``np.repeat``/``cumsum``.
    Look-back never crosses from one sequence into the next.
    """

    def __init__(
        self,
        dims: NgramDims,
        tokens: Any,
        ctx_lens: Any,
        seq_lens: Any,
        *,
        _names: str = "tokens",
        _checked: bool = False,
    ) -> None:
        if not isinstance(dims, NgramDims):
            raise ConfigError(f"dims must be an NgramDims, got {type(dims).__name__}")
        self.dims = dims
        self._names = _names  # "tokens", "ctx_tokens" (one sequence) or "contexts"
        self.on_device = is_device_array(tokens)
        if not self.on_device:
            tokens = np.asarray(tokens)
            if tokens.size == 0 and tokens.dtype.kind == "f":
                tokens = tokens.astype(_I64)  # np.asarray([]) is float64
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise ConfigError(
                f"{_names} must be a 1-D integer array of token ids, got "
                f"{tokens.dtype}{list(tokens.shape)}"
            )
        self.ctx_lens = _int_vector("ctx_lens", ctx_lens, None)
        S = self.ctx_lens.shape[0]
        if S == 0:
            raise ConfigError("an NgramBatch needs at least one sequence (ctx_lens is empty)")
        self.seq_lens = _int_vector("seq_lens", seq_lens, S)
        small = S <= _FEW_SEQS
        cl = self.ctx_lens.tolist() if small else self.ctx_lens
        lo, total = (min(cl), sum(cl)) if small else (int(cl.min()), int(cl.sum()))
        if lo < 0 or total != tokens.shape[0]:
            raise ConfigError(
                f"ctx_lens must be >= 0 and sum to len(tokens)={tokens.shape[0]}, "
                f"got sum {total} (min {lo})"
            )
        if small:
            sl = self.seq_lens.tolist()
            ok = min(sl) >= 0 and all(map(operator.le, sl, cl))
            n = sum(sl)
        else:
            ok = int(self.seq_lens.min()) >= 0 and not bool((self.seq_lens > cl).any())
            n = int(self.seq_lens.sum())
        if not ok:
            bad = (self.seq_lens < 0) | (self.seq_lens > self.ctx_lens)
            s = int(np.flatnonzero(bad)[0])
            k, L = int(self.seq_lens[s]), int(self.ctx_lens[s])
            where = "ctx_tokens" if S == 1 and _names == "ctx_tokens" else f"{_names}[{s}]"
            raise ConfigError(
                f"seq_len={k} for {where} must be an int in [0, {L}] (the context length)"
            )
        if self.on_device:
            import cupy as cp

            self.tokens = cp.ascontiguousarray(tokens, dtype=cp.int64)
        else:
            self.tokens = np.ascontiguousarray(tokens, dtype=_I64)
            if not _checked:
                self._check_range()
        self.num_seqs = S
        self.n = n
        self.length = int(tokens.shape[0])

    @classmethod
    def from_contexts(
        cls, dims: NgramDims, contexts: Sequence[Any], seq_lens: Sequence[int] | Any
    ) -> NgramBatch:
        """Pack a list of per-sequence contexts (numpy, cupy or lists) once.

        All-device contexts stay on the device (one ``cupy.concatenate``); any other
        mix is packed on the host. The per-context work is ``len`` and the
        concatenation; per-context checks run only to name a bad context.
        """
        if len(contexts) != len(seq_lens) or len(contexts) == 0:
            raise ConfigError(
                f"contexts ({len(contexts)}) and seq_lens ({len(seq_lens)}) must be "
                "non-empty and of one length"
            )
        names = "ctx_tokens" if len(contexts) == 1 else "contexts"
        S = len(contexts)
        tokens: Any
        if set(map(type, contexts)) == {np.ndarray}:  # the common case: C-level passes only
            try:
                lens = np.fromiter(map(len, contexts), dtype=_I64, count=S)
                tokens = np.concatenate(contexts) if S > 1 else contexts[0]
                if tokens.ndim == 1 and tokens.dtype.kind in "iu" and tokens.shape[0] == lens.sum():
                    return cls(dims, tokens, lens, _seq_lens(seq_lens), _names=names)
            except (ValueError, TypeError):
                pass  # a 0-d or ragged context: named below
        lens = np.fromiter(map(_length, contexts), dtype=_I64, count=S)
        on_device = all(map(is_device_array, contexts))
        try:
            if on_device:
                import cupy as cp

                tokens = cp.concatenate(contexts) if len(contexts) > 1 else contexts[0]
            else:
                host = [c.get() if is_device_array(c) else c for c in contexts]
                tokens = np.concatenate(host) if len(host) > 1 else np.asarray(host[0])
                if tokens.size == 0:
                    tokens = tokens.astype(_I64)
            clean = tokens.ndim == 1 and tokens.dtype.kind in "iu" and tokens.shape[0] == lens.sum()
        except (ValueError, TypeError):
            clean = False
        if not clean:  # name the first bad context (a loop on the error path only)
            for s, c in enumerate(contexts):
                check_tokens(
                    dims, c, name="ctx_tokens" if names == "ctx_tokens" else f"contexts[{s}]"
                )
            raise ConfigError(f"contexts must be 1-D integer token arrays, got {contexts!r:.200}")
        return cls(dims, tokens, lens, _seq_lens(seq_lens), _names=names)

    @classmethod
    def single(cls, dims: NgramDims, ctx_tokens: Any, seq_len: Any) -> NgramBatch:
        """One sequence: ``embed(ctx_tokens, seq_len)``."""
        if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)):
            raise ConfigError(
                f"seq_len={seq_len!r} for ctx_tokens must be an int in [0, len(ctx_tokens)]"
            )
        if not is_device_array(ctx_tokens):
            ctx_tokens = np.asarray(ctx_tokens)
            if ctx_tokens.size == 0 and ctx_tokens.dtype.kind == "f":
                ctx_tokens = ctx_tokens.astype(_I64)
        length = int(ctx_tokens.shape[0]) if getattr(ctx_tokens, "ndim", 0) >= 1 else 0
        return cls(dims, ctx_tokens, np.array([length]), np.array([seq_len]), _names="ctx_tokens")

    # --- validation -----------------------------------------------------------
    def _check_range(self) -> None:
        tok = self.tokens
        if not tok.size:
            return
        if tok.size <= _FEW_TOKENS:
            v = tok.tolist()
            lo, hi = min(v), max(v)
        else:
            lo, hi = int(tok.min()), int(tok.max())
        if lo < 0 or hi >= self.dims.vocab_size:
            bad = (tok < 0) | (tok >= self.dims.vocab_size)
            p = int(np.flatnonzero(bad)[0])
            raise ConfigError(
                f"{self.name_position(p)} = {int(tok[p])} is outside the vocabulary "
                f"[0, {self.dims.vocab_size})"
            )

    def name_position(self, p: int) -> str:
        """How an error names packed position ``p``: ``contexts[s][k]`` or ``tokens[p]``."""
        if self._names == "ctx_tokens":
            return f"ctx_tokens[{p}]"
        s = int(np.searchsorted(self.begin, p, side="right")) - 1
        k = p - int(self.begin[s])
        if self._names == "contexts":
            return f"contexts[{s}][{k}]"
        return f"tokens[{p}] (sequence {s}, position {k})"

    # --- derived positions ----------------------------------------------------
    @functools.cached_property
    def begin(self) -> np.ndarray:
        """int64[S]: where each sequence's context starts in ``tokens``."""
        return np.cumsum(self.ctx_lens) - self.ctx_lens

    @functools.cached_property
    def starts(self) -> np.ndarray | None:
        """int64[L_total]: each position's sequence start (None for one sequence)."""
        if self.num_seqs == 1:
            return None
        return np.repeat(self.begin, self.ctx_lens)

    @functools.cached_property
    def positions(self) -> np.ndarray:
        """int64[n]: the embedded positions in ``tokens``, sequence by sequence."""
        if self.num_seqs == 1:
            L = self.length
            return np.arange(L - self.n, L, dtype=_I64)
        first = self.begin + self.ctx_lens - self.seq_lens
        return np.repeat(first - (np.cumsum(self.seq_lens) - self.seq_lens), self.seq_lens) + (
            np.arange(self.n, dtype=_I64)
        )

    @property
    def selection(self) -> slice | np.ndarray:
        """The embedded positions as a slice (one sequence) or :attr:`positions`."""
        if self.num_seqs == 1:
            return slice(self.length - self.n, self.length)
        return self.positions

    @functools.cached_property
    def row_first(self) -> np.ndarray | int:
        """int64[n] (or 0 for one sequence): each output row's sequence start."""
        if self.num_seqs == 1:
            return 0
        return np.repeat(self.begin, self.seq_lens)

    @functools.cached_property
    def word_ids(self) -> Any:
        """int64[n]: the token of each output row (host or device, like ``tokens``)."""
        if self.num_seqs == 1:
            return self.tokens[self.length - self.n :]
        if self.on_device:
            return self.tokens[_dev(self.positions)]
        return self.tokens[self.positions]

    def host_ids(self, tables: Any = None, offsets: np.ndarray | None = None) -> np.ndarray:
        """Ids of the embedded positions on the host: int64[len(tables), n].

        ``tables`` : int[k] table indices (default all ``num_tables``); ``offsets``
        int64[k], added to each table's ids (global ids of a shared arena). Host
        tokens only (device tokens must be hashed on the device).
        """
        assert not self.on_device, "host_ids needs host tokens"
        mult, rows = self.dims.table_subset(tables)
        return hash_packed(
            self.tokens,
            self.ctx_lens,
            self.seq_lens,
            mult,
            rows,
            self.dims.eos_token_id,
            offsets,
            self.n,
        )

    def rows_per_sequence(self, values: Any) -> np.ndarray:
        """``values`` (one per sequence) repeated for each output row: ``[n]``."""
        return np.repeat(np.asarray(values), self.seq_lens)

    def __repr__(self) -> str:
        where = "cuda" if self.on_device else "cpu"
        return f"NgramBatch(seqs={self.num_seqs}, tokens={self.length}, rows={self.n}, {where})"


def _length(c: Any) -> int:
    shape = getattr(c, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else -1
    return len(c)


def _seq_lens(seq_lens: Any) -> np.ndarray:
    if isinstance(seq_lens, np.ndarray):
        return seq_lens
    values = list(seq_lens)
    arr = np.array(values)
    if arr.ndim != 1 or arr.dtype.kind not in "iu" or bool in set(map(type, values)):
        for s, k in enumerate(values):  # name the first bad entry (error path only)
            if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
                raise ConfigError(
                    f"seq_lens[{s}]={k!r} must be an int (how many positions to embed)"
                )
    return arr.astype(_I64, copy=False)


def _dev(a: np.ndarray) -> Any:
    import cupy as cp

    return cp.asarray(a)


__all__ = ["NgramBatch", "hash_positions"]
