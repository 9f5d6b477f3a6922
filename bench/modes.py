"""The judges' modelled server: the layers around a step's lookups, its modes, its history.

Owns :class:`Model` (the layers of a model as spun time: a device kernel on the GPU, a busy
loop on the CPU), :class:`Mode` (decode xB or prefill chunks of real text, each step's tokens
and look-back), :func:`parse_mode` / :func:`plan_modes` (the modes on their own slices of the
text after the history), :class:`History` (the text a server served before the timed modes,
its rows a chunk at a time, and the rows an LRU arena holds after it: :meth:`History.lru_end`)
and :func:`run_series` (one series timed over a mode's steps). ``bench/engram.py``,
``bench/engram_v41.py`` and ``bench/qwen4.py`` share them; what a lookup reads is theirs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from rowcache.errors import ConfigError


def _spin_kernel(cp: Any) -> Any:
    return cp.RawKernel(
        r"""
extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}""",
        "spin",
    )


class Model:
    """The layers around the lookups, as time on the device (or the host on the CPU)."""

    def __init__(self, device: str, layer_us: float, token_us: float, layers: int) -> None:
        self.device, self.layer_us, self.token_us, self.layers = device, layer_us, token_us, layers
        self._cp: Any = None
        if device == "cuda":
            import cupy as cp

            self._cp = cp
            self._spin = _spin_kernel(cp)

    def run(self, layers: int, tokens: int) -> None:
        us = layers * (self.layer_us + self.token_us * tokens)
        if us <= 0:
            return
        if self._cp is None:
            end = time.perf_counter() + us * 1e-6
            while time.perf_counter() < end:
                pass
        else:
            self._spin((1,), (1,), (np.uint64(int(us * 1e3)),))

    def sync(self) -> None:
        if self._cp is not None:
            self._cp.cuda.get_current_stream().synchronize()


def next_context(h: Any, tokens: np.ndarray, context: np.ndarray) -> np.ndarray:
    """int64 ``[B, keep]``: the look-back after ``tokens`` of a hash ``h`` (an ``EngramHash``
    or ``Qwen4NgramHash``: its ``keep`` and ``padded``)."""
    return np.ascontiguousarray(h.padded(tokens, context)[:, -h.keep :])


@dataclass
class Mode:
    """One mode's steps: ``B`` streams of ``T`` tokens a step, ``steps`` steps of which the
    first ``start`` run untimed, on ``toks`` (int64 ``[B, steps * T]``)."""

    name: str
    B: int
    T: int
    steps: int
    start: int  # the first timed step
    toks: np.ndarray  # int64 [B, steps * T]

    def pieces(self, h: Any, fill: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each step's (tokens [B, T], context [B, keep]); ``fill`` (the hash's pad or EOS
        token) before the streams' start."""
        ctx = np.full((self.B, h.keep), fill, dtype=np.int64)
        out = []
        for s in range(self.steps):
            p = np.ascontiguousarray(self.toks[:, s * self.T : (s + 1) * self.T])
            out.append((p, ctx))
            ctx = next_context(h, p, ctx)
        return out

    @property
    def prefill(self) -> bool:
        return self.T > 1


def parse_mode(name: str, chunk: int) -> tuple[str, int, int]:
    """``(name, B, T)`` of ``"decode xB"``, ``"prefill N"`` or ``"prefill"`` (``chunk``)."""
    name = name.strip()
    if name == "prefill":
        name = f"prefill {chunk}"
    kind, _, n = name.partition(" ")
    try:
        k = int(n.lstrip("x"))
    except ValueError:
        k = 0
    if kind not in ("decode", "prefill") or k < 1:
        raise ConfigError(f"--modes {name!r}: give 'decode xB' or 'prefill N' (or 'prefill')")
    return name, (k if kind == "decode" else 1), (1 if kind == "decode" else k)


def mode_tokens(names: list[str], tokens: int, max_steps: int, chunk: int) -> int:
    """Tokens of text the modes ``names`` take (:func:`plan_modes`'s steps)."""
    total = 0
    for raw in names:
        _, B, T = parse_mode(raw, chunk)
        total += max(4, min(max_steps, tokens // (B * T))) * B * T
    return total


def plan_modes(
    names: list[str],
    text: np.ndarray,
    history: int,
    tokens: int,
    max_steps: int,
    warm: float,
    chunk: int,
) -> list[Mode]:
    """Each mode's steps on its own slice of the text after the history."""
    at, out = history, []
    for raw in names:
        name, B, T = parse_mode(raw, chunk)
        steps = max(4, min(max_steps, tokens // (B * T)))
        n = steps * B * T
        if at + n > text.size:
            raise ConfigError(f"the text has {text.size:,} tokens; mode {name} needs {at + n:,}")
        out.append(
            Mode(
                name,
                B,
                T,
                steps,
                max(1, int(warm * steps)),
                text[at : at + n].reshape(B, steps * T),
            )
        )
        at += n
    return out


class History:
    """The text a server served before the timed modes, one stream in chunks of ``per``
    tokens (a chunk one step of the history): chunk ``i``'s rows are ``rows_of(tokens [1,
    per], context [1, keep])`` (int64, any shape: the global rows of every table a position
    reads), its look-back the ``keep`` tokens before it (``fill`` before the text).

    Chunks are hashed when asked (:meth:`chunk`), in any order, so that a history of
    millions of tokens is never held as rows."""

    def __init__(
        self,
        h: Any,
        tokens: np.ndarray,
        fill: int,
        rows_of: Callable[[np.ndarray, np.ndarray], Any],
        per: int = 4096,
    ) -> None:
        if per < h.keep:
            raise ConfigError(f"history chunks of {per} tokens: at least the look-back's {h.keep}")
        self.tokens, self.keep, self.fill, self.per = tokens, int(h.keep), fill, per
        self.rows_of = rows_of

    def __len__(self) -> int:
        return -(-self.tokens.size // self.per)

    def chunk(self, i: int) -> np.ndarray:
        """int64: chunk ``i``'s distinct rows, sorted."""
        a = i * self.per
        p = np.ascontiguousarray(self.tokens[a : a + self.per][None])
        ctx = np.full((1, self.keep), self.fill, dtype=np.int64)
        back = self.tokens[max(0, a - self.keep) : a]
        if back.size:
            ctx[0, self.keep - back.size :] = back
        return np.unique(np.asarray(self.rows_of(p, ctx)))

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self.chunk(i) for i in range(len(self)))

    def lru_end(self, slots: int, rows: int) -> list[np.ndarray]:
        """The rows an LRU arena of ``slots`` rows holds after the history, as the cache's
        exact batch LRU (a chunk one batch, its rows touched in ascending order) leaves
        them: per chunk, oldest first, the rows whose last use was that chunk, sorted
        (``rows``: the global rows' range, for a bitmap of those seen).

        Found from the end backwards: each chunk's rows not used later, until ``slots``
        rows; of the oldest chunk kept only its highest rows (touched last within it). So
        a cache that reads these rows and then touches each list in order (a prefetch each:
        ``NgramRowCache.prefetch`` touches resident rows most recently used) holds what
        serving the history chunk by chunk would have left, without reading a row twice."""
        seen = np.zeros(rows, dtype=bool)
        kept: list[np.ndarray] = []
        n = 0
        for i in range(len(self) - 1, -1, -1):
            if n >= slots:
                break
            r = self.chunk(i)
            r = r[~seen[r]]
            seen[r] = True
            if n + r.size > slots:
                r = r[r.size - (slots - n) :]  # the highest: ties go by row id
            kept.append(r)
            n += r.size
        return [r for r in reversed(kept) if r.size]


def run_series(
    lookups: list[tuple[int, Callable[[Any, Any], Any]]],
    mode: Mode,
    steps: list,
    model: Model,
    layers: int,
    *,
    prefetch: Any = None,
    end: Any = None,
    peek: Any = None,
    at_start: Any = None,
    prefetch_own: bool = True,
) -> dict[str, Any]:
    """Time a mode's steps: tokens/s of the timed steps and ms from a step's start to each
    lookup's return (``ready_ms`` the first's: the window a series needs before its first
    lookup; ``ready_ms_each`` every lookup's).

    ``lookups``: ``(layer, lookup(tokens, context))`` in layer order: the lookup runs after
    the model's first ``layer`` layers, the step ends after ``layers``. ``prefetch(tokens,
    context)`` at the step's start (and, in prefill, for the next chunk too, a step ahead),
    ``end()`` after the step, ``peek(tokens, context, next)`` before it (untimed),
    ``at_start()`` when the timed steps begin (after a sync). ``prefetch_own=False``: only
    the next chunk is prefetched (prefill), never the step's own rows at its start (what
    a lookup one layer after the step's start wants: a prefetch costs more than that window
    hides, docs/qwen4.md)."""
    n = mode.B * mode.T
    total = 0.0
    ready = np.zeros(len(lookups))
    for s, (piece, ctx) in enumerate(steps):
        if s == mode.start:
            model.sync()
            total, ready[:] = 0.0, 0.0
            if at_start is not None:
                at_start()
        ahead = steps[s + 1] if mode.prefill and s + 1 < len(steps) else None
        if peek is not None and s >= mode.start:
            peek(piece, ctx, ahead if prefetch is not None else None)  # untimed
        t0 = time.perf_counter()
        if prefetch is not None:
            if prefetch_own:
                prefetch(piece, ctx)
            if ahead is not None:
                prefetch(*ahead)  # the next chunk, a step ahead
        done = 0
        for k, (layer, lookup) in enumerate(lookups):
            model.run(layer - done, n)
            done = layer
            lookup(piece, ctx)
            ready[k] += time.perf_counter() - t0
        model.run(layers - done, n)
        model.sync()
        if end is not None:
            end()
        total += time.perf_counter() - t0
    timed = mode.steps - mode.start
    each = [float(1e3 * r / timed) for r in ready]
    return {"tok_s": timed * n / total, "ready_ms": each[0], "ready_ms_each": each}
