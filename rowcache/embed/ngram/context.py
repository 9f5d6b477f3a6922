"""Per-sequence n-gram context for incremental decoding (the spec's NgramCache contract).

Owns :class:`NgramContext`: it keeps the last ``max_ngram - 1`` raw tokens of one
sequence and turns each forward's new tokens into the context that
``NgramEmbedding.embed(ctx_tokens, len(new_tokens))`` needs; and
:class:`NgramBatchContext`, the same for many sequences at once, vectorized (a
decode step of 256 sequences is a handful of NumPy calls, no loop per sequence),
returning an ``NgramBatch`` for ``NgramEmbedding.embed_packed``. Does not hash or gather.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rowcache.embed.ngram.batch import NgramBatch
from rowcache.embed.ngram.dims import NgramDims
from rowcache.embed.ngram.ids import check_tokens
from rowcache.errors import ConfigError
from rowcache.kernels.loader import array_module, is_device_array

_I64 = np.dtype(np.int64)


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

    What holds for a prefill in one call, in chunks, or token by token:

    - the n-gram ids, and so the gathered table rows, are identical: the context
      always carries ``min(max_ngram - 1, seen)`` earlier tokens (EOS kept as is),
      which is all the hash looks back at;
    - the embeddings are identical bit for bit for the same split (the same step
      shapes), e.g. resident vs cached tables, or two runs;
    - across different splits they can differ slightly, and only there: the float32
      projection GEMM's summation order depends on its row count (NumPy's BLAS blocks
      by it), so a few values in 10^4 round differently: by one bfloat16 ulp, or, for
      a value near zero after cancellation, by an absolute amount at float32 rounding
      of the sum's terms. Measured on the CPU (D = 384, 3,000 random tokens): 135 of
      1.15M values differ token by token vs one prefill (17 for chunks of 256), the
      largest by 6.1e-5 against a median magnitude of 3.7e-3. Compare different splits
      with ``rtol=2**-7`` plus a small ``atol``, not bit for bit.
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


class NgramBatchContext:
    """The kept look-back tokens of ``num_seqs`` sequences (slots), on the host.

    Parameters
    ----------
    dims : NgramDims
    num_seqs : int
        How many sequence slots (a server's maximum batch); each starts empty.

    Examples
    --------
    >>> ctx = NgramBatchContext(dims, 256)
    >>> out = emb.embed_packed(ctx.step(prompts, prompt_lens))  # prefill, every slot
    >>> out = emb.embed_packed(ctx.step(next_tokens))           # decode: one token per slot
    >>> out = emb.embed_packed(ctx.step(toks, seqs=active))     # only some slots this step

    Slot ``s`` behaves exactly like its own :class:`NgramContext` (same contexts,
    ids and embeddings); the state is a ``[num_seqs, keep]`` int64 array,
    right-aligned, with a count per slot. Token ids come from the host: a cupy
    ``new_tokens`` is copied to the host (one sync).
    """

    def __init__(self, dims: NgramDims, num_seqs: int) -> None:
        if not isinstance(dims, NgramDims):
            raise TypeError(f"dims must be an NgramDims, got {type(dims).__name__}")
        if (
            isinstance(num_seqs, bool)
            or not isinstance(num_seqs, (int, np.integer))
            or num_seqs < 1
        ):
            raise ConfigError(f"num_seqs={num_seqs!r} must be an int >= 1")
        self.dims = dims
        self.num_seqs = int(num_seqs)
        self.keep = dims.max_ngram - 1
        self._kept = np.zeros((self.num_seqs, self.keep), dtype=_I64)
        self._count = np.zeros(self.num_seqs, dtype=_I64)
        self._seen = np.zeros(self.num_seqs, dtype=_I64)
        self._all = np.arange(self.num_seqs, dtype=_I64)
        self._cols = np.arange(self.keep, dtype=_I64)

    @property
    def tokens_seen(self) -> np.ndarray:
        """int64[num_seqs]: tokens stepped into each slot since construction or reset."""
        return self._seen.copy()

    def kept_tokens(self, seq: int) -> np.ndarray:
        """int64[min(keep, seen)]: slot ``seq``'s look-back for its next step."""
        c = int(self._count[seq])
        return self._kept[seq, self.keep - c :].copy()

    def step(self, new_tokens: Any, new_lens: Any = None, *, seqs: Any = None) -> NgramBatch:
        """Append each slot's new tokens; return the packed contexts of this forward.

        Parameters
        ----------
        new_tokens : int[m_total], numpy, list (or cupy: copied to the host)
            The new tokens of the stepped slots, concatenated in ``seqs`` order.
        new_lens : int[B], optional
            How many new tokens each stepped slot gets (default one each: decode).
        seqs : int[B], optional
            Which slots step, in output order, each at most once (default all
            ``num_seqs``, in order).

        Returns
        -------
        NgramBatch
            Tokens checked once; ``ctx_lens = kept + new_lens``, ``seq_lens = new_lens``.
            A bad token or argument raises before any state changes.
        """
        if seqs is None:
            sq = self._all
        else:
            sq = np.asarray(seqs)
            if sq.ndim != 1 or (sq.size and sq.dtype.kind not in "iu"):
                raise ConfigError(
                    f"seqs must be a 1-D int array of slots, got {sq.dtype}{list(sq.shape)}"
                )
            sq = sq.astype(_I64, copy=False)
            if sq.size and (int(sq.min()) < 0 or int(sq.max()) >= self.num_seqs):
                raise ConfigError(
                    f"seqs must lie in [0, {self.num_seqs}), got {sq.min()}..{sq.max()}"
                )
            if np.unique(sq).size != sq.size:
                raise ConfigError("seqs must name each slot at most once per step")
        B = sq.shape[0]
        if is_device_array(new_tokens):
            new_tokens = new_tokens.get()
        new = check_tokens(self.dims, new_tokens, name="new_tokens").astype(_I64, copy=False)
        if new_lens is None:
            m = np.ones(B, dtype=_I64)
        else:
            m = np.asarray(new_lens)
            if m.ndim != 1 or m.shape[0] != B or (m.size and m.dtype.kind not in "iu"):
                raise ConfigError(
                    f"new_lens must be int[{B}] (one per stepped slot), got {m.dtype}{list(m.shape)}"
                )
            m = m.astype(_I64, copy=False)
            if m.size and int(m.min()) < 0:
                raise ConfigError(f"new_lens must be >= 0, got {int(m.min())}")
        if int(m.sum()) != new.shape[0]:
            raise ConfigError(
                f"new_tokens has {new.shape[0]} tokens but new_lens sums to {int(m.sum())}"
            )
        keep = self.keep
        c = self._count[sq]
        ctx_lens = c + m
        total = int(ctx_lens.sum())
        begin = np.cumsum(ctx_lens) - ctx_lens
        out = np.empty(total, dtype=_I64)
        # kept tokens: the right-aligned tail of each stepped row
        kept_rows = self._kept[sq]
        mask = self._cols[None, :] >= (keep - c)[:, None]
        dst = (begin - (keep - c))[:, None] + self._cols[None, :]
        out[dst[mask]] = kept_rows[mask]
        # new tokens: after each slot's kept ones
        new_begin = np.cumsum(m) - m
        out[np.repeat(begin + c - new_begin, m) + np.arange(new.shape[0], dtype=_I64)] = new
        # the next look-back: the last `keep` tokens of each context
        end = begin + ctx_lens
        src = (end - keep)[:, None] + self._cols[None, :]
        valid = src >= begin[:, None]
        if total:
            self._kept[sq] = np.where(valid, out[np.maximum(src, 0)], 0)
        self._count[sq] = np.minimum(ctx_lens, keep)
        self._seen[sq] += m
        return NgramBatch(self.dims, out, ctx_lens, m, _checked=True)

    def reset(self, seqs: Any = None) -> None:
        """Forget slots ``seqs`` (default all): a new request starts with no look-back."""
        if seqs is None:
            which = self._all
        else:
            sq = np.asarray(seqs)
            if sq.ndim > 1 or sq.dtype == np.bool_ or (sq.size and sq.dtype.kind not in "iu"):
                raise ConfigError(
                    f"seqs must be a slot or a 1-D int array of slots, got {sq.dtype}{list(sq.shape)}"
                )
            which = sq.astype(_I64).reshape(-1)
            if which.size and (int(which.min()) < 0 or int(which.max()) >= self.num_seqs):
                bad = int(which[(which < 0) | (which >= self.num_seqs)][0])
                raise ConfigError(
                    f"seqs: slot {bad} is not in [0, {self.num_seqs}) (negative slots are "
                    "refused, not counted from the end); nothing was reset"
                )
        self._kept[which] = 0
        self._count[which] = 0
        self._seen[which] = 0

    def __repr__(self) -> str:
        return f"NgramBatchContext(num_seqs={self.num_seqs}, keep={self.keep})"


__all__ = ["NgramBatchContext", "NgramContext"]
