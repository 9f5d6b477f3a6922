"""Graph replay of the GPU embedding step, and :class:`StaticStep`.

Owns the mixin :class:`GraphStep` (``cuda_graphs=True``: a step per shape replayed
from a CUDA graph, cached rows resolved on the host meanwhile; and
``NgramEmbedding.static_step``) and :class:`StaticStep`, the resident step on fixed
buffers (``rowcache.embed.step.device.DeviceStep``) a server captures into its own graph.
"""

from __future__ import annotations

from typing import Any

from rowcache.embed.ngram.batch import NgramBatch
from rowcache.embed.step.device import DeviceStep, StepShape, pack_upload
from rowcache.errors import ConfigError
from rowcache.kernels.gemm import gemm_bf16_f32_parts, project_and_sum, scale_sum
from rowcache.kernels.reference import BF16


class GraphStep:
    """Graph replay of :class:`rowcache.embed.layer.NgramEmbedding`'s step (a mixin)."""

    dims: Any
    device: str
    word: Any
    tables: list[Any]
    _xp: Any
    _wcat: Any
    _groups: list[Any]
    _graphs: dict[tuple[int, int, bool], StaticStep]

    def _run_graph(self, batch: NgramBatch, out: Any) -> Any:
        """A step replayed from a CUDA graph per (tokens, rows, multi) shape: upload,
        hash + gathers (cached tables through their device maps) and the GEMM in the
        graph, the scaled sum eagerly after it into a fresh output (or ``out``), so
        results behave as on the eager path; cached rows resolved on the host once
        both are queued (graph and sum run again after a fault; after a step that
        faulted, resolved first and run once: ``CachedGroups._verified``). The first
        call of a shape runs eagerly into the shape's own buffers (compiling the
        kernels, loading cuBLAS's), the second captures, later ones replay.
        """
        key = (batch.length, batch.n, batch.num_seqs > 1)
        step = self._graphs.get(key)
        if step is None:
            step = self._graphs[key] = StaticStep(self, key, with_sum=False)
        step.load(batch)
        if out is None:
            out = self._xp.empty((batch.n, self.dims.hidden_size), dtype=BF16)
        scale = float(1 + self.dims.num_tables)

        def device_part() -> None:  # the sum queued before the host resolve, as eagerly
            step.launch()
            scale_sum(step.words, step.proj, scale, out=out)

        try:
            self._verified(batch, device_part)  # resolve after (or first, after a fault)
        finally:
            self._end_batches()
        return out

    def static_step(self, batch: NgramBatch) -> StaticStep:
        """A resident GPU step of ``batch``'s shape on fixed buffers, for CUDA graphs.

        For servers that replay their whole decode step from one graph: the returned
        :class:`StaticStep` holds pinned input, device staging and output buffers;
        ``load(batch)`` refills the input on the host, ``launch()`` replays the
        captured upload, hash + gathers, GEMM and scaled sum into ``.out``, and
        ``issue()`` queues the same work on the current stream (to capture it inside
        a larger graph). ``batch`` (host tokens) is loaded; the first ``launch()`` runs
        eagerly, the second captures. Needs resident tables on the GPU and
        ``fused=True`` (cached tables need their rows resolved on the host each step).
        """
        if not self._fused_ids or self._groups:
            raise ConfigError(
                "static_step needs resident tables on the GPU and fused=True "
                f"(this embedding: device {self.device!r}, tables "
                f"{[t.kind for t in (self.word, *self.tables)]})"
            )
        if not isinstance(batch, NgramBatch) or batch.on_device:
            raise ConfigError("static_step takes an NgramBatch of host tokens")
        if batch.dims != self.dims:
            raise ConfigError("the NgramBatch was built for other NgramDims")
        step = StaticStep(self, (batch.length, batch.n, batch.num_seqs > 1), with_sum=True)
        step.load(batch)
        return step

    def _issue_step(self, step: StaticStep) -> None:
        """``step``'s work on the current stream (capturable): upload, hash + gathers,
        GEMM, and with ``step.with_sum`` the scaled sum into ``step.out``."""
        self._upload_gather(step.buf, step.buf.hosts[0], step.shape, step.stack, step.words)
        if step.with_sum:
            project_and_sum(
                step.stack,
                self._wcat,
                step.words,
                proj=step.proj,
                out=step.out,
                denom=float(1 + self.dims.num_tables),
            )
        else:  # the sum comes after the host resolve, outside the graph (cached tables)
            gemm_bf16_f32_parts(step.stack, self._wcat, out=step.proj)


class StaticStep:
    """A resident GPU embedding step on fixed buffers, replayed from a CUDA graph.

    Made by :meth:`NgramEmbedding.static_step` (and used inside ``cuda_graphs=True``).
    Everything a captured graph points at lives here: the pinned upload buffer, the
    device tokens, the stacked rows ``stack`` bfloat16[n, T*d], the word rows ``words``
    bfloat16[n, D], the projection ``proj`` float32[n, D] and, with ``with_sum``, the
    output ``out`` bfloat16[n, D]. The shape (tokens, rows, several sequences) is
    fixed; the tables, projections and token values are not baked in beyond their
    addresses.

    Use: ``load(batch)`` (host only: waits until the previous launch has copied the
    pinned buffer, then packs the batch into it), ``launch()`` (the first launch
    runs eagerly, compiling kernels and loading cuBLAS's; the second captures; later
    ones replay), read ``out``. ``issue()`` queues the same work on the current
    stream, e.g. inside a capture of a larger graph.
    """

    def __init__(self, emb: GraphStep, key: tuple[int, int, bool], *, with_sum: bool) -> None:
        L, n, multi = key
        self._emb = emb
        self.shape = StepShape(L, n, multi)
        self.with_sum = with_sum
        dims = emb.dims
        self.buf = DeviceStep(emb._xp, dims.num_tables, L, n, emb._staging_shapes(n), out=with_sum)
        self.stack: Any = self.buf.stack
        self.proj: Any = self.buf.proj
        self.words: Any = self.buf.words
        self.out: Any = self.buf.out
        self.graph: Any = None
        self.runs = 0

    @property
    def nbytes(self) -> int:
        return self.buf.nbytes

    def load(self, batch: NgramBatch) -> None:
        """Pack ``batch`` (host tokens, this step's shape) into the pinned input."""
        s = self.shape
        if (batch.length, batch.n, batch.num_seqs > 1) != (s.length, s.n, s.num_seqs > 1):
            raise ConfigError(
                f"this static step has {s.length} tokens, {s.n} rows, "
                f"{'several sequences' if s.num_seqs > 1 else 'one sequence'}; the batch has "
                f"{batch.length}, {batch.n}, {batch.num_seqs} sequence(s)"
            )
        if batch.on_device:
            raise ConfigError("a static step loads host tokens (an NgramBatch of numpy ids)")
        pack_upload(self.buf.host(), batch)

    def issue(self) -> None:
        """Queue the step on the current stream (capturable once it ran eagerly)."""
        self._emb._issue_step(self)

    def launch(self, stream: Any = None) -> None:
        """Run the step on ``stream`` (default: the current stream): eagerly the first
        time, captured the second, replayed afterwards."""
        cp = self._emb._xp
        stream = cp.cuda.get_current_stream() if stream is None else stream
        if self.graph is None and self.runs >= 1:
            cap = cp.cuda.Stream(non_blocking=True)  # capture needs a non-default stream
            with cap:
                cap.begin_capture()
                try:
                    self.issue()
                finally:
                    graph = cap.end_capture()
            self.graph = graph
        if self.graph is not None:
            self.graph.launch(stream)
        else:
            with stream:
                self.issue()
        self.runs += 1
        self.buf.uploaded(stream)
