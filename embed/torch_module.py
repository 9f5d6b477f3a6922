"""The n-gram embedding as a ``torch.nn.Module``: where PyTorch serving code calls it.

Owns :class:`TorchNgramEmbedding` (the reference ``ngram_embeddings`` module's
``forward(input_ids, ngram_context)`` over an :class:`NgramEmbedding`: tensors in and
out without copies, numpy views on the CPU, cupy views of the tensors' device memory
on torch's current stream on the GPU; padded batches packed so that each row is
embedded as if alone) and
:class:`TorchStaticStep` (a fixed-shape resident GPU step that a ``torch.cuda.graph``
capture can hold). Importing this module imports torch; ``import embed`` does not.
Does not hash, gather or cache (``embed.layer``) nor read checkpoints (``embed.checkpoint``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from kernels.reference import BF16
from rowcache.errors import ConfigError

from .batch import NgramBatch
from .checkpoint import load_pretrained
from .layer import NgramEmbedding

_D2H = 2  # cudaMemcpyDeviceToHost


def _host_bf16(t: torch.Tensor) -> np.ndarray:
    """A CPU bf16 tensor as an ml_dtypes bfloat16 array over the same memory."""
    return t.view(torch.int16).numpy().view(BF16)


def _cupy_view(t: torch.Tensor) -> Any:
    """A cupy array over a contiguous CUDA tensor's memory (no copy; the tensor is kept
    alive as the memory's owner).

    The zero-copy exchange DLPack would make, without its stream handshake: the
    embedding runs on torch's current stream itself, so there is no other stream to
    order against, and ``cupy.from_dlpack`` of a torch tensor (``Tensor.__dlpack__``'s
    per-call ``ExternalStream`` and event) took ~65 us a tensor on the H200 host under
    cProfile, this view 3-4 us (``bench/torch_step.py --profile``).
    """
    import cupy as cp

    if not t.is_contiguous():  # cannot happen: callers pass fresh or .contiguous() tensors
        raise ConfigError("internal: a cupy view needs a contiguous tensor")
    dtype = {torch.int64: np.int64, torch.int16: np.int16, torch.int32: np.int32}[t.dtype]
    nbytes = t.numel() * t.element_size()
    mem = cp.cuda.UnownedMemory(t.data_ptr(), nbytes, t, t.device.index)
    return cp.ndarray(tuple(t.shape), dtype=dtype, memptr=cp.cuda.MemoryPointer(mem, 0))


def _ints(name: str, t: Any, device: torch.device, ndim: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ConfigError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ConfigError(f"{name} must hold integer token ids (int64), got {t.dtype}")
    if t.dim() != ndim:
        raise ConfigError(f"{name} must be {ndim}-D, got shape {list(t.shape)}")
    if t.device != device:
        raise ConfigError(f"{name} is on {t.device}, input_ids on {device}: put them on one device")
    return t if t.dtype == torch.int64 else t.to(torch.int64)


class _Plan(NamedTuple):
    """One forward's packed input: ``tokens`` (numpy on the CPU, a tensor on the GPU),
    ``ctx_lens``/``seq_lens`` int64[B] and, for padded rows, ``fill`` bool[B, L]."""

    tokens: Any
    ctx_lens: np.ndarray
    seq_lens: np.ndarray
    fill: torch.Tensor | None


class TorchNgramEmbedding(torch.nn.Module):
    """LongCat's ``ngram_embeddings`` module over an :class:`NgramEmbedding`.

    Parameters
    ----------
    emb : NgramEmbedding
        Resident (BF16, FP8), cached or mixed tables, on ``"cpu"`` or ``"cuda"``.
    overlay : embed.overlay.TokenOverlay, optional
        Per-sequence adapters, routed by ``forward(..., seq_slot=...)``.

    Notes
    -----
    The module holds no torch parameters (its tables live in the embedding, or in
    row caches): ``.to()``/``.half()`` do not move or convert them, and it runs under
    no autograd (the output has no history; ids carry no gradient anyway).

    To replace the reference model's module: ``model.model.ngram_embeddings = mod``
    (the reference calls ``ngram_embeddings(input_ids, ngram_context=...)``), or
    compute ``inputs_embeds = mod(input_ids, ctx)`` and pass them to a base
    ``LongcatFlashForCausalLM``.
    """

    def __init__(self, emb: NgramEmbedding, *, overlay: Any = None) -> None:
        super().__init__()
        if not isinstance(emb, NgramEmbedding):
            raise ConfigError(f"emb must be an embed.NgramEmbedding, got {type(emb).__name__}")
        if overlay is not None and not hasattr(overlay, "apply_embed"):
            raise ConfigError(
                f"overlay must be an embed.overlay.TokenOverlay, got {type(overlay).__name__}"
            )
        self.emb = emb
        self.dims = emb.dims
        self.overlay = overlay
        self._device = torch.device(emb.device)
        self._streams: dict[int, Any] = {}

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        *,
        cached: Any = None,
        store: str | os.PathLike[str] | None = None,
        arena_bytes: int | str | None = None,
        tune: Any = None,
        dtype: str = "bf16",
        device: str = "cpu",
        progress: bool = False,
        overlay: Any = None,
    ) -> TorchNgramEmbedding:
        """The module of a Hugging Face LongCat n-gram checkpoint directory.

        Parameters are those of :func:`embed.checkpoint.load_pretrained`: ``cached``
        (``"all"`` or table indices served by row caches; default none, or the tables
        of ``tune``), ``store`` (the cached tables' row store: built from the
        checkpoint's safetensors on first use, reused after; default
        ``<path>/rowcache-<dtype>``), ``arena_bytes`` (the arenas' budget, split by
        rows) or ``tune`` (a ``rowcache tune --json`` report: slots per table),
        ``dtype`` (``"bf16"`` or ``"fp8"``), ``device`` (``"cpu"`` or ``"cuda"``).
        """
        emb = load_pretrained(
            path,
            cached=cached,
            store=store,
            arena_bytes=arena_bytes,
            tune=tune,
            dtype=dtype,
            device=device,
            progress=progress,
        )
        return cls(emb, overlay=overlay)

    @property
    def device(self) -> torch.device:
        """Where the embedding runs and where its inputs must be."""
        return self._device

    def extra_repr(self) -> str:
        return repr(self.emb)

    # --- forward ----------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        ngram_context: torch.Tensor | Sequence[torch.Tensor] | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        seq_slot: Any = None,
        active: int = -1,
    ) -> torch.Tensor:
        """Embeddings of ``input_ids`` with their n-gram look-back.

        Parameters
        ----------
        input_ids : int64[B, L] (any integer dtype), on the embedding's device
        ngram_context : int64[B, C], a list of B int64[C_b] tensors, or None
            The tokens before ``input_ids`` of each row (as the reference ``NgramCache``
            keeps them); only the last ``max_ngram - 1`` are used. None: no look-back
            (the start of the sequences). A list serves rows of different context lengths.
        attention_mask : [B, W] (bool or 0/1), W = L or W >= L + min(C, max_ngram - 1), optional
            Which tokens exist (HF's mask over past and current tokens; its last L
            columns are ``input_ids``, the columns before them the context's last ones).
            Masked tokens are dropped from the look-back, each row is embedded as if
            alone, and masked positions' rows are zero. Without a mask every token
            counts, as in the reference module.
        seq_slot : int, or int[B] (tensor, numpy), optional
            The overlay adapter of each row (negative: none); needs ``overlay``.
        active : int
            The adapter of every row when ``seq_slot`` is None (-1: none).

        Returns
        -------
        bfloat16[B, L, hidden_size] on ``input_ids``' device
            ``(E0[x] + sum_i W_i E_i[id_i]) / (1 + T)``, bit-identical to
            ``NgramEmbedding.embed`` of each row's context.
        """
        device = self._device
        if not isinstance(input_ids, torch.Tensor) or input_ids.device.type != device.type:
            where = input_ids.device if isinstance(input_ids, torch.Tensor) else "not a tensor"
            raise ConfigError(
                f"input_ids ({where}) must be a tensor on the embedding's device {device}"
            )
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise ConfigError(
                "TorchNgramEmbedding.forward is not capturable (it sizes its work on the host "
                "and may fault rows in): capture TorchNgramEmbedding.static_step(...) instead"
            )
        input_ids = _ints("input_ids", input_ids, input_ids.device, 2)
        B, L = input_ids.shape
        if seq_slot is not None or active != -1:
            if self.overlay is None:
                raise ConfigError(
                    "seq_slot/active route an overlay: build the module with overlay="
                )
        plan = self._plan(input_ids, ngram_context, attention_mask)
        D = self.dims.hidden_size
        if device.type == "cpu":
            out = torch.from_numpy(np.empty((B, L, D), dtype=np.int16)).view(torch.bfloat16)
            self._run(plan, out, seq_slot, active, _host_bf16, None)
        else:
            import cupy as cp

            def dev_bf16(t: torch.Tensor) -> Any:
                return _cupy_view(t.view(torch.int16)).view(BF16)

            out = torch.empty((B, L, D), dtype=torch.bfloat16, device=input_ids.device)
            with cp.cuda.Device(input_ids.device.index), self._stream(input_ids.device):
                self._run(plan, out, seq_slot, active, dev_bf16, _cupy_view)
        return out

    def _plan(self, ids: torch.Tensor, ctx: Any, mask: torch.Tensor | None) -> _Plan:
        """The packed step of one forward: tokens, per-row lengths and, for padded
        rows, which output positions the packed rows fill. On the CPU the packing is
        numpy on views of the tensors (cheaper per call than torch ops)."""
        B, L = ids.shape
        keep = self.dims.max_ngram - 1
        cpu = ids.device.type == "cpu"
        if isinstance(ctx, (list, tuple)):  # ragged contexts: one concatenation
            if len(ctx) != B:
                raise ConfigError(f"ngram_context has {len(ctx)} rows, input_ids {B}")
            if mask is not None:
                raise ConfigError("attention_mask goes with a [B, C] ngram_context, not a list")
            rows = [
                _ints(f"ngram_context[{b}]", c, ids.device, 1)[-keep:] for b, c in enumerate(ctx)
            ]
            clens = np.fromiter((r.shape[0] for r in rows), dtype=np.int64, count=B)
            tokens = torch.cat([t for b in range(B) for t in (rows[b], ids[b])])
            return _Plan(tokens.numpy() if cpu else tokens, clens + L, np.full(B, L), None)
        c = 0
        if ctx is not None:
            ctx = _ints("ngram_context", ctx, ids.device, 2)
            if ctx.shape[0] != B:
                raise ConfigError(
                    f"ngram_context has {ctx.shape[0]} rows, input_ids {B}: one context per row"
                )
            c = min(int(ctx.shape[1]), keep)
        x_ids = ids.numpy() if cpu else ids
        if c == 0:
            full = x_ids
        elif cpu:
            full = np.concatenate([ctx.numpy()[:, ctx.shape[1] - c :], x_ids], axis=1)
        else:
            full = torch.cat([ctx[:, ctx.shape[1] - c :], ids], dim=1)
        if mask is not None:
            valid = self._valid(mask, B, L, c)
            if valid is not None:  # some token is padding: pack the real ones only
                host = valid.cpu().numpy()
                return _Plan(
                    full[host] if cpu else full[valid],
                    host.sum(axis=1, dtype=np.int64),
                    host[:, c:].sum(axis=1, dtype=np.int64),
                    valid[:, c:],
                )
        return _Plan(full.reshape(-1), np.full(B, c + L), np.full(B, L), None)

    @staticmethod
    def _valid(mask: torch.Tensor, B: int, L: int, c: int) -> torch.Tensor | None:
        """``[B, c + L]`` bool of the real tokens, or None when all are real."""
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[0] != B:
            shape = list(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ConfigError(f"attention_mask must be a [B={B}, W] tensor, got {shape}")
        W = mask.shape[1]
        if W != L and W < L + c:
            raise ConfigError(
                f"attention_mask has {W} columns: give {L} (input_ids only) or at least "
                f"{L + c} (the context's last {c} tokens and input_ids)"
            )
        valid = (mask if W == L else mask[:, W - L - c :]).to(dtype=torch.bool)
        if W == L and c:
            valid = torch.cat([torch.ones((B, c), dtype=torch.bool, device=mask.device), valid], 1)
        if bool(valid.all()):
            return None
        return valid

    def _run(
        self, plan: _Plan, out: torch.Tensor, seq_slot: Any, active: int, bf16: Any, xp: Any
    ) -> None:
        emb, fill, D = self.emb, plan.fill, out.shape[-1]
        B = out.shape[0]
        kw: dict[str, Any] = {}
        if self.overlay is not None:
            kw = {"overlay": self.overlay, "active": active, "seq_slots": self._slots(seq_slot, B)}
        tokens = (
            plan.tokens if isinstance(plan.tokens, np.ndarray) else xp(plan.tokens.contiguous())
        )
        dest = out.view(-1, D) if fill is None else out.new_empty((int(plan.seq_lens.sum()), D))
        if B == 1 and fill is None:
            if "seq_slots" in kw:
                kw["seq_slot"] = kw.pop("seq_slots")
            emb.embed(tokens, int(plan.seq_lens[0]), out=bf16(dest), **kw)
        else:
            batch = NgramBatch(self.dims, tokens, plan.ctx_lens, plan.seq_lens)
            emb.embed_packed(batch, out=bf16(dest), **kw)
        if fill is not None:
            out.zero_()
            out[fill] = dest

    def _slots(self, seq_slot: Any, B: int) -> Any:
        """Adapter slots, one per row of the batch: host int32[B] (or None). The
        embedding repeats them over each row's positions (a CUDA tensor is copied to
        the host: B ints)."""
        if seq_slot is None:
            return None
        if isinstance(seq_slot, torch.Tensor):
            seq_slot = seq_slot.cpu().numpy()
        arr = np.asarray(seq_slot)
        if arr.ndim == 0:
            arr = np.full(B, int(arr))
        if arr.shape != (B,) or arr.dtype.kind not in "iu":
            raise ConfigError(
                f"seq_slot must be an int or int[B={B}], got {arr.dtype}{list(arr.shape)}"
            )
        return arr.astype(np.int32)

    def _stream(self, device: torch.device) -> Any:
        """cupy's view of torch's current stream on ``device`` (one per stream, kept)."""
        import cupy as cp

        s = torch.cuda.current_stream(device)
        ext = self._streams.get(s.cuda_stream)
        if ext is None:
            # torch's default stream is the legacy null stream: cupy's own null stream
            ext = (
                cp.cuda.Stream.null
                if s.cuda_stream == 0
                else cp.cuda.ExternalStream(s.cuda_stream, device.index)
            )
            self._streams[s.cuda_stream] = ext
        return ext

    # --- CUDA graphs ------------------------------------------------------------
    def static_step(self, batch_size: int, seq_len: int, context_len: int = 0) -> TorchStaticStep:
        """A fixed-shape resident GPU step that ``torch.cuda.graph`` can capture.

        See :class:`TorchStaticStep`. Needs resident tables on the GPU (a cached table
        resolves rows on the host each step, which no graph can hold).
        """
        return TorchStaticStep(self, batch_size, seq_len, context_len)


class TorchStaticStep:
    """A resident GPU embedding step of fixed shape on fixed buffers, capturable.

    ``step(input_ids, ngram_context)`` (int64 ``[B, L]`` and ``[B, C >= context_len]``
    CUDA tensors) queues on torch's current stream: the tokens packed into a device
    buffer (torch copies), a copy into the step's pinned input, then
    ``NgramEmbedding.static_step``'s upload, fused hash + gathers, GEMM and scaled sum
    into :attr:`out` (bf16 ``[B, L, hidden]``, the same tensor every call). Every part
    is stream-ordered and allocation-free, so after one eager call it can be captured
    in a ``torch.cuda.graph`` with the rest of a decode step. Token ids are not range
    checked on this path (as ``nn.Embedding`` on CUDA): keep them in ``[0, vocab)``.
    """

    def __init__(
        self, module: TorchNgramEmbedding, batch_size: int, seq_len: int, context_len: int = 0
    ) -> None:
        emb = module.emb
        for name, v, lo in (
            ("batch_size", batch_size, 1),
            ("seq_len", seq_len, 1),
            ("context_len", context_len, 0),
        ):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ConfigError(f"{name}={v!r} must be an int >= {lo}")
        B, L = int(batch_size), int(seq_len)
        c = min(int(context_len), emb.dims.max_ngram - 1)
        if emb.device != "cuda":
            raise ConfigError("static_step needs an embedding on cuda (CUDA graphs)")
        self.module, self.shape = module, (B, L, c)
        zeros = np.zeros(B * (c + L), dtype=np.int64)
        batch = (
            NgramBatch.single(emb.dims, zeros, L)
            if B == 1
            else NgramBatch(emb.dims, zeros, np.full(B, c + L), np.full(B, L))
        )
        self._step = emb.static_step(batch)  # ConfigError for cached tables
        self._multi = B > 1
        n_words = B * (c + L) + (B * L if self._multi else 0)  # tokens, then word ids
        import cupy as cp

        where = torch.device("cuda", cp.cuda.Device().id)  # the embedding's device
        self._dev = torch.empty(n_words, dtype=torch.int64, device=where)
        self._host = self._step.buf.hosts[0]  # pinned: [tokens | word ids | starts | positions]
        out = torch.from_dlpack(self._step.out.view(np.int16))
        self.out = out.view(torch.bfloat16).view(B, L, emb.dims.hidden_size)
        self.runs = 0

    def __call__(
        self, input_ids: torch.Tensor, ngram_context: torch.Tensor | None = None
    ) -> torch.Tensor:
        import cupy as cp

        B, L, c = self.shape
        if tuple(input_ids.shape) != (B, L) or not input_ids.is_cuda:
            raise ConfigError(
                f"this step takes CUDA input_ids [{B}, {L}], got {list(input_ids.shape)}"
            )
        if c and (
            ngram_context is None
            or ngram_context.dim() != 2
            or ngram_context.shape[0] != B
            or ngram_context.shape[1] < c
        ):
            raise ConfigError(f"this step takes ngram_context [{B}, >= {c}] (CUDA int64)")
        if self.runs == 0 and torch.cuda.is_current_stream_capturing():
            raise ConfigError(
                "run a TorchStaticStep once before capturing it (compiles its kernels)"
            )
        packed = self._dev[: B * (c + L)].view(B, c + L)
        if c:
            assert ngram_context is not None  # checked above
            packed[:, :c].copy_(ngram_context[:, ngram_context.shape[1] - c :])
        packed[:, c:].copy_(input_ids)
        if self._multi:
            self._dev[B * (c + L) :].view(B, L).copy_(input_ids)
        stream = self.module._stream(input_ids.device)
        cp.cuda.runtime.memcpyAsync(
            self._host.ctypes.data, self._dev.data_ptr(), self._dev.numel() * 8, _D2H, stream.ptr
        )
        with cp.cuda.Device(input_ids.device.index), stream:
            self._step.issue()
        self.runs += 1
        return self.out


__all__ = ["TorchNgramEmbedding", "TorchStaticStep"]
