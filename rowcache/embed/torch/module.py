"""The n-gram embedding as a ``torch.nn.Module``: where PyTorch serving code calls it.

Owns :class:`TorchNgramEmbedding` (the reference ``ngram_embeddings`` module's
``forward(input_ids, ngram_context)`` over an :class:`NgramEmbedding`: tensors in and
out without copies, read in place by ``NgramEmbedding.embed_rows`` through numpy views
on the CPU and cupy views (``rowcache.embed.torch.views``) on torch's current stream on the GPU;
ragged contexts and padded batches packed by ``rowcache.embed.torch.packed``) and
:meth:`TorchNgramEmbedding.static_step` (``rowcache.embed.torch.static.TorchStaticStep``, a
fixed-shape resident GPU step that a ``torch.cuda.graph`` capture can hold). Importing
this module imports torch; ``import rowcache.embed`` does not.
Does not hash, gather or cache (``rowcache.embed.layer``) nor read checkpoints (``rowcache.embed.checkpoint``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from rowcache.embed.checkpoint import load_pretrained
from rowcache.embed.layer import NgramEmbedding
from rowcache.embed.torch import packed as torch_packed
from rowcache.embed.torch.static import TorchStaticStep
from rowcache.embed.torch.views import (
    MAX_VIEWS,
    TensorViews,
    TorchStreams,
    capturing,
    check_plain_tensor,
    check_token_ids,
    raw_stream,
)
from rowcache.errors import ConfigError
from rowcache.kernels.reference import BF16


class TorchNgramEmbedding(torch.nn.Module):
    """LongCat's ``ngram_embeddings`` module over an :class:`NgramEmbedding`.

    Parameters
    ----------
    emb : NgramEmbedding
        Resident (BF16, FP8), cached or mixed tables, on ``"cpu"`` or ``"cuda"``.
    overlay : rowcache.embed.overlay.overlay.TokenOverlay, optional
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

    With an embedding built with ``defer_reads=True`` (cached tables on the GPU), a
    forward whose rows must be read from disk returns before the read ends: its
    output is written on torch's current stream once the rows arrive, so the rest of
    the model can be queued behind it. Call :meth:`settle` after queuing the step's
    work and before using its results (sampling): it commits the caches and raises a
    failed read's ``CorruptDataError``, after which the step's outputs are invalid.
    """

    def __init__(self, emb: NgramEmbedding, *, overlay: Any = None) -> None:
        super().__init__()
        if not isinstance(emb, NgramEmbedding):
            raise ConfigError(
                f"emb must be an rowcache.embed.NgramEmbedding, got {type(emb).__name__}"
            )
        if overlay is not None and not hasattr(overlay, "apply_embed"):
            raise ConfigError(
                f"overlay must be an rowcache.embed.overlay.overlay.TokenOverlay, got {type(overlay).__name__}"
            )
        self.emb = emb
        self.dims = emb.dims
        self.overlay = overlay
        self._device = torch.device(emb.device)
        self._cuda = self._device.type == "cuda"
        self._streams = TorchStreams()  # torch's raw stream -> cupy's view of it
        self._views = TensorViews()
        # checked int64 [B, W] tensors by (address, shape, strides, dtype): (view, device
        # index, B, device, B * W, the output's shape as ids, look-back columns as a
        # context), for _forward_known
        self._known: dict[tuple[Any, ...], tuple[Any, ...]] = {}
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
        defer_reads: bool = False,
        allow_nonfinite: bool = False,
    ) -> TorchNgramEmbedding:
        """The module of a Hugging Face LongCat n-gram checkpoint.

        Parameters are those of :func:`rowcache.embed.checkpoint.load_pretrained`: ``path``
        (a checkpoint directory or file, or a Hugging Face repo id, resolved through
        ``huggingface_hub`` as transformers does: the Hugging Face cache where there is no
        network), ``cached`` (``"all"`` or table indices served by row caches; default
        none, or the tables of ``tune``), ``store`` (the cached tables' row store: built
        from the checkpoint's safetensors on first use, reused after; default in the user's
        cache directory, keyed by the checkpoint, never inside it: ``ROWCACHE_CACHE_DIR``),
        ``arena_bytes`` (the arenas' budget, split by rows) or ``tune`` (a ``rowcache tune
        --json`` report: slots per table), ``dtype`` (``"bf16"`` or ``"fp8"``), ``device``
        (``"cpu"`` or ``"cuda"``), ``defer_reads`` (a step does not wait for its rows'
        reads: see :meth:`settle`), ``allow_nonfinite`` (serve tables holding NaN or Inf,
        resident or cached; refused by default).
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
            defer_reads=defer_reads,
            allow_nonfinite=allow_nonfinite,
        )
        return cls(emb, overlay=overlay)

    def settle(self) -> None:
        """Commit the last forward's reads still running (``defer_reads``): wait for
        them on the host; raises a failed read's ``CorruptDataError`` (the caches as
        before that forward, whose output and all computed from it must be dropped). A
        no-op for an embedding that does not defer reads."""
        self.emb.settle()

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
            and self.overlay is None
            and attention_mask is None
            and seq_slot is None
            and active == -1
            and not isinstance(ngram_context, (list, tuple))
        ):
            out = self._forward_known(input_ids, ngram_context)
            if out is not None:
                return out
        if isinstance(input_ids, torch.Tensor):  # meta, nested: named before the device
            check_plain_tensor("input_ids", input_ids)
        if not isinstance(input_ids, torch.Tensor) or input_ids.is_cuda != cuda:
            where = input_ids.device if isinstance(input_ids, torch.Tensor) else "not a tensor"
            raise ConfigError(
                f"input_ids ({where}) must be a tensor on the embedding's device {self._device}"
            )
        if cuda and capturing():
            raise ConfigError(
                "TorchNgramEmbedding.forward is not capturable (it sizes its work on the host "
                "and may fault rows in): capture TorchNgramEmbedding.static_step(...) instead"
            )
        input_ids = check_token_ids("input_ids", input_ids, None, 2)
        if (seq_slot is not None or active != -1) and self.overlay is None:
            raise ConfigError("seq_slot/active route an overlay: build the module with overlay=")
        ctx = ngram_context
        rows = attention_mask is None and not isinstance(ctx, (list, tuple))
        if rows and ctx is not None:  # one [B, C] context: the rows step reads it in place
            ctx = check_token_ids("ngram_context", ctx, input_ids.device, 2)
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
        except (AttributeError, RuntimeError):  # not tensors, nested ones: forward names them
            return None
        if a is None or (ctx is not None and (b is None or b[1] != a[1] or b[2] != a[2])):
            return None
        index = a[1]
        if a[4] == 0 or capturing() or self._cp.cuda.runtime.getDevice() != index:
            return None  # (no rows, capturing, or another device: forward's checks say)
        raw = raw_stream(index)
        out = torch.empty(a[5], dtype=torch.bfloat16, device=a[3])
        # the tensors were checked when remembered: the embedding's step without its checks
        view = self._views.rows(out)
        cv, c = (None, 0) if b is None else (b[0], b[6])
        if self._cp.cuda.get_current_stream().ptr == raw:
            self.emb.embed_rows_prechecked(a[0], cv, c, view)
        else:
            with self._streams(raw, index):
                self.emb.embed_rows_prechecked(a[0], cv, c, view)
        return out

    def _remember(self, t: torch.Tensor, view: Any, index: int) -> None:
        """Record a checked int64 tensor's view for :meth:`_forward_known`."""
        if len(self._known) >= MAX_VIEWS:
            self._known.clear()
        key = (t.data_ptr(), t.shape, t.stride(), t.dtype)
        B, W = (int(x) for x in t.shape)
        # as ids: B * W rows and the output's shape; as a context: its look-back columns
        D, c = self.dims.hidden_size, min(W, self.dims.max_ngram - 1)
        self._known[key] = (view, index, B, t.device, B * W, (B, W, D), c)

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
        plan = torch_packed.plan(self.dims, ids, ctx, mask, cpu=not self._cuda)
        kw = self._overlay_kw(seq_slot, active, B)
        torch_packed.run(self.emb, plan, out, dest if plan.fill is None else None, None, kw)
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
        ragged contexts and masks the packed tokens of ``rowcache.embed.torch.packed``."""
        import cupy as cp

        raw = raw_stream(index)
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
                with self._streams(raw, index):
                    self.emb.embed_rows(*args, out=views(out), **kw)
            return out
        plan = torch_packed.plan(self.dims, ids, ctx, mask, cpu=not self._cuda)
        dest = views(out) if plan.fill is None else None
        kw = self._overlay_kw(seq_slot, active, B)
        if cp.cuda.get_current_stream().ptr == raw:
            torch_packed.run(self.emb, plan, out, dest, views, kw)
        else:
            with self._streams(raw, index):
                torch_packed.run(self.emb, plan, out, dest, views, kw)
        return out

    def _overlay_kw(self, seq_slot: Any, active: int, B: int) -> dict[str, Any]:
        if self.overlay is None:
            return {}
        return {"overlay": self.overlay, "active": active, "seq_slots": self._slots(seq_slot, B)}

    def _slots(self, seq_slot: Any, B: int) -> Any:
        """Adapter slots, one per row of the batch: host int32[B] (or None). The
        embedding repeats them over each row's positions (a CUDA tensor is copied to
        the host: B ints)."""
        if seq_slot is None:
            return None
        if isinstance(seq_slot, torch.Tensor):
            check_plain_tensor("seq_slot", seq_slot)
            seq_slot = seq_slot.cpu().numpy()
        arr = np.asarray(seq_slot)
        if arr.ndim == 0:
            arr = np.full(B, int(arr))
        if arr.shape != (B,) or arr.dtype.kind not in "iu":
            raise ConfigError(
                f"seq_slot must be an int or int[B={B}], got {arr.dtype}{list(arr.shape)}"
            )
        return arr.astype(np.int32)

    # --- CUDA graphs ------------------------------------------------------------
    def static_step(self, batch_size: int, seq_len: int, context_len: int = 0) -> Any:
        """A fixed-shape resident GPU step that ``torch.cuda.graph`` can capture.

        See :class:`TorchStaticStep`. Needs resident tables on the GPU (a cached table
        resolves rows on the host each step, which no graph can hold).
        """
        return TorchStaticStep(self.emb, batch_size, seq_len, context_len)


__all__ = ["TorchNgramEmbedding"]
