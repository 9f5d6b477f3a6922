"""The tables a row-id trace addresses, and how a request's tokens become their row ids.

Owns :class:`NgramTraceTables` (LongCat's n-gram tables, ``rowcache.embed.NgramDims``: one
table per order and split), :class:`EngramTraceTables` (DeepSeek's Engram memory,
``rowcache.embed.EngramHash``: one table per head of every Engram layer, in layer order,
rows its prime) and :class:`Qwen4TraceTables` (Qwen3.8-Flash-Next's n-gram table,
``rowcache.embed.Qwen4NgramHash``: one table per head, rows its prime, in head order), the
things ``rowcache.tools.trace_build.build_trace`` traces. Each
gives the tables' row counts, the ids of one request (int64 ``[tables, tokens]``), the
tokenizer's id range and the manifest's ``dims`` block (``hidden_size`` = tables x row width,
from which ``profile`` takes the row size, or ``row_bytes`` where a family's FP8 rows are not
LongCat's ``dim + 4``; ``table_orders`` for its per-order figures).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from rowcache.errors import ConfigError
from rowcache.kernels.ngram.hash import ngram_hash


class TraceTables(Protocol):
    num_tables: int
    vocab_size: int
    eos_token_id: int | None

    def table_rows(self, i: int) -> int: ...

    def request_ids(self, tokens: np.ndarray) -> np.ndarray: ...

    def manifest(self) -> dict[str, Any]: ...


class NgramTraceTables:
    """LongCat's tables of ``dims`` (an ``NgramDims``)."""

    def __init__(self, dims: Any) -> None:
        self.dims = dims
        self.num_tables = int(dims.num_tables)
        self.vocab_size = int(dims.vocab_size)
        self.eos_token_id: int | None = int(dims.eos_token_id)

    def table_rows(self, i: int) -> int:
        return int(self.dims.table_rows(i))

    def request_ids(self, tokens: np.ndarray) -> np.ndarray:
        """The LongCat ids of every table at every position of one request: int64 [T, L]
        (tokens outside ``[0, vocab_size)`` raise ``TokenRangeError``, a ``ConfigError``)."""
        d = self.dims
        return ngram_hash(
            tokens, d.multipliers, d.all_table_rows, d.eos_token_id, vocab=d.vocab_size
        )

    def manifest(self) -> dict[str, Any]:
        d = self.dims
        return {
            "vocab_size": d.vocab_size,
            "hidden_size": d.hidden_size,
            "max_ngram": d.max_ngram,
            "splits": d.splits,
            "ratio": d.ratio,
            "eos_token_id": d.eos_token_id,
        }


class EngramTraceTables:
    """Engram's head tables of ``engram_hash`` (an ``EngramHash``): every head of every layer
    a table of its prime's rows, one access a position; the layers' tables end to end are
    what a store holds, and one arena over all of them is ``profile``'s shared curve.
    A request is one sequence: the positions before its start read the pad id."""

    def __init__(self, engram_hash: Any) -> None:
        self.hash = engram_hash
        cfg = engram_hash.config
        self._rows = np.concatenate(
            [engram_hash.primes[layer].reshape(-1) for layer in cfg.layer_ids]
        )
        self.num_tables = int(self._rows.size)
        self.vocab_size = int(engram_hash.vocab.tokenizer_size)
        self.eos_token_id: int | None = None

    def table_rows(self, i: int) -> int:
        return int(self._rows[i])

    def request_ids(self, tokens: np.ndarray) -> np.ndarray:
        ids = self.hash.hash(tokens[None, :])
        return np.concatenate([ids[layer][0].T for layer in self.hash.layer_ids], axis=0)

    def manifest(self) -> dict[str, Any]:
        cfg = self.hash.config
        return {
            "kind": "engram",
            "vocab_size": self.vocab_size,
            "hidden_size": self.num_tables * cfg.head_dim,
            "layer_ids": list(cfg.layer_ids),
            "max_ngram": cfg.max_ngram,
            "vocab_per_ngram": list(cfg.vocab_per_ngram),
            "n_embed_per_ngram": cfg.n_embed_per_ngram,
            "n_head_per_ngram": cfg.n_head_per_ngram,
            "pad_id": cfg.pad_id,
            "seed": cfg.seed,
            "table_orders": [
                k // cfg.n_head_per_ngram + 2
                for _ in cfg.layer_ids
                for k in range(cfg.heads_per_layer)
            ],
        }


# What a Qwen4 trace's token stream is, for its manifest: the tokenizer names it (a
# ``--tokenizer`` value, or None where every input was token ids).
QWEN4_PROXY_NOTE = (
    "{what} standing in for Qwen's tokenization (Qwen's tokenizer is not available offline): "
    "the hash and the tables are Qwen4's, the token stream a proxy's (its ids all fit Qwen's "
    "vocabulary). The n-gram reuse, and so the curves' shape, the compulsory floor and the "
    "arena a fault rate needs, are those of this tokenizer on this text, not Qwen's: Qwen's "
    "larger vocabulary likely gives fewer tokens per text and more distinct n-grams per "
    "token; read the figures as estimates"
)
_TOKENIZER_NAMES = {
    "deepseek": "DeepSeek-tokenized text",
    "words": "text tokenized by the offline 'words' stand-in (hashed words)",
    "bytes": "text tokenized by the offline 'bytes' stand-in (UTF-8 bytes)",
}


PROXY_TOKENIZERS = tuple(_TOKENIZER_NAMES)  # tokenizers that are surely not Qwen's


def qwen4_token_note(tokenizer: str | None) -> str:
    """What a Qwen4 trace's token stream is, as its manifest says it."""
    if tokenizer is None:
        return "token ids as given (.npy / .jsonl inputs)"
    if tokenizer in PROXY_TOKENIZERS:
        return QWEN4_PROXY_NOTE.format(what=_TOKENIZER_NAMES[tokenizer])
    return (
        f"text tokenized by {tokenizer}: Qwen's tokenization if that is Qwen's own "
        "tokenizer.json, else a proxy token stream (the curves then a proxy's)"
    )


class Qwen4TraceTables:
    """Qwen3.8-Flash-Next's n-gram table(s) of ``config`` (a ``Qwen4NgramConfig``): each head
    of each table (one per ``ple_layer_ids`` entry, the release one) a trace table of its
    prime's rows, in head order, one access a position. A store holds a table's heads end
    to end: the row of trace table ``h`` is ``offsets[h] +`` its trace row (the manifest's
    ``head_offsets``; ``Qwen4NgramHash.hash`` gives those global rows).
    A request is one sequence: the positions before its start read EOS (the reference's
    rule, as a sequence with no cache); an EOS inside it starts a segment.

    Parameters
    ----------
    config : Qwen4NgramConfig
    tokenizer : what tokenized the traced text, for the manifest ("deepseek", a
        tokenizer.json path, "words", "bytes"), or None (default) where the requests are
        token ids as given.
    """

    def __init__(self, config: Any, tokenizer: str | None = None) -> None:
        from rowcache.embed.qwen4.config import Qwen4NgramConfig
        from rowcache.embed.qwen4.hash import Qwen4NgramHash

        if not isinstance(config, Qwen4NgramConfig):
            raise ConfigError(f"config must be a Qwen4NgramConfig, got {type(config).__name__}")
        self.config = config
        self.tokenizer = tokenizer
        self.hashes = [Qwen4NgramHash(config, t) for t in range(len(config.ple_layer_ids))]
        self._rows = np.concatenate([h.primes for h in self.hashes])
        self._offsets = np.concatenate([h.offsets for h in self.hashes])
        self.num_tables = int(self._rows.size)
        self.vocab_size = int(config.vocab_size)
        self.eos_token_id: int | None = int(config.eos_token_id)

    def table_rows(self, i: int) -> int:
        return int(self._rows[i])

    def request_ids(self, tokens: np.ndarray) -> np.ndarray:
        """The ids of every head table at every position of one request, int64 [tables, T]:
        ``Qwen4NgramHash.hash`` of the request with no context, less each head's offset
        (tokens outside ``[0, vocab_size)`` raise a ``ConfigError``)."""
        out = np.empty((self.num_tables, tokens.size), dtype=np.int64)
        heads = self.config.heads
        for t, h in enumerate(self.hashes):
            rows = h.hash(tokens[None, :])[0]  # [T, heads], global rows of table t
            out[t * heads : (t + 1) * heads] = rows.T - h.offsets[:, None]
        return out

    def row_bytes(self) -> dict[str, int]:
        """Stored bytes of one row: BF16 ``2 x head_dim`` (320), FP8 ``head_dim`` (160: the
        release's one scale is the whole table's, not a row's)."""
        return {"bf16": 2 * self.config.head_dim, "fp8": self.config.head_dim}

    def manifest(self) -> dict[str, Any]:
        cfg = self.config
        heads = cfg.heads
        tok = self.tokenizer
        return {
            "kind": "qwen4",
            "vocab_size": self.vocab_size,
            "hidden_size": self.num_tables * cfg.head_dim,
            "row_bytes": self.row_bytes(),
            "eos_token_id": cfg.eos_token_id,
            "ngram_size": cfg.ngram_size,
            "heads_per_ngram": cfg.heads_per_ngram,
            "ngram_vocab_size_base": cfg.ngram_vocab_size_base,
            "make_ngram_vocab_size_divisible_by": cfg.make_ngram_vocab_size_divisible_by,
            "split_ngram_parts": cfg.split_ngram_parts,
            "ple_layer_ids": list(cfg.ple_layer_ids),
            "ple_embed_dim": cfg.ple_embed_dim,
            "seed": cfg.seed,
            "defaulted": list(cfg.defaulted),
            "head_dim": cfg.head_dim,
            "head_offsets": self._offsets.tolist(),
            "padded_rows": [h.table_rows() for h in self.hashes],
            "table_orders": [
                k // cfg.heads_per_ngram + 2 for _ in self.hashes for k in range(heads)
            ],
            "tokenizer": tok,
            "tokens": qwen4_token_note(tok),
            # True: surely not Qwen's tokenization; None: not known (ids or a tokenizer.json)
            "proxy_tokens": True if tok in PROXY_TOKENIZERS else None,
        }


def as_trace_tables(tables: Any) -> TraceTables:
    """``tables`` as a :class:`TraceTables`: an ``NgramDims``, ``EngramHash`` or
    ``Qwen4NgramConfig`` is wrapped (a Qwen4 one's manifest: token ids as given; give a
    :class:`Qwen4TraceTables` to name the tokenizer)."""
    if hasattr(tables, "request_ids") and hasattr(tables, "manifest"):
        return tables  # type: ignore[no-any-return, unused-ignore]
    from rowcache.embed.engram.hash import EngramHash
    from rowcache.embed.ngram.dims import NgramDims

    if isinstance(tables, NgramDims):
        return NgramTraceTables(tables)
    if isinstance(tables, EngramHash):
        return EngramTraceTables(tables)
    from rowcache.embed.qwen4.config import Qwen4NgramConfig

    if isinstance(tables, Qwen4NgramConfig):
        return Qwen4TraceTables(tables)
    raise ConfigError(
        f"dims: give an NgramDims, an EngramHash or a Qwen4NgramConfig, got {type(tables).__name__}"
    )
