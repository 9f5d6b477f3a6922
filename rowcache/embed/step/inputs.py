"""A call's tokens, as the runners take them: host tokens, device tokens, rows in place.

Owns the per-call input adapters: :class:`HostTokens` and :class:`DeviceTokens` (an
``NgramBatch`` whose tokens are on the host or on the GPU) and :class:`RowsInPlace`
(``ids[B, L]`` after contexts ``ctx[B, C]``, any strides, as a serving engine holds
them), each with its checks, its step shape and :meth:`run` (which hands it to the
runner's step for its kind). Does not run stages (``rowcache.embed.step.runners``).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from rowcache.embed.ngram.batch import NgramBatch
from rowcache.embed.ngram.dims import NgramDims
from rowcache.embed.step.device import StepShape
from rowcache.embed.step.stages import StepCall
from rowcache.errors import ConfigError
from rowcache.kernels.loader import is_device_array
from rowcache.kernels.ngram.rows import first_bad_token, rows_packed

_D2H = 2  # cudaMemcpyDeviceToHost


class Runner(Protocol):
    """What an input adapter hands itself to: a runner's step for each kind of input
    (``CpuRunner``, ``EagerRunner``, ``GraphRunner``)."""

    name: str

    def run_host(self, batch: NgramBatch, call: StepCall) -> Any: ...

    def run_device(self, batch: NgramBatch, call: StepCall) -> Any: ...

    def run_rows(self, rows: RowsInPlace, call: StepCall) -> Any: ...


class HostTokens:
    """A batch of host tokens (``NgramBatch``, checked when it was built)."""

    __slots__ = ("batch",)

    def __init__(self, batch: NgramBatch) -> None:
        self.batch = batch

    @property
    def shape(self) -> StepShape:
        return StepShape.of(self.batch)

    def run(self, runner: Runner, call: StepCall) -> Any:
        return runner.run_host(self.batch, call)


class DeviceTokens:
    """A batch of tokens on the GPU (range-checked by the hash kernel)."""

    __slots__ = ("batch",)

    def __init__(self, batch: NgramBatch) -> None:
        self.batch = batch

    @property
    def shape(self) -> StepShape:
        return StepShape.of(self.batch)

    def host(self) -> HostTokens:
        """The batch with its tokens copied to the host (one sync)."""
        b = self.batch
        return HostTokens(NgramBatch(b.dims, b.tokens.get(), b.ctx_lens, b.seq_lens))

    def run(self, runner: Runner, call: StepCall) -> Any:
        return runner.run_device(self.batch, call)


def tokens_of(batch: NgramBatch) -> HostTokens | DeviceTokens:
    """The adapter of ``batch``'s tokens."""
    return DeviceTokens(batch) if batch.on_device else HostTokens(batch)


def _matrix(name: str, a: Any, rows: int | None) -> Any:
    """``a`` checked as a 2-D integer array (numpy or cupy) of ``rows`` rows, int64."""
    if not hasattr(a, "ndim") or not hasattr(a, "dtype"):
        a = np.asarray(a)
    if a.ndim != 2 or a.dtype.kind not in "iu":
        raise ConfigError(
            f"{name} must be a 2-D integer array of token ids, got {a.dtype}{list(a.shape)}"
        )
    if rows is not None and int(a.shape[0]) != rows:
        raise ConfigError(f"{name} has {a.shape[0]} rows, ids {rows}: one context per row")
    return a if a.dtype == np.int64 else a.astype(np.int64)


class RowsInPlace:
    """Every token of ``ids[B, L]``, each row a sequence after the last ``c`` tokens of
    its row of ``ctx[B, C]`` (``c = min(C, max_ngram - 1)``; no context: ``c = 0``).

    Made by :meth:`checked` (the arrays checked: 2-D integer, one array module, one
    context per row) or, for arrays checked before, directly (cupy int64 ``ids`` with
    ``B * L > 0``, ``ctx`` with ``c`` look-back columns or None).
    """

    __slots__ = ("B", "L", "c", "ctx", "ids")

    def __init__(self, ids: Any, ctx: Any, c: int) -> None:
        self.ids, self.ctx, self.c = ids, ctx, c
        self.B, self.L = (int(x) for x in ids.shape)

    @classmethod
    def checked(cls, dims: NgramDims, ids: Any, ctx: Any) -> RowsInPlace:
        ids = _matrix("ids", ids, None)
        B = int(ids.shape[0])
        if ctx is not None:
            ctx = _matrix("ctx", ctx, B)
            if is_device_array(ctx) != is_device_array(ids):
                raise ConfigError("ids and ctx must both be numpy or both be cupy arrays")
        c = 0 if ctx is None else min(int(ctx.shape[1]), dims.max_ngram - 1)
        return cls(ids, ctx, c)

    @property
    def n(self) -> int:
        return self.B * self.L

    @property
    def on_device(self) -> bool:
        return is_device_array(self.ids)

    def run(self, runner: Runner, call: StepCall) -> Any:
        return runner.run_rows(self, call)

    def packed(self, dims: NgramDims, host: np.ndarray | None = None) -> HostTokens:
        """The rows packed on the host as an ``NgramBatch`` (each row a sequence),
        range-checked (a bad token raises, naming it). Device rows are copied into the
        pinned ``host`` (:meth:`to_host`), or fetched by cupy when ``host`` is None."""
        if not self.on_device:
            tokens = rows_packed(self.ids, self.ctx, self.c)
        elif host is None:
            ctx = None if self.ctx is None else self.ctx.get()
            tokens = rows_packed(self.ids.get(), ctx, self.c)
        else:
            tokens = self.to_host(host)
        bad = (tokens < 0) | (tokens >= dims.vocab_size)
        if tokens.size and bool(bad.any()):
            self.raise_bad(dims)
        lens = np.full(self.B, self.c + self.L, dtype=np.int64)
        seq_lens = np.full(self.B, self.L, dtype=np.int64)
        return HostTokens(NgramBatch(dims, tokens, lens, seq_lens, _checked=True))

    def raise_bad(self, dims: NgramDims) -> None:
        """Raise the ``ConfigError`` naming the first token outside the vocabulary."""
        dev = self.on_device
        ids = self.ids.get() if dev else np.asarray(self.ids)
        ctx = None if self.ctx is None else (self.ctx.get() if dev else self.ctx)
        where = first_bad_token(ids, ctx, self.c, dims.vocab_size)
        raise ConfigError(f"{where} is outside the vocabulary [0, {dims.vocab_size})")

    def to_host(self, host: np.ndarray) -> np.ndarray:
        """``[ctx[:, C - c:] | ids]`` rows packed into the pinned ``host`` (int64, at
        least ``B * (c + L)``): one strided device-to-host copy per array on the current
        stream, then a sync. ``host`` is rewritten by the next call: the step copies its
        tokens (the upload, the host hash) before that call returns."""
        import cupy as cp

        B, L, c = self.B, self.L, self.c
        W = c + L
        assert host.size >= B * W
        stream = cp.cuda.get_current_stream()
        parts = [(c, self.ids, L)]
        if c:
            parts.insert(0, (0, self.ctx[:, self.ctx.shape[1] - c :], c))
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
