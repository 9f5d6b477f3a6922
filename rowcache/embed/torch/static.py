"""A fixed-shape resident GPU step of the torch module, capturable in a CUDA graph.

Owns :class:`TorchStaticStep` (what ``TorchNgramEmbedding.static_step`` returns, made from
the module's ``NgramEmbedding``, so this module does not import the torch module): the
tokens packed into a device buffer by torch copies, a copy into the step's pinned input,
then ``NgramEmbedding.static_step``'s upload, fused hash + gathers, GEMM and scaled sum
into one output tensor, all stream-ordered and allocation-free. Does not run the eager
forward (``rowcache.embed.torch.module``).
"""

from __future__ import annotations

import numpy as np
import torch

from rowcache.embed.layer import NgramEmbedding
from rowcache.embed.ngram.batch import NgramBatch
from rowcache.embed.torch.views import TorchStreams, capturing, check_plain_tensor, raw_stream
from rowcache.errors import ConfigError

_D2H = 2  # cudaMemcpyDeviceToHost


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
        self, emb: NgramEmbedding, batch_size: int, seq_len: int, context_len: int = 0
    ) -> None:
        self._streams = TorchStreams()  # cupy's view of torch's current stream
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
        self.emb, self.shape = emb, (B, L, c)
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
        for name, t in (("input_ids", input_ids), ("ngram_context", ngram_context)):
            if isinstance(t, torch.Tensor):  # meta, nested: named, not torch's internal error
                check_plain_tensor(name, t)
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
        if self.runs == 0 and capturing():
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
        index = input_ids.get_device()
        stream = self._streams(raw_stream(index), index)
        cp.cuda.runtime.memcpyAsync(
            self._host.ctypes.data, self._dev.data_ptr(), self._dev.numel() * 8, _D2H, stream.ptr
        )
        with cp.cuda.Device(index), stream:
            self._step.issue()
        self.runs += 1
        return self.out


__all__ = ["TorchStaticStep"]
