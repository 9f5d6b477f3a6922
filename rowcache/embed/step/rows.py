"""The embedding step of tokens held as rows: ``ids[B, L]`` after contexts ``ctx[B, C]``.

Owns the mixin :class:`RowsStep` behind :meth:`rowcache.embed.layer.NgramEmbedding.embed_rows`:
each row a sequence, its look-back the last ``max_ngram - 1`` tokens of its context
row, every position embedded (the layout serving engines and
``rowcache.embed.TorchNgramEmbedding`` hold). On the GPU with resident tables (no overlay) the
step reads the two arrays in place: one ``rowcache.kernels.ngram.rows.hash_gather_rows`` launch
(hash, range check, every gather), GEMM, scaled sum, and one sync for the range check.
Everywhere else (the CPU, cached tables, an overlay) the rows are packed on the host
(on the GPU by two strided device-to-host copies into pinned memory: the host resolve
needs the tokens there anyway) and run as an ``NgramBatch`` on the usual paths.
Does not own those paths (``rowcache.embed.layer``, ``rowcache.embed.step.fused``...).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rowcache.embed.ngram.batch import NgramBatch
from rowcache.errors import ConfigError
from rowcache.kernels.gemm import project_and_sum
from rowcache.kernels.loader import is_device_array
from rowcache.kernels.ngram.rows import first_bad_token, hash_gather_rows, rows_packed
from rowcache.kernels.reference import BF16

_D2H = 2  # cudaMemcpyDeviceToHost


def _matrix(name: str, a: Any, rows: int | None) -> Any:
    """``a`` checked as a 2-D integer array (numpy or cupy) of ``rows`` rows."""
    if not hasattr(a, "ndim") or not hasattr(a, "dtype"):
        a = np.asarray(a)
    if a.ndim != 2 or a.dtype.kind not in "iu":
        raise ConfigError(
            f"{name} must be a 2-D integer array of token ids, got {a.dtype}{list(a.shape)}"
        )
    if rows is not None and int(a.shape[0]) != rows:
        raise ConfigError(f"{name} has {a.shape[0]} rows, ids {rows}: one context per row")
    return a if a.dtype == np.int64 else a.astype(np.int64)


class RowsStep:
    """The rows step of :class:`rowcache.embed.layer.NgramEmbedding` (a mixin)."""

    dims: Any
    _xp: Any
    _mult: Any
    _rows: Any
    _wcat: Any
    _stacked: Any
    _word_stacked: Any
    _groups: list[Any]
    _rows_flag: Any  # pinned int64[1], the rows kernel's range flag (None until first use)
    _rows_seq: int
    _rows_host: Any  # pinned int64 buffer the GPU rows are packed into for the host path

    def _embed_rows(
        self,
        ids: Any,
        ctx: Any,
        out: Any,
        overlay: Any,
        seq_slots: Any,
        active: int,
    ) -> Any:
        """:meth:`rowcache.embed.layer.NgramEmbedding.embed_rows`: checks, then the in-place
        GPU step or the packed host batch."""
        ids = _matrix("ids", ids, None)
        B, L = (int(x) for x in ids.shape)
        if ctx is not None:
            ctx = _matrix("ctx", ctx, B)
            if is_device_array(ctx) != is_device_array(ids):
                raise ConfigError("ids and ctx must both be numpy or both be cupy arrays")
        c = 0 if ctx is None else min(int(ctx.shape[1]), self.dims.max_ngram - 1)
        n, D = B * L, self.dims.hidden_size
        if is_device_array(ids) and overlay is None and self._rows_in_place and n > 0:
            if out is not None and (
                out.shape != (n, D) or out.dtype != BF16 or not is_device_array(out)
            ):
                raise ConfigError(
                    f"out must be bfloat16[{n}, {D}] on the GPU, got {out.dtype}{list(out.shape)}"
                )
            return self._step_rows(ids, ctx, c, out)
        return self._rows_checked(ids, ctx, c, out, overlay, seq_slots, active)

    def _rows_known(self, ids: Any, ctx: Any, c: int, out: Any) -> Any:
        """:meth:`_embed_rows` of arrays it checked before (cupy int64 ``ids[B, L]``, ``B * L
        > 0``, ``ctx`` with ``c`` look-back columns or None, ``out`` bfloat16[B * L, hidden]
        on the GPU; no overlay), without checking them again: ``TorchNgramEmbedding``'s
        step for tensors it has seen."""
        if self._rows_in_place:
            return self._step_rows(ids, ctx, c, out)
        return self._rows_checked(ids, ctx, c, out, None, None, -1)

    @property
    def _rows_in_place(self) -> bool:
        """Every table resident and stacked on the GPU: :meth:`_step_rows` reads the rows
        in place."""
        return not self._groups and self._stacked is not None and self._word_stacked is not None

    def _rows_checked(
        self, ids: Any, ctx: Any, c: int, out: Any, overlay: Any, seq_slots: Any, active: int
    ) -> Any:
        """The packed-batch path of checked rows (int64 ``ids[B, L]``, ``ctx[B, >= c]`` or
        None, one array module; ``out`` None or of the step's shape): tokens packed on
        the host, range-checked, and embedded as an ``NgramBatch``."""
        B, L = (int(x) for x in ids.shape)
        if is_device_array(ids):
            tokens = self._rows_to_host(ids, ctx, c)
        else:
            tokens = rows_packed(ids, ctx, c)
        bad = (tokens < 0) | (tokens >= self.dims.vocab_size)
        if tokens.size and bool(bad.any()):
            host_ids = ids.get() if is_device_array(ids) else np.asarray(ids)
            host_ctx = None if ctx is None else (ctx.get() if is_device_array(ctx) else ctx)
            self._bad_rows(host_ids, host_ctx, c)
        lens = np.full(B, c + L, dtype=np.int64)
        batch = NgramBatch(self.dims, tokens, lens, np.full(B, L, dtype=np.int64), _checked=True)
        return self._run(batch, overlay=overlay, seq_slots=seq_slots, active=active, out=out)

    def _step_rows(self, ids: Any, ctx: Any, c: int, out: Any) -> Any:
        """Resident tables on the GPU: hash + range check + gathers in one launch over
        ``ids`` and ``ctx`` in place, GEMM and sum; then one sync to read the range flag
        (a bad token raises, naming it; ``out`` is then written but meaningless)."""
        B, L = (int(x) for x in ids.shape)
        out, stack, words, proj = self._step_buffers(B * L, out)
        if self._rows_flag is None:
            import cupyx

            self._rows_flag = cupyx.empty_pinned(1, dtype=np.int64)
            self._rows_flag[0] = 0
        self._rows_seq += 1
        seq = self._rows_seq
        hash_gather_rows(
            ids,
            ctx,
            c,
            self._mult,
            self._rows,
            self.dims.eos_token_id,
            self.dims.vocab_size,
            self._rows_flag,
            seq,
            self._stacked,
            stack,
            self._word_stacked,
            words,
        )
        project_and_sum(
            stack, self._wcat, words, proj=proj, out=out, denom=float(1 + self.dims.num_tables)
        )
        self._xp.cuda.get_current_stream().synchronize()
        if int(self._rows_flag[0]) == seq:
            self._bad_rows(ids.get(), None if ctx is None else ctx.get(), c)
        return out

    def _bad_rows(self, ids: np.ndarray, ctx: np.ndarray | None, c: int) -> None:
        where = first_bad_token(ids, ctx, c, self.dims.vocab_size)
        raise ConfigError(f"{where} is outside the vocabulary [0, {self.dims.vocab_size})")

    def _rows_to_host(self, ids: Any, ctx: Any, c: int) -> np.ndarray:
        """``[ctx[:, C - c:] | ids]`` rows packed into pinned host memory (int64[B * (c + L)]):
        one strided device-to-host copy per array on the current stream, then a sync.
        The buffer is rewritten by the next call: its tokens are copied by the step
        (the upload ring, the host hash) before this call returns."""
        cp = self._xp
        B, L = (int(x) for x in ids.shape)
        W = c + L
        if self._rows_host is None or self._rows_host.size < B * W:
            import cupyx

            self._rows_host = cupyx.empty_pinned(max(B * W, 4096), dtype=np.int64)
        host = self._rows_host
        stream = cp.cuda.get_current_stream()
        parts = [(c, ids, L)]
        if c:
            parts.insert(0, (0, ctx[:, ctx.shape[1] - c :], c))
        for col, a, width in parts:
            if width == 0 or B == 0:
                continue
            if not (a.strides[1] == 8 or width == 1) or not (B == 1 or a.strides[0] >= width * 8):
                a = cp.ascontiguousarray(a)
            pitch = a.strides[0] if B > 1 else width * 8
            cp.cuda.runtime.memcpy2DAsync(
                host.ctypes.data + col * 8, W * 8, a.data.ptr, pitch, width * 8, B, _D2H, stream.ptr
            )
        stream.synchronize()
        return host[: B * W]


__all__ = ["RowsStep"]
