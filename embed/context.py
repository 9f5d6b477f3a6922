"""Per-sequence n-gram context for incremental decoding (the spec's NgramCache contract).

Owns :class:`NgramContext`: it keeps the last ``max_ngram - 1`` raw tokens of one
sequence and turns each forward's new tokens into the context that
``NgramEmbedding.embed(ctx_tokens, len(new_tokens))`` needs. Does not hash or gather.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernels._cuda import array_module

from .dims import NgramDims
from .ids import check_tokens


class NgramContext:
    """The kept look-back tokens of one sequence.

    Parameters
    ----------
    dims : NgramDims

    Examples
    --------
    >>> ctx = NgramContext(dims)
    >>> out = emb.embed(ctx.step(prompt), len(prompt))       # prefill
    >>> out = emb.embed(ctx.step([next_token]), 1)           # each decode step

    Prefill in one call, in chunks, or token by token gives identical ids and
    embeddings: the context always carries ``min(max_ngram - 1, seen)`` earlier
    tokens (EOS kept as is), which is all the hash looks back at.
    """

    def __init__(self, dims: NgramDims) -> None:
        if not isinstance(dims, NgramDims):
            raise TypeError(f"dims must be an NgramDims, got {type(dims).__name__}")
        self.dims = dims
        self._kept: Any = np.zeros(0, dtype=np.int64)
        self._seen = 0

    @property
    def keep(self) -> int:
        """How many tokens are carried between steps: ``max_ngram - 1``."""
        return self.dims.max_ngram - 1

    @property
    def kept_tokens(self) -> Any:
        """int64[min(keep, seen)]: the tokens the next step's context starts with."""
        return self._kept.copy()

    @property
    def tokens_seen(self) -> int:
        """Tokens passed to :meth:`step` since construction or :meth:`reset`."""
        return self._seen

    def step(self, new_tokens: Any) -> Any:
        """Append ``new_tokens`` and return the context for this forward.

        Parameters
        ----------
        new_tokens : int[L], numpy, cupy, or a list
            The prefill chunk or the decode token(s); each in ``[0, vocab_size)``.

        Returns
        -------
        int64[len(kept) + L]
            Kept tokens followed by ``new_tokens``, on the device of ``new_tokens``.
            Embed its last ``L`` positions. A bad token raises before any state changes.
        """
        new = check_tokens(self.dims, new_tokens, name="new_tokens")
        xp = array_module(new)
        kept = self._kept
        if array_module(kept) is not xp:
            kept = xp.asarray(kept) if xp is not np else array_module(kept).asnumpy(kept)
        ctx = xp.concatenate([kept, new.astype(xp.int64, copy=False)])
        self._kept = ctx[max(0, ctx.shape[0] - self.keep) :].copy()
        self._seen += int(new.shape[0])
        return ctx

    def reset(self) -> None:
        """Forget the sequence (a new request starts with no look-back)."""
        self._kept = np.zeros(0, dtype=np.int64)
        self._seen = 0

    def __repr__(self) -> str:
        return f"NgramContext(keep={self.keep}, seen={self._seen}, kept={self._kept.tolist()})"


__all__ = ["NgramContext"]
