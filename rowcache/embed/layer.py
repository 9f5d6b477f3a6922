"""The fused n-gram embedding: word row + projected n-gram rows, scaled.

Owns :class:`NgramEmbedding`: its construction (tables, projections, options), the
public calls (embed, embed_batch, embed_packed, ids, prefetch...) and the choice of a
step's path. The paths live apart: the composed step (CPU references, device tokens,
host resolve first: ``rowcache.embed.step.composed``), the fused eager GPU step
(``rowcache.embed.step.fused``), graph replay and :class:`StaticStep` (``rowcache.embed.step.graph``),
over the cached-table orchestration (``rowcache.embed.step.cached_groups``), the staging buffers
(``rowcache.embed.step.staging``) and the device buffers (``rowcache.embed.step.device``).
On every path: hashed ids (``rowcache.kernels.ngram.hash.ngram_hash``), every table's rows gathered
into a stacked ``[n, T*d]`` buffer, the T projections as one ``[n, T*d] x [T*d, D]``
GEMM with fp32 accumulation, and ``bf16((word + proj) / (1 + T))``.
Does not own the tables (``rowcache.embed.tables``) or the checkpoint format.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rowcache.cache.prefetch import PrefetchHandle
from rowcache.embed.layer_inputs import check_gemm_splits, check_tables, stack_projs
from rowcache.embed.lookahead import prefetch_step
from rowcache.embed.ngram.batch import NgramBatch
from rowcache.embed.ngram.dims import NgramDims
from rowcache.embed.step.cached_groups import CachedGroups
from rowcache.embed.step.composed import ComposedStep
from rowcache.embed.step.fused import FusedStep
from rowcache.embed.step.graph import GraphStep, StaticStep
from rowcache.embed.step.rows import RowsStep
from rowcache.embed.step.staging import GEMM_SPLITS, GEMM_SPLITS_MAX, Staging
from rowcache.embed.tables import CachedTable
from rowcache.errors import ConfigError
from rowcache.kernels.loader import is_device_array, require_cupy
from rowcache.kernels.ngram.hash import TokenRangeError, ngram_hash
from rowcache.kernels.ngram.stacked import StackedTables
from rowcache.kernels.reference import BF16


class NgramEmbedding(CachedGroups, Staging, ComposedStep, FusedStep, GraphStep, RowsStep):
    """LongCat n-gram embedding over any mix of table variants.

    Parameters
    ----------
    dims : NgramDims
    word : Bf16Table | Fp8Table | CachedTable | bfloat16[vocab_size, hidden_size]
        The base word table E0.
    tables : sequence of ``dims.num_tables`` tables (or bf16 arrays)
        Table ``i`` has ``dims.table_rows(i)`` rows of ``dims.table_dim``.
    projs : sequence of ``num_tables`` arrays bfloat16[hidden_size, table_dim]
        ``W_i`` in nn.Linear layout (``y = W_i @ e``), or one array ``[T, D, d]``.

    fused : bool
        On the GPU, gather all T tables with one ``rowcache.kernels.ngram.stacked.gather_stacked``
        launch (default) instead of one ``rowcache.kernels.batched_embed[_fp8]`` launch per
        table; the two are bit-identical. Ignored on the CPU. Kept (not measured
        worse in ``docs/results/``, which has no figure for it) as the per-table
        gather path the GPU tests compare the fused launch with, bit for bit.
    cuda_graphs : bool
        On the GPU, replay steps (no overlay, host tokens, fused; cached tables with
        ``device_lookup``) from a CUDA graph captured per (tokens, rows, several
        sequences) shape: the upload, the fused hash + gathers and the GEMM in one
        launch, then the scaled sum into a fresh output (two launches per step).
        Results are bit-identical to the eager path. Default off. A server that
        replays its whole decode step from one graph uses :meth:`static_step`
        (resident tables) instead.
    device_lookup : bool
        On the GPU (fused), read cached tables through their caches' device row ->
        slot maps (``NgramRowCache.device_map()``: 4 bytes per table row in device
        memory), so a step hashes, looks up and gathers in one launch and resolves
        the rows on the host (pinning them, keeping the LRU exact) while the device
        works; a step whose resolve faulted runs its device part again. Default on;
        off: the ids are hashed and resolved on the host before the gathers. Kept
        (``docs/results/`` has no figure for it) as the host-resolve-first path
        the GPU tests compare the device-map path with, and for memory: it needs no
        device map.
    defer_reads : bool
        With ``device_lookup``: a step whose rows must be read from disk does not wait
        for them. Its caches read them on their readers' threads
        (``NgramRowCache.resolve_deferred``) while the step's launches, and the
        caller's after it (the rest of the model), queue on the GPU behind the read.
        The caches commit the step at their next call (:meth:`settle`, or the next
        step), which raises a failed read's ``CorruptDataError``: the caches are then
        as before the step, and its output (and all computed from it) is invalid, to
        be dropped. Default off: a step returns once its rows are read, and raises
        there.
    gemm_splits : int, optional
        On the GPU, the projection GEMM runs as this many GEMMs over equal chunks of
        its inner dimension (``T*d``), summed by the scaled-sum kernel: a decode step's
        GEMM has few rows and one GEMM reads the weights on too few thread blocks.
        Default: by rows per step (:data:`GEMM_SPLITS`). Results depend on it (float
        sums in another order), and every GPU path of one embedding uses the same
        rule, so they stay bit-identical to each other. Ignored on the CPU.

    Every table and the word table must be on one device (``"cpu"`` or ``"cuda"``);
    the projections are copied there.
    """

    def __init__(
        self,
        dims: NgramDims,
        word: Any,
        tables: Sequence[Any],
        projs: Any,
        *,
        fused: bool = True,
        cuda_graphs: bool = False,
        gemm_splits: int | None = None,
        device_lookup: bool = True,
        defer_reads: bool = False,
    ) -> None:
        if not isinstance(dims, NgramDims):
            raise ConfigError(f"dims must be an NgramDims, got {type(dims).__name__}")
        self.dims = dims
        self.word, self.tables, device = check_tables(dims, word, tables)
        self.device: str = device
        self._xp: Any = require_cupy("NgramEmbedding on cuda") if self.device == "cuda" else np
        wcat = stack_projs(dims, projs)  # bfloat16[T*d, D], host
        if self.device == "cuda":
            self._wcat: Any = self._xp.asarray(wcat)
        else:
            self._wcat = wcat.astype(np.float32)  # the CPU GEMM runs in float32
        self._stacked: StackedTables | None = None
        self._word_stacked: StackedTables | None = None
        self.device_lookup = bool(device_lookup) and fused and self.device == "cuda"
        self.defer_reads = bool(defer_reads) and self.device_lookup
        self._resolve_first = False  # rowcache.embed.step.fused: the last fused step faulted
        if fused and self.device == "cuda":
            self._stacked = StackedTables(
                [t.arrays for t in self.tables], [self._map_of(t) for t in self.tables]
            )
            if self.device_lookup or not isinstance(self.word, CachedTable):
                self._word_stacked = StackedTables([self.word.arrays], [self._map_of(self.word)])
        self._mult = self._xp.ascontiguousarray(self._xp.asarray(dims.multipliers, dtype=np.int64))
        self._rows = self._xp.ascontiguousarray(
            self._xp.asarray(dims.all_table_rows, dtype=np.int64)
        )
        self.gemm_splits = check_gemm_splits(dims, gemm_splits)
        self.cuda_graphs = bool(cuda_graphs) and self.device == "cuda"
        self._graphs: dict[tuple[int, int, bool], StaticStep] = {}
        self._tok = None
        self._group_caches()
        self._cap = 0
        self._stack: Any = None
        self._proj: Any = None
        self._words: Any = None
        self._rows_flag: Any = None  # rowcache.embed.step.rows: the range flag and host packing
        self._rows_seq = 0
        self._rows_host: Any = None

    # --- public ---------------------------------------------------------------
    @property
    def num_tables(self) -> int:
        return self.dims.num_tables

    @property
    def cached_tables(self) -> list[CachedTable]:
        """The tables (word table included) served through a row cache."""
        return [t for t in (self.word, *self.tables) if isinstance(t, CachedTable)]

    @property
    def caches(self) -> list[Any]:
        """The distinct row caches behind the cached tables (a shared cache once)."""
        return [g[0] for g in self._groups]

    def resident_bytes(self) -> int:
        """Bytes held by the tables (a shared arena once, with its device map when
        ``device_lookup``), projections and staging."""
        staged = sum(int(a.nbytes) for a in (self._stack, self._proj, self._words) if a is not None)
        steps = [self._tok, *self._graphs.values()]
        staged += sum(s.nbytes for s in steps if s is not None)
        tables = sum(t.nbytes for t in (self.word, *self.tables) if not isinstance(t, CachedTable))
        arenas = {id(t.cache): t.nbytes for t in self.cached_tables}
        if self.device_lookup:  # each cache's device map, once
            for t in self.cached_tables:
                arenas[id(t.cache)] = t.nbytes + int(t.cache.device_map().nbytes)
        return int(tables + sum(arenas.values()) + self._wcat.nbytes + staged)

    def ids(self, ctx_tokens: Any) -> Any:
        """``ngram_ids(dims, ctx_tokens)`` on this embedding's device: int64[T, L]."""
        return self._hash_all(NgramBatch.single(self.dims, ctx_tokens, 0))

    def embed(
        self,
        ctx_tokens: Any,
        seq_len: int,
        *,
        overlay: Any = None,
        seq_slot: Any = None,
        active: int = -1,
        out: Any = None,
    ) -> Any:
        """Embeddings of the last ``seq_len`` tokens of ``ctx_tokens``.

        Parameters
        ----------
        ctx_tokens : int[L], numpy, cupy or list
            Kept look-back tokens followed by the new ones (``NgramContext.step``).
        seq_len : int
            How many trailing positions to embed, ``0 <= seq_len <= L``.
        overlay : object with ``apply_embed(ids, rows, seq_slot=None, active=-1)``, optional
            Applied to the gathered word rows (bfloat16[seq_len, D]) before the sum;
            its return value replaces the rows when it is not None (else in place).
        seq_slot, active : passed to ``overlay.apply_embed``.
        out : bfloat16[seq_len, hidden_size], optional

        Returns
        -------
        bfloat16[seq_len, hidden_size]
            ``(E0[x_t] + sum_i W_i E_i[id_i(t)]) / (1 + T)`` on this embedding's device.
        """
        batch = NgramBatch.single(self.dims, ctx_tokens, seq_len)
        return self._run(batch, overlay=overlay, seq_slots=seq_slot, active=active, out=out)

    def embed_batch(
        self,
        contexts: Sequence[Any],
        seq_lens: Sequence[int],
        *,
        overlay: Any = None,
        seq_slots: Any = None,
        active: int = -1,
        out: Any = None,
    ) -> Any:
        """:meth:`embed` for several sequences in one pass (one hash, gather and GEMM).

        ``contexts[s]`` is sequence ``s``'s context; its last ``seq_lens[s]`` positions
        are embedded, in order, rows ``sum(seq_lens[:s]) ...``. Look-back never crosses
        from one sequence into another. ``seq_slots`` (one per sequence, or one per
        output row) is passed to the overlay per row. Returns bfloat16[sum(seq_lens), D].
        The contexts are packed once (:meth:`NgramBatch.from_contexts`), then this is
        :meth:`embed_packed`.
        """
        batch = NgramBatch.from_contexts(self.dims, contexts, seq_lens)
        return self._run(batch, overlay=overlay, seq_slots=seq_slots, active=active, out=out)

    def embed_packed(
        self,
        tokens: Any,
        ctx_lens: Any = None,
        seq_lens: Any = None,
        *,
        overlay: Any = None,
        seq_slots: Any = None,
        active: int = -1,
        out: Any = None,
    ) -> Any:
        """:meth:`embed_batch` on packed input: no Python work per sequence.

        Parameters
        ----------
        tokens : NgramBatch, or int[L_total] (numpy, cupy, list)
            An ``NgramBatch`` (e.g. from ``NgramBatchContext.step``), or every
            sequence's context concatenated; then ``ctx_lens`` and ``seq_lens``
            (int[S] each) give each context's length and how many of its trailing
            positions to embed.
        overlay, seq_slots, active, out : as in :meth:`embed_batch`.

        Returns
        -------
        bfloat16[sum(seq_lens), hidden_size]

        Notes
        -----
        Cached tables: every cached table's ids are resolved (faulted in and pinned)
        with ONE ``resolve`` per cache (the parts of a shared cache are concatenated
        as ``row_offsets[k] + ids_k``), their ids hashed on the host from host
        tokens; from device tokens they are copied to the host (one sync). With
        ``device_lookup`` (GPU, fused, host tokens) the device gathers first through
        the caches' device maps and the host resolves meanwhile; an eager step of at
        most ``rowcache.embed.step.cached_groups.CHECK_TOKENS`` tokens that would fault
        (``NgramRowCache.holds_all``, asked first) resolves first instead and runs
        its device part once. In a larger step, or one replayed from a graph, a
        resolve that faulted makes the device part run again, and the next step
        then resolves first (until a step does not fault). Otherwise the resolve
        comes first.
        Every cache's batch ends when this call returns: a later fault writes the
        arena in stream order after this step's gathers, so no step synchronizes
        the host with the device.
        """
        if isinstance(tokens, NgramBatch):
            if tokens.dims != self.dims:
                raise ConfigError("the NgramBatch was built for other NgramDims")
            batch = tokens
        else:
            if ctx_lens is None or seq_lens is None:
                raise ConfigError(
                    "embed_packed needs ctx_lens and seq_lens (int[S] each) with packed tokens"
                )
            batch = NgramBatch(self.dims, tokens, ctx_lens, seq_lens)
        return self._run(batch, overlay=overlay, seq_slots=seq_slots, active=active, out=out)

    def embed_rows(
        self,
        ids: Any,
        ctx: Any = None,
        *,
        overlay: Any = None,
        seq_slots: Any = None,
        active: int = -1,
        out: Any = None,
    ) -> Any:
        """Embeddings of every token of ``ids[B, L]``, each row a sequence after its
        context row: the layout of a serving engine's batch (``TorchNgramEmbedding``).

        Parameters
        ----------
        ids : int[B, L] (numpy or cupy, any strides)
            Output row ``b * L + l`` embeds ``ids[b, l]``.
        ctx : int[B, C] (same array module), or None
            The tokens before each row; only the last ``max_ngram - 1`` are its look-back.
            None: no look-back (the sequences start here).
        overlay, seq_slots, active, out : as in :meth:`embed_batch` (``out``
            bfloat16[B * L, hidden_size]).

        Returns
        -------
        bfloat16[B * L, hidden_size], bit-identical to :meth:`embed_packed` of the rows
        ``[ctx[b, -c:] | ids[b]]`` (``c = min(C, max_ngram - 1)``).

        Notes
        -----
        On the GPU with resident tables and no overlay the arrays are read in place:
        one launch hashes, range-checks and gathers, then GEMM and sum, then one sync
        reads the range check (a bad token raises, naming it, after ``out`` was
        written). Otherwise the rows are packed on the host (on the GPU by two strided
        device-to-host copies and a sync: a cached table's resolve needs the tokens on
        the host) and embedded as by :meth:`embed_packed`.
        """
        return self._embed_rows(ids, ctx, out, overlay, seq_slots, active)

    def prefetch(self, ctx_tokens: Any, seq_len: int | None = None) -> PrefetchHandle:
        """Start reading the cached rows that :meth:`embed` of these arguments will
        need (the next prefill chunk, draft tokens); returns at once.

        ``seq_len`` defaults to every position of ``ctx_tokens``. Returns a handle with
        ``wait()`` and ``done()``. A later step that embeds these positions waits only
        for reads still in flight and faults nothing twice; rows arrive unpinned and
        most recently used, never in place of a row the current step holds; a failed
        read raises at the step that needs the row (``NgramRowCache.prefetch``).
        Resident tables read nothing: the handle is then empty.
        """
        L = len(ctx_tokens) if seq_len is None else seq_len
        return prefetch_step(self, NgramBatch.single(self.dims, ctx_tokens, L))

    def prefetch_batch(self, contexts: Sequence[Any], seq_lens: Sequence[int]) -> PrefetchHandle:
        """:meth:`prefetch` of a coming :meth:`embed_batch` (same arguments)."""
        return prefetch_step(self, NgramBatch.from_contexts(self.dims, contexts, seq_lens))

    def prefetch_packed(
        self, tokens: Any, ctx_lens: Any = None, seq_lens: Any = None
    ) -> PrefetchHandle:
        """:meth:`prefetch` of a coming :meth:`embed_packed` (same arguments: an
        ``NgramBatch``, or packed tokens with ``ctx_lens`` and ``seq_lens``)."""
        if isinstance(tokens, NgramBatch):
            if tokens.dims != self.dims:
                raise ConfigError("the NgramBatch was built for other NgramDims")
            return prefetch_step(self, tokens)
        if ctx_lens is None or seq_lens is None:
            raise ConfigError(
                "prefetch_packed needs ctx_lens and seq_lens (int[S] each) with packed tokens"
            )
        return prefetch_step(self, NgramBatch(self.dims, tokens, ctx_lens, seq_lens))

    def embed_ids(self, contexts: Sequence[Any], seq_lens: Sequence[int]) -> tuple[Any, Any]:
        """Ids of the embedded positions: ``(all_ids int64[T, L_total], ids int64[T, n])``.

        ``all_ids`` covers every position of the concatenated contexts (look-back
        stopping at sequence boundaries); ``ids`` the ``n = sum(seq_lens)`` positions
        that :meth:`embed_batch` embeds. On this embedding's device.
        """
        batch = NgramBatch.from_contexts(self.dims, contexts, seq_lens)
        all_ids = self._hash_all(batch)
        sel = batch.selection
        if isinstance(sel, np.ndarray) and self._xp is not np:
            sel = self._xp.asarray(sel)
        return all_ids, all_ids[:, sel]

    def clear_graphs(self) -> None:
        """Drop the captured CUDA graphs and their buffers."""
        self._graphs.clear()

    # --- the step ---------------------------------------------------------------
    def _run(
        self, batch: NgramBatch, *, overlay: Any, seq_slots: Any, active: int, out: Any
    ) -> Any:
        """Check ``out``, then run the step on its one path: graph replay
        (``rowcache.embed.step.graph``), the fused eager GPU step (``rowcache.embed.step.fused``) or the
        composed step (``rowcache.embed.step.composed``: the CPU, device tokens, host resolve
        first)."""
        xp = self._xp
        n, D = batch.n, self.dims.hidden_size
        if out is not None and (
            out.shape != (n, D) or out.dtype != BF16 or is_device_array(out) != (xp is not np)
        ):
            raise ConfigError(
                f"out must be bfloat16[{n}, {D}] on {self.device}, got "
                f"{getattr(out, 'dtype', None)}{list(getattr(out, 'shape', ()))}"
            )
        if batch.on_device and xp is np:
            batch = NgramBatch(self.dims, batch.tokens.get(), batch.ctx_lens, batch.seq_lens)
        if n == 0:
            if batch.on_device:  # the range check of device tokens still runs
                self._hash_all(batch)
            return xp.empty((0, D), dtype=BF16) if out is None else out
        if self.cuda_graphs and self._fused_ids and overlay is None and not batch.on_device:
            return self._run_graph(batch, out)
        out, stack, words, proj = self._step_buffers(n, out)
        step = (
            self._step_fused
            if xp is not np and not batch.on_device and self._fused_ids
            else self._step_composed
        )
        return step(batch, stack, words, proj, out, overlay, seq_slots, active)

    def _overlay_rows(
        self,
        overlay: Any,
        word_ids: Any,
        words: Any,
        seq_slots: Any,
        active: int,
        batch: NgramBatch,
        n: int,
    ) -> Any:
        """The word rows after the overlay (``words`` itself, changed in place, or the
        overlay's returned rows)."""
        if overlay is None:
            return words
        slots = self._row_slots(seq_slots, batch, n)
        applied = overlay.apply_embed(word_ids, words, seq_slot=slots, active=active)
        return words if applied is None else applied

    def _row_slots(self, seq_slots: Any, batch: NgramBatch, n: int) -> Any:
        if seq_slots is None or np.ndim(seq_slots) == 0 or len(seq_slots) == n:
            return seq_slots
        if len(seq_slots) != batch.num_seqs:
            raise ConfigError(
                f"seq_slots has {len(seq_slots)} entries: expected one per sequence "
                f"({batch.num_seqs}) or one per row ({n})"
            )
        return batch.rows_per_sequence(seq_slots)

    def _hash_all(self, batch: NgramBatch) -> Any:
        """Ids of every position of the batch: int64[T, L_total] on this device."""
        xp = self._xp
        tokens = batch.tokens
        if xp is not np and not batch.on_device:
            tokens = xp.asarray(tokens)
        starts = batch.starts
        if starts is not None and xp is not np:
            starts = xp.asarray(starts)
        try:
            return ngram_hash(
                tokens,
                self._mult,
                self._rows,
                self.dims.eos_token_id,
                starts,
                vocab=self.dims.vocab_size if batch.on_device else None,
            )
        except TokenRangeError as e:
            raise ConfigError(
                f"{batch.name_position(e.position)} = {e.value} is outside the vocabulary "
                f"[0, {e.vocab})"
            ) from None

    def __repr__(self) -> str:
        kinds = [t.kind for t in self.tables]
        return (
            f"NgramEmbedding(tables={kinds}, word={self.word.kind}, hidden={self.dims.hidden_size}, "
            f"device={self.device!r})"
        )


__all__ = ["GEMM_SPLITS", "GEMM_SPLITS_MAX", "NgramEmbedding", "StaticStep"]
