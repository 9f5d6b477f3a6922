"""Qwen3.8-Flash-Next's (``qwen4_exp``) row ids: the global table rows of every position.

Owns :class:`Qwen4NgramHash` (one table's multipliers, head primes and offsets; ``hash``
runs the native ``EngramHasher`` of ``rowcache.kernels._host``, ``csrc/engram_hash.c``, the
multiply-XOR-heads kernel shared with Engram, made with the identity token map, the head
offsets and the EOS segment rule), :func:`hash_reference`, the NumPy statement of
docs/qwen4-spec.md ("Ids of one position") that the kernel is tested against bit for bit,
and the helpers that fix the tables: :func:`splitmix64`, :func:`table_multipliers`,
:func:`head_primes`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rowcache.embed.engram.config import is_prime
from rowcache.embed.qwen4.config import Qwen4NgramConfig
from rowcache.embed.token_ids import (
    checked_ids_out,
    first_bad_token,
    padded_history,
    token_ids_2d,
)
from rowcache.errors import ConfigError
from rowcache.kernels import extensions, host

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment, also each order's seed step
_TABLE_SEED_STEP = 10007  # each table's multiplier seed: seed + 10007 * L
_PATH_ENV = "ROWCACHE_ENGRAM_HASH"  # read by the native hasher: avx512, avx2 or scalar


def splitmix64(value: int) -> int:
    """SplitMix64's output for state ``value`` (one step: add the increment, then mix), as
    an unsigned 64-bit Python int."""
    z = (value + _GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def table_multipliers(config: Qwen4NgramConfig, table: int) -> np.ndarray:
    """Table ``table``'s (its index in ``ple_layer_ids``) odd multipliers, int64
    ``[ngram_size]``: ``2 * (splitmix64(seed + 10007 L + gamma (i + 1)) % half) + 1`` with
    ``half = ((2**63 - 1) // vocab_size) // 2``, so every product of a token id is below
    2**63."""
    half = max(1, ((2**63 - 1) // config.vocab_size) // 2)
    base = config.seed + _TABLE_SEED_STEP * table
    m = [
        2 * (splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half) + 1
        for i in range(config.ngram_size)
    ]
    return np.array(m, dtype=np.int64)


def head_primes(config: Qwen4NgramConfig, table: int) -> np.ndarray:
    """Table ``table``'s head row counts, int64 ``[heads]``: head ``h`` has the
    ``(heads * table + h + 1)``-th prime above ``ngram_vocab_size_base - 1`` (the primes
    run on across tables)."""
    want = config.heads * (table + 1)
    primes: list[int] = []
    p = config.ngram_vocab_size_base - 1
    while len(primes) < want:
        p += 1
        if is_prime(p):
            primes.append(p)
    return np.array(primes[config.heads * table :], dtype=np.int64)


def hash_reference(
    history: np.ndarray,
    keep: int,
    eos: int,
    multipliers: np.ndarray,
    primes: np.ndarray,
    offsets: np.ndarray,
) -> np.ndarray:
    """Global rows of one table (docs/qwen4-spec.md), vectorized NumPy: the spec.

    Parameters
    ----------
    history : int64 [B, keep + T]
        Raw token ids; the first ``keep`` columns are look-back only (the tokens before the
        step, EOS where the sequence had none).
    keep : int
        Look-back columns, ``ngram_size - 1``.
    eos : int
        The EOS token id.
    multipliers : int64 [ngram_size]
    primes, offsets : int64 [(ngram_size - 1) * heads_per_ngram]
        Each head's modulus and first row, order 2's heads first.

    Returns
    -------
    int64 [B, T, heads]: ``offsets[h] + mix_n mod primes[h]`` for head ``h`` of order ``n``,
    where ``mix_n`` XORs ``s_k * multipliers[k]`` for ``k < n`` and ``s_k`` is the token
    ``k`` back, or EOS where that source is before the history's start or at or before the
    last EOS strictly before the position.
    """
    x = np.asarray(history, dtype=np.int64)
    B, W = x.shape
    n_max = multipliers.size
    heads = primes.size // (n_max - 1)
    pos = np.arange(W)
    eos_at = np.where(x == eos, pos, -1)
    last_eos = np.maximum.accumulate(eos_at, axis=1)  # the last EOS at or before t
    before = np.concatenate([np.full((B, 1), -1), last_eos[:, :-1]], axis=1)  # strictly
    shifted = []
    for k in range(n_max):
        src = pos - k
        valid = (src >= 0) & (src > before)
        s = np.where(valid, x[:, np.maximum(src, 0)], eos)
        shifted.append(s[:, keep:])
    mix = shifted[0] * multipliers[0]
    out = []
    for n in range(2, n_max + 1):
        mix = np.bitwise_xor(mix, shifted[n - 1] * multipliers[n - 1])
        at = slice((n - 2) * heads, (n - 1) * heads)
        out.append(mix[:, :, None] % primes[at] + offsets[at])
    return np.concatenate(out, axis=2)


class Qwen4NgramHash:
    """The global table rows of one ``qwen4_exp`` n-gram table, bit-exact with transformers'
    ``Qwen4ExpTextNGramEmbedding``.

    Parameters
    ----------
    config : Qwen4NgramConfig
    table : int, default 0
        The table's index in ``config.ple_layer_ids`` (its ``L``: the release has one).

    Attributes
    ----------
    multipliers : int64 [ngram_size]
    primes : int64 [heads]: each head's rows (order 2's heads, then order 3's, ...)
    offsets : int64 [heads]: each head's first row in the table (the running sum of primes)
    keep : ``ngram_size - 1``, the look-back a position reads
    eos : the EOS token id

    Examples
    --------
    >>> h = Qwen4NgramHash(Qwen4NgramConfig.release())
    >>> rows = h.hash(prompt)                          # int64 [B, T, 16], rows of the table
    >>> ctx = h.next_context(prompt)                   # [B, 2]: what the reference keeps
    >>> rows = h.hash(next_tokens, ctx)                # a decode step, [B, 1, 16]
    """

    def __init__(self, config: Qwen4NgramConfig, table: int = 0) -> None:
        if not isinstance(config, Qwen4NgramConfig):
            raise ConfigError(f"config must be a Qwen4NgramConfig, got {type(config).__name__}")
        n_tables = len(config.ple_layer_ids)
        if (
            isinstance(table, bool)
            or not isinstance(table, (int, np.integer))
            or not (0 <= table < n_tables)
        ):
            raise ConfigError(
                f"table={table!r}: give the table's index in ple_layer_ids, 0..{n_tables - 1}"
            )
        self.config = config
        self.table = int(table)
        self.layer_id = config.ple_layer_ids[self.table]
        self.multipliers = table_multipliers(config, self.table)
        self.primes = head_primes(config, self.table)
        self.offsets = np.concatenate([[0], np.cumsum(self.primes[:-1])]).astype(np.int64)
        self.keep = config.ngram_size - 1
        self.eos = config.eos_token_id
        self._heads = config.heads
        self._vocab = config.vocab_size
        # the native hasher holds the multipliers, primes and offsets from here on; AVX2 where
        # the CPU runs it (its .path), or the path ROWCACHE_ENGRAM_HASH names
        self._native: Any = None
        if host.native is None:
            extensions.fallback("rowcache.kernels._host")
        else:
            try:
                self._native = host.native.EngramHasher(
                    None,
                    self.multipliers[None, :],
                    self.primes[None, :],
                    config.heads_per_ngram,
                    offsets=self.offsets[None, :],
                    eos=self.eos,
                    vocab=config.vocab_size,
                )
            except ValueError as e:  # a path asked for that cannot run
                if _PATH_ENV not in str(e):
                    raise
                raise ConfigError(str(e).removeprefix("EngramHasher: ")) from None

    @property
    def path(self) -> str:
        """The reduction the hash runs: ``"avx2"`` (the default where the CPU has it),
        ``"avx512"`` (asked by ``ROWCACHE_ENGRAM_HASH``), ``"scalar"``, or ``"reference"``
        (no native module: the NumPy statement)."""
        return str(self._native.path) if self._native is not None else "reference"

    def used_rows(self) -> int:
        """Rows the heads address, the sum of the primes (release 320,001,446)."""
        return int(self.primes.sum())

    def table_rows(self) -> int:
        """The table's rows, :meth:`used_rows` padded up to a multiple of
        ``make_ngram_vocab_size_divisible_by`` (release 320,001,536; the last never read)."""
        div = self.config.make_ngram_vocab_size_divisible_by
        return -(-self.used_rows() // div) * div

    def hash(self, tokens: Any, context: Any = None, *, out: Any = None) -> np.ndarray:
        """The table rows of every position of ``tokens``.

        Parameters
        ----------
        tokens : int [B, T] raw token ids in ``[0, vocab_size)``; 1-D is one sequence.
        context : int [B, C] the raw tokens before ``tokens`` (the last ``ngram_size - 1``
            are read: what the reference keeps in its cache, :meth:`next_context`); fewer
            columns, or None, means EOS before them (the sequences start here).
        out : int64 [B, T, heads], C-contiguous, to write the rows into (a server's buffer,
            reused step after step); default a new array.

        Returns
        -------
        int64 [B, T, heads]: head ``h``'s row ``offsets[h] + mix mod primes[h]``.
        """
        native = self._native if host.native is not None else None
        if out is not None and native is not None:
            # a server's own arrays and buffer: the native call checks their dtypes and
            # shapes itself (a decode step's call costs a microsecond or two, as much as
            # checks here would); anything it refuses takes the path below, which names it
            try:
                native.rows(tokens, context, self.eos, out, host.HOST_THREADS)
                return out
            except (TypeError, ValueError, BufferError):
                pass
        t = token_ids_2d("tokens", tokens)
        c = None
        if context is not None:
            c = token_ids_2d("context", context)
            if c.shape[0] != t.shape[0]:
                raise ConfigError(
                    f"context has {c.shape[0]} rows and tokens {t.shape[0]}: one per sequence"
                )
        B, T = t.shape
        shape = (B, T, self._heads)
        out = np.empty(shape, dtype=np.int64) if out is None else checked_ids_out(out, shape)
        if B and T:
            if native is not None:
                try:
                    native.hash(t, B, c, self.eos, out, host.HOST_THREADS)
                except ValueError as e:  # a token outside the vocabulary: the one check a call
                    if "outside the vocabulary" not in str(e):
                        raise
                    raise self._name_bad_token(tokens, context) from None
            else:
                x = self.padded(t, c)
                if int(x.min()) < 0 or int(x.max()) >= self._vocab:
                    raise self._name_bad_token(tokens, context)
                out[...] = hash_reference(
                    x, self.keep, self.eos, self.multipliers, self.primes, self.offsets
                )
        return out

    def padded(self, tokens: Any, context: Any = None) -> np.ndarray:
        """int64 [B, keep + T]: ``tokens`` after ``keep`` columns of look-back (the last of
        ``context``, EOS before it): the history :func:`hash_reference` reads. The native
        hash reads the look-back in place."""
        return padded_history(tokens, context, self.keep, self.eos)

    def next_context(self, tokens: Any, context: Any = None) -> np.ndarray:
        """int64 [B, keep]: the context of the call after ``hash(tokens, context)``, the last
        ``ngram_size - 1`` raw tokens (EOS-filled before the sequence's start), as the
        reference keeps them in its cache (``conv_state`` index 2 of the layer)."""
        return self.padded(tokens, context)[:, -self.keep :].copy()

    def _name_bad_token(self, tokens: Any, context: Any) -> ConfigError:
        """The first token read that is outside ``[0, vocab_size)``, named where the caller
        gave it."""
        V = self._vocab
        found = first_bad_token(tokens, context, self.keep, V, "the token ids")
        if found is not None:
            return found
        return ConfigError(f"a token is outside the token ids [0, {V})")  # pragma: no cover
