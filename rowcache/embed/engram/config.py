"""The parameters of an Engram hash, and the head moduli they fix.

Owns :class:`EngramConfig` (frozen, validated; DeepSeek's demo values as the defaults;
``from_config`` reads a checkpoint's ``engram_*`` fields) and :func:`head_primes`
(docs/engram-spec.md section 3: a distinct prime row count for every head of every layer).
The multipliers depend on the compressed vocabulary as well and live with the hash
(``rowcache.embed.engram.hash``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rowcache.errors import ConfigError

MAX_NGRAM = 16  # the native hash's bounds (csrc/engram_hash.c)
MAX_HEADS = 4096
MAX_HEAD_ROWS = 1 << 40
MAX_TOTAL_HEADS = 1 << 18  # heads of every layer together (each a distinct prime): ~1 s


@dataclass(frozen=True, kw_only=True)
class EngramConfig:
    """An Engram hash's parameters (docs/engram-spec.md).

    Parameters
    ----------
    vocab_per_ngram : rows sought per n-gram order 2..max_ngram (each head's prime is the
        next unused prime above it); the demo's ``129280 * 5`` for orders 2 and 3.
    max_ngram : the longest n-gram (2..16).
    n_embed_per_ngram : the width of one order's heads together (``n_head_per_ngram`` heads
        of ``n_embed_per_ngram / n_head_per_ngram`` values).
    n_head_per_ngram : heads per order.
    layer_ids : the layers that hold Engram memory (distinct, ascending order not required;
        primes are assigned in the order given, as the reference does).
    pad_id : the token read before a sequence's start (mapped through the compressed
        vocabulary).
    seed : the multipliers' seed.
    compressed_vocab_size : where a checkpoint states it, the size the compressed vocabulary
        must have (checked by :class:`~rowcache.embed.engram.hash.EngramHash`); else None.
    num_embeddings : where a checkpoint states them (V4.1's ``engram_num_embeddings``), each
        layer's table rows in ``layer_ids`` order, which must be the sums of the layers'
        head primes (checked by ``EngramHash``); else None.
    defaults_used : the fields :meth:`from_config` did not find (not compared).
    """

    vocab_per_ngram: tuple[int, ...] = (646400, 646400)
    max_ngram: int = 3
    n_embed_per_ngram: int = 512
    n_head_per_ngram: int = 8
    layer_ids: tuple[int, ...] = (1, 15)
    pad_id: int = 2
    seed: int = 0
    compressed_vocab_size: int | None = None
    num_embeddings: tuple[int, ...] | None = None
    defaults_used: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        def integer(name: str, value: Any, low: int) -> int:
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise ConfigError(f"{name}={value!r}: give an integer >= {low}")
            return int(value)

        n = integer("max_ngram", self.max_ngram, 2)
        if n > MAX_NGRAM:
            raise ConfigError(f"max_ngram={n}: at most {MAX_NGRAM}")
        vocab = _int_tuple("vocab_per_ngram", self.vocab_per_ngram)
        if len(vocab) != n - 1:
            raise ConfigError(
                f"vocab_per_ngram={self.vocab_per_ngram!r}: give one size per order 2..{n} "
                f"({n - 1} values)"
            )
        for v in vocab:
            integer("vocab_per_ngram", v, 2)
            if v > MAX_HEAD_ROWS:
                raise ConfigError(
                    f"vocab_per_ngram={self.vocab_per_ngram!r}: at most {MAX_HEAD_ROWS:,} rows "
                    "a head (2**40; a layer's table rows are int64 sums of them)"
                )
        heads = integer("n_head_per_ngram", self.n_head_per_ngram, 1)
        if heads > MAX_HEADS:
            raise ConfigError(f"n_head_per_ngram={heads}: at most {MAX_HEADS}")
        width = integer("n_embed_per_ngram", self.n_embed_per_ngram, 1)
        if width % heads:
            raise ConfigError(
                f"n_embed_per_ngram={width} must be divisible by n_head_per_ngram={heads}"
            )
        layers = _int_tuple("layer_ids", self.layer_ids)
        if not layers:
            raise ConfigError("layer_ids=(): give the layers that hold Engram memory")
        for layer in layers:
            integer("layer_ids", layer, 0)
        if len(set(layers)) != len(layers):
            raise ConfigError(f"layer_ids={self.layer_ids!r} names a layer twice")
        if len(layers) * (n - 1) * heads > MAX_TOTAL_HEADS:
            raise ConfigError(
                f"layer_ids: {len(layers):,} layers of {(n - 1) * heads:,} heads "
                f"(max_ngram={n}, n_head_per_ngram={heads}) are {len(layers) * (n - 1) * heads:,} "
                f"heads; at most {MAX_TOTAL_HEADS:,} in all (each has a prime of its own)"
            )
        integer("pad_id", self.pad_id, 0)
        integer("seed", self.seed, 0)
        if self.compressed_vocab_size is not None:
            integer("compressed_vocab_size", self.compressed_vocab_size, 1)
        if self.num_embeddings is not None:
            rows = _int_tuple("num_embeddings", self.num_embeddings)
            if len(rows) != len(layers) or any(r < 1 for r in rows):
                raise ConfigError(
                    f"num_embeddings={self.num_embeddings!r}: give one table size (rows >= 1) "
                    f"for each of the {len(layers)} layers {list(layers)}"
                )
            object.__setattr__(self, "num_embeddings", rows)
        object.__setattr__(self, "vocab_per_ngram", vocab)
        object.__setattr__(self, "layer_ids", layers)

    @property
    def head_dim(self) -> int:
        """Values per head row: ``n_embed_per_ngram / n_head_per_ngram`` (demo: 64)."""
        return self.n_embed_per_ngram // self.n_head_per_ngram

    @property
    def heads_per_layer(self) -> int:
        """Head tables of one layer, ``(max_ngram - 1) * n_head_per_ngram`` (demo: 16): the
        columns of the hash's ids."""
        return (self.max_ngram - 1) * self.n_head_per_ngram

    @property
    def output_dim(self) -> int:
        """Width of one position's looked-up rows, ``(max_ngram - 1) * n_embed_per_ngram``."""
        return (self.max_ngram - 1) * self.n_embed_per_ngram

    @classmethod
    def reported_v41(cls) -> EngramConfig:
        """DeepSeek-V4.1-Flash's hash (docs/engram-spec.md, its last section): layers 1 and
        14, orders 2..4 of 8 heads, 256 values a head, the prime search from 16,000,000 for
        every order (tables of 384,006,168 and 384,016,682 rows, the checkpoint's
        ``engram_num_embeddings``); pad 2 and seed 0, as the demo's. A checkpoint's own
        ``config.json`` is read with :meth:`from_config`."""
        return cls(
            vocab_per_ngram=(16_000_000,) * 3,
            max_ngram=4,
            n_embed_per_ngram=2048,
            n_head_per_ngram=8,
            layer_ids=(1, 14),
        )

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> EngramConfig:
        """The hash of a checkpoint's ``config.json`` dict (or its ``engram_config`` part).

        Reads DeepSeek-V4.1's names (``engram_layer_ids``, ``engram_vocab_size``: the prime
        search's start, one for every order or one an order; ``engram_max_ngram_size``,
        ``engram_n_heads``, ``engram_head_dim`` or ``engram_n_embed_per_ngram``,
        ``engram_pad_token_id`` or ``engram_pad_id``, ``engram_seed``,
        ``engram_compressed_vocab_size``, ``engram_num_embeddings``: each layer's table rows,
        checked against the hash) and the demo's own names (``layer_ids``,
        ``max_ngram_size``, ...). Fields not found keep the demo's values and are listed in
        ``defaults_used``; a found value that is invalid is a ConfigError naming the config's
        key. (The table's format, ``engram_dtype``, ``engram_block_size`` and
        ``engram_scale_fmt``, is no part of the hash:
        ``rowcache.embed.engram.table_format.EngramTableFormat``.)
        """
        if not isinstance(config, Mapping):
            raise ConfigError(f"config must be a dict, got {type(config).__name__}")
        nested = config.get("engram_config")
        if isinstance(nested, Mapping):
            config = {**config, **nested}
        found: dict[str, Any] = {}
        keys: dict[str, str] = {}

        def take(name: str, *aliases: str) -> Any:
            for key in aliases:
                if key in config and config[key] is not None:
                    keys[name] = key
                    return config[key]
            return None

        n = take("max_ngram", "engram_max_ngram_size", "max_ngram_size", "max_ngram")
        if n is not None:
            found["max_ngram"] = n
        heads = take("n_head_per_ngram", "engram_n_heads", "n_head_per_ngram")
        if heads is not None:
            found["n_head_per_ngram"] = heads
        width = take("n_embed_per_ngram", "engram_n_embed_per_ngram", "n_embed_per_ngram")
        head_dim = config.get("engram_head_dim")
        if width is None and head_dim is not None:
            keys["n_embed_per_ngram"] = "engram_head_dim"
            h = found.get("n_head_per_ngram", cls.n_head_per_ngram)
            width = head_dim * h if isinstance(head_dim, int) and isinstance(h, int) else head_dim
        if width is not None:
            found["n_embed_per_ngram"] = width
        vocab = take("vocab_per_ngram", "engram_vocab_size", "vocab_per_ngram")
        if vocab is not None:
            if isinstance(vocab, (int, np.integer)) and not isinstance(vocab, bool):
                orders = int(found.get("max_ngram", cls.max_ngram)) - 1
                vocab = (vocab,) * max(orders, 1)  # one size for every order
            found["vocab_per_ngram"] = vocab
        pads = {k: config[k] for k in ("engram_pad_token_id", "engram_pad_id") if k in config}
        if len(pads) == 2 and pads["engram_pad_token_id"] != pads["engram_pad_id"]:
            raise ConfigError(
                f"config['engram_pad_token_id']={pads['engram_pad_token_id']!r} and "
                f"config['engram_pad_id']={pads['engram_pad_id']!r} disagree: one pad token, "
                "give the same id (or one of them)"
            )
        for name, aliases in (
            ("layer_ids", ("engram_layer_ids", "layer_ids")),
            ("pad_id", ("engram_pad_token_id", "engram_pad_id", "pad_id")),
            ("seed", ("engram_seed", "seed")),
            ("compressed_vocab_size", ("engram_compressed_vocab_size",)),
            ("num_embeddings", ("engram_num_embeddings",)),
        ):
            v = take(name, *aliases)
            if v is not None:
                found[name] = v
        checked_only = ("defaults_used", "compressed_vocab_size", "num_embeddings")
        missing = tuple(
            f.name
            for f in dataclasses.fields(cls)
            if f.name not in found and f.name not in checked_only
        )
        try:
            return cls(**found, defaults_used=missing)
        except ConfigError as e:
            message = str(e)
            for name, key in keys.items():
                if message.startswith(f"{name}="):
                    message = f"config[{key!r}]: {message}"
                    break
            raise ConfigError(message) from None


def _int_tuple(name: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ConfigError(f"{name}={value!r}: give a sequence of integers")
    items = tuple(value)
    for v in items:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ConfigError(f"{name}={value!r}: give a sequence of integers")
    return tuple(int(v) for v in items)


def is_prime(n: int) -> bool:
    """Exact primality for ``n < 3.3 * 10**24`` (deterministic Miller-Rabin, the first 13
    primes as bases), so for every 64-bit row count."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in small:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def head_primes(config: EngramConfig) -> dict[int, np.ndarray]:
    """Each layer's head row counts, int64 ``[max_ngram - 1, n_head_per_ngram]``.

    For every layer in ``layer_ids`` order, every order ``n`` and every head: the smallest
    prime above the search start (``vocab_per_ngram[n - 2] - 1``, then the head before's
    prime) not used by any earlier head of any layer (docs/engram-spec.md section 3).

    The primes come from a segmented sieve of the ranges the search reaches
    (:class:`_Sieve`), and "the next unused one" from a skip map (a used prime points past
    itself, paths compressed): linear in the heads, where testing every number
    from each start on walked past every earlier layer's primes again (200 layers of 192
    heads took 35 s). The primes are the same, one by one (tests/embed/test_engram_hash.py
    checks them against that walk).
    """
    sieve = _Sieve()
    skip: dict[int, int] = {}  # a used prime -> a prime at or before the next unused one

    def unused_from(p: int) -> int:
        path = []
        while p in skip:
            path.append(p)
            p = skip[p]
        for q in path:
            skip[q] = p
        return p

    out: dict[int, np.ndarray] = {}
    for layer in config.layer_ids:
        rows = np.empty((config.max_ngram - 1, config.n_head_per_ngram), dtype=np.int64)
        for order in range(2, config.max_ngram + 1):
            start = config.vocab_per_ngram[order - 2] - 1
            for h in range(config.n_head_per_ngram):
                p = unused_from(sieve.next_prime(start))
                skip[p] = sieve.next_prime(p)
                rows[order - 2, h] = p
                start = p
        out[layer] = rows
    return out


class _Sieve:
    """``next_prime(x)``, the smallest prime > ``x``, from aligned segments of
    :data:`SEGMENT` numbers sieved once, when first asked for (a segmented sieve of
    Eratosthenes over only the ranges the search reaches, whatever their height)."""

    SEGMENT = 1 << 20

    def __init__(self) -> None:
        self.segments: dict[int, np.ndarray] = {}  # segment number -> its primes
        self.base = np.empty(0, dtype=np.int64)  # the primes up to at least sqrt of the top

    def next_prime(self, x: int) -> int:
        k = (x + 1) // self.SEGMENT
        while True:
            primes = self._segment(k)
            i = int(np.searchsorted(primes, x, side="right"))
            if i < primes.size:
                return int(primes[i])
            k += 1

    def _segment(self, k: int) -> np.ndarray:
        primes = self.segments.get(k)
        if primes is not None:
            return primes
        lo, hi = k * self.SEGMENT, (k + 1) * self.SEGMENT
        root = math.isqrt(hi - 1)
        if self.base.size == 0 or self.base[-1] < root:
            self.base = _small_primes(max(root + 1, 1024))
        mask = np.ones(hi - lo, dtype=bool)
        for p in self.base.tolist():
            if p * p >= hi:
                break
            first = max(p * p, -(-lo // p) * p)
            mask[first - lo :: p] = False
        if lo < 2:
            mask[: 2 - lo] = False
        primes = np.flatnonzero(mask).astype(np.int64) + lo
        self.segments[k] = primes
        return primes


def _small_primes(limit: int) -> np.ndarray:
    """The primes <= ``limit`` (a plain sieve; ``limit`` is at most about 2**20 here)."""
    mask = np.ones(limit + 1, dtype=bool)
    mask[:2] = False
    for p in range(2, math.isqrt(limit) + 1):
        if mask[p]:
            mask[p * p :: p] = False
    return np.flatnonzero(mask).astype(np.int64)
