"""The fixed stages of an embedding step, one implementation per device.

Owns :class:`Stages`: ids -> resolve (cached tables, ``rowcache.embed.step.cached_groups``)
-> gather -> overlay -> project and sum, over the embedding's tables described once
(``StackedTables``; on the GPU with each cached table's device row -> slot map) and its
stacked projections; and :class:`StepCall`, a call's overlay arguments and ``out``.

- ids: the host hash (``NgramBatch.host_ids``, C) on the CPU; the ``ngram_hash`` kernel
  for device tokens (range-checked in the launch).
- gather: ``gather_stacked`` (the NumPy reference on the CPU, one launch on the GPU) of
  hashed ids or resolved slots, the word rows through the word table. On the GPU a step
  from host tokens hashes and gathers in one launch instead (``hash_gather``, reading
  cached tables through their device maps: the measured GPU path), and a step of
  resident rows in place in one ``hash_gather_rows`` launch.
- overlay: the token overlay's ``apply_embed`` on the word rows.
- project and sum: ``rowcache.kernels.gemm.project_and_sum``, written once.

Does not choose between them (``rowcache.embed.step.runners``) nor own buffers
(``rowcache.embed.step.staging``, ``rowcache.embed.step.device``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rowcache.embed.ngram.batch import NgramBatch
from rowcache.embed.ngram.dims import NgramDims
from rowcache.embed.step.cached_groups import CachedGroups
from rowcache.embed.step.device import DeviceStep, StepShape, upload_words
from rowcache.embed.tables import CachedTable
from rowcache.errors import ConfigError
from rowcache.kernels.gemm import gemm_bf16_f32_parts, project_and_sum, scale_sum
from rowcache.kernels.ngram.hash import TokenRangeError, hash_gather, ngram_hash
from rowcache.kernels.ngram.rows import hash_gather_rows
from rowcache.kernels.ngram.stacked import StackedTables, copy_from_mapped, gather_stacked


class StepCall:
    """One call's overlay arguments (``overlay``, ``seq_slots``, ``active``) and ``out``."""

    __slots__ = ("active", "out", "overlay", "seq_slots")

    def __init__(
        self, overlay: Any = None, seq_slots: Any = None, active: int = -1, out: Any = None
    ) -> None:
        self.overlay, self.seq_slots, self.active, self.out = overlay, seq_slots, active, out


class Stages:
    """The stages of one embedding's step (see the module's docstring).

    Parameters
    ----------
    dims : NgramDims
    word, tables : the embedding's checked tables (``rowcache.embed.layer_inputs``)
    wcat : bfloat16[T*d, D] (host) the stacked projections, copied to the device
    xp : numpy or cupy
    groups : the embedding's :class:`CachedGroups`
    """

    def __init__(
        self,
        dims: NgramDims,
        word: Any,
        tables: Sequence[Any],
        wcat: np.ndarray,
        xp: Any,
        groups: CachedGroups,
    ) -> None:
        self.dims, self.word, self.tables, self.xp, self.groups = dims, word, tables, xp, groups
        gpu = xp is not np
        # the CPU GEMM runs in float32
        self.wcat: Any = xp.asarray(wcat) if gpu else wcat.astype(np.float32)
        self.denom = float(1 + dims.num_tables)
        self.mult = xp.ascontiguousarray(xp.asarray(dims.multipliers, dtype=np.int64))
        self.rows = xp.ascontiguousarray(xp.asarray(dims.all_table_rows, dtype=np.int64))

        def map_of(t: Any) -> tuple[Any, int] | None:  # a cached table's device map (GPU)
            return (t.cache.device_map(), t.offset) if gpu and isinstance(t, CachedTable) else None

        self.stacked = StackedTables([t.arrays for t in tables], [map_of(t) for t in tables])
        # the fused kernels read the word table through one more StackedTables (GPU)
        self.word_stacked = StackedTables([word.arrays], [map_of(word)]) if gpu else None

    @property
    def nbytes(self) -> int:
        """Bytes of the projections and of the caches' device maps (each cache once)."""
        maps = {
            id(t.cache): int(t.cache.device_map().nbytes)
            for t in (self.word, *self.tables)
            if self.xp is not np and isinstance(t, CachedTable)
        }
        return int(self.wcat.nbytes) + sum(maps.values())

    # --- ids ----------------------------------------------------------------------------
    def hash_all(self, batch: NgramBatch) -> Any:
        """Ids of every position of the batch: int64[T, L_total] on this device (device
        tokens range-checked in the launch, a bad one named)."""
        xp = self.xp
        tokens = batch.tokens
        if xp is not np and not batch.on_device:
            tokens = xp.asarray(tokens)
        starts = batch.starts
        if starts is not None and xp is not np:
            starts = xp.asarray(starts)
        try:
            return ngram_hash(
                tokens,
                self.mult,
                self.rows,
                self.dims.eos_token_id,
                starts,
                vocab=self.dims.vocab_size if batch.on_device else None,
            )
        except TokenRangeError as e:
            raise ConfigError(
                f"{batch.name_position(e.position)} = {e.value} is outside the vocabulary "
                f"[0, {e.vocab})"
            ) from None

    def ids(self, batch: NgramBatch) -> tuple[Any, Any, np.ndarray | None]:
        """The ids stage of a step whose rows are resolved first: ``(ids int64[T, n],
        word ids int64[n], host ids of the cached tables or None)`` on this device.
        Host tokens on the CPU (one host hash), device tokens on the GPU (hashed
        there, the cached tables' ids copied to the host: one sync)."""
        groups = self.groups
        if self.xp is np:
            ids = batch.host_ids()  # int64[T, n]: only the embedded positions
            return ids, batch.word_ids, ids[groups.cached_rows] if groups else None
        xp = self.xp
        sel = batch.selection
        ids = self.hash_all(batch)[:, xp.asarray(sel) if isinstance(sel, np.ndarray) else sel]
        host = ids[groups.cached_rows].get() if groups else None
        return ids, batch.word_ids, host

    # --- gather -------------------------------------------------------------------------
    def gather(self, ids: Any, word_ids: Any, word_slots: Any, stack: Any, words: Any) -> None:
        """The gather stage of resolved ids (cached tables' rows replaced by slots):
        every n-gram table into ``stack`` (``gather_stacked``), the word rows into
        ``words`` (by slot when the word table is cached)."""
        gather_stacked(ids, self.stacked, stack)
        if word_slots is not None:
            self.word.gather_slots(word_slots, out=words)
        else:
            self.word.gather(word_ids, out=words)

    def hash_gather(
        self, buf: DeviceStep, host: np.ndarray, shape: StepShape, stack: Any, words: Any
    ) -> Any:
        """The ids and gather stages of a GPU step from host tokens in one launch: the
        upload packed in the pinned ``host`` (``pack_upload``) copied into ``buf.dev`` by a
        kernel, then hashed and every table gathered (cached tables through their device
        maps) into ``stack`` and ``words``. No allocation, no sync: capturable. Returns
        the word ids (int64[n], device)."""
        L, n, multi = shape.length, shape.n, shape.num_seqs > 1
        copy_from_mapped(host.ctypes.data, buf.dev, upload_words(L, n, multi))
        assert self.word_stacked is not None  # the GPU
        tok = buf.dev[:L]
        hash_gather(
            tok,
            buf.dev[L + n : 2 * L + n] if multi else None,
            buf.dev[2 * L + n : 2 * L + 2 * n] if multi else None,
            self.mult,
            self.rows,
            self.dims.eos_token_id,
            self.stacked,
            stack,
            self.word_stacked,
            words,
        )
        return buf.dev[L : L + n] if multi else tok[L - n :]

    def hash_gather_rows(
        self, ids: Any, ctx: Any, c: int, flag: Any, seq: int, stack: Any, words: Any
    ) -> None:
        """The ids and gather stages of resident rows read in place on the GPU
        (``ids[B, L]`` after the last ``c`` columns of ``ctx``): one launch, tokens
        range-checked into ``flag`` (set to ``seq`` at a bad one)."""
        assert self.word_stacked is not None  # the GPU
        hash_gather_rows(
            ids,
            ctx,
            c,
            self.mult,
            self.rows,
            self.dims.eos_token_id,
            self.dims.vocab_size,
            flag,
            seq,
            self.stacked,
            stack,
            self.word_stacked,
            words,
        )

    # --- overlay ------------------------------------------------------------------------
    def overlay(self, call: StepCall, word_ids: Any, words: Any, batch: NgramBatch) -> Any:
        """The word rows after the call's overlay: ``words`` itself (changed in place)
        or the overlay's returned rows; ``words`` when there is no overlay."""
        if call.overlay is None:
            return words
        slots = _row_slots(call.seq_slots, batch)
        applied = call.overlay.apply_embed(word_ids, words, seq_slot=slots, active=call.active)
        return words if applied is None else applied

    # --- project and sum ----------------------------------------------------------------
    def project(self, stack: Any, rows: Any, proj: Any, out: Any) -> Any:
        """``out = bf16((rows + stack @ W) / (1 + T))`` (``project_and_sum``)."""
        return project_and_sum(stack, self.wcat, rows, proj=proj, out=out, denom=self.denom)

    def project_parts(self, stack: Any, proj: Any) -> None:
        """The GEMM half of :meth:`project` alone (a graph step that sums outside its graph)."""
        gemm_bf16_f32_parts(stack, self.wcat, out=proj)

    def sum_parts(self, words: Any, proj: Any, out: Any) -> Any:
        """The scaled-sum half of :meth:`project`, after :meth:`project_parts`."""
        return scale_sum(words, proj, self.denom, out=out)


def _row_slots(seq_slots: Any, batch: NgramBatch) -> Any:
    """``seq_slots`` per output row: as given (None, a scalar, one per row) or repeated
    from one per sequence."""
    n = batch.n
    if seq_slots is None or np.ndim(seq_slots) == 0 or len(seq_slots) == n:
        return seq_slots
    if len(seq_slots) != batch.num_seqs:
        raise ConfigError(
            f"seq_slots has {len(seq_slots)} entries: expected one per sequence "
            f"({batch.num_seqs}) or one per row ({n})"
        )
    return batch.rows_per_sequence(seq_slots)
