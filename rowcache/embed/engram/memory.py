"""Engram's memory lookup: each Engram layer's head rows from its table, resident or cached.

Owns :class:`EngramMemory` (an :class:`~rowcache.embed.engram.hash.EngramHash` and one table
per Engram layer: ``Bf16Table``, ``Fp8Table``, ``Fp8TableScaleTable``, ``Fp8BlockScaleTable``
(DeepSeek-V4.1's format as shipped) or ``CachedTable`` over an ``NgramRowCache``,
one arena shared by every layer's table or one per layer) and :class:`EngramPrefetch`, the
handle of a step's reads started at its start. A layer's table is its heads' tables end to
end (rows ``EngramHash.table_rows(layer)``, ``head_dim`` wide); a position's ``e`` is its
heads' rows concatenated (docs/engram-spec.md section 5). Gathers are the tables' own (the
same kernels for resident and cached rows), so cached == resident bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from rowcache.cache.prefetch import PrefetchHandle
from rowcache.cache.step_rows import StepRows
from rowcache.embed.engram.hash import EngramHash
from rowcache.embed.tables import (
    Bf16Table,
    CachedTable,
    Fp8BlockScaleTable,
    Fp8Table,
    Fp8TableScaleTable,
)
from rowcache.errors import ConfigError

TABLES = (Bf16Table, Fp8Table, Fp8TableScaleTable, Fp8BlockScaleTable, CachedTable)
"""The tables an Engram layer may have."""

EngramPrefetch = PrefetchHandle
"""The reads a step's :meth:`EngramMemory.prefetch` started (one per row cache, merged):
``rows`` it asked for that were not resident, ``dropped`` left out for want of an unpinned
slot (a later lookup faults them); ``wait``/``done``/``exception`` over every cache."""


class EngramMemory:
    """Every Engram layer's lookup of a step, from resident or cached tables.

    Parameters
    ----------
    engram_hash : EngramHash
    tables : {layer_id: table} for every layer of ``engram_hash.layer_ids``: one of
        :data:`TABLES` (``CachedTable`` over a store of any codec), ``table_rows(layer)``
        rows of ``head_dim`` values,
        all on one device. Cached tables may share one arena (parts of one
        ``NgramRowCache``) or have one each.

    Examples
    --------
    >>> mem = EngramMemory(h, {1: CachedTable(cache, 0), 15: CachedTable(cache, 1)})
    >>> pf = mem.prefetch(tokens)           # at the step's start: every layer's reads begin
    >>> e1 = mem.lookup(1, tokens)          # at layer 1: bf16 [B, T, output_dim]
    >>> e15 = mem.lookup(15, tokens)        # at layer 15
    >>> mem.end_step()                      # after the step's gathers: unpin its rows

    A step's rows stay pinned from their lookup to :meth:`end_step`, so an arena must hold
    one step's distinct rows of every layer it serves.
    """

    def __init__(self, engram_hash: EngramHash, tables: Mapping[int, Any]) -> None:
        if not isinstance(engram_hash, EngramHash):
            raise ConfigError(
                f"engram_hash must be an EngramHash, got {type(engram_hash).__name__}"
            )
        if not isinstance(tables, Mapping):
            raise ConfigError(
                f"tables must be a dict {{layer_id: table}}, got {type(tables).__name__}"
            )
        cfg = engram_hash.config
        layers = set(engram_hash.layer_ids)
        if set(tables) != layers:
            missing, extra = sorted(layers - set(tables)), sorted(set(tables) - layers)
            raise ConfigError(
                f"tables: give one table for each Engram layer {sorted(layers)}"
                + (f"; missing {missing}" if missing else "")
                + (f"; not Engram layers: {extra}" if extra else "")
            )
        devices = set()
        for layer, t in tables.items():
            if not isinstance(t, TABLES):
                raise ConfigError(
                    f"tables[{layer}]: give one of {', '.join(k.__name__ for k in TABLES)}; "
                    f"got {type(t).__name__}"
                )
            want = engram_hash.table_rows(layer)
            if t.rows != want or t.dim != cfg.head_dim:
                raise ConfigError(
                    f"tables[{layer}] is [{t.rows}, {t.dim}]; layer {layer}'s heads need "
                    f"[{want}, {cfg.head_dim}] (the sum of its primes x head_dim)"
                )
            devices.add(t.device)
        if len(devices) != 1:
            raise ConfigError(f"tables: all on one device, got {sorted(devices)}")
        self.hash = engram_hash
        self.tables = dict(tables)
        self.device = devices.pop()
        self._offsets = {layer: engram_hash.head_offsets(layer) for layer in engram_hash.layer_ids}
        self._recent: list[tuple[np.ndarray, np.ndarray | None, dict[int, np.ndarray]]] = []
        # the cached layers' tables: the members of the step's rows over their caches
        self._cached = [layer for layer, t in self.tables.items() if isinstance(t, CachedTable)]
        self._member = {layer: k for k, layer in enumerate(self._cached)}
        self._rows = StepRows(
            [(self.tables[lay].cache, self.tables[lay].part) for lay in self._cached]
        )

    @property
    def output_dim(self) -> int:
        """Width of ``e``: ``(max_ngram - 1) * n_embed_per_ngram``."""
        return self.hash.config.output_dim

    def rows(self, tokens: Any, context: Any = None) -> dict[int, np.ndarray]:
        """Each layer's table rows of the step, int64 ``[B, T, heads_per_layer]`` (the hash's
        head ids plus each head's offset). The rows of the last two steps hashed are kept, so
        a step's lookups reuse its prefetch's hash, also when the next step's prefetch (a
        prefill chunk read one step ahead) came in between."""
        t = np.asarray(tokens)
        c = None if context is None else np.asarray(context)
        for kt, kc, rows in self._recent:
            if _same(kt, t) and ((c is None and kc is None) or (kc is not None and _same(kc, c))):
                return rows
        ids = self.hash.hash(t, c)
        rows = {layer: ids[layer] + self._offsets[layer] for layer in ids}
        kept = (np.array(t, copy=True), None if c is None else np.array(c, copy=True), rows)
        self._recent = [kept, *self._recent[:1]]
        return rows

    def prefetch(self, tokens: Any, context: Any = None) -> EngramPrefetch:
        """Start reading every cached layer's rows of the step; returns at once.

        Call it at the step's start (the rows depend on the tokens only): the reads run
        while the layers before the first Engram layer compute, and a :meth:`lookup` waits
        only for rows still in flight. One prefetch per row cache (a shared arena reads
        every layer's rows in one)."""
        rows = self.rows(tokens, context)
        return self._rows.prefetch([rows[layer].reshape(-1) for layer in self._cached])

    def lookup(self, layer_id: int, tokens: Any, context: Any = None, *, out: Any = None) -> Any:
        """Layer ``layer_id``'s ``e``: bfloat16 ``[B, T, output_dim]`` on the tables' device.

        Parameters
        ----------
        layer_id : an Engram layer.
        tokens, context : as :meth:`EngramHash.hash` (the step's token ids, uncompressed).
        out : bfloat16 ``[B, T, output_dim]`` on the tables' device to write into.

        Cached rows are resolved (faulted in where not resident or in flight) and pinned
        until :meth:`end_step`.
        """
        if layer_id not in self.tables:
            raise ConfigError(
                f"layer_id={layer_id!r} holds no Engram memory; layers: {list(self.hash.layer_ids)}"
            )
        rows = self.rows(tokens, context)[layer_id]
        B, T, K = rows.shape
        d = self.hash.config.head_dim
        flat_out = None
        if out is not None:
            if tuple(out.shape) != (B, T, K * d):
                raise ConfigError(
                    f"out: give shape {(B, T, K * d)} (bfloat16 on {self.device}), got {tuple(out.shape)}"
                )
            flat_out = out.reshape(B * T * K, d)
        table, ids = self.tables[layer_id], rows.reshape(-1)
        if isinstance(table, CachedTable):  # resolved and pinned until end_step
            slots = self._rows.resolve_member(self._member[layer_id], ids)
            g = table.gather_slots(slots, flat_out)
        else:
            g = table.gather(ids, flat_out)
        return g.reshape(B, T, K * d) if out is None else out

    def end_step(self) -> None:
        """End the step: unpin the rows its lookups pinned (each cache once). Call it after
        the step's gathers were issued (on the GPU, the caches' later writes wait for the
        current stream's work so far: ``StepRows.end_step``)."""
        self._rows.end_step()

    def __repr__(self) -> str:
        kinds = ", ".join(f"{layer}: {type(t).__name__}" for layer, t in self.tables.items())
        return f"EngramMemory({{{kinds}}}, device={self.device!r})"


def _same(a: np.ndarray, b: np.ndarray | None) -> bool:
    return b is not None and a.shape == b.shape and bool(np.array_equal(a, b))
