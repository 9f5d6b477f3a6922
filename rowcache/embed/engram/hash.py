"""Engram's row ids: every layer's head ids at every position, from the token ids alone.

Owns :class:`EngramHash` (the multipliers and head primes of a config over a compressed
vocabulary; ``hash`` runs the native ``EngramHasher`` of ``rowcache.kernels._host``,
``csrc/engram_hash.c``, made once with them), :class:`EngramContext` (one batch's look-back between steps) and
:func:`hash_reference`, the NumPy statement of docs/engram-spec.md section 4 that the
kernel is tested against bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rowcache.embed.engram.config import EngramConfig, head_primes
from rowcache.embed.engram.vocab import CompressedVocab
from rowcache.embed.token_ids import (
    checked_ids_out,
    first_bad_token,
    padded_history,
    token_ids_2d,
)
from rowcache.errors import ConfigError
from rowcache.kernels import extensions, host

_PRIME_SEED_STEP = 10007  # each layer's multiplier seed: seed + 10007 * layer
_PATH_ENV = "ROWCACHE_ENGRAM_HASH"  # read by the native hasher: avx512, avx2 or scalar


def layer_multipliers(config: EngramConfig, vocab_size: int) -> dict[int, np.ndarray]:
    """Each layer's odd multipliers, int64 ``[max_ngram]`` (docs/engram-spec.md section 2):
    below ``2**63 / vocab_size`` so that no product of a compressed token wraps."""
    bound = max(1, ((2**63 - 1) // vocab_size) // 2)
    out = {}
    for layer in config.layer_ids:
        g = np.random.default_rng(config.seed + _PRIME_SEED_STEP * layer)
        r = g.integers(0, bound, size=(config.max_ngram,), dtype=np.int64)
        out[layer] = r * 2 + 1
    return out


def hash_reference(
    compressed: np.ndarray,
    ctx: int,
    multipliers: np.ndarray,
    primes: np.ndarray,
) -> np.ndarray:
    """Head ids of one layer (docs/engram-spec.md section 4), vectorized NumPy: the spec.

    Parameters
    ----------
    compressed : int64 [B, W]
        Compressed token ids; the first ``ctx`` columns are look-back only (positions before
        a sequence's start hold the compressed pad id).
    ctx : int
        Look-back columns, at least ``max_ngram - 1``.
    multipliers : int64 [max_ngram]
    primes : int64 [max_ngram - 1, heads]

    Returns
    -------
    int64 [B, W - ctx, (max_ngram - 1) * heads]: order 2's heads, then order 3's, ...
    """
    x = np.asarray(compressed, dtype=np.int64)
    n_max = multipliers.size
    W = x.shape[1]
    shifted = [x[:, ctx - k : W - k] for k in range(n_max)]
    out = []
    mix = shifted[0] * multipliers[0]
    for n in range(2, n_max + 1):
        mix = np.bitwise_xor(mix, shifted[n - 1] * multipliers[n - 1])
        for p in primes[n - 2]:
            out.append(mix % p)
    return np.stack(out, axis=2)


class EngramHash:
    """The row ids of every Engram layer, bit-exact with DeepSeek's ``NgramHashMapping``.

    Parameters
    ----------
    config : EngramConfig
    vocab : CompressedVocab (``CompressedVocab.from_tokenizer``)

    Attributes
    ----------
    multipliers : {layer_id: int64 [max_ngram]}
    primes : {layer_id: int64 [max_ngram - 1, n_head_per_ngram]}: each head's rows
    pad : the compressed pad id

    Examples
    --------
    >>> h = EngramHash(EngramConfig(), CompressedVocab.from_tokenizer("tokenizer.json"))
    >>> ids = h.hash(tokens)              # {1: int64 [B, T, 16], 15: ...}
    >>> rows = ids[1] + h.head_offsets(1) # rows of layer 1's one table of h.table_rows(1)
    """

    def __init__(self, config: EngramConfig, vocab: CompressedVocab) -> None:
        if not isinstance(config, EngramConfig):
            raise ConfigError(f"config must be an EngramConfig, got {type(config).__name__}")
        if not isinstance(vocab, CompressedVocab):
            raise ConfigError(f"vocab must be a CompressedVocab, got {type(vocab).__name__}")
        if config.compressed_vocab_size is not None and config.compressed_vocab_size != len(vocab):
            raise ConfigError(
                f"the config's compressed_vocab_size is {config.compressed_vocab_size:,} but "
                f"this tokenizer compresses to {len(vocab):,} ids: a different tokenizer?"
            )
        if config.pad_id >= vocab.tokenizer_size:
            raise ConfigError(
                f"pad_id={config.pad_id} is outside the tokenizer's ids [0, {vocab.tokenizer_size})"
            )
        self.config = config
        self.vocab = vocab
        self.layer_ids = config.layer_ids
        self.multipliers = layer_multipliers(config, len(vocab))
        self.primes = head_primes(config)
        if config.num_embeddings is not None:
            rows = [int(self.primes[layer].sum()) for layer in config.layer_ids]
            if list(config.num_embeddings) != rows:
                raise ConfigError(
                    f"the config's num_embeddings (engram_num_embeddings) is "
                    f"{list(config.num_embeddings)}, but the hash's tables of layers "
                    f"{list(config.layer_ids)} have {rows} rows (the sums of their heads' "
                    "primes): the hash's other fields do not match the checkpoint's tables"
                )
        self.pad = int(vocab.lookup[config.pad_id])
        self._n_layers, self._heads = len(config.layer_ids), config.heads_per_layer
        self._pad_id = config.pad_id  # a decode step's call reads these, not the properties
        # the native hasher holds the vocabulary, multipliers and primes from here on; it
        # takes AVX2 where the CPU runs it (its .path; AVX-512 only when asked), or the
        # path ROWCACHE_ENGRAM_HASH names
        self._native: Any = None
        if host.native is None:
            extensions.fallback("rowcache.kernels._host")
        else:
            try:
                self._native = host.native.EngramHasher(
                    vocab.lookup,
                    np.stack([self.multipliers[i] for i in self.layer_ids]),
                    np.stack([self.primes[i].reshape(-1) for i in self.layer_ids]),
                    config.n_head_per_ngram,
                )
            except ValueError as e:  # a path asked for that cannot run
                if _PATH_ENV not in str(e):
                    raise
                raise ConfigError(str(e).removeprefix("EngramHasher: ")) from None

    @property
    def path(self) -> str:
        """The reduction the hash runs: ``"avx2"`` (the default where the CPU has it),
        ``"avx512"`` (asked by ``ROWCACHE_ENGRAM_HASH``), ``"scalar"`` (the native fallback),
        or ``"reference"`` (no native module: the NumPy statement)."""
        return str(self._native.path) if self._native is not None else "reference"

    @property
    def keep(self) -> int:
        """Tokens of look-back a position needs: ``max_ngram - 1``."""
        return self.config.max_ngram - 1

    def table_rows(self, layer_id: int) -> int:
        """Rows of ``layer_id``'s one table (its heads' tables end to end): the sum of its primes."""
        return int(self._layer_primes(layer_id).sum())

    def head_offsets(self, layer_id: int) -> np.ndarray:
        """int64 ``[heads_per_layer]``: each head's first row in the layer's table."""
        p = self._layer_primes(layer_id).reshape(-1)
        return np.concatenate([[0], np.cumsum(p[:-1])]).astype(np.int64)

    def _layer_primes(self, layer_id: int) -> np.ndarray:
        if layer_id not in self.primes:
            raise ConfigError(
                f"layer_id={layer_id!r} holds no Engram memory; layers: {list(self.layer_ids)}"
            )
        return self.primes[layer_id]

    def hash(self, tokens: Any, context: Any = None, *, out: Any = None) -> dict[int, np.ndarray]:
        """Every layer's head ids of ``tokens``.

        Parameters
        ----------
        tokens : int [B, T] token ids (the tokenizer's, uncompressed); 1-D is one sequence.
        context : int [B, C] the tokens before ``tokens`` (the last ``max_ngram - 1`` are
            used; fewer, or None, means the sequences start here: pad before).
        out : int64 [len(layer_ids), B, T, heads_per_layer], C-contiguous, to write the ids
            into (a server's buffer, reused step after step); default a new array.

        Returns
        -------
        {layer_id: int64 [B, T, heads_per_layer]}, each column in its head's own range
        ``[0, primes[layer][order - 2, head])`` (add :meth:`head_offsets` for table rows).
        """
        t = token_ids_2d("tokens", tokens)
        c = None
        if context is not None:
            c = token_ids_2d("context", context)
            if c.shape[0] != t.shape[0]:
                raise ConfigError(
                    f"context has {c.shape[0]} rows and tokens {t.shape[0]}: one per sequence"
                )
        B, T = t.shape
        shape = (self._n_layers, B, T, self._heads)
        out = np.empty(shape, dtype=np.int64) if out is None else checked_ids_out(out, shape)
        if B and T:
            native = self._native if host.native is not None else None
            if native is not None:
                try:
                    native.hash(t, B, c, self._pad_id, out, host.HOST_THREADS)
                except ValueError as e:  # a token outside the vocabulary: the one check a call
                    if "outside the vocabulary" not in str(e):
                        raise
                    raise self._name_bad_token(tokens, context) from None
            elif not self._reference_into(t, c, out):
                raise self._name_bad_token(tokens, context)
        return dict(zip(self.layer_ids, out))

    def _reference_into(self, t: np.ndarray, c: np.ndarray | None, out: np.ndarray) -> bool:
        """Without the native module (no compiler at install): the ids of ``t`` after ``c``
        by the reference into ``out``; False, writing nothing, where a token read is outside
        the vocabulary."""
        x = self.padded(t, c)
        V = self.vocab.tokenizer_size
        if int(x.min()) < 0 or int(x.max()) >= V:
            return False
        xc = self.vocab.lookup[x]
        for i, layer in enumerate(self.layer_ids):
            out[i] = hash_reference(xc, self.keep, self.multipliers[layer], self.primes[layer])
        return True

    def _name_bad_token(self, tokens: Any, context: Any) -> ConfigError:
        """The first token outside the tokenizer's ids, named where the caller gave it."""
        V = self.vocab.tokenizer_size
        found = first_bad_token(tokens, context, self.keep, V, "the tokenizer's ids")
        if found is not None:
            return found
        return ConfigError(f"pad_id={self.config.pad_id} is outside the tokenizer's ids [0, {V})")

    def padded(self, tokens: Any, context: Any = None) -> np.ndarray:
        """int64 [B, keep + T]: ``tokens`` after ``keep`` columns of look-back (the last of
        ``context``, the pad id's token before it): what :func:`hash_reference` reads once
        compressed (``vocab.compress``). The native hash reads the look-back in place."""
        return padded_history(tokens, context, self.keep, self.config.pad_id)


class EngramContext:
    """The look-back of a batch of sequences between steps (the last ``max_ngram - 1``
    tokens of each), so that a prefill then decode steps hash as one prefill.

    >>> ctx = EngramContext(h, batch=2)
    >>> ids = ctx.step(prompt_tokens)      # [2, T]
    >>> ids = ctx.step(next_tokens)        # [2, 1] each decode step
    """

    def __init__(self, engram_hash: EngramHash, batch: int = 1) -> None:
        if not isinstance(engram_hash, EngramHash):
            raise ConfigError(
                f"engram_hash must be an EngramHash, got {type(engram_hash).__name__}"
            )
        if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
            raise ConfigError(f"batch={batch!r}: give a positive integer")
        self.hash = engram_hash
        self.batch = int(batch)
        self.reset()

    def reset(self) -> None:
        """Start every sequence anew (pad look-back)."""
        self._kept = np.full((self.batch, self.hash.keep), self.hash.config.pad_id, np.int64)

    @property
    def kept(self) -> np.ndarray:
        """int64 [batch, max_ngram - 1]: the look-back the next step reads (a copy)."""
        return self._kept.copy()

    def step(self, tokens: Any) -> dict[int, np.ndarray]:
        """Head ids of the next ``tokens`` [batch, T] of every sequence; keeps their tail."""
        t = token_ids_2d("tokens", tokens)
        if t.shape[0] != self.batch:
            raise ConfigError(f"tokens has {t.shape[0]} rows; this context holds {self.batch}")
        ids = self.hash.hash(t, self._kept)
        keep, T = self.hash.keep, t.shape[1]
        if T >= keep:
            self._kept = t[:, T - keep :].copy()
        else:  # fewer tokens than the look-back: shift them in (NumPy copes with the overlap)
            self._kept[:, : keep - T] = self._kept[:, T:]
            self._kept[:, keep - T :] = t
        return ids
