"""The tables a row-id trace addresses, and how a request's tokens become their row ids.

Owns :class:`NgramTraceTables` (LongCat's n-gram tables, ``rowcache.embed.NgramDims``: one
table per order and split) and :class:`EngramTraceTables` (DeepSeek's Engram memory,
``rowcache.embed.EngramHash``: one table per head of every Engram layer, in layer order,
rows its prime), the two things ``rowcache.tools.trace_build.build_trace`` traces. Each
gives the tables' row counts, the ids of one request (int64 ``[tables, tokens]``), the
tokenizer's id range and the manifest's ``dims`` block (``hidden_size`` = tables x row width,
from which ``profile`` takes the row size; ``table_orders`` for its per-order figures).
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


def as_trace_tables(tables: Any) -> TraceTables:
    """``tables`` as a :class:`TraceTables`: an ``NgramDims`` or ``EngramHash`` is wrapped."""
    if hasattr(tables, "request_ids") and hasattr(tables, "manifest"):
        return tables  # type: ignore[no-any-return, unused-ignore]
    from rowcache.embed.engram.hash import EngramHash
    from rowcache.embed.ngram.dims import NgramDims

    if isinstance(tables, NgramDims):
        return NgramTraceTables(tables)
    if isinstance(tables, EngramHash):
        return EngramTraceTables(tables)
    raise ConfigError(f"dims: give an NgramDims or an EngramHash, got {type(tables).__name__}")
