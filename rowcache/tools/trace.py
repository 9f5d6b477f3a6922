"""Row-id traces of a modelled server, written as chunked ``.npy`` files with a manifest.

Owns the server model and the trace format. The model: ``batch`` concurrent
request slots; a request is a prefill of its prompt in chunks of ``chunk`` tokens
followed by its last ``decode`` tokens one per step; each server step (one forward
= one cache batch) takes one unit (a chunk or a token) from every live request in
slot order (round robin); a request is admitted into the first slot that frees, at
the step after its predecessor's last one. Row ids per table come from
``embed.ngram_ids`` over the whole request (equal to chunked or incremental ids by
the NgramCache contract). Memory stays bounded: requests stream in, and the steps
that no later request can join are flushed. Does not compute curves.

Format (directory): ``manifest.json`` and per chunk ``rows-NNNNN.npy`` (int32
[tables, n], the row of each table at each token position, server order) and
``steps-NNNNN.npy`` (int64 [n], the server step = cache batch of each position).
"""

from __future__ import annotations

import heapq
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError, FormatError

TRACE_FORMAT = "rowcache-trace"
TRACE_VERSION = 1
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class ServerModel:
    """How requests share the server: ``batch`` slots, prefill ``chunk``, ``decode`` tokens."""

    batch: int = 64
    chunk: int = 512
    decode: int = 256

    def __post_init__(self) -> None:
        for name in ("batch", "chunk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ConfigError(f"ServerModel.{name} must be an int >= 1; got {v!r}")
        if (
            isinstance(self.decode, bool)
            or not isinstance(self.decode, (int, np.integer))
            or self.decode < 0
        ):
            raise ConfigError(f"ServerModel.decode must be an int >= 0; got {self.decode!r}")

    def units(self, length: int) -> tuple[int, int, int]:
        """``(prompt tokens, decode tokens, steps)`` of a request of ``length`` tokens."""
        d = min(self.decode, max(0, length - 1))
        p = length - d
        return p, d, -(-p // self.chunk) + d


def schedule_request(model: ServerModel, length: int, start: int) -> np.ndarray:
    """Server step of every token of a request admitted at step ``start`` (int64[length])."""
    p, _d, _ = model.units(length)
    t = np.arange(length, dtype=np.int64)
    unit = np.where(t < p, t // model.chunk, -(-p // model.chunk) + (t - p))
    return start + unit


@dataclass(frozen=True)
class TraceChunk:
    """One chunk file pair as listed in the manifest."""

    rows: str
    steps: str
    positions: int
    first_step: int
    last_step: int


@dataclass(frozen=True)
class Trace:
    """An opened trace directory (see the module docstring for the format)."""

    path: Path
    num_tables: int
    table_rows: tuple[int, ...]
    positions: int
    requests: int
    steps: int
    model: ServerModel
    dims: dict[str, Any]
    chunks: tuple[TraceChunk, ...]

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Trace:
        path = Path(path)
        mf = path / MANIFEST
        if not mf.is_file():
            raise FormatError(
                f"{path} is not a trace: {MANIFEST} is missing (run `rowcache trace`)"
            )
        meta = json.loads(mf.read_text())
        if meta.get("format") != TRACE_FORMAT or meta.get("version") != TRACE_VERSION:
            raise FormatError(
                f"{mf}: format {meta.get('format')!r} v{meta.get('version')!r}; "
                f"expected {TRACE_FORMAT!r} v{TRACE_VERSION}"
            )
        return cls(
            path=path,
            num_tables=int(meta["num_tables"]),
            table_rows=tuple(int(r) for r in meta["table_rows"]),
            positions=int(meta["positions"]),
            requests=int(meta["requests"]),
            steps=int(meta["steps"]),
            model=ServerModel(**meta["model"]),
            dims=dict(meta["dims"]),
            chunks=tuple(TraceChunk(**c) for c in meta["chunks"]),
        )

    def _table(self, table: int) -> int:
        if isinstance(table, bool) or not isinstance(table, (int, np.integer)):
            raise ConfigError(f"table must be an int; got {table!r}")
        if not 0 <= table < self.num_tables:
            raise ConfigError(
                f"table={table} is outside [0, {self.num_tables}) of trace {self.path}"
            )
        return int(table)

    def iter_chunks(self, table: int | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``(rows, steps)`` per chunk: rows int64[n] of ``table``, or int32[tables, n]."""
        t = None if table is None else self._table(table)
        for c in self.chunks:
            rows = np.load(self.path / c.rows, mmap_mode="r")
            steps = np.load(self.path / c.steps)
            if t is None:
                yield np.asarray(rows), steps
            else:
                yield np.asarray(rows[t], dtype=np.int64), steps

    def table_accesses(self, table: int) -> tuple[np.ndarray, np.ndarray]:
        """All rows (int64[positions]) and steps (int64[positions]) of one table."""
        parts = list(self.iter_chunks(table))
        if not parts:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def steps_array(self) -> np.ndarray:
        parts = [np.load(self.path / c.steps) for c in self.chunks]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)


class _Writer:
    def __init__(self, out: Path, chunk_positions: int) -> None:
        self.out = out
        self.chunk_positions = chunk_positions
        self.chunks: list[TraceChunk] = []
        self.positions = 0
        self._rows: list[np.ndarray] = []
        self._steps: list[np.ndarray] = []
        self._buffered = 0

    def add(self, rows: np.ndarray, steps: np.ndarray) -> None:
        self._rows.append(rows)
        self._steps.append(steps)
        self._buffered += steps.size
        while self._buffered >= self.chunk_positions:
            self._write(self.chunk_positions)

    def _write(self, n: int) -> None:
        rows = np.concatenate(self._rows, axis=1)
        steps = np.concatenate(self._steps)
        i = len(self.chunks)
        rname, sname = f"rows-{i:05d}.npy", f"steps-{i:05d}.npy"
        np.save(self.out / rname, rows[:, :n])
        np.save(self.out / sname, steps[:n])
        self.chunks.append(TraceChunk(rname, sname, int(n), int(steps[0]), int(steps[n - 1])))
        self.positions += n
        self._rows, self._steps = [rows[:, n:]], [steps[n:]]
        self._buffered = steps.size - n

    def close(self) -> None:
        if self._buffered:
            self._write(self._buffered)


def write_manifest(
    out: Path, writer: Any, dims: Any, model: Any, requests: int, steps: int
) -> None:
    """Write a trace's manifest last and atomically: the trace is valid once it exists.

    ``writer`` is the trace's chunk writer (closed); ``dims`` the NgramDims whose tables
    the rows address; ``model`` the ServerModel that scheduled the requests.
    """
    manifest = {
        "format": TRACE_FORMAT,
        "version": TRACE_VERSION,
        "num_tables": dims.num_tables,
        "table_rows": [int(dims.table_rows(i)) for i in range(dims.num_tables)],
        "positions": writer.positions,
        "requests": requests,
        "steps": steps,
        "model": asdict(model),
        "dims": {
            "vocab_size": dims.vocab_size,
            "hidden_size": dims.hidden_size,
            "max_ngram": dims.max_ngram,
            "splits": dims.splits,
            "ratio": dims.ratio,
            "eos_token_id": dims.eos_token_id,
        },
        "chunks": [asdict(c) for c in writer.chunks],
    }
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.replace(out / MANIFEST)


def build_trace(
    requests: Iterable[np.ndarray],
    dims: Any,
    out: str | os.PathLike[str],
    *,
    model: ServerModel | None = None,
    chunk_positions: int = 1 << 22,
    overwrite: bool = False,
    progress: bool = True,
) -> Trace:
    """Schedule ``requests`` on the modelled server and write their row-id trace.

    Parameters
    ----------
    requests : iterable of int[L_r]
        Token ids of each request, in arrival order.
    dims : embed.NgramDims
    out : path
        A new (or, with ``overwrite``, replaced) trace directory.
    model : ServerModel
    chunk_positions : int
        Token positions per chunk file.

    Returns
    -------
    Trace
    """
    from embed.ids import ngram_ids

    model = model or ServerModel()
    if chunk_positions < 1:
        raise ConfigError(f"chunk_positions must be >= 1; got {chunk_positions}")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise ConfigError(f"trace directory {out} exists and is not empty; pass overwrite=True")
        for f in out.iterdir():
            if f.name == MANIFEST or f.name.startswith(("rows-", "steps-")):
                f.unlink()
    out.mkdir(parents=True, exist_ok=True)
    writer = _Writer(out, int(chunk_positions))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(unit="tok", unit_scale=True, desc="trace")
    # Slot heap: (step at which the slot is free, slot index).
    free: list[tuple[int, int]] = [(0, s) for s in range(model.batch)]
    pend_rows: list[np.ndarray] = []
    pend_key: list[np.ndarray] = []
    pend_n = 0
    n_req = 0
    last_step = -1
    stride = np.int64(model.batch)
    biggest = max(int(dims.table_rows(i)) for i in range(dims.num_tables))
    row_dtype = np.int32 if biggest <= np.iinfo(np.int32).max else np.int64

    def flush(before: int | None) -> None:
        nonlocal pend_rows, pend_key, pend_n
        if not pend_key:
            return
        key = np.concatenate(pend_key)
        rows = np.concatenate(pend_rows, axis=1)
        order = np.argsort(key, kind="stable")
        key, rows = key[order], rows[:, order]
        cut = key.size if before is None else int(np.searchsorted(key, before * stride, "left"))
        if cut:
            writer.add(rows[:, :cut], key[:cut] // stride)
        pend_key, pend_rows = [key[cut:]], [rows[:, cut:]]
        pend_n = key.size - cut

    for tokens in requests:
        tokens = np.asarray(tokens)
        if tokens.size == 0:
            continue
        start, slot = heapq.heappop(free)
        _, _, n_steps = model.units(tokens.size)
        heapq.heappush(free, (start + n_steps, slot))
        steps = schedule_request(model, tokens.size, start)
        ids = np.asarray(ngram_ids(dims, tokens))
        # Sort key: step-major, slot-minor (round robin), token order kept by the stable sort.
        pend_key.append(steps * stride + slot)
        pend_rows.append(ids.astype(row_dtype))
        pend_n += tokens.size
        last_step = max(last_step, int(steps[-1]))
        n_req += 1
        if bar is not None:
            bar.update(tokens.size)
        if pend_n >= 2 * chunk_positions:
            flush(start)  # no later request can run before `start`
    flush(None)
    writer.close()
    if bar is not None:
        bar.close()
    write_manifest(out, writer, dims, model, n_req, last_step + 1)
    return Trace.open(out)
