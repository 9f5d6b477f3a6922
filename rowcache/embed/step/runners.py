"""The runners of an embedding step, one chosen at construction: the CPU, the GPU eagerly.

Owns :class:`Step` (a planned eager step: its buffers, and the stages run over them in
their fixed order), :class:`CpuRunner` and :class:`EagerRunner`. A runner plans a step
for a shape (``plan(shape, out) -> Step``) and runs it (``Step.run_*``); each takes the
three input adapters of ``rowcache.embed.step.inputs``:

- the CPU: every input is packed on the host; ids (host hash) -> resolve first ->
  gather -> overlay -> project and sum, with the NumPy references;
- the GPU, host tokens: the upload, hash and every gather in one launch (cached tables
  through their device maps), overlay, project and sum, the host resolve ordered
  around it by ``CachedGroups.ordered``;
- the GPU, device tokens: ids hashed on the device -> resolve first -> gather ->
  overlay -> project and sum;
- the GPU, rows in place (resident tables, no overlay): hash, range check and gathers
  in one launch over the arrays as they are, project and sum, one sync for the check;
  other rows are packed on the host and run as host tokens.

Graph replay is ``rowcache.embed.step.graph``. Does not check a call's arguments
(``rowcache.embed.layer``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rowcache.embed.ngram.batch import NgramBatch
from rowcache.embed.step.device import StepShape, pack_upload
from rowcache.embed.step.inputs import DeviceTokens, HostTokens, RowsInPlace
from rowcache.embed.step.stages import Stages, StepCall
from rowcache.embed.step.staging import Staging, StepBuffers


class Step:
    """A planned eager step: the stages over one shape's buffers (``buf``)."""

    __slots__ = ("buf", "stages")

    def __init__(self, stages: Stages, buf: StepBuffers) -> None:
        self.stages, self.buf = stages, buf

    def run_resolved(self, batch: NgramBatch, call: StepCall) -> Any:
        """ids -> resolve first -> gather -> overlay -> project and sum, into ``buf.out``
        (the CPU, and device tokens on the GPU); every cache's batch ends after."""
        st, buf, groups = self.stages, self.buf, self.stages.groups
        try:
            ids, word_ids, host_ids = st.ids(batch)
            word_slots = None
            if host_ids is not None:  # cached tables: their rows resolved first
                word_slots = groups.resolve(batch, ids, host_ids)
            st.gather(ids, word_ids, word_slots, buf.stack, buf.words)
            rows = st.overlay(call, word_ids, buf.words, batch)
            return st.project(buf.stack, rows, buf.proj, buf.out)
        finally:
            groups.end_step()

    def run_mapped(self, batch: NgramBatch, call: StepCall) -> Any:
        """A GPU step from host tokens into ``buf.out``: the upload, hash and gathers in
        one launch (cached tables through their device maps), overlay, project and sum,
        with the host resolve before or after it (``CachedGroups.ordered``)."""
        st, buf, groups = self.stages, self.buf, self.stages.groups
        tok = buf.tok
        assert tok is not None  # planned with tokens
        try:
            host = tok.host()
            pack_upload(host, batch)
            shape = StepShape.of(batch)

            def device_part() -> None:
                word_ids = st.hash_gather(tok, host, shape, buf.stack, buf.words)
                rows = st.overlay(call, word_ids, buf.words, batch)
                st.project(buf.stack, rows, buf.proj, buf.out)

            try:
                groups.ordered(batch, device_part)
            finally:  # the pinned upload is free once the last part that reads it ran
                tok.uploaded(st.xp.cuda.get_current_stream())
        finally:
            groups.end_step()
        return buf.out

    def run_rows(self, rows: RowsInPlace, flag: Any, seq: int) -> Any:
        """Resident rows read in place on the GPU: hash + range check + gathers in one
        launch, project and sum into ``buf.out``, then one sync to read the range flag
        (a bad token raises, naming it; ``buf.out`` is then written but meaningless)."""
        st, buf = self.stages, self.buf
        st.hash_gather_rows(rows.ids, rows.ctx, rows.c, flag, seq, buf.stack, buf.words)
        st.project(buf.stack, buf.words, buf.proj, buf.out)
        st.xp.cuda.get_current_stream().synchronize()
        if int(flag[0]) == seq:
            rows.raise_bad(st.dims)
        return buf.out


class CpuRunner:
    """The CPU runner: every step eager, on the host, resolve first (the NumPy
    references: the specification the GPU runners are compared with)."""

    name = "cpu"

    def __init__(self, stages: Stages, staging: Staging) -> None:
        self.stages, self.staging = stages, staging

    @property
    def nbytes(self) -> int:
        return self.staging.nbytes

    def plan(self, shape: StepShape, out: Any = None) -> Step:
        """A step of ``shape`` on the staging buffers (``out`` as given or fresh)."""
        return Step(self.stages, self.staging.buffers(shape, out, tokens=False))

    def run(self, inputs: HostTokens | DeviceTokens | RowsInPlace, call: StepCall) -> Any:
        """Run one call's input adapter (``rowcache.embed.step.inputs``)."""
        return inputs.run(self, call)

    def run_host(self, batch: NgramBatch, call: StepCall) -> Any:
        return self.plan(StepShape.of(batch), call.out).run_resolved(batch, call)

    def run_device(self, batch: NgramBatch, call: StepCall) -> Any:
        return self.run_host(DeviceTokens(batch).host().batch, call)

    def run_rows(self, rows: RowsInPlace, call: StepCall) -> Any:
        return self.run_host(rows.packed(self.stages.dims).batch, call)


class EagerRunner:
    """The GPU runner that launches every step eagerly (see the module's docstring)."""

    name = "eager"

    def __init__(self, stages: Stages, staging: Staging) -> None:
        self.stages, self.staging = stages, staging
        self._flag: Any = None  # pinned int64[1]: the rows kernel's range flag
        self._seq = 0
        self._rows_host: Any = None  # pinned int64: device rows packed for the host

    @property
    def nbytes(self) -> int:
        return self.staging.nbytes

    def plan(self, shape: StepShape, out: Any = None, tokens: bool = False) -> Step:
        """A step of ``shape`` on the staging buffers; ``tokens``: with the device token
        buffers of a step from host tokens."""
        return Step(self.stages, self.staging.buffers(shape, out, tokens=tokens))

    def run(self, inputs: HostTokens | DeviceTokens | RowsInPlace, call: StepCall) -> Any:
        """Run one call's input adapter (``rowcache.embed.step.inputs``)."""
        return inputs.run(self, call)

    def run_host(self, batch: NgramBatch, call: StepCall) -> Any:
        return self.plan(StepShape.of(batch), call.out, tokens=True).run_mapped(batch, call)

    def run_device(self, batch: NgramBatch, call: StepCall) -> Any:
        return self.plan(StepShape.of(batch), call.out).run_resolved(batch, call)

    def in_place(self, rows: RowsInPlace, call: StepCall) -> bool:
        """Whether ``rows`` are read in place: device rows, resident tables, no overlay."""
        return rows.on_device and call.overlay is None and not self.stages.groups and rows.n > 0

    def run_rows(self, rows: RowsInPlace, call: StepCall) -> Any:
        """Device rows of resident tables with no overlay in place; other rows packed on
        the host (device rows by two strided copies: a resolve needs them there)."""
        if self.in_place(rows, call):
            if self._flag is None:
                import cupyx

                self._flag = cupyx.empty_pinned(1, dtype=np.int64)
                self._flag[0] = 0
            self._seq += 1
            shape = StepShape(rows.B * (rows.c + rows.L), rows.n, rows.B > 1)
            return self.plan(shape, call.out).run_rows(rows, self._flag, self._seq)
        return self.run_host(rows.packed(self.stages.dims, self.rows_host(rows)).batch, call)

    def rows_host(self, rows: RowsInPlace) -> Any:
        """The pinned buffer device rows are packed into (grown, rewritten each call),
        or None for host rows."""
        if not rows.on_device:
            return None
        need = rows.B * (rows.c + rows.L)
        if self._rows_host is None or self._rows_host.size < need:
            import cupyx

            self._rows_host = cupyx.empty_pinned(max(need, 4096), dtype=np.int64)
        return self._rows_host
