"""The PyTorch module of Engram's memory: a layer's ``e`` as a bfloat16 tensor, no copy.

Owns :class:`TorchEngramMemory` (an ``nn.Module`` over an
:class:`~rowcache.embed.engram.memory.EngramMemory`). The same zero-copy rules as
``TorchNgramEmbedding``: the output tensor is made by torch and written in place (a NumPy
view of a CPU tensor; a cupy view of a CUDA tensor, the gathers run on torch's current
stream); the token ids are read on the host (the hash is a host kernel: a server holds its
step's tokens there). Importing it imports torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rowcache.embed.engram.memory import EngramMemory, EngramPrefetch
from rowcache.embed.torch.views import (
    TorchStreams,
    capturing,
    check_token_ids,
    cupy_view,
    raw_stream,
)
from rowcache.errors import ConfigError
from rowcache.kernels.reference import BF16


def _host_ids(name: str, t: Any) -> np.ndarray:
    t = check_token_ids(name, t, None, 2)
    return t.detach().cpu().numpy()


class TorchEngramMemory(torch.nn.Module):
    """Engram's lookup as a module: ``forward(layer_id, input_ids, context)``.

    Parameters
    ----------
    memory : EngramMemory (its tables on the CPU for CPU tensors, on the GPU for CUDA ones).

    Examples
    --------
    >>> mem = TorchEngramMemory(EngramMemory(h, {1: t1, 15: t15}))
    >>> mem.prefetch(input_ids, context)          # at the step's start
    >>> e = mem(1, input_ids, context)            # bf16 [B, L, output_dim], at layer 1
    >>> mem.end_step()                            # after the step
    """

    def __init__(self, memory: EngramMemory) -> None:
        super().__init__()
        if not isinstance(memory, EngramMemory):
            raise ConfigError(f"memory must be an EngramMemory, got {type(memory).__name__}")
        self.memory = memory
        self._cuda = memory.device == "cuda"
        self._streams = TorchStreams()

    def prefetch(
        self, input_ids: torch.Tensor, context: torch.Tensor | None = None
    ) -> EngramPrefetch:
        """Start every layer's reads of the step (``EngramMemory.prefetch``)."""
        ctx = None if context is None else _host_ids("context", context)
        return self.memory.prefetch(_host_ids("input_ids", input_ids), ctx)

    def forward(
        self, layer_id: int, input_ids: torch.Tensor, context: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Layer ``layer_id``'s ``e``: bfloat16 ``[B, L, output_dim]`` on the memory's device.

        ``input_ids`` int [B, L] (any device: read on the host); ``context`` int [B, C], the
        tokens before them (the last ``max_ngram - 1`` used), or None at the sequences' start.
        """
        ids = _host_ids("input_ids", input_ids)
        ctx = None if context is None else _host_ids("context", context)
        B, L = ids.shape
        device = torch.device("cuda", torch.cuda.current_device()) if self._cuda else "cpu"
        out = torch.empty((B, L, self.memory.output_dim), dtype=torch.bfloat16, device=device)
        if not self._cuda:
            self.memory.lookup(layer_id, ids, ctx, out=out.view(torch.int16).numpy().view(BF16))
            return out
        if capturing():
            raise ConfigError("TorchEngramMemory.forward is not capturable (it may fault rows in)")
        import cupy as cp

        view = cupy_view(out.view(torch.int16)).view(BF16)
        index = out.get_device()
        raw = raw_stream(index)
        if cp.cuda.get_current_stream().ptr == raw:
            self.memory.lookup(layer_id, ids, ctx, out=view)
        else:
            with self._streams(raw, index):
                self.memory.lookup(layer_id, ids, ctx, out=view)
        return out

    def end_step(self) -> None:
        """Unpin the step's rows (``EngramMemory.end_step``), after its lookups were issued."""
        self.memory.end_step()
