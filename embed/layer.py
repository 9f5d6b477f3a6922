"""The fused n-gram embedding: word row + projected n-gram rows, scaled.

Owns :class:`NgramEmbedding`: hashed ids (``kernels.ngram.ngram_hash``), every
table's rows gathered into a stacked ``[n, T*d]`` staging buffer (one launch for all
tables on the GPU), the T projections as one ``[n, T*d] x [T*d, D]`` GEMM with fp32
accumulation, and ``bf16((word + proj) / (1 + T))``. The same composition runs on
the CPU (NumPy references) and the GPU (CUDA kernels, cuBLAS); staging buffers are
allocated once and grown only for a larger batch.
Input is packed once (``embed.batch.NgramBatch``: no Python work per sequence). On
the GPU a step from host tokens is one upload (read from pinned memory by a kernel),
one fused hash + gather launch (every table's row and the word row; cached tables
through their caches' device row -> slot maps), the GEMM and the sum, with no host
sync (``StaticStep``: the same on fixed buffers, replayed from a CUDA graph). Cached
rows are resolved on the host (hashed there: no copy back) while the device works.
Does not own the tables (``embed.tables``) or the checkpoint format.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from kernels._cuda import get_kernel, is_device_array, launch_1d, require_cupy
from kernels.ngram import (
    StackedTables,
    TokenRangeError,
    copy_from_mapped,
    gather_stacked,
    gemm_bf16_f32_parts,
    hash_gather,
    ngram_hash,
    scale_sum,
    split_k,
)
from kernels.reference import BF16
from rowcache.errors import ConfigError

from .batch import NgramBatch
from .dims import NgramDims
from .lookahead import StepPrefetch, prefetch_step
from .tables import Bf16Table, CachedTable, Fp8Table

_TABLE_TYPES = (Bf16Table, Fp8Table, CachedTable)
# Parts of the projection GEMM by rows per step: (at most this many rows, parts).
# Measured on an H200 at LongCat's shape ([n, 3072] x [3072, 3072], bench/embed.py's
# GEMM sweep): 1 row 10.8 -> 8.8 us with 4 parts; 64 and 2,048 rows are fastest
# whole; 256 rows gain 1 us, less than the wider scaled sum costs.
GEMM_SPLITS = ((16, 4),)
GEMM_SPLITS_MAX = max(s for _, s in GEMM_SPLITS)


def _as_table(name: str, t: Any) -> Any:
    if isinstance(t, _TABLE_TYPES):
        return t
    if hasattr(t, "ndim") and hasattr(t, "dtype"):
        return Bf16Table(t)
    raise ConfigError(
        f"{name} must be a Bf16Table, Fp8Table, CachedTable or a bf16 array, got {type(t).__name__}"
    )


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

    fused : bool
        On the GPU, gather all T tables with one ``kernels.ngram.gather_stacked``
        launch (default) instead of one ``kernels.batched_embed[_fp8]`` launch per
        table; the two are bit-identical. Ignored on the CPU.
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
        off: the ids are hashed and resolved on the host before the gathers.
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
    ) -> None:
        if not isinstance(dims, NgramDims):
            raise ConfigError(f"dims must be an NgramDims, got {type(dims).__name__}")
        self.dims = dims
        T, d, D = dims.num_tables, dims.table_dim, dims.hidden_size
        self.word = _as_table("word", word)
        if (self.word.rows, self.word.dim) != (dims.vocab_size, D):
            raise ConfigError(
                f"word table is [{self.word.rows}, {self.word.dim}], expected "
                f"[vocab_size {dims.vocab_size}, hidden_size {D}]"
            )
        if len(tables) != T:
            raise ConfigError(f"tables has {len(tables)} entries, expected num_tables={T}")
        self.tables = [_as_table(f"tables[{i}]", t) for i, t in enumerate(tables)]
        for i, t in enumerate(self.tables):
            if (t.rows, t.dim) != (dims.table_rows(i), d):
                raise ConfigError(
                    f"tables[{i}] is [{t.rows}, {t.dim}], expected "
                    f"[{dims.table_rows(i)}, {d}] (table_rows({i}), table_dim)"
                )
        devices = {self.word.device, *(t.device for t in self.tables)}
        if len(devices) != 1:
            raise ConfigError(
                f"the word table and the n-gram tables must share one device, got "
                f"{sorted(devices)}; move resident tables with .to(device)"
            )
        self.device: str = devices.pop()
        self._xp: Any = require_cupy("NgramEmbedding on cuda") if self.device == "cuda" else np
        wcat = self._stack_projs(projs)  # bfloat16[T*d, D], host
        if self.device == "cuda":
            self._wcat: Any = self._xp.asarray(wcat)
        else:
            self._wcat = wcat.astype(np.float32)  # the CPU GEMM runs in float32
        self._stacked: StackedTables | None = None
        self._word_stacked: StackedTables | None = None
        self.device_lookup = bool(device_lookup) and fused and self.device == "cuda"
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
        if gemm_splits is not None and (
            isinstance(gemm_splits, bool) or not split_k(T * d, int(gemm_splits))
        ):
            raise ConfigError(
                f"gemm_splits={gemm_splits!r}: give a count that divides T*d = {T * d} "
                "into chunks of a multiple of 8, or None"
            )
        self.gemm_splits = None if gemm_splits is None else int(gemm_splits)
        self.cuda_graphs = bool(cuda_graphs) and self.device == "cuda"
        self._graphs: dict[tuple[int, int, bool], StaticStep] = {}
        self._tok: _DeviceStep | None = None
        self._group_caches()
        self._cap = 0
        self._stack: Any = None
        self._proj: Any = None
        self._words: Any = None

    def _group_caches(self) -> None:
        """Group the cached tables by cache: one resolve per cache and step.

        ``self._groups``: ``(cache, members, offsets, pos)`` where ``members`` are
        table indices (-1 for the word table, always last), ``offsets`` int64 each
        member's ``row_offsets[part]`` and ``pos`` the n-gram members' rows among the
        cached tables (``self._cached_list`` order). ``self._cached_index`` selects
        the cached tables' rows of a ``[T, n]`` id array (a slice when contiguous).
        """
        entries = [(i, t) for i, t in enumerate(self.tables) if isinstance(t, CachedTable)]
        self._cached_rows = np.array([i for i, _ in entries], dtype=np.int64)
        self._cached_list = [i for i, _ in entries]
        self._cached_pos = {i: k for k, (i, _) in enumerate(entries)}
        rows = self._cached_list
        self._cached_index: Any = (
            slice(rows[0], rows[0] + len(rows))
            if rows and rows == list(range(rows[0], rows[0] + len(rows)))
            else self._xp.asarray(self._cached_rows)
        )
        if isinstance(self.word, CachedTable):
            entries.append((-1, self.word))
        by_cache: dict[int, list[tuple[int, CachedTable]]] = {}
        for i, t in entries:
            by_cache.setdefault(id(t.cache), []).append((i, t))
        self._groups: list[tuple[Any, list[int], np.ndarray, np.ndarray]] = []
        for group in by_cache.values():
            members = [i for i, _ in group]
            offsets = np.array([t.offset for _, t in group], dtype=np.int64)
            pos = np.array([self._cached_pos[i] for i in members if i >= 0], dtype=np.int64)
            self._groups.append((group[0][1].cache, members, offsets, pos))

    def _map_of(self, table: Any) -> tuple[Any, int] | None:
        """``(device map, row offset)`` of a cached table read through its cache's
        device map (``device_lookup``), else None."""
        if not isinstance(table, CachedTable) or not self.device_lookup:
            return None
        return table.cache.device_map(), table.offset

    def _stack_projs(self, projs: Any) -> np.ndarray:
        T, d, D = self.dims.num_tables, self.dims.table_dim, self.dims.hidden_size
        if hasattr(projs, "ndim"):
            if projs.shape != (T, D, d):
                raise ConfigError(f"projs must be [{T}, {D}, {d}], got {list(projs.shape)}")
            projs = [projs[i] for i in range(T)]
        if len(projs) != T:
            raise ConfigError(f"projs has {len(projs)} entries, expected num_tables={T}")
        out = np.empty((T * d, D), dtype=BF16)
        for i, w in enumerate(projs):
            w = w.get() if is_device_array(w) else np.asarray(w)
            if w.shape != (D, d) or w.dtype not in (BF16, np.dtype(np.float32)):
                raise ConfigError(
                    f"projs[{i}] must be bfloat16/float32 [{D}, {d}] (nn.Linear layout), "
                    f"got {w.dtype}{list(w.shape)}"
                )
            out[i * d : (i + 1) * d] = w.T.astype(BF16)
        return out

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
        the caches' device maps and the host resolves meanwhile; a resolve that
        faulted makes the device part run again. Otherwise the resolve comes first.
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

    def prefetch(self, ctx_tokens: Any, seq_len: int | None = None) -> StepPrefetch:
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

    def prefetch_batch(self, contexts: Sequence[Any], seq_lens: Sequence[int]) -> StepPrefetch:
        """:meth:`prefetch` of a coming :meth:`embed_batch` (same arguments)."""
        return prefetch_step(self, NgramBatch.from_contexts(self.dims, contexts, seq_lens))

    def prefetch_packed(
        self, tokens: Any, ctx_lens: Any = None, seq_lens: Any = None
    ) -> StepPrefetch:
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
        self._reserve(n)
        if out is None:
            out = xp.empty((n, D), dtype=BF16)
        stack, words = self._stack[:n], self._words[:n]
        S = self._splits(n)
        proj = self._proj[: S * n * D].reshape(S, n, D)
        try:
            if xp is np:
                ids: Any = batch.host_ids()  # int64[T, n]: only the embedded positions
                word_ids: Any = batch.word_ids
                host_ids = ids[self._cached_rows] if self._groups else None
            elif batch.on_device:
                ids = self._hash_all(batch)
                sel = batch.selection
                ids = ids[:, xp.asarray(sel) if isinstance(sel, np.ndarray) else sel]
                word_ids = batch.word_ids
                host_ids = ids[self._cached_rows].get() if self._groups else None
            elif self._fused_ids:
                # fused: upload, then the hash and every gather in one launch (cached
                # tables through their caches' device maps), the overlay, GEMM and sum;
                # then the cached rows are resolved on the host (pinned, LRU) while the
                # device works, and the device part runs again if that faulted
                buf = self._tok_buffers(batch)
                host = buf.host()
                _pack(host, batch)
                self._after_caches()

                def device_part() -> None:
                    w = self._upload_gather(buf, host, _Shape.of(batch), stack, words)
                    rows = self._overlay_rows(overlay, w, words, seq_slots, active, batch, n)
                    gemm_bf16_f32_parts(stack, self._wcat, out=proj)
                    scale_sum(rows, proj, float(1 + self.dims.num_tables), out=out)

                device_part()
                try:
                    if self._verify_cached(batch):
                        self._after_caches()
                        device_part()
                finally:  # the pinned upload is free once the last part that reads it ran
                    buf.uploaded(xp.cuda.get_current_stream())
                return out
            else:
                # every n-gram table cached: their slots replace all ids, skip the hash
                hashed = self._cached_rows.size < self.dims.num_tables
                ids, word_ids = self._device_ids(self._tok_buffers(batch), batch, hashed)
                host_ids = batch.host_ids(self._cached_rows) if self._groups else None
            word_slots = None
            if self._groups:
                word_slots = self._resolve(batch, ids, host_ids)
                if xp is not np:
                    self._after_caches()
            if self._stacked is not None:
                gather_stacked(ids, self._stacked, stack)
            else:
                d = self.dims.table_dim
                for i, table in enumerate(self.tables):
                    block = stack[:, i * d : (i + 1) * d]
                    if isinstance(table, CachedTable):
                        table.gather_slots(ids[i], out=block)
                    else:
                        table.gather(ids[i], out=block)
            if word_slots is not None:
                self.word.gather_slots(word_slots, out=words)
            else:
                self.word.gather(word_ids, out=words)
            rows = self._overlay_rows(overlay, word_ids, words, seq_slots, active, batch, n)
            gemm_bf16_f32_parts(stack, self._wcat, out=proj)
            scale_sum(rows, proj, float(1 + self.dims.num_tables), out=out)
        finally:
            self._end_batches()
        return out

    def _after_caches(self) -> None:
        """Order the current stream after every cache's stream (their faults' writes),
        with finished prefetches committed first (their rows in the device maps)."""
        cur = self._xp.cuda.get_current_stream()
        for cache, *_ in self._groups:
            cache.poll()
        for cache, *_ in self._groups:
            if cache.stream is not None and cache.stream.ptr != cur.ptr:
                cur.wait_event(cache.stream.record())

    def _end_batches(self) -> None:
        """End every cache's batch. A later fault rewrites slots on the cache's stream:
        where that is not the current stream, it first waits for this step's gathers
        (stream order, no host sync)."""
        if not self._groups:
            return
        if self._xp is not np:
            cur = self._xp.cuda.get_current_stream()
            done = None
            for cache, *_ in self._groups:
                if cache.stream is not None and cache.stream.ptr != cur.ptr:
                    done = done or cur.record()
                    cache.stream.wait_event(done)
        for cache, *_ in self._groups:
            cache.end_batch()

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

    def _verify_cached(self, batch: NgramBatch) -> bool:
        """Resolve the step's cached rows on the host (pins them, keeps the LRU exact)
        after the device gathered them through the caches' device maps. True when a
        resolve faulted rows in: the device part must run again (in stream order after
        the faults' writes and the maps' updates)."""
        if not self._groups:
            return False
        faulted = False
        for cache, _, gid, _ in self._group_ids(batch, None):  # the device has the slots
            cache.resolve_host(gid.ravel())
            faulted = faulted or cache.last_faults > 0
        return faulted

    def _resolve(self, batch: NgramBatch, ids: Any, host_ids: Any) -> Any:
        """Arena slots replace the cached tables' rows of ``ids`` (in place). Returns
        the word table's slots when it is cached, else None."""
        xp = self._xp
        slots, word_slots = self._resolve_host(batch, host_ids)
        if slots.shape[0]:
            ids[self._cached_index] = slots if xp is np else xp.asarray(slots)
        if word_slots is None or xp is np:
            return word_slots
        return xp.asarray(word_slots)

    def _resolve_host(
        self, batch: NgramBatch, host_ids: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """One ``resolve_host`` per cache: the cached n-gram tables' slots (int64
        ``[len(cached_list), n]``, from their host ids ``host_ids`` in that order) and
        the word table's slots (int32[n], or None when it is resident)."""
        n = batch.n
        out = np.empty((len(self._cached_list), n), dtype=np.int64)
        word_slots = None
        for cache, members, gid, pos in self._group_ids(batch, host_ids):
            slots = cache.resolve_host(gid.ravel()).reshape(len(members), n)
            if pos.size:
                out[pos] = slots[: pos.size]
            if members[-1] < 0:
                word_slots = slots[-1]
        return out, word_slots

    def _group_ids(
        self, batch: NgramBatch, host_ids: np.ndarray | None
    ) -> Iterator[tuple[Any, list[int], np.ndarray, np.ndarray]]:
        """Per cache: ``(cache, members, global ids int64[len(members), n], pos)`` of a
        batch whose cached n-gram tables' host ids are ``host_ids`` (hashed here
        when None; host tokens)."""
        host_word = None
        for cache, members, offsets, pos in self._groups:
            if members == self._cached_list:  # one cache holds every cached n-gram table
                if host_ids is None:  # hashed straight into global ids: one C pass
                    gid = batch.host_ids(self._cached_rows, offsets)
                else:
                    gid = host_ids + offsets[:, None]
            else:
                if host_ids is None:
                    host_ids = batch.host_ids(self._cached_rows)
                parts = []
                for m in members:  # members of one cache (<= T + 1), vectorized over rows
                    if m < 0:
                        if host_word is None:  # host tokens: no copy back from the device
                            w = batch.word_ids
                            host_word = w.get() if batch.on_device else np.asarray(w)
                        parts.append(host_word)
                    else:
                        parts.append(host_ids[self._cached_pos[m]])
                gid = np.stack(parts).astype(np.int64, copy=False) + offsets[:, None]
            yield cache, members, gid, pos

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

    # --- the GPU step from host tokens ------------------------------------------------
    def _tok_buffers(self, batch: NgramBatch) -> _DeviceStep:
        L, n = batch.length, batch.n
        buf = self._tok
        if buf is None or buf.cap_len < L or buf.cap_rows < n:
            cap_len = max(L, 2 * buf.cap_len) if buf is not None else L
            cap_rows = max(n, 2 * buf.cap_rows) if buf is not None else n
            if buf is not None:
                buf.wait()
            buf = self._tok = _DeviceStep(self._xp, self.dims.num_tables, cap_len, cap_rows)
        return buf

    def _device_ids(
        self, buf: _DeviceStep, batch: NgramBatch, hashed: bool = True
    ) -> tuple[Any, Any]:
        """Upload the packed tokens (one H2D copy from a pinned buffer), hash them,
        select the embedded positions: ``(ids int64[T, n], word ids int64[n])`` on the
        device, all in ``buf``'s fixed buffers (no allocation, no sync). With
        ``hashed=False`` only the word ids go up and ``ids`` is left for the caller
        to fill (every n-gram table is cached)."""
        cp = self._xp
        L, n = batch.length, batch.n
        T = self.dims.num_tables
        multi = batch.num_seqs > 1
        host = buf.host()
        if not hashed:
            host[:n] = batch.word_ids
            stream = cp.cuda.get_current_stream()
            buf.dev[:n].set(host[:n], stream=stream)
            buf.uploaded(stream)
            return buf.ids_sel[: T * n].reshape(T, n), buf.dev[:n]
        k = _pack(host, batch)
        stream = cp.cuda.get_current_stream()
        dev = buf.dev
        dev[:k].set(host[:k], stream=stream)
        buf.uploaded(stream)
        ids_all = buf.ids_all[: T * L].reshape(T, L)
        tok = dev[:L]
        _launch_hash(
            tok,
            dev[L + n : 2 * L + n] if multi else tok,
            self._mult,
            self._rows,
            ids_all,
            self.dims.eos_token_id,
            multi,
        )
        if not multi:
            return ids_all[:, L - n :], tok[L - n :]
        ids = buf.ids_sel[: T * n].reshape(T, n)
        cp.take(ids_all, dev[2 * L + n : 2 * L + 2 * n], axis=1, out=ids)
        return ids, dev[L : L + n]

    @property
    def _fused_ids(self) -> bool:
        """GPU, fused, every table resident or read through its cache's device map: a
        step's id work is one ``hash_gather`` launch."""
        return (
            self._word_stacked is not None
            and self._stacked is not None
            and (self.device_lookup or not self._groups)
        )

    def _upload_gather(
        self, buf: _DeviceStep, host: np.ndarray, batch: Any, stack: Any, words: Any
    ) -> Any:
        """Pack ``batch``'s host tokens into the pinned ``host``, copy them up into
        ``buf.dev`` and hash + gather them into ``stack`` and ``words`` (one copy,
        one launch; no allocation, no sync: capturable). Returns the word ids
        (int64[n], device). ``batch`` may be a :class:`_Shape` when ``host`` is
        already packed."""
        L, n, multi = batch.length, batch.n, batch.num_seqs > 1
        k = _pack(host, batch) if isinstance(batch, NgramBatch) else _words(L, n, multi)
        copy_from_mapped(host.ctypes.data, buf.dev, k)
        assert self._stacked is not None and self._word_stacked is not None
        tok = buf.dev[:L]
        hash_gather(
            tok,
            buf.dev[L + n : 2 * L + n] if multi else None,
            buf.dev[2 * L + n : 2 * L + 2 * n] if multi else None,
            self._mult,
            self._rows,
            self.dims.eos_token_id,
            self._stacked,
            stack,
            self._word_stacked,
            words,
        )
        return buf.dev[L : L + n] if multi else tok[L - n :]

    def _run_graph(self, batch: NgramBatch, out: Any) -> Any:
        """A step replayed from a CUDA graph per (tokens, rows, multi) shape: upload,
        hash + gathers (cached tables through their device maps) and the GEMM in the
        graph; cached rows resolved on the host meanwhile (the graph replayed again
        after a fault); the scaled sum follows eagerly into a fresh output (or
        ``out``), so results behave as on the eager path. The first call of a shape
        runs eagerly into the shape's own buffers (compiling the kernels, loading
        cuBLAS's), the second captures, later ones replay.
        """
        key = (batch.length, batch.n, batch.num_seqs > 1)
        step = self._graphs.get(key)
        if step is None:
            step = self._graphs[key] = StaticStep(self, key, with_sum=False)
        step.load(batch)
        try:
            if self._groups:
                self._after_caches()
            step.launch()
            if self._verify_cached(batch):  # a cached row was not resident: run again
                self._after_caches()
                step.launch()
            if out is None:
                out = self._xp.empty((batch.n, self.dims.hidden_size), dtype=BF16)
            scale_sum(step.words, step.proj, float(1 + self.dims.num_tables), out=out)
        finally:
            self._end_batches()
        return out

    def static_step(self, batch: NgramBatch) -> StaticStep:
        """A resident GPU step of ``batch``'s shape on fixed buffers, for CUDA graphs.

        For servers that replay their whole decode step from one graph: the returned
        :class:`StaticStep` holds pinned input, device staging and output buffers;
        ``load(batch)`` refills the input on the host, ``launch()`` replays the
        captured upload, hash + gathers, GEMM and scaled sum into ``.out``, and
        ``issue()`` queues the same work on the current stream (to capture it inside
        a larger graph). ``batch`` (host tokens) is loaded; the first ``launch()`` runs
        eagerly, the second captures. Needs resident tables on the GPU and
        ``fused=True`` (cached tables need their rows resolved on the host each step).
        """
        if not self._fused_ids or self._groups:
            raise ConfigError(
                "static_step needs resident tables on the GPU and fused=True "
                f"(this embedding: device {self.device!r}, tables "
                f"{[t.kind for t in (self.word, *self.tables)]})"
            )
        if not isinstance(batch, NgramBatch) or batch.on_device:
            raise ConfigError("static_step takes an NgramBatch of host tokens")
        if batch.dims != self.dims:
            raise ConfigError("the NgramBatch was built for other NgramDims")
        step = StaticStep(self, (batch.length, batch.n, batch.num_seqs > 1), with_sum=True)
        step.load(batch)
        return step

    def _issue_step(self, step: StaticStep) -> None:
        """``step``'s work on the current stream (capturable): upload, hash + gathers,
        GEMM, and with ``step.with_sum`` the scaled sum into ``step.out``."""
        self._upload_gather(step.buf, step.buf.hosts[0], step.shape, step.stack, step.words)
        gemm_bf16_f32_parts(step.stack, self._wcat, out=step.proj)
        if step.with_sum:
            scale_sum(step.words, step.proj, float(1 + self.dims.num_tables), out=step.out)

    def _staging_shapes(self, n: int) -> tuple[tuple[int, int], int, int]:
        return (
            (n, self.dims.num_tables * self.dims.table_dim),
            self.dims.hidden_size,
            self._splits(n),
        )

    def _splits(self, n: int) -> int:
        """Parts of the projection GEMM of an ``n``-row step (1 on the CPU)."""
        if self._xp is np:
            return 1
        if self.gemm_splits is not None:
            return self.gemm_splits
        K = self.dims.num_tables * self.dims.table_dim
        for rows, splits in GEMM_SPLITS:
            if n <= rows:
                return splits if split_k(K, splits) else 1
        return 1

    def _row_slots(self, seq_slots: Any, batch: NgramBatch, n: int) -> Any:
        if seq_slots is None or np.ndim(seq_slots) == 0 or len(seq_slots) == n:
            return seq_slots
        if len(seq_slots) != batch.num_seqs:
            raise ConfigError(
                f"seq_slots has {len(seq_slots)} entries: expected one per sequence "
                f"({batch.num_seqs}) or one per row ({n})"
            )
        return batch.rows_per_sequence(seq_slots)

    def _reserve(self, n: int) -> None:
        """Grow the staging buffers to at least ``n`` rows (they never shrink)."""
        if n <= self._cap:
            return
        cap = max(n, 2 * self._cap)
        xp, D = self._xp, self.dims.hidden_size
        self._stack = xp.empty((cap, self.dims.num_tables * self.dims.table_dim), dtype=BF16)
        self._proj = xp.empty(max(GEMM_SPLITS_MAX, self.gemm_splits or 1) * cap * D, np.float32)
        self._words = xp.empty((cap, D), dtype=BF16)
        self._cap = cap

    def __repr__(self) -> str:
        kinds = [t.kind for t in self.tables]
        return (
            f"NgramEmbedding(tables={kinds}, word={self.word.kind}, hidden={self.dims.hidden_size}, "
            f"device={self.device!r})"
        )


class _Shape:
    """A step's shape (what a captured graph depends on): ``length`` tokens, ``n``
    embedded rows, several sequences or one."""

    __slots__ = ("length", "n", "num_seqs")

    def __init__(self, length: int, n: int, multi: bool) -> None:
        self.length, self.n, self.num_seqs = length, n, 2 if multi else 1

    @classmethod
    def of(cls, batch: NgramBatch) -> _Shape:
        return cls(batch.length, batch.n, batch.num_seqs > 1)


def _words(L: int, n: int, multi: bool) -> int:
    """int64 words of an upload: ``[tokens L | word ids n | starts L | positions n]``,
    or the tokens alone for one sequence."""
    return 2 * L + 2 * n if multi else L


def _pack(host: np.ndarray, batch: NgramBatch) -> int:
    """Pack ``batch`` into the pinned upload buffer ``host``; returns the words used."""
    L, n = batch.length, batch.n
    host[:L] = batch.tokens
    if batch.num_seqs > 1:
        host[L : L + n] = batch.word_ids
        host[L + n : 2 * L + n] = batch.starts
        host[2 * L + n : 2 * L + 2 * n] = batch.positions
    return _words(L, n, batch.num_seqs > 1)


class StaticStep:
    """A resident GPU embedding step on fixed buffers, replayed from a CUDA graph.

    Made by :meth:`NgramEmbedding.static_step` (and used inside ``cuda_graphs=True``).
    Everything a captured graph points at lives here: the pinned upload buffer, the
    device tokens, the stacked rows ``stack`` bfloat16[n, T*d], the word rows ``words``
    bfloat16[n, D], the projection ``proj`` float32[n, D] and, with ``with_sum``, the
    output ``out`` bfloat16[n, D]. The shape (tokens, rows, several sequences) is
    fixed; the tables, projections and token values are not baked in beyond their
    addresses.

    Use: ``load(batch)`` (host only: waits until the previous launch has copied the
    pinned buffer, then packs the batch into it), ``launch()`` (the first launch
    runs eagerly, compiling kernels and loading cuBLAS's; the second captures; later
    ones replay), read ``out``. ``issue()`` queues the same work on the current
    stream, e.g. inside a capture of a larger graph.
    """

    def __init__(self, emb: NgramEmbedding, key: tuple[int, int, bool], *, with_sum: bool) -> None:
        L, n, multi = key
        self._emb = emb
        self.shape = _Shape(L, n, multi)
        self.with_sum = with_sum
        dims = emb.dims
        self.buf = _DeviceStep(emb._xp, dims.num_tables, L, n, emb._staging_shapes(n), out=with_sum)
        self.stack: Any = self.buf.stack
        self.proj: Any = self.buf.proj
        self.words: Any = self.buf.words
        self.out: Any = self.buf.out
        self.graph: Any = None
        self.runs = 0

    @property
    def nbytes(self) -> int:
        return self.buf.nbytes

    def load(self, batch: NgramBatch) -> None:
        """Pack ``batch`` (host tokens, this step's shape) into the pinned input."""
        s = self.shape
        if (batch.length, batch.n, batch.num_seqs > 1) != (s.length, s.n, s.num_seqs > 1):
            raise ConfigError(
                f"this static step has {s.length} tokens, {s.n} rows, "
                f"{'several sequences' if s.num_seqs > 1 else 'one sequence'}; the batch has "
                f"{batch.length}, {batch.n}, {batch.num_seqs} sequence(s)"
            )
        if batch.on_device:
            raise ConfigError("a static step loads host tokens (an NgramBatch of numpy ids)")
        _pack(self.buf.host(), batch)

    def issue(self) -> None:
        """Queue the step on the current stream (capturable once it ran eagerly)."""
        self._emb._issue_step(self)

    def launch(self, stream: Any = None) -> None:
        """Run the step on ``stream`` (default: the current stream): eagerly the first
        time, captured the second, replayed afterwards."""
        cp = self._emb._xp
        stream = cp.cuda.get_current_stream() if stream is None else stream
        if self.graph is None and self.runs >= 1:
            cap = cp.cuda.Stream(non_blocking=True)  # capture needs a non-default stream
            with cap:
                cap.begin_capture()
                try:
                    self.issue()
                finally:
                    graph = cap.end_capture()
            self.graph = graph
        if self.graph is not None:
            self.graph.launch(stream)
        else:
            with stream:
                self.issue()
        self.runs += 1
        self.buf.uploaded(stream)


def _launch_hash(
    tokens: Any, starts: Any, mult: Any, rows: Any, out: Any, eos: int, has_starts: bool
) -> None:
    """``kernels/ngram.cu``'s ``ngram_hash`` into a preallocated ``out`` int64[T, L].

    ``kernels.ngram.ngram_hash`` allocates its result; a CUDA graph needs fixed
    buffers, so the step launches the same kernel (same arguments, no range check:
    host tokens were checked once in ``NgramBatch``) into its own.
    """
    T, L = int(out.shape[0]), int(out.shape[1])
    if T * L == 0:
        return
    grid, block = launch_1d(T * L)
    get_kernel("ngram.cu", "ngram_hash")(
        grid,
        block,
        (
            tokens,
            starts,
            mult,
            rows,
            out,
            np.int64(L),
            np.int32(T),
            np.int32(mult.shape[1]),
            np.int64(eos),
            np.int32(has_starts),
            np.int64(0),
            rows,  # the unused range-check flag
        ),
    )


class _DeviceStep:
    """Fixed device buffers of a GPU step from host tokens (capacity ``cap_len``
    tokens, ``cap_rows`` rows), and a pinned upload buffer ring.

    Layout of an upload: ``[tokens L | word ids n | starts L | positions n]`` (one
    sequence: the tokens only). Before a pinned buffer is rewritten, the copy that
    last read it must have run (its event is waited on: normally long done). With
    ``staging`` (graph steps) it also owns the step's stack, projection, word-row
    and output buffers, so a captured graph's pointers stay valid.
    """

    def __init__(
        self,
        cp: Any,
        T: int,
        cap_len: int,
        cap_rows: int,
        staging: tuple[tuple[int, int], int, int] | None = None,
        out: bool = False,
    ) -> None:
        import cupyx

        self.cap_len, self.cap_rows = cap_len, cap_rows
        words = 2 * cap_len + 2 * cap_rows  # [tokens | word ids | starts | positions]
        ring = 1 if staging is not None else 2  # a graph reads one fixed buffer
        # pinned buffers (cudaHostAlloc: with unified addressing the device reads them at
        # their host address): a step's first kernel reads its upload straight from them
        self.hosts = [cupyx.empty_pinned(max(words, 1), dtype=np.int64) for _ in range(ring)]
        self._events: list[Any] = [None] * ring
        self._next = 0
        self.dev = cp.empty(max(words, 1), dtype=cp.int64)
        # ids are only materialized by the unfused step (graph steps hash and gather at once)
        self.ids_all = cp.empty(1 if staging else max(T * cap_len, 1), dtype=cp.int64)
        self.ids_sel = cp.empty(1 if staging else max(T * cap_rows, 1), dtype=cp.int64)
        self.stack = self.proj = self.words = self.out = None
        if staging is not None:
            (n, td), D, S = staging
            self.stack = cp.empty((n, td), dtype=BF16)
            self.proj = cp.empty((S, n, D), dtype=cp.float32)
            self.words = cp.empty((n, D), dtype=BF16)
            if out:
                self.out = cp.empty((n, D), dtype=BF16)

    @property
    def nbytes(self) -> int:
        arrays = [self.dev, self.ids_all, self.ids_sel, self.stack, self.proj, self.words, self.out]
        return sum(int(a.nbytes) for a in arrays if a is not None)

    def host(self) -> np.ndarray:
        """The next pinned buffer to fill, once its previous copy has read it."""
        k = self._next
        if self._events[k] is not None:
            self._events[k].synchronize()
            self._events[k] = None
        return self.hosts[k]

    def uploaded(self, stream: Any) -> None:
        """Mark the buffer just handed out as being read by work queued on ``stream``."""
        self._events[self._next] = stream.record()
        self._next = (self._next + 1) % len(self.hosts)

    def wait(self) -> None:
        for e in self._events:
            if e is not None:
                e.synchronize()


__all__ = ["NgramEmbedding", "StaticStep"]
