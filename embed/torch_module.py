"""The n-gram embedding as a ``torch.nn.Module``: where PyTorch serving code calls it.

Owns :class:`TorchNgramEmbedding` (the reference ``ngram_embeddings`` module's
``forward(input_ids, ngram_context)`` over an :class:`NgramEmbedding`: tensors in and
out without copies, numpy views on the CPU, cupy views of the tensors' device memory
on torch's current stream on the GPU; padded batches packed so that each row is
embedded as if alone) and
:meth:`TorchNgramEmbedding.static_step` (``embed.torch_static.TorchStaticStep``, a
fixed-shape resident GPU step that a ``torch.cuda.graph`` capture can hold). Importing
this module imports torch; ``import embed`` does not.
Does not hash, gather or cache (``embed.layer``) nor read checkpoints (``embed.checkpoint``).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from kernels.reference import BF16
from rowcache.errors import ConfigError

from .batch import NgramBatch
from .checkpoint import load_pretrained
from .layer import NgramEmbedding


def _cupy_view(t: torch.Tensor, owner: Any = True) -> Any:
    """A cupy array over a CUDA tensor's memory, at the tensor's strides (no copy).

    ``owner=True`` keeps the tensor alive as the memory's owner; ``owner=None`` makes a
    bare view (:class:`_Views`, whose caller holds the tensor while the view is used).
    The zero-copy exchange DLPack would make, without its stream handshake: the
    embedding runs on torch's current stream itself, so there is no other stream to
    order against, and ``cupy.from_dlpack`` of a torch tensor (``Tensor.__dlpack__``'s
    per-call ``ExternalStream`` and event) took ~65 us a tensor on the H200 host under
    cProfile, this view 3-4 us (``bench/torch_step.py --profile``).
    """
    import cupy as cp

    dtype = _NP_INTS[t.dtype]
    size = t.element_size()
    # the bytes the view spans (torch strides are >= 0; an empty tensor spans none)
    span = 0 if t.numel() == 0 else 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    mem = cp.cuda.UnownedMemory(
        t.data_ptr(), span * size, t if owner is True else None, t.get_device()
    )
    strides = tuple(st * size for st in t.stride())
    return cp.ndarray(
        tuple(t.shape), dtype=dtype, memptr=cp.cuda.MemoryPointer(mem, 0), strides=strides
    )


_NP_INTS = {torch.int64: np.int64, torch.int16: np.int16, torch.int32: np.int32}
_INT_DTYPES = frozenset(
    {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8}
    | {getattr(torch, f"uint{b}") for b in (16, 32, 64) if hasattr(torch, f"uint{b}")}
)
_MAX_VIEWS = 64


class _Views:
    """Bare cupy views of CUDA tensors, kept by (address, shape, strides, dtype).

    torch's caching allocator hands a step's output and packed tokens the same blocks
    step after step, so the same few views serve every call (a dict lookup, against
    ~3 us to build one). A view owns nothing: it is only used while the caller holds
    the tensor it was looked up for, which is what makes a stale entry harmless (its
    address is looked up again only for a live tensor of the same size)."""

    def __init__(self) -> None:
        self._views: dict[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype], Any] = {}

    def __call__(self, t: torch.Tensor, shape: tuple[int, ...] | None = None) -> Any:
        """The view of ``t``: int64 tokens at their strides, or contiguous bf16 rows
        viewed as ml_dtypes bfloat16 ``[rows, hidden]``; or of its memory as ``shape``."""
        key = (t.data_ptr(), t.shape if shape is None else shape, t.stride(), t.dtype)
        v = self._views.get(key)
        if v is None:
            if len(self._views) >= _MAX_VIEWS:
                self._views.clear()
            if t.dtype == torch.bfloat16:
                v = _cupy_view(t.view(torch.int16), owner=None).view(BF16)
                v = v.reshape(-1, t.shape[-1])
            else:
                v = _cupy_view(t, owner=None)
            if shape is not None:
                v = v.reshape(shape)
            self._views[key] = v
        return v


def _ints(name: str, t: Any, device: torch.device | None, ndim: int) -> torch.Tensor:
    """``t`` as int64 token ids, checked: a tensor of integers, ``ndim``-D, on ``device``
    (None: not checked)."""
    if not isinstance(t, torch.Tensor):
        raise ConfigError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dt = t.dtype
    if dt not in _INT_DTYPES:
        raise ConfigError(f"{name} must hold integer token ids (int64), got {dt}")
    if t.dim() != ndim:
        raise ConfigError(f"{name} must be {ndim}-D, got shape {list(t.shape)}")
    if device is not None and t.get_device() != (-1 if device.index is None else device.index):
        if t.device != device:  # get_device: an int, not a device object, on the common path
            raise ConfigError(
                f"{name} is on {t.device}, input_ids on {device}: put them on one device"
            )
    return t if dt is torch.int64 else t.to(torch.int64)


# torch's current CUDA stream as a cudaStream_t int, and whether it is capturing: the
# private calls torch's own kernels use (the public ones cost ~2-5 us more a call on the
# H200 host), with the public ones where a torch build lacks them
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_CAPTURING = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)


def _raw_stream(index: int) -> int:
    """torch's current CUDA stream on device ``index``, as a ``cudaStream_t`` int."""
    if _RAW_STREAM is not None:
        return int(_RAW_STREAM(index))
    return int(torch.cuda.current_stream(index).cuda_stream)


def _capturing() -> bool:
    """Whether torch's current CUDA stream is capturing a graph."""
    if _CAPTURING is not None:
        return bool(_CAPTURING())
    return torch.cuda.is_current_stream_capturing()


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
        self._cuda = self._device.type == "cuda"
        self._streams: dict[int, Any] = {}  # torch's raw stream -> cupy's view of it
        self._views = _Views()
        # checked int64 tensors by (address, shape, strides, dtype): (view, device index,
        # rows, device), for _forward_known
        self._known: dict[tuple[Any, ...], tuple[Any, int, int, torch.device]] = {}
        self._cp: Any = None
        if self._cuda:
            import cupy

            self._cp = cupy

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
        cuda = self._cuda
        if (
            cuda
            and attention_mask is None
            and seq_slot is None
            and active == -1
            and not isinstance(ngram_context, (list, tuple))
        ):
            out = self._forward_known(input_ids, ngram_context)
            if out is not None:
                return out
        if not isinstance(input_ids, torch.Tensor) or input_ids.is_cuda != cuda:
            where = input_ids.device if isinstance(input_ids, torch.Tensor) else "not a tensor"
            raise ConfigError(
                f"input_ids ({where}) must be a tensor on the embedding's device {self._device}"
            )
        if cuda and _capturing():
            raise ConfigError(
                "TorchNgramEmbedding.forward is not capturable (it sizes its work on the host "
                "and may fault rows in): capture TorchNgramEmbedding.static_step(...) instead"
            )
        input_ids = _ints("input_ids", input_ids, None, 2)
        if (seq_slot is not None or active != -1) and self.overlay is None:
            raise ConfigError("seq_slot/active route an overlay: build the module with overlay=")
        ctx = ngram_context
        rows = attention_mask is None and not isinstance(ctx, (list, tuple))
        if rows and ctx is not None:  # one [B, C] context: the rows step reads it in place
            ctx = _ints("ngram_context", ctx, input_ids.device, 2)
            if ctx.shape[0] != input_ids.shape[0]:
                raise ConfigError(
                    f"ngram_context has {ctx.shape[0]} rows, input_ids {input_ids.shape[0]}: "
                    "one context per row"
                )
        if not cuda:
            return self._forward_cpu(input_ids, ctx, attention_mask, seq_slot, active, rows)
        import cupy as cp

        index = input_ids.get_device()
        if cp.cuda.runtime.getDevice() != index:
            with cp.cuda.Device(index):
                return self._forward_cuda(
                    input_ids, ctx, attention_mask, seq_slot, active, rows, index
                )
        return self._forward_cuda(input_ids, ctx, attention_mask, seq_slot, active, rows, index)

    def _forward_known(self, ids: Any, ctx: Any) -> torch.Tensor | None:
        """:meth:`forward`'s rows step when ``ids`` and ``ctx`` have the address, shape,
        strides and dtype of tensors an earlier call checked (a server's step reuses
        its buffers, so this is the common call): the checks are one dict lookup a
        tensor. None when a tensor is new, or when the checks must run (capture, another
        current device): then :meth:`forward` runs them."""
        known = self._known
        try:
            a = known.get((ids.data_ptr(), ids.shape, ids.stride(), ids.dtype))
            b = (
                None
                if ctx is None
                else known.get((ctx.data_ptr(), ctx.shape, ctx.stride(), ctx.dtype))
            )
        except AttributeError:  # not tensors: forward names the argument
            return None
        if a is None or (ctx is not None and (b is None or b[1] != a[1] or b[2] != a[2])):
            return None
        index = a[1]
        cp = self._cp
        if _capturing() or cp.cuda.runtime.getDevice() != index:
            return None
        raw = _raw_stream(index)
        B, L = a[2], a[0].shape[1]
        out = torch.empty((B, L, self.dims.hidden_size), dtype=torch.bfloat16, device=a[3])
        c = None if b is None else b[0]
        if cp.cuda.get_current_stream().ptr == raw:
            self.emb.embed_rows(a[0], c, out=self._views(out))
        else:
            with self._stream(raw, index):
                self.emb.embed_rows(a[0], c, out=self._views(out))
        return out

    def _remember(self, t: torch.Tensor, view: Any, index: int) -> None:
        """Record a checked int64 tensor's view for :meth:`_forward_known`."""
        if len(self._known) >= _MAX_VIEWS:
            self._known.clear()
        key = (t.data_ptr(), t.shape, t.stride(), t.dtype)
        self._known[key] = (view, index, int(t.shape[0]), t.device)

    def _forward_cpu(
        self, ids: torch.Tensor, ctx: Any, mask: Any, seq_slot: Any, active: int, rows: bool
    ) -> torch.Tensor:
        """:meth:`forward` on the CPU: numpy views of the tensors, a numpy output."""
        B, L = ids.shape
        D = self.dims.hidden_size
        host = np.empty((B, L, D), dtype=np.int16)
        out = torch.from_numpy(host).view(torch.bfloat16)
        dest = host.reshape(B * L, D).view(BF16)
        if rows:
            kw = self._overlay_kw(seq_slot, active, B)
            self.emb.embed_rows(ids.numpy(), None if ctx is None else ctx.numpy(), out=dest, **kw)
            return out
        plan = self._plan(ids, ctx, mask)
        self._run(plan, out, dest if plan.fill is None else None, seq_slot, active, None)
        return out

    def _forward_cuda(
        self,
        ids: torch.Tensor,
        ctx: Any,
        mask: torch.Tensor | None,
        seq_slot: Any,
        active: int,
        rows: bool,
        index: int,
    ) -> torch.Tensor:
        """:meth:`forward` on the GPU (cupy's current device is ``index``), on torch's
        current stream (cupy's current stream already, or entered for the call): one
        ``NgramEmbedding.embed_rows`` on cupy views of the tensors (no copy), or for
        ragged contexts and masks the packed tokens of :meth:`_plan`."""
        import cupy as cp

        raw = _raw_stream(index)
        B, L = ids.shape
        out = torch.empty((B, L, self.dims.hidden_size), dtype=torch.bfloat16, device=ids.device)
        views = self._views
        if rows:
            kw = self._overlay_kw(seq_slot, active, B)
            args = (views(ids), None if ctx is None else views(ctx))
            self._remember(ids, args[0], index)
            if ctx is not None:
                self._remember(ctx, args[1], index)
            if cp.cuda.get_current_stream().ptr == raw:
                self.emb.embed_rows(*args, out=views(out), **kw)
            else:
                with self._stream(raw, index):
                    self.emb.embed_rows(*args, out=views(out), **kw)
            return out
        plan = self._plan(ids, ctx, mask)
        dest = views(out) if plan.fill is None else None
        if cp.cuda.get_current_stream().ptr == raw:
            self._run(plan, out, dest, seq_slot, active, views)
        else:
            with self._stream(raw, index):
                self._run(plan, out, dest, seq_slot, active, views)
        return out

    def _overlay_kw(self, seq_slot: Any, active: int, B: int) -> dict[str, Any]:
        if self.overlay is None:
            return {}
        return {"overlay": self.overlay, "active": active, "seq_slots": self._slots(seq_slot, B)}

    def _plan(self, ids: torch.Tensor, ctx: Any, mask: torch.Tensor | None) -> _Plan:
        """The packed step of a forward with ragged contexts or a mask: tokens (numpy
        on the CPU, a tensor on the GPU: ``torch.cat``), per-row lengths and, for padded
        rows, which output positions the packed rows fill."""
        B, L = ids.shape
        keep = self.dims.max_ngram - 1
        cpu = not self._cuda
        if isinstance(ctx, (list, tuple)):  # ragged contexts: one concatenation
            if len(ctx) != B:
                raise ConfigError(f"ngram_context has {len(ctx)} rows, input_ids {B}")
            if mask is not None:
                raise ConfigError("attention_mask goes with a [B, C] ngram_context, not a list")
            dev = ids.device
            rows = [_ints(f"ngram_context[{b}]", c, dev, 1)[-keep:] for b, c in enumerate(ctx)]
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
        valid = None if mask is None else self._valid(mask, B, L, c)
        tokens = ids if c == 0 else torch.cat([ctx[:, ctx.shape[1] - c :], ids], dim=1)
        if valid is not None:  # some token is padding: pack the real ones only
            host = valid.cpu().numpy()
            return _Plan(
                tokens.numpy()[host] if cpu else tokens[valid],
                host.sum(axis=1, dtype=np.int64),
                host[:, c:].sum(axis=1, dtype=np.int64),
                valid[:, c:],
            )
        tokens = tokens.reshape(-1)
        return _Plan(tokens.numpy() if cpu else tokens, np.full(B, c + L), np.full(B, L), None)

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
        self, plan: _Plan, out: torch.Tensor, dest: Any, seq_slot: Any, active: int, view: Any
    ) -> None:
        """Embed the plan into ``out``: ``dest`` is the numpy/cupy view of its rows (None
        for padded rows: packed rows are embedded into a scratch tensor, then scattered
        to the real positions), ``view`` makes the tokens' view."""
        fill, D = plan.fill, out.shape[-1]
        kw = self._overlay_kw(seq_slot, active, out.shape[0])
        tokens = plan.tokens
        if isinstance(tokens, torch.Tensor):
            tokens = view(tokens.contiguous())
        scratch = None
        if dest is None:
            scratch = out.new_empty((int(plan.seq_lens.sum()), D))
            dest = view(scratch) if self._cuda else scratch.view(torch.int16).numpy().view(BF16)
        batch = NgramBatch(self.dims, tokens, plan.ctx_lens, plan.seq_lens)
        self.emb.embed_packed(batch, out=dest, **kw)
        if fill is not None:
            out.zero_()
            out[fill] = scratch

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

    def _stream(self, raw: int, index: int) -> Any:
        """cupy's view of torch's stream ``raw`` on device ``index`` (one per stream, kept)."""
        import cupy as cp

        ext = self._streams.get(raw)
        if ext is None:
            if raw == 0:  # torch's default stream is the legacy null stream: cupy's own
                ext = cp.cuda.Stream.null
            else:
                with warnings.catch_warnings():  # cupy 14 deprecates it for a
                    warnings.simplefilter("ignore")  # from_external whose form varies
                    ext = cp.cuda.ExternalStream(raw, index)
            self._streams[raw] = ext
        return ext

    # --- CUDA graphs ------------------------------------------------------------
    def static_step(self, batch_size: int, seq_len: int, context_len: int = 0) -> Any:
        """A fixed-shape resident GPU step that ``torch.cuda.graph`` can capture.

        See :class:`TorchStaticStep`. Needs resident tables on the GPU (a cached table
        resolves rows on the host each step, which no graph can hold).
        """
        from .torch_static import TorchStaticStep

        return TorchStaticStep(self, batch_size, seq_len, context_len)


__all__ = ["TorchNgramEmbedding"]
