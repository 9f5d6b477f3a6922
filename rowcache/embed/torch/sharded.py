"""The sharded n-gram embedding as a ``torch.nn.Module``: one per rank of a tensor-parallel group.

Owns :class:`TorchShardedNgramEmbedding` (``forward(input_ids, ngram_context)`` as
``TorchNgramEmbedding``'s, over a :class:`rowcache.embed.sharded.ShardedNgramEmbedding`:
numpy views of CPU tensors, cupy views of CUDA tensors on torch's current stream).
Does not place, hash, gather or reduce (``rowcache.embed.sharded``).
"""

from __future__ import annotations

import numpy as np
import torch

from rowcache.embed.sharded import ShardedNgramEmbedding
from rowcache.embed.torch.views import (
    TensorViews,
    TorchStreams,
    check_plain_tensor,
    check_token_ids,
    cupy_view,
    raw_stream,
)
from rowcache.errors import ConfigError
from rowcache.kernels.reference import BF16


class TorchShardedNgramEmbedding(torch.nn.Module):
    """LongCat's ``ngram_embeddings`` module over one rank's :class:`ShardedNgramEmbedding`.

    Every rank of the embedding's group calls :meth:`forward` with the same tokens (a
    tensor-parallel engine gives every rank the whole batch): each rank returns the whole
    ``[B, L, hidden]`` embedding, the ranks' partial sums combined by one ``all_reduce``.
    The module holds no torch parameters and runs under no autograd.
    """

    def __init__(self, emb: ShardedNgramEmbedding) -> None:
        super().__init__()
        if not isinstance(emb, ShardedNgramEmbedding):
            raise ConfigError(
                f"TorchShardedNgramEmbedding wraps a ShardedNgramEmbedding, got {type(emb).__name__}"
            )
        self.emb = emb
        self.dims = emb.dims
        self._cuda = emb.device == "cuda"
        self._streams = TorchStreams()
        self._views = TensorViews()

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, ngram_context: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Embeddings of ``input_ids`` with their n-gram look-back.

        Parameters
        ----------
        input_ids : int64[B, L] (any integer dtype), on the embedding's device
        ngram_context : int64[B, C] or None
            The tokens before each row of ``input_ids``; only the last ``max_ngram - 1``
            are used. None: no look-back.

        Returns
        -------
        bfloat16[B, L, hidden_size] on ``input_ids``' device: ``(E0[x] + sum_i W_i
        E_i[id_i]) / (1 + T)`` within the tolerance of ``ShardedNgramEmbedding``.
        """
        dev = "cuda" if self._cuda else "cpu"
        if isinstance(input_ids, torch.Tensor):  # meta, nested: named before the device
            check_plain_tensor("input_ids", input_ids)
        if not isinstance(input_ids, torch.Tensor) or input_ids.is_cuda != self._cuda:
            where = input_ids.device if isinstance(input_ids, torch.Tensor) else "not a tensor"
            raise ConfigError(f"input_ids ({where}) must be a tensor on the embedding's {dev}")
        ids = check_token_ids("input_ids", input_ids, None, 2)
        ctx = None
        if ngram_context is not None:
            ctx = check_token_ids("ngram_context", ngram_context, input_ids.device, 2)
            if ctx.shape[0] != ids.shape[0]:
                raise ConfigError(
                    f"ngram_context has {ctx.shape[0]} rows, input_ids {ids.shape[0]}: "
                    "one context per row"
                )
        B, L = (int(x) for x in ids.shape)
        D = self.dims.hidden_size
        if not self._cuda:
            host = np.empty((B, L, D), dtype=np.int16)
            self.emb.embed_rows(
                ids.numpy(),
                None if ctx is None else ctx.numpy(),
                out=host.reshape(B * L, D).view(BF16),
            )
            return torch.from_numpy(host).view(torch.bfloat16)
        out = torch.empty((B, L, D), dtype=torch.bfloat16, device=ids.device)
        index = ids.get_device()
        with self._streams(raw_stream(index), index):
            self.emb.embed_rows(
                cupy_view(ids),
                None if ctx is None else cupy_view(ctx),
                out=self._views.rows(out),
            )
        return out


__all__ = ["TorchShardedNgramEmbedding"]
