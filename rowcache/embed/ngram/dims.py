"""The shape of an n-gram embedding: vocabulary, orders, splits, table sizes.

Owns :class:`NgramDims`, the validated configuration from which every table size,
table order and hash multiplier is derived (``docs/ngram-spec.md``, "Configuration"
and "Tables"). Does not compute ids (``rowcache.embed.ngram.ids``) or hold any weights.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from rowcache.errors import ConfigError

_INT64_MAX = (1 << 63) - 1


@dataclass(frozen=True)
class NgramDims:
    """Dimensions of a LongCat-style n-gram embedding.

    Parameters
    ----------
    vocab_size : int
        V, the token vocabulary size and the hash base.
    hidden_size : int
        D, the model width; each of the ``num_tables`` tables is ``D / num_tables`` wide.
    max_ngram : int
        N, the largest n-gram order; orders ``2..N`` have tables.
    splits : int
        K, sub-tables per order.
    ratio : float
        r; the base row count is ``m = int(r * V)`` (r may be non-integer).
    eos_token_id : int
        The token that ends a segment for the look-back rule.

    Table ``i = (n - 2) * K + k`` serves order ``n`` and split ``k`` and has
    ``m + 2 i + 1`` rows.
    """

    vocab_size: int
    hidden_size: int
    max_ngram: int
    splits: int
    ratio: float
    eos_token_id: int

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "max_ngram", "splits", "eos_token_id"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ConfigError(f"NgramDims.{name} must be an int, got {value!r}")
        if self.vocab_size < 2:
            raise ConfigError(f"NgramDims.vocab_size={self.vocab_size} must be at least 2")
        if self.max_ngram < 2:
            raise ConfigError(
                f"NgramDims.max_ngram={self.max_ngram} must be at least 2 (orders 2..max_ngram)"
            )
        if self.splits < 1:
            raise ConfigError(f"NgramDims.splits={self.splits} must be at least 1")
        if self.hidden_size < 1:
            raise ConfigError(f"NgramDims.hidden_size={self.hidden_size} must be positive")
        if self.hidden_size % self.num_tables:
            raise ConfigError(
                f"NgramDims.hidden_size={self.hidden_size} is not divisible by the table count "
                f"{self.num_tables} = splits {self.splits} x (max_ngram {self.max_ngram} - 1)"
            )
        ratio = self.ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float, np.integer, np.floating)):
            raise ConfigError(f"NgramDims.ratio must be a number, got {ratio!r}")
        if not math.isfinite(float(ratio)) or int(float(ratio) * self.vocab_size) < 1:
            raise ConfigError(
                f"NgramDims.ratio={ratio!r} must be finite and give int(ratio * vocab_size) >= 1"
            )
        if not 0 <= self.eos_token_id < self.vocab_size:
            raise ConfigError(
                f"NgramDims.eos_token_id={self.eos_token_id} is outside the vocabulary "
                f"[0, {self.vocab_size})"
            )
        # The hash sums max_ngram terms, each below vocab_size * rows, in int64.
        worst = self.max_ngram * (self.vocab_size - 1) * (self.table_rows(self.num_tables - 1) - 1)
        if worst > _INT64_MAX:
            raise ConfigError(
                f"NgramDims(vocab_size={self.vocab_size}, ratio={ratio!r}, "
                f"max_ngram={self.max_ngram}) overflows the int64 hash (largest sum {worst})"
            )

    # --- constructors ------------------------------------------------------
    @classmethod
    def longcat_flash_lite(cls) -> NgramDims:
        """LongCat-Flash-Lite: V 131072, D 3072, N 4, K 4, ratio 78, EOS 2."""
        return cls(
            vocab_size=131072,
            hidden_size=3072,
            max_ngram=4,
            splits=4,
            ratio=78,
            eos_token_id=2,
        )

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> NgramDims:
        """From a Hugging Face ``config.json`` dict of a LongCat n-gram model.

        Reads ``vocab_size``, ``hidden_size``, ``emb_neighbor_num``,
        ``emb_split_num``, ``ngram_vocab_size_ratio`` and ``eos_token_id`` (an int, or
        a one-element list).
        """
        keys = {
            "vocab_size": "vocab_size",
            "hidden_size": "hidden_size",
            "max_ngram": "emb_neighbor_num",
            "splits": "emb_split_num",
            "ratio": "ngram_vocab_size_ratio",
            "eos_token_id": "eos_token_id",
        }
        missing = [k for k in keys.values() if k not in config]
        if missing:
            raise ConfigError(
                f"config is missing {', '.join(missing)}; a LongCat n-gram config needs "
                f"{', '.join(keys.values())}"
            )
        kw = {field: config[key] for field, key in keys.items()}
        eos = kw["eos_token_id"]
        if isinstance(eos, (list, tuple)):
            if len(eos) != 1:
                raise ConfigError(f"config eos_token_id={eos!r}: exactly one EOS id is supported")
            kw["eos_token_id"] = eos[0]
        return cls(**kw)

    # --- derived sizes -----------------------------------------------------
    @property
    def num_tables(self) -> int:
        """T = splits * (max_ngram - 1)."""
        return self.splits * (self.max_ngram - 1)

    @property
    def table_dim(self) -> int:
        """d = hidden_size / num_tables, the width of every n-gram table."""
        return self.hidden_size // self.num_tables

    @property
    def base_rows(self) -> int:
        """m = int(ratio * vocab_size)."""
        return int(float(self.ratio) * self.vocab_size)

    def _check_table(self, i: int) -> int:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise ConfigError(f"table index must be an int, got {i!r}")
        if not 0 <= i < self.num_tables:
            raise ConfigError(f"table index {i} is outside [0, {self.num_tables})")
        return int(i)

    def table_rows(self, i: int) -> int:
        """M_i = m + 2 i + 1, the row count of table ``i``."""
        i = self._check_table(i)
        return self.base_rows + 2 * i + 1

    def table_order(self, i: int) -> int:
        """The n-gram order n of table ``i`` (``i // splits + 2``)."""
        return self._check_table(i) // self.splits + 2

    def table_index(self, order: int, split: int) -> int:
        """``(order - 2) * splits + split``, the table of an (order, split) pair."""
        if not 2 <= order <= self.max_ngram:
            raise ConfigError(f"order={order} is outside [2, {self.max_ngram}]")
        if not 0 <= split < self.splits:
            raise ConfigError(f"split={split} is outside [0, {self.splits})")
        return (order - 2) * self.splits + split

    def table_offset(self, i: int) -> int:
        """Row offset of table ``i`` in the concatenated layout: ``i*m + i*i``."""
        i = self._check_table(i)
        return i * self.base_rows + i * i

    @functools.cached_property
    def all_table_rows(self) -> np.ndarray:
        """int64[num_tables], ``table_rows(i)`` for every table (read-only)."""
        rows = self.base_rows + 2 * np.arange(self.num_tables, dtype=np.int64) + 1
        rows.setflags(write=False)
        return rows

    @property
    def all_table_orders(self) -> np.ndarray:
        """int64[num_tables], ``table_order(i)`` for every table."""
        return np.arange(self.num_tables, dtype=np.int64) // self.splits + 2

    def table_subset(self, tables: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """``(multipliers[tables], all_table_rows[tables])``, contiguous, made once per
        subset (``tables`` int[k] table indices, or None for every table)."""
        if tables is None:
            return self.multipliers, self.all_table_rows
        key = np.asarray(tables, dtype=np.int64).tobytes()
        got = self._subsets.get(key)
        if got is None:
            idx = np.frombuffer(key, dtype=np.int64)
            got = (
                np.ascontiguousarray(self.multipliers[idx]),
                np.ascontiguousarray(self.all_table_rows[idx]),
            )
            self._subsets[key] = got
        return got

    @functools.cached_property
    def _subsets(self) -> dict[bytes, tuple[np.ndarray, np.ndarray]]:
        return {}

    @functools.cached_property
    def multipliers(self) -> np.ndarray:
        """Pre-reduced hash multipliers, int64[num_tables, max_ngram] (read-only).

        ``out[i, j] = V**j mod M_i`` for ``j < order(i)`` and 0 beyond the table's
        order, so one weighted sum over ``j`` serves every table.
        """
        out = np.zeros((self.num_tables, self.max_ngram), dtype=np.int64)
        for i in range(self.num_tables):  # T x N Python ints, once per config
            rows = self.table_rows(i)
            for j in range(self.table_order(i)):
                out[i, j] = pow(self.vocab_size, j, rows)
        out.setflags(write=False)
        return out

    def to_config(self) -> dict[str, Any]:
        """The ``config.json`` keys this object reads in :meth:`from_config`."""
        return {
            "vocab_size": int(self.vocab_size),
            "hidden_size": int(self.hidden_size),
            "emb_neighbor_num": int(self.max_ngram),
            "emb_split_num": int(self.splits),
            "ngram_vocab_size_ratio": self.ratio,
            "eos_token_id": int(self.eos_token_id),
        }


__all__ = ["NgramDims"]
