"""The PyTorch adapter's packed forward: ragged contexts and attention masks.

Owns :func:`plan` (a forward whose rows cannot be read in place, packed into one token
array by ``torch.cat``: a list of per-row contexts, or a mask whose padding leaves
each row's real tokens only) and :func:`run` (that array embedded by
``NgramEmbedding.embed_packed``, padded positions zero). The common forward, one
``[B, C]`` context without a mask, is ``rowcache.embed.torch.module``'s rows step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from rowcache.embed.layer import NgramEmbedding
from rowcache.embed.ngram.batch import NgramBatch
from rowcache.embed.ngram.dims import NgramDims
from rowcache.embed.torch.views import check_plain_tensor, check_token_ids
from rowcache.errors import ConfigError
from rowcache.kernels.reference import BF16


class Plan(NamedTuple):
    """One forward's packed input: ``tokens`` (numpy on the CPU, a tensor on the GPU),
    ``ctx_lens``/``seq_lens`` int64[B] and, for padded rows, ``fill`` bool[B, L]."""

    tokens: Any
    ctx_lens: np.ndarray
    seq_lens: np.ndarray
    fill: torch.Tensor | None


def plan(
    dims: NgramDims, ids: torch.Tensor, ctx: Any, mask: torch.Tensor | None, cpu: bool
) -> Plan:
    """The packed step of a forward with ragged contexts or a mask: tokens (numpy
    on the CPU, a tensor on the GPU: ``torch.cat``), per-row lengths and, for padded
    rows, which output positions the packed rows fill."""
    B, L = ids.shape
    keep = dims.max_ngram - 1
    if isinstance(ctx, (list, tuple)):  # ragged contexts: one concatenation
        if len(ctx) != B:
            raise ConfigError(f"ngram_context has {len(ctx)} rows, input_ids {B}")
        if mask is not None:
            raise ConfigError("attention_mask goes with a [B, C] ngram_context, not a list")
        dev = ids.device
        rows = [
            check_token_ids(f"ngram_context[{b}]", c, dev, 1)[-keep:] for b, c in enumerate(ctx)
        ]
        clens = np.fromiter((r.shape[0] for r in rows), dtype=np.int64, count=B)
        tokens = torch.cat([t for b in range(B) for t in (rows[b], ids[b])])
        return Plan(tokens.numpy() if cpu else tokens, clens + L, np.full(B, L), None)
    c = 0
    if ctx is not None:
        ctx = check_token_ids("ngram_context", ctx, ids.device, 2)
        if ctx.shape[0] != B:
            raise ConfigError(
                f"ngram_context has {ctx.shape[0]} rows, input_ids {B}: one context per row"
            )
        c = min(int(ctx.shape[1]), keep)
    valid = None if mask is None else _valid(mask, B, L, c)
    tokens = ids if c == 0 else torch.cat([ctx[:, ctx.shape[1] - c :], ids], dim=1)
    if valid is not None:  # some token is padding: pack the real ones only
        host = valid.cpu().numpy()
        return Plan(
            tokens.numpy()[host] if cpu else tokens[valid],
            host.sum(axis=1, dtype=np.int64),
            host[:, c:].sum(axis=1, dtype=np.int64),
            valid[:, c:],
        )
    tokens = tokens.reshape(-1)
    return Plan(tokens.numpy() if cpu else tokens, np.full(B, c + L), np.full(B, L), None)


def _valid(mask: torch.Tensor, B: int, L: int, c: int) -> torch.Tensor | None:
    """``[B, c + L]`` bool of the real tokens, or None when all are real."""
    if isinstance(mask, torch.Tensor):
        check_plain_tensor("attention_mask", mask)
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


def run(
    emb: NgramEmbedding, p: Plan, out: torch.Tensor, dest: Any, view: Any, kw: dict[str, Any]
) -> None:
    """Embed plan ``p`` into ``out`` by ``emb.embed_packed(..., **kw)``: ``dest`` is the
    numpy/cupy view of its rows (None for padded rows: packed rows are embedded into a
    scratch tensor, then scattered to the real positions), ``view`` makes the tokens'
    cupy view (None on the CPU)."""
    fill, D = p.fill, out.shape[-1]
    tokens = p.tokens
    if isinstance(tokens, torch.Tensor):
        tokens = view(tokens.contiguous())
    scratch = None
    if dest is None:
        scratch = out.new_empty((int(p.seq_lens.sum()), D))
        dest = view(scratch) if view is not None else scratch.view(torch.int16).numpy().view(BF16)
    batch = NgramBatch(emb.dims, tokens, p.ctx_lens, p.seq_lens)
    emb.embed_packed(batch, out=dest, **kw)
    if fill is not None:
        assert scratch is not None  # fill is set only with dest None (plan)
        out.zero_()
        out[fill] = scratch


__all__ = ["Plan", "plan", "run"]
