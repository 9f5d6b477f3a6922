"""The n-gram embedding with its tables spread over the ranks of a ``torch.distributed`` group.

Owns :class:`ShardPlacement` (which rank holds which table, or which row range of a table
larger than one rank's byte budget) and :class:`ShardedNgramEmbedding` (one rank's part of
the embedding: its own tables, resident or served by its own row caches, the step's ids
hashed on every rank, the projected partial sum of its tables, and one ``all_reduce`` (SUM)
of the float32 partials, then the scaling). Reuses the ids (``NgramBatch.host_ids``), the
tables (``rowcache.embed.tables``), the stacked projections (``stack_projs``) and the GEMM
(``rowcache.kernels.gemm``); does not own the caches (``rowcache.cache``) or the
single-process step (``rowcache.embed.step``). Importing this module imports torch
(``import rowcache.embed`` does not: the name is loaded on first use). ``docs/sharding.md``.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rowcache.cache.prefetch import PrefetchHandle
from rowcache.cache.step_rows import StepRows
from rowcache.embed.layer_inputs import stack_projs
from rowcache.embed.ngram.batch import NgramBatch
from rowcache.embed.ngram.dims import NgramDims
from rowcache.embed.step.inputs import RowsInPlace
from rowcache.embed.tables import Bf16Table, CachedTable, Fp8Table
from rowcache.errors import ConfigError, RankFailedError
from rowcache.kernels.gemm import gemm_bf16_f32, scale_sum
from rowcache.kernels.loader import is_device_array, require_cupy
from rowcache.kernels.reference import BF16


@dataclasses.dataclass(frozen=True)
class TablePiece:
    """Rows ``[lo, hi)`` of n-gram table ``table``, held by rank ``rank``."""

    table: int
    lo: int
    hi: int
    rank: int

    @property
    def rows(self) -> int:
        return self.hi - self.lo


@dataclasses.dataclass(frozen=True)
class ShardPlacement:
    """Which rank of a group of ``world_size`` holds which n-gram table (or row range).

    Made by :meth:`plan`: a table of more than ``rank_bytes`` bytes is cut row-wise into
    ``ceil(bytes / rank_bytes)`` contiguous ranges of near-equal rows (never more than
    ``world_size``); then the pieces, largest first (ties by table, then first row), go
    each to the rank holding the fewest bytes so far (ties: the lowest rank) that holds
    no other piece of the same table: greedy balance by bytes. The word table is
    rank 0's. The same arguments give the same placement on every rank.
    """

    dims: NgramDims
    world_size: int
    row_bytes: int
    rank_bytes: int | None
    pieces: tuple[TablePiece, ...]

    @classmethod
    def plan(
        cls,
        dims: NgramDims,
        world_size: int,
        *,
        rank_bytes: int | None = None,
        row_bytes: int | None = None,
    ) -> ShardPlacement:
        """Place ``dims``' tables over ``world_size`` ranks.

        Parameters
        ----------
        dims : NgramDims
        world_size : int, >= 1
        rank_bytes : int, optional
            The most bytes of one table a rank should hold (as stored, not a cache's
            arena): a larger table is split row-wise into pieces of at most this. None: no
            split. (A rank may hold several pieces: :meth:`bytes_of` says how much.)
        row_bytes : int, optional
            Bytes of one table row; default ``2 * table_dim`` (bfloat16).
        """
        if not isinstance(dims, NgramDims):
            raise ConfigError(f"dims must be an NgramDims, got {type(dims).__name__}")
        if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)):
            raise ConfigError(f"world_size={world_size!r} must be an int >= 1")
        if world_size < 1:
            raise ConfigError(f"world_size={world_size} must be >= 1")
        rb = 2 * dims.table_dim if row_bytes is None else int(row_bytes)
        if rb < 1:
            raise ConfigError(f"row_bytes={row_bytes!r} must be >= 1")
        if rank_bytes is not None and int(rank_bytes) < rb:
            raise ConfigError(
                f"rank_bytes={rank_bytes!r} must hold at least one row ({rb} bytes), or be None"
            )
        cuts: list[tuple[int, int, int]] = []
        for i in range(dims.num_tables):
            rows = dims.table_rows(i)
            k = 1 if rank_bytes is None else -(-rows * rb // int(rank_bytes))
            if k > world_size:
                raise ConfigError(
                    f"table {i} ({rows * rb} bytes) needs {k} ranks of rank_bytes={rank_bytes}, "
                    f"the group has world_size={world_size}: give more ranks or a larger rank_bytes"
                )
            edges = [rows * j // k for j in range(k + 1)]
            cuts += [(i, edges[j], edges[j + 1]) for j in range(k)]
        load = [0] * world_size
        held: list[set[int]] = [set() for _ in range(world_size)]
        pieces = []
        for i, lo, hi in sorted(cuts, key=lambda c: (-(c[2] - c[1]), c[0], c[1])):
            r = min((r for r in range(world_size) if i not in held[r]), key=lambda r: load[r])
            load[r] += (hi - lo) * rb
            held[r].add(i)
            pieces.append(TablePiece(i, lo, hi, r))
        order = sorted(pieces, key=lambda p: (p.table, p.lo))
        return cls(
            dims, int(world_size), rb, None if rank_bytes is None else int(rank_bytes), tuple(order)
        )

    def of_rank(self, rank: int) -> list[TablePiece]:
        """The pieces rank ``rank`` holds, by table then first row."""
        return [p for p in self.pieces if p.rank == rank]

    def bytes_of(self, rank: int) -> int:
        """Table bytes rank ``rank`` holds (as stored)."""
        return sum(p.rows for p in self.of_rank(rank)) * self.row_bytes

    @property
    def split_tables(self) -> list[int]:
        """The tables cut into several row ranges."""
        counts: dict[int, int] = {}
        for p in self.pieces:
            counts[p.table] = counts.get(p.table, 0) + 1
        return sorted(i for i, c in counts.items() if c > 1)

    def __repr__(self) -> str:
        per = [
            "r{}: {}".format(r, ", ".join(_piece_name(p, self.dims) for p in self.of_rank(r)))
            for r in range(self.world_size)
        ]
        return f"ShardPlacement({'; '.join(per)})"


def _piece_name(p: TablePiece, dims: NgramDims) -> str:
    whole = p.lo == 0 and p.hi == dims.table_rows(p.table)
    return f"t{p.table}" if whole else f"t{p.table}[{p.lo}:{p.hi}]"


def _f32(a: Any, xp: Any) -> Any:
    """float32 of a bfloat16 array (exact: the bf16 bits are the float32's top half)."""
    return (a.view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32)


class _Piece:
    """One rank's piece: its table, the row offset of the table's ids, and its projection
    columns in the rank's stacked rows."""

    def __init__(self, piece: TablePiece, table: Any, dims: NgramDims) -> None:
        full = dims.table_rows(piece.table)
        if table.dim != dims.table_dim or table.rows not in (piece.rows, full):
            raise ConfigError(
                f"the table given for {_piece_name(piece, dims)} is [{table.rows}, {table.dim}]; "
                f"it must have {piece.rows} rows (the piece's, addressed from its first row) "
                f"or {full} (the whole table's) of dim {dims.table_dim}"
            )
        self.piece, self.table = piece, table
        self.split = piece.rows != full
        # the piece's table is addressed by local id (its own rows) or global id (whole)
        self.offset = piece.lo if table.rows == piece.rows else 0


class ShardedNgramEmbedding:
    """One rank's part of an n-gram embedding spread over a ``torch.distributed`` group.

    ``e_t = (E0[x_t] + sum_i W_i E_i[id_i(t)]) / (1 + T)``: every rank hashes the step's
    tokens (host hash of its own tables' ids only), gathers its own tables' rows (rows
    outside a row-split piece count zero), projects them with one GEMM (float32
    accumulation) into a float32 ``[n, D]`` partial, rank 0 adds the word rows' float32
    values, one ``all_reduce`` (SUM) adds the partials over the group, and every rank
    scales the sum into bfloat16. Every call is collective: every rank of the group
    makes it with the same tokens, in the same order.

    Parameters
    ----------
    dims : NgramDims
    placement : ShardPlacement
        For the group's size; the same on every rank (checked at construction).
    word : Bf16Table | Fp8Table | CachedTable | bfloat16[V, D] on rank 0; None elsewhere.
    tables : sequence
        This rank's tables, one per piece of ``placement.of_rank(rank)`` in that order:
        ``Bf16Table``, ``Fp8Table``, ``CachedTable`` or bfloat16 arrays, each holding the
        piece's rows (addressed from its first row) or the whole table's (a cache over a
        store of the whole table, addressed by the table's ids; only the piece's rows are
        ever asked for).
    projs : the ``T`` projections ``W_i`` (bfloat16 ``[D, d]`` each, or one ``[T, D, d]``),
        the same on every rank (checked); the rank keeps its tables' columns.
    group : torch.distributed.ProcessGroup, optional
        Default the world group (``torch.distributed`` must be initialized).
    defer_reads : bool
        On the GPU, this rank's caches resolve with ``NgramRowCache.resolve_deferred``
        (as ``NgramEmbedding(defer_reads=True)``): :meth:`settle` commits. Ignored on the CPU.

    Tolerance: with one rank the result is bit-identical to ``NgramEmbedding`` on the CPU
    (same stacked GEMM, same ``(word + proj) / (1 + T)``). With several, the float32 sum
    is added in another order (per-rank partial GEMMs, then the reduction), so it differs
    from the single-process sum by float32 rounding; after the bfloat16 cast the outputs
    differ by at most 1 bf16 ulp of the larger magnitude, floored near zero at
    :data:`ULP_FLOOR` of the row's largest value (:func:`max_ulps` ``<= 1``;
    ``docs/sharding.md`` has the measured figures). Every rank gets the same bits.
    """

    def __init__(
        self,
        dims: NgramDims,
        placement: ShardPlacement,
        word: Any,
        tables: Sequence[Any],
        projs: Any,
        *,
        group: Any = None,
        defer_reads: bool = False,
    ) -> None:
        if not isinstance(dims, NgramDims):
            raise ConfigError(f"dims must be an NgramDims, got {type(dims).__name__}")
        if not isinstance(placement, ShardPlacement) or placement.dims != dims:
            raise ConfigError("placement must be a ShardPlacement made for these dims")
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError(
                "ShardedNgramEmbedding needs torch.distributed initialized "
                "(torch.distributed.init_process_group) before it is built"
            )
        self.dims, self.placement = dims, placement
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        # a rank that cannot build its part still joins the construction's one collective
        # (_check_same), so every rank raises and none is left waiting in it
        stacked: np.ndarray | None = None
        error: ConfigError | None = None
        try:
            stacked = self._build(word, tables, projs, defer_reads)
        except ConfigError as e:
            error = e
        self._check_same(stacked, error)

    def _build(self, word: Any, tables: Sequence[Any], projs: Any, defer_reads: bool) -> np.ndarray:
        """This rank's part, checked: its pieces' tables, the word table (rank 0), the
        device, its projection columns, its caches. Returns the stacked projections (for
        the ranks' comparison)."""
        dims, placement = self.dims, self.placement
        if self.world_size != placement.world_size:
            raise ConfigError(
                f"the placement is for world_size={placement.world_size}, the group has "
                f"{self.world_size} ranks: plan it with ShardPlacement.plan(dims, "
                f"{self.world_size}, ...)"
            )
        mine = placement.of_rank(self.rank)
        if len(tables) != len(mine):
            raise ConfigError(
                f"rank {self.rank} holds {len(mine)} piece(s) "
                f"({[_piece_name(p, dims) for p in mine]}), got {len(tables)} table(s)"
            )
        self._pieces = [_Piece(p, _as_table(t), dims) for p, t in zip(mine, tables)]
        if (self.rank == 0) != (word is not None):
            raise ConfigError(
                f"word is rank 0's table (the word term is added there): rank {self.rank} got "
                f"{'None' if word is None else type(word).__name__}"
            )
        self.word = None if word is None else _as_table(word)
        if self.word is not None and (
            self.word.rows != dims.vocab_size or self.word.dim != dims.hidden_size
        ):
            raise ConfigError(
                f"word must be [{dims.vocab_size}, {dims.hidden_size}], got "
                f"[{self.word.rows}, {self.word.dim}]"
            )
        every = [p.table for p in self._pieces] + ([self.word] if self.word is not None else [])
        devices = {t.device for t in every}
        if len(devices) > 1:
            raise ConfigError(f"rank {self.rank}'s tables are on several devices: {devices}")
        self.device: str = devices.pop() if devices else _group_device(self.group)
        gpu = self.device == "cuda"
        self._xp: Any = require_cupy("ShardedNgramEmbedding on cuda") if gpu else np
        stacked = stack_projs(dims, projs)  # [T*d, D], checked
        d = dims.table_dim
        own = [p.piece.table for p in self._pieces]
        weights = np.concatenate([stacked[i * d : (i + 1) * d] for i in own]) if own else None
        # the CPU's GEMM (the NumPy reference) takes float32 weights as they are: converted
        # once here (exact), not every step; cuBLAS takes bf16
        self._weights = (
            None
            if weights is None
            else (self._xp.asarray(weights) if gpu else weights.astype(np.float32))
        )
        self._own = np.array(own, dtype=np.int64)
        self.defer_reads = bool(defer_reads) and gpu
        # a step's tables: the pieces', then the word table; the cached ones are the
        # members of the step's rows over their caches
        every = [p.table for p in self._pieces] + ([self.word] if self.word is not None else [])
        self._cached = [k for k, t in enumerate(every) if isinstance(t, CachedTable)]
        self._rows = StepRows([(every[k].cache, every[k].part) for k in self._cached])
        self._flag: Any = None  # the last step's failure flag (a device scalar on the GPU)
        return stacked

    # --- construction ---------------------------------------------------------------------
    @classmethod
    def from_arrays(
        cls,
        dims: NgramDims,
        word: Any,
        tables: Sequence[Any],
        projs: Any,
        *,
        group: Any = None,
        rank_bytes: int | None = None,
        device: str = "cpu",
    ) -> ShardedNgramEmbedding:
        """Every rank given the whole tables (bfloat16 arrays, e.g. memory-mapped ``.npy``)
        keeps its pieces only, resident on ``device``; the word table on rank 0."""
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("from_arrays needs torch.distributed initialized")
        group = group if group is not None else dist.group.WORLD
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        placement = ShardPlacement.plan(dims, size, rank_bytes=rank_bytes)
        if len(tables) != dims.num_tables:
            raise ConfigError(f"tables has {len(tables)} entries, expected {dims.num_tables}")
        mine = [
            Bf16Table(np.ascontiguousarray(np.asarray(tables[p.table])[p.lo : p.hi])).to(device)
            for p in placement.of_rank(rank)
        ]
        w = Bf16Table(np.asarray(word)).to(device) if rank == 0 else None
        return cls(dims, placement, w, mine, projs, group=group)

    @classmethod
    def from_store(
        cls,
        dims: NgramDims,
        word: Any,
        store: Any,
        projs: Any,
        *,
        slots: int,
        tables: Sequence[str | int] | None = None,
        group: Any = None,
        rank_bytes: int | None = None,
        device: str = "cpu",
        defer_reads: bool = False,
    ) -> ShardedNgramEmbedding:
        """Each rank serves its pieces from one ``NgramRowCache`` of ``slots`` rows over
        its tables of ``store`` (the node's store, opened by every rank; ``tables``: the
        store's names or indices of the T n-gram tables, default ``0..T-1``). ``word``:
        rank 0's word table (a table or a bfloat16 array), None elsewhere."""
        from rowcache.cache.row_cache import NgramRowCache

        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("from_store needs torch.distributed initialized")
        group = group if group is not None else dist.group.WORLD
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        placement = ShardPlacement.plan(dims, size, rank_bytes=rank_bytes)
        names = list(range(dims.num_tables)) if tables is None else list(tables)
        if len(names) != dims.num_tables:
            raise ConfigError(f"tables has {len(names)} entries, expected {dims.num_tables}")
        mine = placement.of_rank(rank)
        parts: list[Any] = []
        if mine:
            cache = NgramRowCache(store, [names[p.table] for p in mine], slots=slots, device=device)
            parts = [CachedTable(cache, part=k) for k in range(len(mine))]
        w = None if word is None else _as_table(word)
        if w is not None and w.device != device:
            w = w.to(device)
        return cls(dims, placement, w, parts, projs, group=group, defer_reads=defer_reads)

    def _check_same(self, stacked: np.ndarray | None, error: ConfigError | None) -> None:
        """Every rank of the group built its part, with the same dims, placement and
        projections: one ``all_gather_object``; every rank raises otherwise (a rank that
        failed its own error, the others one that names it)."""
        crc = None if stacked is None else zlib.crc32(stacked.view(np.uint8).tobytes())
        mine = (
            None if error is None else str(error),
            dataclasses.astuple(self.dims)[:6],
            self.placement.pieces,
            self.placement.row_bytes,
            crc,
            getattr(self, "device", None),
        )
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.group)
        if error is not None:
            raise error
        for r, theirs in enumerate(everyone):
            if theirs[0] is not None:
                raise ConfigError(f"rank {r} of the group could not build its part: {theirs[0]}")
        what = ("dims", "placement", "row bytes", "projections' CRC32", "device")
        for r, theirs in enumerate(everyone):
            for k, name in enumerate(what, start=1):
                if theirs[k] != everyone[0][k]:
                    raise ConfigError(
                        f"the ranks of the group were built differently: rank {r}'s {name} "
                        f"is {theirs[k]!r}, rank 0's {everyone[0][k]!r}; build every rank "
                        "with the same dims, placement (rank_bytes) and projections"
                    )

    # --- public ---------------------------------------------------------------------------
    @property
    def pieces(self) -> list[TablePiece]:
        """This rank's pieces."""
        return [p.piece for p in self._pieces]

    @property
    def caches(self) -> list[Any]:
        """This rank's distinct row caches."""
        return self._rows.caches

    def resident_bytes(self) -> int:
        """Bytes this rank holds: its resident tables, its caches' arenas (once each), its
        projection columns."""
        tables = [p.table for p in self._pieces] + ([self.word] if self.word is not None else [])
        res = sum(t.nbytes for t in tables if not isinstance(t, CachedTable))
        arenas = {id(t.cache): t.nbytes for t in tables if isinstance(t, CachedTable)}
        w = 0 if self._weights is None else self._weights.nbytes
        return int(res + sum(arenas.values()) + w)

    def embed(self, ctx_tokens: Any, seq_len: int, *, out: Any = None) -> Any:
        """``NgramEmbedding.embed``: the last ``seq_len`` positions of one context."""
        return self._run(NgramBatch.single(self.dims, _host(ctx_tokens), seq_len), out)

    def embed_batch(
        self, contexts: Sequence[Any], seq_lens: Sequence[int], *, out: Any = None
    ) -> Any:
        """``NgramEmbedding.embed_batch``: several sequences in one pass."""
        contexts = [_host(c) for c in contexts]
        return self._run(NgramBatch.from_contexts(self.dims, contexts, seq_lens), out)

    def embed_packed(
        self, tokens: Any, ctx_lens: Any = None, seq_lens: Any = None, *, out: Any = None
    ) -> Any:
        """``NgramEmbedding.embed_packed``: an ``NgramBatch`` or packed tokens."""
        return self._run(self._batch(tokens, ctx_lens, seq_lens), out)

    def embed_rows(self, ids: Any, ctx: Any = None, *, out: Any = None) -> Any:
        """``NgramEmbedding.embed_rows``: every token of ``ids[B, L]``, each row after its
        context row ``ctx[B, C]`` (or none). Returns bfloat16[B * L, hidden_size]."""
        rows = RowsInPlace.checked(self.dims, ids, ctx)
        return self._run(rows.packed(self.dims).batch, out)

    def prefetch(self, ctx_tokens: Any, seq_len: int | None = None) -> PrefetchHandle:
        """Start this rank's caches reading the rows a coming :meth:`embed` of these
        arguments needs (its own pieces' rows only); returns at once. Not collective."""
        tokens = _host(ctx_tokens)
        L = len(tokens) if seq_len is None else seq_len
        return self._prefetch(NgramBatch.single(self.dims, tokens, L))

    def prefetch_packed(
        self, tokens: Any, ctx_lens: Any = None, seq_lens: Any = None
    ) -> PrefetchHandle:
        """:meth:`prefetch` of a coming :meth:`embed_packed` (same arguments)."""
        return self._prefetch(self._batch(tokens, ctx_lens, seq_lens))

    def settle(self) -> None:
        """Commit this rank's deferred reads (``defer_reads``); raises the first failed
        read's ``CorruptDataError`` after every cache was settled (on this rank: the
        others' outputs of that step are invalid too, which their callers learn from
        this rank's). Then raises ``RankFailedError`` when a rank failed the last step
        (the GPU's flag, read here). A no-op otherwise."""
        self._rows.settle()
        self._check_flag(wait=True)

    # --- the step ---------------------------------------------------------------------------
    def _batch(self, tokens: Any, ctx_lens: Any, seq_lens: Any) -> NgramBatch:
        if isinstance(tokens, NgramBatch):
            if tokens.dims != self.dims:
                raise ConfigError("the NgramBatch was built for other NgramDims")
            if tokens.on_device:
                return NgramBatch(self.dims, tokens.tokens.get(), tokens.ctx_lens, tokens.seq_lens)
            return tokens
        if ctx_lens is None or seq_lens is None:
            raise ConfigError("packed tokens need ctx_lens and seq_lens (int[S] each)")
        return NgramBatch(self.dims, _host(tokens), ctx_lens, seq_lens)

    def _piece_ids(self, batch: NgramBatch) -> list[tuple[_Piece, np.ndarray, np.ndarray | None]]:
        """Per piece: (piece, its table's ids of the piece's rows, the output rows they
        fill, or None for every row)."""
        if not self._pieces or batch.n == 0:
            return []
        ids = batch.host_ids(self._own)
        res: list[tuple[_Piece, np.ndarray, np.ndarray | None]] = []
        for k, p in enumerate(self._pieces):
            row = ids[k]
            if not p.split:
                res.append((p, row - p.offset if p.offset else row, None))
                continue
            sel = np.flatnonzero((row >= p.piece.lo) & (row < p.piece.hi))
            res.append((p, row[sel] - p.offset, sel))
        return res

    def _prefetch(self, batch: NgramBatch) -> PrefetchHandle:
        if not self._rows or batch.n == 0:
            return PrefetchHandle([], 0, 0)
        none = np.empty(0, dtype=np.int64)
        ids = [ids for _, ids, _ in self._piece_ids(batch)] + [none]  # (the word table's
        return self._rows.prefetch([ids[k] for k in self._cached])  # rows are not prefetched)

    def _resolve(self, wanted: list[tuple[Any, np.ndarray]]) -> list[Any]:
        """Arena slots of every cached table's rows of the step (``wanted``: (table, host
        ids) pairs; None for a resident table): ONE resolve per cache (``StepRows``), so a
        shared cache faults its misses in one read; with ``defer_reads`` the slots are read
        from the device maps, in stream order after the reads. The current stream then
        waits for the caches' writes."""
        xp = self._xp
        slots: list[Any] = [None] * len(wanted)
        if not self._rows:
            return slots
        ids = [wanted[k][1] for k in self._cached]
        got = self._rows.resolve(ids, defer=self.defer_reads)
        self._rows.wait_ready()
        if got is None:  # deferred: the slots from the device maps, after the reads
            maps = self._rows.device_maps()
            got = [
                maps[m][xp.asarray(ids[m] + wanted[k][0].offset)]
                for m, k in enumerate(self._cached)
            ]
        for m, k in enumerate(self._cached):
            slots[k] = got[m]
        return slots

    def _partial(self, batch: NgramBatch, partial: Any) -> None:
        """This rank's share of ``word + sum_i W_i E_i[id_i]`` into ``partial``
        (float32 ``[n, D]``, zeros, C-contiguous)."""
        xp, d, n = self._xp, self.dims.table_dim, batch.n
        pieces = self._piece_ids(batch)
        wanted: list[tuple[Any, np.ndarray]] = [(p.table, ids) for p, ids, _ in pieces]
        if self.word is not None:
            wanted.append((self.word, np.asarray(batch.word_ids)))
        slots = self._resolve(wanted)
        rows = [
            t.gather_slots(sl) if sl is not None else t.gather(ids if xp is np else xp.asarray(ids))
            for (t, ids), sl in zip(wanted, slots)
        ]
        if pieces:
            # bf16 moved as its uint16 bits (cupy copies no ml_dtypes type); rows outside a
            # row-split piece stay zero: W_i @ 0 adds nothing
            bits = xp.zeros((n, len(pieces) * d), dtype=xp.uint16)
            for k, (_, _, sel) in enumerate(pieces):
                if sel is None:
                    bits[:, k * d : (k + 1) * d] = rows[k].view(xp.uint16)
                elif sel.size:
                    bits[xp.asarray(sel), k * d : (k + 1) * d] = rows[k].view(xp.uint16)
            gemm_bf16_f32(bits.view(BF16), self._weights, out=partial)
        if self.word is not None:
            partial += _f32(rows[-1], xp)

    def _end_step(self) -> None:
        """End this rank's step in its caches (``StepRows.end_step``: on the GPU a cache's
        later faults first wait for this step's gathers, in stream order)."""
        if self._rows:
            self._rows.end_step()

    def _run(self, batch: NgramBatch, out: Any) -> Any:
        """The step: this rank's partial into rows ``[:n]`` of one float32 buffer whose
        last row carries a failure flag, one ``all_reduce`` of it, the scaling. A rank
        whose part fails (a bad ``out``, ``ArenaExhaustedError``, a failed read) still
        joins the reduction, flagged, then raises its error; the other ranks raise
        ``RankFailedError`` (at once on the CPU; on the GPU at a later call once the step
        is done, or at :meth:`settle`: the flag is read without a host sync in the step)."""
        self._check_flag()
        D, xp = self.dims.hidden_size, self._xp
        n = batch.n
        buf = xp.zeros((n + 1, D), dtype=xp.float32)
        error: BaseException | None = None
        try:
            if out is not None and (
                out.shape != (n, D) or out.dtype != BF16 or is_device_array(out) != (xp is not np)
            ):
                raise ConfigError(
                    f"out must be bfloat16[{n}, {D}] on {self.device}, got "
                    f"{getattr(out, 'dtype', None)}{list(getattr(out, 'shape', ()))}"
                )
            if n:
                self._partial(batch, buf[:n])
        except Exception as e:
            error = e
            buf[n, 0] = 1.0
        finally:
            self._end_step()
        self._all_reduce(buf)
        if error is not None:
            raise error
        if xp is np:
            self._flag = (buf[n, 0], None)
            self._check_flag()
        else:
            self._flag = (buf[n, 0], xp.cuda.get_current_stream().record())
        return self._scaled(buf[:n], out)

    def _check_flag(self, wait: bool = False) -> None:
        """Raise ``RankFailedError`` when a rank of the group failed the last step. On the
        GPU the flag is read once its step is done (``wait``: wait for it; else a step
        still running is left for a later check: no host sync in the step)."""
        if self._flag is None:
            return
        flag, done = self._flag
        if done is not None and not wait and not done.done:
            return
        self._flag = None
        if float(flag) > 0:
            raise RankFailedError(
                f"{int(float(flag))} rank(s) of the group failed the last step (their own error "
                f"raised there); its output on rank {self.rank} is invalid, to be dropped"
            )

    def _all_reduce(self, partial: Any) -> None:
        """SUM of every rank's float32 partial, in place (one collective, also for n = 0:
        every rank calls it the same number of times)."""
        if self._xp is np:
            t = torch.from_numpy(partial)
        else:
            # the reduction runs in torch's stream order: where cupy's current stream is
            # another (a direct call, not the module's), the host waits on each side of it
            apart = (
                self._xp.cuda.get_current_stream().ptr != torch.cuda.current_stream().cuda_stream
            )
            if apart:
                self._xp.cuda.get_current_stream().synchronize()
            t = torch.as_tensor(partial, device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        if self._xp is not np and apart:
            torch.cuda.current_stream().synchronize()

    def _scaled(self, total: Any, out: Any) -> Any:
        """``bf16(total / (1 + T))``, as ``NgramEmbedding``'s ``(word + proj) / (1 + T)``."""
        denom = float(1 + self.dims.num_tables)
        if self._xp is np:
            res = (total / np.float32(denom)).astype(BF16)
            if out is None:
                return res
            out[...] = res
            return out
        zero = self._xp.zeros(total.shape, dtype=self._xp.uint16).view(BF16)  # (0 + x) / denom
        return scale_sum(zero, total, denom, out=out)

    def __repr__(self) -> str:
        return (
            f"ShardedNgramEmbedding(rank={self.rank}/{self.world_size}, "
            f"pieces={[_piece_name(p, self.dims) for p in self.pieces]}, device={self.device!r})"
        )


#: the magnitude floor of :func:`max_ulps`, as a fraction of a row's largest value
ULP_FLOOR = 2.0**-12


def max_ulps(got: Any, ref: Any, *, floor: float = ULP_FLOOR) -> float:
    """The largest difference of two bfloat16 ``[n, D]`` outputs (numpy, or their uint16
    bits) in bf16 ulps of the larger magnitude, floored at ``floor`` times the row's
    largest ``|ref|``: the tolerance of :class:`ShardedNgramEmbedding` against
    ``NgramEmbedding`` is ``max_ulps <= 1``.

    The floor is what a float32 sum in another order needs: near zero its result cancels
    (terms of the row's size, a sum far smaller), and a few float32 ulps of the terms are
    many bf16 ulps of the tiny result (measured without a floor: up to 27.5, and 256 where
    the sign flips), yet far below the row's own values. Measured with floors 2^-8 ..
    2^-14 at LongCat's widths (``docs/sharding.md``): 1.0 each."""
    a = np.asarray(got).view(np.uint16).astype(np.uint32) << 16
    b = np.asarray(ref).view(np.uint16).astype(np.uint32) << 16
    a, b = a.view(np.float32), b.view(np.float32)
    if a.size == 0:
        return 0.0
    row = np.abs(b).max(axis=-1, keepdims=True) * np.float32(floor)
    mag = np.maximum(np.maximum(np.abs(a), np.abs(b)), row)
    ulp = np.exp2(np.floor(np.log2(np.maximum(mag, np.finfo(np.float32).tiny))) - 7)
    return float((np.abs(a.astype(np.float64) - b) / ulp).max())


def _as_table(t: Any) -> Any:
    if isinstance(t, (Bf16Table, Fp8Table, CachedTable)):
        return t
    if getattr(t, "dtype", None) == BF16 and getattr(t, "ndim", 0) == 2:
        return Bf16Table(t)
    raise ConfigError(
        f"a table must be a Bf16Table, Fp8Table, CachedTable or a bfloat16 2-D array, got "
        f"{type(t).__name__} {getattr(t, 'dtype', '')}"
    )


def _host(tokens: Any) -> Any:
    """Token ids on the host (every rank hashes on its host: cheap, and the caches'
    resolve needs host ids)."""
    return tokens.get() if is_device_array(tokens) else tokens


def _group_device(group: Any) -> str:
    """The device of a rank that holds no table: the group's backend's."""
    return "cuda" if dist.get_backend(group) == "nccl" else "cpu"


__all__ = [
    "ULP_FLOOR",
    "RankFailedError",
    "ShardPlacement",
    "ShardedNgramEmbedding",
    "TablePiece",
    "max_ulps",
]
