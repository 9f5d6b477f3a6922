"""The fused n-gram embedding: word row + projected n-gram rows, scaled.

Owns :class:`NgramEmbedding`: hashed ids (``kernels.ngram.ngram_hash``), every
table's rows gathered into a stacked ``[n, T*d]`` staging buffer (one launch for all
tables on the GPU), the T projections as one ``[n, T*d] x [T*d, D]`` GEMM with fp32
accumulation, and ``bf16((word + proj) / (1 + T))``. The same composition runs on
the CPU (NumPy references) and the GPU (CUDA kernels, cuBLAS); staging buffers are
allocated once and grown only for a larger batch.
Does not own the tables (``embed.tables``) or the checkpoint format.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kernels._cuda import is_device_array, require_cupy
from kernels.ngram import (
    StackedTables,
    TokenRangeError,
    gather_stacked,
    gemm_bf16_f32,
    ngram_hash,
    scale_sum,
)
from kernels.reference import BF16
from rowcache.errors import ConfigError

from .dims import NgramDims
from .ids import check_tokens
from .tables import Bf16Table, CachedTable, Fp8Table

_TABLE_TYPES = (Bf16Table, Fp8Table, CachedTable)


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
        if fused and self.device == "cuda":
            self._stacked = StackedTables([t.arrays for t in self.tables])
        self._mult = self._xp.asarray(dims.multipliers)
        self._rows = self._xp.asarray(dims.all_table_rows)
        self._cap = 0
        self._stack: Any = None
        self._proj: Any = None
        self._words: Any = None

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

    def resident_bytes(self) -> int:
        """Bytes held by the tables (arenas for cached ones), projections and staging."""
        staged = sum(int(a.nbytes) for a in (self._stack, self._proj, self._words) if a is not None)
        tables = sum(t.nbytes for t in (self.word, *self.tables))
        return int(tables + self._wcat.nbytes + staged)

    def ids(self, ctx_tokens: Any) -> Any:
        """``ngram_ids(dims, ctx_tokens)`` on this embedding's device: int64[T, L]."""
        return self.embed_ids([ctx_tokens], [0])[0]

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
        return self.embed_batch(
            [ctx_tokens], [seq_len], overlay=overlay, seq_slots=seq_slot, active=active, out=out
        )

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

        Cached tables: their ids are resolved (faulted in and pinned) before the
        gather, and every cache's batch ends when this call returns, after the current
        CUDA stream has finished the gathers (the caches write their arenas on the
        stream current when they were built, normally the same one).
        """
        prepared = self._prepare(contexts, seq_lens)
        tokens, sel, n, _, _ = prepared
        ids_all = self.embed_ids(contexts, seq_lens, _prepared=prepared)[1]
        xp = self._xp
        x_sel = tokens[sel]
        D, d = self.dims.hidden_size, self.dims.table_dim
        if out is None:
            out = xp.empty((n, D), dtype=BF16)
        elif out.shape != (n, D) or out.dtype != BF16 or is_device_array(out) != (xp is not np):
            raise ConfigError(
                f"out must be bfloat16[{n}, {D}] on {self.device}, got "
                f"{getattr(out, 'dtype', None)}{list(getattr(out, 'shape', ()))}"
            )
        if n == 0:
            return out
        self._reserve(n)
        stack, proj, words = self._stack[:n], self._proj[:n], self._words[:n]
        cached = self.cached_tables
        # A cache resolves on the host: hand it host ids once instead of one copy per table.
        host_ids = ids_all.get() if (cached and xp is not np) else None
        try:
            if self._stacked is not None:
                ids_g = ids_all
                if host_ids is not None:
                    # arena slots replace the hashed ids of cached tables
                    ids_g = xp.ascontiguousarray(ids_all)
                    for i, table in enumerate(self.tables):
                        if isinstance(table, CachedTable):
                            ids_g[i] = table.resolve(host_ids[i])
                gather_stacked(ids_g, self._stacked, stack)
            else:
                for i, table in enumerate(self.tables):
                    ids_i = (
                        host_ids[i]
                        if host_ids is not None and isinstance(table, CachedTable)
                        else ids_all[i]
                    )
                    table.gather(ids_i, out=stack[:, i * d : (i + 1) * d])
            x_word = x_sel.get() if (isinstance(self.word, CachedTable) and xp is not np) else x_sel
            self.word.gather(x_word, out=words)
            rows = words
            if overlay is not None:
                slots = self._row_slots(seq_slots, seq_lens, n)
                applied = overlay.apply_embed(x_sel, rows, seq_slot=slots, active=active)
                if applied is not None:
                    rows = applied
            gemm_bf16_f32(stack, self._wcat, out=proj)
            scale_sum(rows, proj, float(1 + self.dims.num_tables), out=out)
        finally:
            if cached:
                if xp is not np:
                    # The next step's faults may rewrite these slots: let the gathers finish.
                    xp.cuda.get_current_stream().synchronize()
                for t in cached:
                    t.end_batch()
        return out

    def embed_ids(
        self, contexts: Sequence[Any], seq_lens: Sequence[int], *, _prepared: Any = None
    ) -> tuple[Any, Any]:
        """Ids of the embedded positions: ``(all_ids int64[T, L_total], ids int64[T, n])``.

        ``all_ids`` covers every position of the concatenated contexts (look-back
        stopping at sequence boundaries); ``ids`` the ``n = sum(seq_lens)`` positions
        that :meth:`embed_batch` embeds. On this embedding's device.
        """
        prepared = _prepared if _prepared is not None else self._prepare(contexts, seq_lens)
        tokens, sel, _, starts, unchecked = prepared
        try:
            ids = ngram_hash(
                tokens,
                self._mult,
                self._rows,
                self.dims.eos_token_id,
                starts,
                vocab=self.dims.vocab_size if unchecked else None,
            )
        except TokenRangeError as e:
            where = f"{unchecked}[{e.position}]"
            if len(contexts) > 1:  # name the sequence and the position within it
                lengths = np.array([int(c.shape[0]) for c in contexts], dtype=np.int64)
                begin = np.cumsum(lengths) - lengths
                s = int(np.searchsorted(begin, e.position, side="right")) - 1
                where = f"contexts[{s}][{e.position - int(begin[s])}]"
            raise ConfigError(
                f"{where} = {e.value} is outside the vocabulary [0, {e.vocab})"
            ) from None
        return ids, ids[:, sel]

    # --- internals -------------------------------------------------------------
    def _prepare(
        self, contexts: Sequence[Any], seq_lens: Sequence[int]
    ) -> tuple[Any, Any, int, Any, str | None]:
        """``(tokens, sel, n, starts, unchecked)``: concatenated int64 tokens on the
        device, the embedded positions (a slice, or an index array for several
        sequences), their count, each position's sequence start (None for one
        sequence), and the name of a device context whose range the hash kernel must
        still check (None when every token was checked on the host)."""
        xp = self._xp
        if len(contexts) != len(seq_lens) or len(contexts) == 0:
            raise ConfigError(
                f"contexts ({len(contexts)}) and seq_lens ({len(seq_lens)}) must be "
                "non-empty and of one length"
            )
        parts, lens = [], []
        unchecked = None
        # device contexts on a GPU embedding stay there: their range is checked
        # inside the hash kernel (no extra sync); anything else is checked on the host
        on_device = xp is not np and all(is_device_array(c) for c in contexts)
        for s, (ctx, k) in enumerate(zip(contexts, seq_lens)):
            name = "ctx_tokens" if len(contexts) == 1 else f"contexts[{s}]"
            if on_device:
                tok = check_tokens(self.dims, ctx, name=name, check_range=False)
                unchecked = "ctx_tokens" if len(contexts) == 1 else "contexts"
            else:
                tok = check_tokens(self.dims, ctx.get() if is_device_array(ctx) else ctx, name=name)
            L = int(tok.shape[0])
            if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= L:
                raise ConfigError(
                    f"seq_len={k!r} for {name} must be an int in [0, {L}] (the context length)"
                )
            parts.append(tok)
            lens.append((L, int(k)))
        if len(parts) == 1:
            tokens = parts[0]
            if is_device_array(tokens) and xp is np:
                tokens = tokens.get()
            tokens = xp.asarray(tokens).astype(xp.int64, copy=False)
            L, k = lens[0]
            return tokens, slice(L - k, L), k, None, unchecked
        if on_device:
            tokens = xp.concatenate([p.astype(xp.int64, copy=False) for p in parts])
        else:
            tokens = xp.asarray(np.concatenate(parts).astype(np.int64))
        ctx_len = np.array([L for L, _ in lens], dtype=np.int64)
        emb_len = np.array([k for _, k in lens], dtype=np.int64)
        begin = np.cumsum(ctx_len) - ctx_len
        # first position of each position's sequence, for the look-back
        starts = xp.asarray(np.repeat(begin, ctx_len))
        first = begin + ctx_len - emb_len  # first embedded position per sequence
        n = int(emb_len.sum())
        sel = np.repeat(first - (np.cumsum(emb_len) - emb_len), emb_len) + np.arange(n)
        return tokens, (xp.asarray(sel) if xp is not np else sel), n, starts, unchecked

    def _row_slots(self, seq_slots: Any, seq_lens: Sequence[int], n: int) -> Any:
        if seq_slots is None or np.ndim(seq_slots) == 0 or len(seq_slots) == n:
            return seq_slots
        if len(seq_slots) != len(seq_lens):
            raise ConfigError(
                f"seq_slots has {len(seq_slots)} entries: expected one per sequence "
                f"({len(seq_lens)}) or one per row ({n})"
            )
        return np.repeat(np.asarray(seq_slots), np.asarray(seq_lens, dtype=np.int64))

    def _reserve(self, n: int) -> None:
        """Grow the staging buffers to at least ``n`` rows (they never shrink)."""
        if n <= self._cap:
            return
        cap = max(n, 2 * self._cap)
        xp, D = self._xp, self.dims.hidden_size
        self._stack = xp.empty((cap, self.dims.num_tables * self.dims.table_dim), dtype=BF16)
        self._proj = xp.empty((cap, D), dtype=np.float32)
        self._words = xp.empty((cap, D), dtype=BF16)
        self._cap = cap

    def __repr__(self) -> str:
        kinds = [t.kind for t in self.tables]
        return (
            f"NgramEmbedding(tables={kinds}, word={self.word.kind}, hidden={self.dims.hidden_size}, "
            f"device={self.device!r})"
        )


__all__ = ["NgramEmbedding"]
