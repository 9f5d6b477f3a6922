"""The GPU step on fixed buffers (:class:`StaticStep`), and the runner that replays it.

Owns :class:`StaticStep`, a step planned for one shape (tokens, rows, several sequences)
on buffers a captured CUDA graph points at (``plan``: its constructor; ``run``: eagerly
the first time, captured the second, replayed afterwards), and :class:`GraphRunner`
(``cuda_graphs=True``): a ``StaticStep`` per shape for the calls of host tokens with no
overlay, the scaled sum after the graph into each call's own output, the host resolve
ordered around it by ``CachedGroups.ordered``; other calls run eagerly
(``rowcache.embed.step.runners.EagerRunner``). ``NgramEmbedding.static_step`` is the other
use of a ``StaticStep``: resident tables, the sum inside, captured by a server.
"""

from __future__ import annotations

from typing import Any

from rowcache.embed.ngram.batch import NgramBatch
from rowcache.embed.step.device import DeviceStep, StepShape, pack_upload
from rowcache.embed.step.inputs import DeviceTokens, HostTokens, RowsInPlace
from rowcache.embed.step.runners import EagerRunner
from rowcache.embed.step.stages import Stages, StepCall
from rowcache.errors import ConfigError
from rowcache.kernels.reference import BF16


class StaticStep:
    """A GPU embedding step on fixed buffers, replayed from a CUDA graph.

    Made by :meth:`NgramEmbedding.static_step` (and by ``cuda_graphs=True``'s runner).
    Everything a captured graph points at lives here: the pinned upload buffer, the
    device tokens, the stacked rows ``stack`` bfloat16[n, T*d], the word rows ``words``
    bfloat16[n, D], the projection ``proj`` float32[S, n, D] and, with ``with_sum``, the
    output ``out`` bfloat16[n, D]. The shape (tokens, rows, several sequences) is
    fixed; the tables, projections and token values are not baked in beyond their
    addresses.

    Use: ``load(batch)`` (host only: waits until the previous run has copied the
    pinned buffer, then packs the batch into it), ``run()`` (the first run is eager,
    compiling kernels and loading cuBLAS's; the second captures; later ones replay;
    ``launch()`` is the same), read ``out``. ``issue()`` queues the same work on the
    current stream, e.g. inside a capture of a larger graph.
    """

    def __init__(self, stages: Stages, shape: StepShape, parts: int, *, with_sum: bool) -> None:
        self._stages = stages
        self.shape = shape
        self.with_sum = with_sum
        dims, n = stages.dims, shape.n
        staging = ((n, dims.num_tables * dims.table_dim), dims.hidden_size, parts)
        self.buf = DeviceStep(stages.xp, shape.length, n, staging, out=with_sum)
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
        """Queue the step on the current stream (capturable once it ran eagerly): the
        upload, hash and gathers, the GEMM, and with ``with_sum`` the scaled sum into
        ``out``."""
        st = self._stages
        st.hash_gather(self.buf, self.buf.hosts[0], self.shape, self.stack, self.words)
        if self.with_sum:
            st.project(self.stack, self.words, self.proj, self.out)
        else:  # the sum comes after the host resolve, outside the graph (GraphRunner)
            st.project_parts(self.stack, self.proj)

    def run(self, stream: Any = None) -> None:
        """Run the step on ``stream`` (default: the current stream): eagerly the first
        time, captured the second, replayed afterwards."""
        cp = self._stages.xp
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

    launch = run


class GraphRunner:
    """The GPU runner that replays a step per shape from a CUDA graph (``cuda_graphs``).

    Calls of host tokens with no overlay: the upload, hash + gathers (cached tables
    through their device maps) and the GEMM from the shape's graph, then the scaled sum
    into a fresh output (or ``out``), so results behave as on the eager runner; the host
    resolve ordered around both (``CachedGroups.ordered``: before them when a small step
    would fault; else after, and both again when it faulted). The first call of a shape
    runs eagerly into the shape's own buffers, the second captures, later ones replay.
    Other calls (device tokens, rows, an overlay) run on ``eager``.
    """

    name = "graphs"

    def __init__(self, stages: Stages, eager: EagerRunner) -> None:
        self.stages, self.eager = stages, eager
        self.graphs: dict[tuple[int, int, bool], StaticStep] = {}

    @property
    def nbytes(self) -> int:
        return self.eager.nbytes + sum(s.nbytes for s in self.graphs.values())

    def plan(self, shape: StepShape) -> StaticStep:
        """The shape's step (made once, kept until :meth:`clear`)."""
        key = (shape.length, shape.n, shape.num_seqs > 1)
        step = self.graphs.get(key)
        if step is None:
            parts = self.eager.staging.parts(shape.n)
            step = self.graphs[key] = StaticStep(self.stages, shape, parts, with_sum=False)
        return step

    def clear(self) -> None:
        self.graphs.clear()

    def run(self, inputs: HostTokens | DeviceTokens | RowsInPlace, call: StepCall) -> Any:
        """Run one call's input adapter (``rowcache.embed.step.inputs``)."""
        return inputs.run(self, call)

    def run_host(self, batch: NgramBatch, call: StepCall) -> Any:
        if call.overlay is not None:
            return self.eager.run_host(batch, call)
        st = self.stages
        step = self.plan(StepShape.of(batch))
        step.load(batch)
        out = call.out
        if out is None:
            out = st.xp.empty((batch.n, st.dims.hidden_size), dtype=BF16)

        def device_part() -> None:  # the sum queued before a host resolve that follows
            step.run()
            st.sum_parts(step.words, step.proj, out)

        try:
            st.groups.ordered(batch, device_part)
        finally:
            st.groups.end_step()
        return out

    def run_device(self, batch: NgramBatch, call: StepCall) -> Any:
        return self.eager.run_device(batch, call)

    def run_rows(self, rows: RowsInPlace, call: StepCall) -> Any:
        """Rows read in place, or with an overlay, run eagerly; other rows are packed on
        the host and replayed as host tokens."""
        if call.overlay is not None or self.eager.in_place(rows, call):
            return self.eager.run_rows(rows, call)
        return self.run_host(rows.packed(self.stages.dims, self.eager.rows_host(rows)).batch, call)
