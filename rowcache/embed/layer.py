"""The n-gram embedding: word row + projected n-gram rows, scaled.

Owns :class:`NgramEmbedding`: its construction (tables, projections, options), the
public calls (embed, embed_batch, embed_packed, embed_rows, ids, prefetch...) and their
checks. A call becomes an input adapter (``rowcache.embed.step.inputs``: host tokens,
device tokens, rows in place) run by the one runner chosen at construction
(``rowcache.embed.step.runners``: the CPU, the GPU eagerly; ``rowcache.embed.step.graph``:
the GPU with CUDA graphs) over the fixed stages (``rowcache.embed.step.stages``: ids ->
resolve -> gather -> overlay -> project and sum) and the cached groups
(``rowcache.embed.step.cached_groups``). Does not own the tables (``rowcache.embed.tables``)
or the checkpoint format.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rowcache.cache.prefetch import PrefetchHandle
from rowcache.cache.step_rows import StepRows
from rowcache.embed.layer_inputs import check_gemm_splits, check_tables, stack_projs
from rowcache.embed.ngram.batch import NgramBatch
from rowcache.embed.ngram.dims import NgramDims
from rowcache.embed.step.cached_groups import CachedGroups
from rowcache.embed.step.device import StepShape
from rowcache.embed.step.graph import GraphRunner, StaticStep
from rowcache.embed.step.inputs import DeviceTokens, RowsInPlace, tokens_of
from rowcache.embed.step.runners import CpuRunner, EagerRunner
from rowcache.embed.step.stages import Stages, StepCall
from rowcache.embed.step.staging import GEMM_SPLITS, GEMM_SPLITS_MAX, Staging
from rowcache.embed.tables import CachedTable
from rowcache.errors import ConfigError
from rowcache.kernels.loader import is_device_array, require_cupy
from rowcache.kernels.reference import BF16


class NgramEmbedding:
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

    cuda_graphs : bool
        On the GPU, replay steps (host tokens, no overlay; cached tables too) from a CUDA
        graph planned per (tokens, rows, several sequences) shape: the upload, the hash
        + gathers and the GEMM in one launch, then the scaled sum into a fresh output
        (two launches per step). Results are bit-identical to the eager runner. Default
        off. A server that replays its whole decode step from one graph uses
        :meth:`static_step` (resident tables) instead.
    defer_reads : bool
        On the GPU: a step whose rows must be read from disk does not wait
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
    the projections are copied there. On the GPU, cached tables are read through their
    caches' device row -> slot maps (``NgramRowCache.device_map()``: 4 bytes a table row
    of device memory), so a step from host tokens hashes and gathers every table in one
    launch while the host resolves its rows (``rowcache.embed.step.cached_groups``).
    """

    def __init__(
        self,
        dims: NgramDims,
        word: Any,
        tables: Sequence[Any],
        projs: Any,
        *,
        cuda_graphs: bool = False,
        gemm_splits: int | None = None,
        defer_reads: bool = False,
    ) -> None:
        if not isinstance(dims, NgramDims):
            raise ConfigError(f"dims must be an NgramDims, got {type(dims).__name__}")
        self.dims = dims
        self.word, self.tables, device = check_tables(dims, word, tables)
        self.device: str = device
        gpu = self.device == "cuda"
        xp: Any = require_cupy("NgramEmbedding on cuda") if gpu else np
        self._xp = xp
        self.gemm_splits = check_gemm_splits(dims, gemm_splits)
        self.cuda_graphs = bool(cuda_graphs) and gpu
        self.defer_reads = bool(defer_reads) and gpu
        self._groups = CachedGroups(self.word, self.tables, xp, defer_reads=self.defer_reads)
        self._stages = Stages(
            dims, self.word, self.tables, stack_projs(dims, projs), xp, self._groups
        )
        staging = Staging(dims, xp, self.gemm_splits)
        self._staging = staging
        self._runner: CpuRunner | EagerRunner | GraphRunner
        if not gpu:
            self._runner = CpuRunner(self._stages, staging)
        elif self.cuda_graphs:
            self._runner = GraphRunner(self._stages, EagerRunner(self._stages, staging))
        else:
            self._runner = EagerRunner(self._stages, staging)

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
        return self._groups.caches

    @property
    def step_rows(self) -> StepRows:
        """The step's rows over its caches (``rowcache.cache.StepRows``): its members are
        the cached n-gram tables in order, then the word table when it is cached."""
        return self._groups.rows

    @property
    def runner(self) -> str:
        """The runner chosen at construction: ``"cpu"``, ``"eager"`` or ``"graphs"``."""
        return self._runner.name

    def resident_bytes(self) -> int:
        """Bytes held by the tables (a shared arena once, with its device map on the
        GPU), projections and staging."""
        tables = sum(t.nbytes for t in (self.word, *self.tables) if not isinstance(t, CachedTable))
        arenas = {id(t.cache): t.nbytes for t in self.cached_tables}
        return int(tables + sum(arenas.values()) + self._stages.nbytes + self._runner.nbytes)

    def ids(self, ctx_tokens: Any) -> Any:
        """``ngram_ids(dims, ctx_tokens)`` on this embedding's device: int64[T, L]."""
        return self._stages.hash_all(NgramBatch.single(self.dims, ctx_tokens, 0))

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
        tokens; from device tokens they are copied to the host (one sync) and resolved
        before the gathers. On the GPU from host tokens the device gathers through the
        caches' device maps and the host resolves beside it, in one order decided by
        the call (``CachedGroups.ordered``): a step of at most
        ``rowcache.embed.step.cached_groups.CHECK_TOKENS`` tokens that would fault
        (``NgramRowCache.holds_all``, asked first) resolves first and runs its device
        part once; otherwise the device part goes first, and runs again after a
        resolve that faulted.
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
        rows = RowsInPlace.checked(self.dims, ids, ctx)
        self._check_out(rows.n, out)
        if rows.n == 0:
            rows.packed(self.dims)  # the context is still range-checked
            return self._empty(out)
        return self._runner.run(rows, StepCall(overlay, seq_slots, active, out))

    def embed_rows_prechecked(self, ids: Any, ctx: Any, c: int, out: Any) -> Any:
        """:meth:`embed_rows` of arrays checked before (cupy int64 ``ids[B, L]``, ``B * L
        > 0``, ``ctx`` with ``c`` look-back columns or None, ``out`` bfloat16[B * L,
        hidden] on the GPU; no overlay), without checking them again:
        ``TorchNgramEmbedding``'s step for tensors it has seen."""
        return self._runner.run(RowsInPlace(ids, ctx, c), StepCall(out=out))

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
        return self._groups.prefetch(self.dims, NgramBatch.single(self.dims, ctx_tokens, L))

    def prefetch_batch(self, contexts: Sequence[Any], seq_lens: Sequence[int]) -> PrefetchHandle:
        """:meth:`prefetch` of a coming :meth:`embed_batch` (same arguments)."""
        batch = NgramBatch.from_contexts(self.dims, contexts, seq_lens)
        return self._groups.prefetch(self.dims, batch)

    def prefetch_packed(
        self, tokens: Any, ctx_lens: Any = None, seq_lens: Any = None
    ) -> PrefetchHandle:
        """:meth:`prefetch` of a coming :meth:`embed_packed` (same arguments: an
        ``NgramBatch``, or packed tokens with ``ctx_lens`` and ``seq_lens``)."""
        if isinstance(tokens, NgramBatch):
            if tokens.dims != self.dims:
                raise ConfigError("the NgramBatch was built for other NgramDims")
            return self._groups.prefetch(self.dims, tokens)
        if ctx_lens is None or seq_lens is None:
            raise ConfigError(
                "prefetch_packed needs ctx_lens and seq_lens (int[S] each) with packed tokens"
            )
        return self._groups.prefetch(self.dims, NgramBatch(self.dims, tokens, ctx_lens, seq_lens))

    def embed_ids(self, contexts: Sequence[Any], seq_lens: Sequence[int]) -> tuple[Any, Any]:
        """Ids of the embedded positions: ``(all_ids int64[T, L_total], ids int64[T, n])``.

        ``all_ids`` covers every position of the concatenated contexts (look-back
        stopping at sequence boundaries); ``ids`` the ``n = sum(seq_lens)`` positions
        that :meth:`embed_batch` embeds. On this embedding's device.
        """
        batch = NgramBatch.from_contexts(self.dims, contexts, seq_lens)
        all_ids = self._stages.hash_all(batch)
        sel = batch.selection
        if isinstance(sel, np.ndarray) and self._xp is not np:
            sel = self._xp.asarray(sel)
        return all_ids, all_ids[:, sel]

    def clear_graphs(self) -> None:
        """Drop the captured CUDA graphs and their buffers (``cuda_graphs``)."""
        if isinstance(self._runner, GraphRunner):
            self._runner.clear()

    def static_step(self, batch: NgramBatch) -> StaticStep:
        """A resident GPU step of ``batch``'s shape on fixed buffers, for CUDA graphs.

        For servers that replay their whole decode step from one graph: the returned
        :class:`StaticStep` (planned for ``batch``'s shape) holds pinned input, device
        staging and output buffers; ``load(batch)`` refills the input on the host,
        ``run()`` (or ``launch()``) replays the captured upload, hash + gathers, GEMM
        and scaled sum into ``.out``, and ``issue()`` queues the same work on the
        current stream (to capture it inside a larger graph). ``batch`` (host tokens)
        is loaded; the first ``run()`` is eager, the second captures. Needs resident
        tables on the GPU (cached tables need their rows resolved on the host each
        step).
        """
        if self.device != "cuda" or self._groups:
            raise ConfigError(
                "static_step needs resident tables on the GPU "
                f"(this embedding: device {self.device!r}, tables "
                f"{[t.kind for t in (self.word, *self.tables)]})"
            )
        if not isinstance(batch, NgramBatch) or batch.on_device:
            raise ConfigError("static_step takes an NgramBatch of host tokens")
        if batch.dims != self.dims:
            raise ConfigError("the NgramBatch was built for other NgramDims")
        shape = StepShape.of(batch)
        step = StaticStep(self._stages, shape, self._staging.parts(shape.n), with_sum=True)
        step.load(batch)
        return step

    def settle(self) -> None:
        """Commit the step's reads still running (``defer_reads``): wait for them; raises
        a failed read's ``CorruptDataError`` (the caches as before the step, whose
        output is invalid). A no-op otherwise. Call it after queuing the rest of the
        step's work, before using its results. Every cache is settled, the first
        error raised after: no cache is left with a failed read pending."""
        self._groups.settle()

    # --- the step ---------------------------------------------------------------
    def _check_out(self, n: int, out: Any) -> None:
        D = self.dims.hidden_size
        if out is not None and (
            out.shape != (n, D)
            or out.dtype != BF16
            or is_device_array(out) != (self.device == "cuda")
        ):
            raise ConfigError(
                f"out must be bfloat16[{n}, {D}] on {self.device}, got "
                f"{getattr(out, 'dtype', None)}{list(getattr(out, 'shape', ()))}"
            )

    def _run(
        self, batch: NgramBatch, *, overlay: Any, seq_slots: Any, active: int, out: Any
    ) -> Any:
        """Check ``out``, then run the batch's input adapter on the runner."""
        n = batch.n
        self._check_out(n, out)
        if n == 0:
            if batch.on_device:  # the range check of device tokens still runs
                if self.device == "cuda":
                    self._stages.hash_all(batch)
                else:
                    DeviceTokens(batch).host()
            return self._empty(out)
        return self._runner.run(tokens_of(batch), StepCall(overlay, seq_slots, active, out))

    def _empty(self, out: Any) -> Any:
        return self._xp.empty((0, self.dims.hidden_size), dtype=BF16) if out is None else out

    def __repr__(self) -> str:
        kinds = [t.kind for t in self.tables]
        return (
            f"NgramEmbedding(tables={kinds}, word={self.word.kind}, hidden={self.dims.hidden_size}, "
            f"device={self.device!r})"
        )


__all__ = ["GEMM_SPLITS", "GEMM_SPLITS_MAX", "NgramEmbedding", "StaticStep"]
