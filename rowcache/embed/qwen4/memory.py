"""Qwen3.8-Flash-Next's n-gram lookup: a step's 16 rows a token from its table, resident or cached.

Owns :class:`Qwen4NgramMemory`: a :class:`~rowcache.embed.qwen4.hash.Qwen4NgramHash` and its
one table (``Bf16Table``, ``Fp8TableScaleTable`` or ``CachedTable`` over an ``NgramRowCache``
of a store of the table), and for a cached table the step's rows over its cache
(:class:`rowcache.cache.StepRows`). A position's output is its heads' rows concatenated in
head order (docs/qwen4-spec.md, "Table and checkpoint"). Gathers are the tables' own (the same
kernels for resident and cached rows), so cached == resident bit for bit. A lookup whose rows
could outnumber the arena's slots is served in pieces, never refused.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rowcache.cache.prefetch import PrefetchHandle
from rowcache.cache.step_rows import StepRows
from rowcache.embed.qwen4.hash import Qwen4NgramHash
from rowcache.embed.tables import Bf16Table, CachedTable, Fp8TableScaleTable
from rowcache.errors import ConfigError
from rowcache.kernels.reference import BF16

TABLES = (Bf16Table, Fp8TableScaleTable, CachedTable)


class Qwen4NgramMemory:
    """The n-gram rows of a step, from a resident or cached table.

    Parameters
    ----------
    ngram_hash : Qwen4NgramHash
    table : ``Bf16Table``, ``Fp8TableScaleTable`` or ``CachedTable`` of
        ``ngram_hash.table_rows()`` rows of ``config.head_dim`` values.

    Examples
    --------
    >>> mem = Qwen4NgramMemory(h, CachedTable(cache))
    >>> pf = mem.prefetch(tokens, context)      # at the step's start: its reads begin
    >>> e = mem.lookup(tokens, context)         # at layer 1: bf16 [B, T, ple_embed_dim]
    >>> mem.end_step()                          # after the step's gathers: unpin its rows

    A step's rows stay pinned from their lookup to :meth:`end_step`; a lookup of more
    positions than ``slots // heads`` ends the step first and is served in pieces of that
    many positions (each piece's rows pinned until its gathers are issued).
    """

    def __init__(self, ngram_hash: Qwen4NgramHash, table: Any) -> None:
        if not isinstance(ngram_hash, Qwen4NgramHash):
            raise ConfigError(
                f"ngram_hash must be a Qwen4NgramHash, got {type(ngram_hash).__name__}"
            )
        if not isinstance(table, TABLES):
            raise ConfigError(
                "table: give a Bf16Table, Fp8TableScaleTable or CachedTable, got "
                f"{type(table).__name__}"
            )
        cfg = ngram_hash.config
        want = (ngram_hash.table_rows(), cfg.head_dim)
        if (table.rows, table.dim) != want:
            raise ConfigError(
                f"table is [{table.rows}, {table.dim}]; the n-gram table needs {list(want)} "
                "(the padded rows of its heads' primes x ple_embed_dim / heads)"
            )
        self.hash = ngram_hash
        self.table = table
        self.device = table.device
        self._rows = StepRows([(table.cache, table.part)] if isinstance(table, CachedTable) else [])
        self._recent: list[tuple[np.ndarray, np.ndarray | None, np.ndarray]] = []

    @property
    def output_dim(self) -> int:
        """Width of a position's output: ``ple_embed_dim``."""
        return int(self.hash.config.ple_embed_dim)

    @property
    def piece_positions(self) -> int | None:
        """Positions a piece of a lookup holds (a cached table: ``slots // heads``), or None
        for a resident table (one piece)."""
        if not isinstance(self.table, CachedTable):
            return None
        return max(1, int(self.table.cache.num_slots) // self.hash.config.heads)

    def rows(self, tokens: Any, context: Any = None) -> np.ndarray:
        """The step's global table rows, int64 ``[B, T, heads]`` (:meth:`Qwen4NgramHash.hash`).
        The rows of the last two steps hashed are kept, so a step's lookup reuses its
        prefetch's hash, also when the next step's prefetch came in between."""
        t = np.asarray(tokens)
        c = None if context is None else np.asarray(context)
        for kt, kc, rows in self._recent:
            if _same(kt, t) and ((c is None and kc is None) or (kc is not None and _same(kc, c))):
                return rows
        rows = self.hash.hash(t, c)
        kept = (np.array(t, copy=True), None if c is None else np.array(c, copy=True), rows)
        self._recent = [kept, *self._recent[:1]]
        return rows

    def prefetch(self, tokens: Any, context: Any = None) -> PrefetchHandle:
        """Start reading the rows of a coming step (a cached table); returns at once: the
        reads run while the model computes. Worth it a step ahead (the next prefill chunk,
        whose tokens are known): at a step's own start the one layer before Qwen's table
        hides less than a prefetch costs, and the lookup's own reads are faster
        (docs/qwen4.md, "A prefetch at the step's start"). A resident table needs nothing
        (an empty handle)."""
        if not self._rows:
            return PrefetchHandle([], 0, 0)
        return self._rows.prefetch([self.rows(tokens, context).reshape(-1)])

    def lookup(self, tokens: Any, context: Any = None, *, out: Any = None) -> Any:
        """The step's n-gram embedding: bfloat16 ``[B, T, ple_embed_dim]`` on the table's device.

        Parameters
        ----------
        tokens : int ``[B, T]`` (or ``[T]``) token ids; context : int ``[B, ngram_size - 1]``,
            the raw tokens before the step (None: the sequences start here), as
            :meth:`Qwen4NgramHash.hash`.
        out : bfloat16 ``[B, T, ple_embed_dim]`` on the table's device to write into.
        """
        rows = self.rows(tokens, context)
        B, T, K = rows.shape
        d = self.hash.config.head_dim
        if out is not None and tuple(out.shape) != (B, T, K * d):
            raise ConfigError(
                f"out: give shape {(B, T, K * d)} (bfloat16 on {self.device}), got "
                f"{tuple(out.shape)}"
            )
        flat_ids = rows.reshape(-1)
        if not isinstance(self.table, CachedTable):
            flat = None if out is None else out.reshape(B * T * K, d)
            g = self.table.gather(flat_ids, flat)
            return g.reshape(B, T, K * d) if out is None else out
        piece = self.piece_positions
        assert piece is not None
        if out is None:
            out = self._empty((B, T, K * d))
        flat_out = out.reshape(B * T * K, d)
        n = B * T
        if n <= piece:
            slots = self._rows.resolve_member(0, flat_ids)
            self.table.gather_slots(slots, flat_out)
            return out
        self._rows.end_step()  # rows pinned before this lookup would shrink every piece
        for a in range(0, n, piece):
            b = min(n, a + piece)
            slots = self._rows.resolve_member(0, flat_ids[a * K : b * K])
            self.table.gather_slots(slots, flat_out[a * K : b * K])
            self._rows.end_step()  # (after the piece's gathers: stream order on the GPU)
        return out

    def end_step(self) -> None:
        """End the step: unpin the rows its lookups pinned. Call it after the step's gathers
        were issued (on the GPU the cache's later writes wait for the current stream's work
        so far: ``StepRows.end_step``)."""
        self._rows.end_step()

    def _empty(self, shape: tuple[int, int, int]) -> Any:
        """An uninitialized bfloat16 output on the table's device."""
        if self.device == "cpu":
            return np.empty(shape, dtype=BF16)
        import cupy

        return cupy.empty(shape, dtype=BF16)

    def __repr__(self) -> str:
        return f"Qwen4NgramMemory({type(self.table).__name__}, device={self.device!r})"


def _same(a: np.ndarray, b: np.ndarray | None) -> bool:
    return b is not None and a.shape == b.shape and bool(np.array_equal(a, b))


__all__ = ["Qwen4NgramMemory"]
