"""The PyTorch drop-in of Qwen3.8-Flash-Next's n-gram embedding, its table from a row cache.

Owns :class:`TorchQwen4NgramEmbedding`: transformers' ``Qwen4ExpTextNGramEmbedding`` (5.25)
with its ``forward(input_ids, cache)``, its output (bf16 ``[B, T, ple_embed_dim]`` on the
input's device) and its use of the model's cache (the last ``ngram_size - 1`` raw tokens in
``conv_state`` index 2 of its layer, EOS-padded as the reference pads them), over a
:class:`~rowcache.embed.qwen4.memory.Qwen4NgramMemory` (the table resident or behind a row
cache). It holds no table parameter. Importing it imports torch.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from rowcache.embed.qwen4.memory import Qwen4NgramMemory
from rowcache.embed.torch.views import (
    TorchStreams,
    capturing,
    check_token_ids,
    cupy_view,
    raw_stream,
)
from rowcache.errors import ConfigError
from rowcache.kernels.reference import BF16

REFERENCE_CLASS = "Qwen4ExpTextNGramEmbedding"
"""transformers' class this module stands in for (``transformers.monkey_patching`` name)."""


class TorchQwen4NgramEmbedding(torch.nn.Module):
    """Qwen4's n-gram embedding as the reference module: ``forward(input_ids, cache)``.

    Parameters
    ----------
    memory : Qwen4NgramMemory (its table on the CPU, or on the GPU for CUDA inputs).
    layer_idx : the 0-based decoder layer whose cache state it reads and updates (the
        reference's ``layer_idx``); default ``ple_layer_ids[table] - 1`` of the memory's hash.

    Examples
    --------
    >>> emb = TorchQwen4NgramEmbedding.from_pretrained("ckpt/", arena="4GiB")
    >>> model.model.layers[emb.layer_idx].ple.ple_embedding = emb
    >>> model.generate(input_ids, max_new_tokens=32)      # the same tokens as resident

    Each forward ends the memory's step after its gathers (``Qwen4NgramMemory.end_step``).
    Besides the reference's buffers (``layer_multipliers``, ``ngram_heads_vocab_sizes``,
    ``ngram_heads_offsets``: the hash's, so a checkpoint's load into them) it has no state.
    """

    def __init__(self, memory: Qwen4NgramMemory, layer_idx: int | None = None) -> None:
        super().__init__()
        if not isinstance(memory, Qwen4NgramMemory):
            raise ConfigError(f"memory must be a Qwen4NgramMemory, got {type(memory).__name__}")
        h = memory.hash
        cfg = h.config
        if layer_idx is None:
            layer_idx = h.layer_id - 1
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or layer_idx < 0:
            raise ConfigError(f"layer_idx={layer_idx!r}: give the 0-based decoder layer (an int)")
        self.memory = memory
        self.layer_idx = layer_idx
        # the reference's attributes, as its _init_weights and users read them
        self.ngram_size = cfg.ngram_size
        self.context_len = cfg.ngram_size - 1
        self.heads_per_ngram = cfg.heads_per_ngram
        self.ngram_heads = cfg.heads
        self.ple_layer_index = h.table
        self.unigram_vocab_size = cfg.vocab_size
        self.ngram_vocab_size_base = cfg.ngram_vocab_size_base
        self.seed = cfg.seed
        self.eos_token_id = cfg.eos_token_id
        self.head_vocab_sizes = [int(p) for p in h.primes]
        self.head_offsets = [int(o) for o in h.offsets]
        self.total_vocab_size = int(np.sum(h.primes))
        self.layer_multipliers = torch.nn.Buffer(torch.tensor(h.multipliers, dtype=torch.long))
        self.ngram_heads_vocab_sizes = torch.nn.Buffer(
            torch.tensor(self.head_vocab_sizes, dtype=torch.long)
        )
        self.ngram_heads_offsets = torch.nn.Buffer(
            torch.tensor(self.head_offsets, dtype=torch.long)
        )
        self._cuda = memory.device == "cuda"
        self._streams = TorchStreams()

    @classmethod
    def from_pretrained(
        cls,
        checkpoint: str | os.PathLike[str],
        *,
        store: str | os.PathLike[str] | None = None,
        slots: int | None = None,
        arena: int | str | float | None = None,
        device: str = "cpu",
        layer: int | None = None,
        config: Any = None,
        progress: bool | None = None,
        engine: str = "auto",
    ) -> TorchQwen4NgramEmbedding:
        """The module of a ``qwen4_exp`` checkpoint's n-gram table, served from a store.

        Parameters
        ----------
        checkpoint : the checkpoint directory (``config.json``, ``model.safetensors.index.json``
            and shards, or one ``model.safetensors``), or its index or file; or a Hugging Face
            repo id, resolved through ``huggingface_hub`` as transformers does (the Hugging
            Face cache where there is no network).
        store : the store directory (default: in the user's cache directory, keyed by the
            checkpoint, never inside it: ``ROWCACHE_CACHE_DIR``): built from the checkpoint
            when it does not exist yet (streamed, with progress), else opened and checked
            against the config. A place a store cannot be built is a ``ConfigError`` naming
            ``store=``.
        slots, arena : the arena's rows, or its size (bytes, ``"4GiB"``, or a fraction of the
            table's rows); default a quarter of the rows.
        device : ``"cpu"`` or ``"cuda"``: the arena's.
        layer : the 1-based decoder layer of the table (default ``ple_layer_ids[0]``).
        config : a ``Qwen4NgramConfig`` (default: from ``config.json``).
        engine : the store reader's engine (``load_qwen4_memory``): ``"uring+threads"`` on a
            multi-queue virtio disk like the H100 VM's (docs/qwen4.md, "The read engine").
        """
        from rowcache.embed.qwen4.checkpoint import load_qwen4_memory

        memory = load_qwen4_memory(
            checkpoint,
            store=store,
            slots=slots,
            arena=arena,
            device=device,
            config=config,
            layer=layer,
            progress=progress,
            engine=engine,
        )
        return cls(memory)

    @classmethod
    def patch_mapping(cls, checkpoint: str | os.PathLike[str], **kwargs: Any) -> dict[str, type]:
        """``{"Qwen4ExpTextNGramEmbedding": class}`` for ``transformers.monkey_patching``'s
        ``apply_patches`` (or ``register_patch_mapping``): while it applies, the model
        transformers builds in ``from_pretrained`` holds this module, made by
        :meth:`from_pretrained` ``(checkpoint, layer=..., **kwargs)``, in place of the
        reference's, so the n-gram table is never materialized (its checkpoint tensors load
        into nothing: transformers reports them as unexpected and never reads them)."""
        from rowcache.embed.qwen4.checkpoint import load_qwen4_memory

        base = cls
        path = os.fspath(checkpoint)
        options = dict(kwargs)

        class TorchQwen4NgramEmbeddingPatched(base):  # type: ignore[valid-type, misc]
            """``TorchQwen4NgramEmbedding`` built by the reference's constructor call."""

            def __init__(
                self, config: Any, embedding_dim: int, layer_idx: int, ple_layer_index: int = 0
            ) -> None:
                memory = load_qwen4_memory(path, layer=layer_idx + 1, **options)
                if memory.output_dim != embedding_dim:
                    raise ConfigError(
                        f"{path}: the n-gram table's rows give {memory.output_dim} values a "
                        f"position; the model's ple_embed_dim is {embedding_dim}"
                    )
                base.__init__(self, memory, layer_idx)

        return {REFERENCE_CLASS: TorchQwen4NgramEmbeddingPatched}

    def forward(self, input_ids: torch.Tensor, cache: Any = None, **kwargs: Any) -> torch.Tensor:
        """The n-gram embedding of ``input_ids``: bfloat16 ``[B, T, ple_embed_dim]`` on the
        input's device.

        ``input_ids`` int ``[B, T]``; ``cache`` the model's cache (a ``DynamicCache``) or None.
        As the reference: the tokens before ``input_ids`` are its layer's ``conv_state``
        index 2 (none: EOS), which is then updated with ``input_ids`` (EOS-padded on the left
        when a first input is shorter than ``ngram_size - 1``).
        """
        ids_t = check_token_ids("input_ids", input_ids, None, 2)
        cached_ctx = (
            cache.get_conv_state(self.layer_idx, state_idx=2) if cache is not None else None
        )
        # a copy: the update below writes the cache's state in place (as the reference clones)
        ctx = (
            None
            if cached_ctx is None
            else cached_ctx.detach().to("cpu", torch.int64).numpy().copy()
        )
        if cache is not None:
            to_cache = ids_t
            if cached_ctx is None and ids_t.shape[1] < self.context_len:
                to_cache = torch.nn.functional.pad(
                    to_cache, (self.context_len - ids_t.shape[1], 0), value=self.eos_token_id
                )
            cache.update_conv_state(
                to_cache, self.layer_idx, state_idx=2, conv_kernel_size=self.context_len
            )
        ids = ids_t.detach().cpu().numpy()
        out = self._lookup(ids, ctx)
        self.memory.end_step()  # after the step's gathers (on the GPU: issued on its stream)
        return out if out.device == input_ids.device else out.to(input_ids.device)

    def _lookup(self, ids: np.ndarray, ctx: np.ndarray | None) -> torch.Tensor:
        B, T = ids.shape
        dim = self.memory.output_dim
        if not self._cuda:
            out = torch.empty((B, T, dim), dtype=torch.bfloat16)
            self.memory.lookup(ids, ctx, out=out.view(torch.int16).numpy().view(BF16))
            return out
        if capturing():
            raise ConfigError(
                "TorchQwen4NgramEmbedding.forward is not capturable (it may fault rows in)"
            )
        import cupy as cp

        device = torch.device("cuda", torch.cuda.current_device())
        out = torch.empty((B, T, dim), dtype=torch.bfloat16, device=device)
        view = cupy_view(out.view(torch.int16)).view(BF16)
        index = out.get_device()
        raw = raw_stream(index)
        if cp.cuda.get_current_stream().ptr == raw:
            self.memory.lookup(ids, ctx, out=view)
        else:
            with self._streams(raw, index):
                self.memory.lookup(ids, ctx, out=view)
        return out

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, {self.memory!r}"


__all__ = ["REFERENCE_CLASS", "TorchQwen4NgramEmbedding"]
