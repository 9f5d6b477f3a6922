"""Row-id traces of a modelled server, written as chunked ``.npy`` files with a manifest.

Owns the server model, the trace format and its reader (:class:`Trace`); writing a trace
is ``rowcache.tools.trace_build``. The model: ``batch`` concurrent
request slots; a request is a prefill of its prompt in chunks of ``chunk`` tokens
followed by its last ``decode`` tokens one per step; each server step (one forward
= one cache batch) takes one unit (a chunk or a token) from every live request in
slot order (round robin); a request is admitted into the first slot that frees, at
the step after its predecessor's last one. Row ids per table come from the LongCat
hash of ``rowcache.kernels.ngram.hash`` over the whole request (``rowcache.embed.ngram_ids``'s; equal to
chunked or incremental ids by the NgramCache contract). Does not compute curves.

Format (directory): ``manifest.json`` and per chunk ``rows-NNNNN.npy`` (int32
[tables, n], the row of each table at each token position, server order) and
``steps-NNNNN.npy`` (int64 [n], the server step = cache batch of each position).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from rowcache.errors import ConfigError, FormatError

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
        """Open and check a trace directory: its manifest, and that it lists every chunk file.

        Each chunk's contents are checked as it is read (:meth:`iter_chunks`).
        """
        path = Path(path)
        mf = path / MANIFEST
        if not mf.is_file():
            raise FormatError(
                f"{path} is not a trace: {MANIFEST} is missing (run `rowcache trace`)"
            )
        try:
            meta = json.loads(mf.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise FormatError(f"{mf}: not a readable trace manifest ({e})") from e
        except RecursionError:
            raise FormatError(f"{mf}: not a trace manifest: nested too deeply to read") from None
        if not isinstance(meta, dict):
            raise FormatError(f"{mf}: a trace manifest is a JSON object; got a {_kind(meta)}")
        if meta.get("format") != TRACE_FORMAT or meta.get("version") != TRACE_VERSION:
            raise FormatError(
                f"{mf}: format {meta.get('format')!r} v{meta.get('version')!r}; "
                f"expected {TRACE_FORMAT!r} v{TRACE_VERSION}"
            )
        missing = sorted(_MANIFEST_KEYS - set(meta))
        if missing:
            raise FormatError(f"{mf}: missing {', '.join(map(repr, missing))}")
        num_tables = _int(mf, "num_tables", meta["num_tables"], 1)
        rows = meta["table_rows"]
        if not isinstance(rows, list) or len(rows) != num_tables:
            raise FormatError(
                f"{mf}: 'table_rows' must list the rows of each of the {num_tables} tables "
                f"('num_tables'); got {_kind(rows)} of {len(rows) if isinstance(rows, list) else '?'}"
            )
        table_rows = tuple(_int(mf, f"table_rows[{i}]", r, 1) for i, r in enumerate(rows))
        positions = _int(mf, "positions", meta["positions"], 0)
        if positions == 0:
            raise FormatError(
                f"{mf}: the trace holds no tokens ('positions' is 0): there is nothing to "
                "read in it; trace inputs that hold tokens"
            )
        for key in ("model", "dims"):
            if not isinstance(meta[key], dict):
                raise FormatError(f"{mf}: {key!r} must be an object; got a {_kind(meta[key])}")
        try:
            model = ServerModel(**meta["model"])
        except (TypeError, ConfigError) as e:
            raise FormatError(f"{mf}: 'model' is not a server model ({e})") from e
        hidden = meta["dims"].get("hidden_size")
        if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < num_tables:
            raise FormatError(f"{mf}: 'dims' needs hidden_size >= num_tables; got {hidden!r}")
        if not isinstance(meta["chunks"], list):
            raise FormatError(f"{mf}: 'chunks' must be a list; got a {_kind(meta['chunks'])}")
        chunks = tuple(_chunk(mf, i, c) for i, c in enumerate(meta["chunks"]))
        listed = sum(c.positions for c in chunks)
        if listed != positions:
            raise FormatError(
                f"{mf}: its {len(chunks)} chunks hold {listed} positions but 'positions' "
                f"says {positions}"
            )
        for i in range(1, len(chunks)):
            if chunks[i].first_step < chunks[i - 1].last_step:
                raise FormatError(f"{mf}: chunk {i} starts before chunk {i - 1} ends (steps)")
        on_disk = {f.name for f in path.glob("rows-*.npy")} | {
            f.name for f in path.glob("steps-*.npy")
        }
        names = {c.rows for c in chunks} | {c.steps for c in chunks}
        if on_disk - names:
            extra = sorted(on_disk - names)
            raise FormatError(
                f"{mf}: lists {len(chunks)} chunks, but {path} also holds {len(extra)} other "
                f"chunk files ({extra[0]}, ...): not the manifest of these files"
            )
        for n in sorted(names - on_disk):
            raise FormatError(f"{path / n}: listed in {MANIFEST} but missing")
        return cls(
            path=path,
            num_tables=num_tables,
            table_rows=table_rows,
            positions=positions,
            requests=_int(mf, "requests", meta["requests"], 0),
            steps=_int(mf, "steps", meta["steps"], 0),
            model=model,
            dims=dict(meta["dims"]),
            chunks=chunks,
        )

    def _table(self, table: int) -> int:
        if isinstance(table, bool) or not isinstance(table, (int, np.integer)):
            raise ConfigError(f"table must be an int; got {table!r}")
        if not 0 <= table < self.num_tables:
            raise ConfigError(
                f"table={table} is outside [0, {self.num_tables}) of trace {self.path}"
            )
        return int(table)

    def _load(self, i: int, name: str, mmap: bool) -> np.ndarray:
        f = self.path / name
        try:
            arr = np.load(f, mmap_mode="r" if mmap else None, allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            raise FormatError(
                f"{f} (chunk {i}): not a readable .npy file ({e or type(e).__name__})"
            ) from e
        if arr.dtype.kind not in "iu":
            raise FormatError(f"{f} (chunk {i}): expected integers; got {arr.dtype}")
        return arr

    def _steps(self, i: int, c: TraceChunk) -> np.ndarray:
        steps = self._load(i, c.steps, mmap=False)
        f = self.path / c.steps
        if steps.shape != (c.positions,):
            raise FormatError(
                f"{f} (chunk {i}): shape {steps.shape}; the manifest says ({c.positions},)"
            )
        steps = steps.astype(np.int64, copy=False)
        if steps.size and (int(steps[0]) != c.first_step or int(steps[-1]) != c.last_step):
            raise FormatError(
                f"{f} (chunk {i}): steps {int(steps[0])}..{int(steps[-1])}; the manifest says "
                f"{c.first_step}..{c.last_step}"
            )
        if steps.size > 1 and bool(np.any(np.diff(steps) < 0)):
            raise FormatError(f"{f} (chunk {i}): server steps must not decrease")
        return steps

    def _rows(self, i: int, c: TraceChunk) -> np.ndarray:
        rows = self._load(i, c.rows, mmap=True)
        if rows.shape != (self.num_tables, c.positions):
            raise FormatError(
                f"{self.path / c.rows} (chunk {i}): shape {rows.shape}; the manifest says "
                f"({self.num_tables} tables, {c.positions} positions)"
            )
        return rows

    def _check_rows(self, i: int, c: TraceChunk, rows: np.ndarray, tables: np.ndarray) -> None:
        """Row ids within each table's rows: ``rows[k]`` (int[n]) belongs to ``tables[k]``."""
        if rows.shape[-1] == 0:
            return
        lo, hi = rows.min(axis=-1), rows.max(axis=-1)
        limit = np.asarray(self.table_rows, dtype=np.int64)[tables]
        bad = np.flatnonzero((lo < 0) | (hi >= limit))
        if bad.size:
            k = int(bad[0])
            v = int(lo[k]) if lo[k] < 0 else int(hi[k])
            raise FormatError(
                f"{self.path / c.rows} (chunk {i}): table {int(tables[k])} has row id {v}, "
                f"outside its [0, {int(limit[k])}) rows"
            )

    def iter_chunks(self, table: int | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``(rows, steps)`` per chunk: rows int64[n] of ``table``, or int32[tables, n].

        Each chunk is checked against the manifest (shapes, steps, row ids within
        each table's rows); a bad one raises :class:`FormatError` naming its file.
        """
        t = None if table is None else self._table(table)
        for i in range(len(self.chunks)):
            yield self.read_chunk(i, t)

    def read_chunk(self, i: int, table: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Chunk ``i`` checked: ``(rows, steps)`` as :meth:`iter_chunks` yields them."""
        c = self.chunks[i]
        rows = self._rows(i, c)
        steps = self._steps(i, c)
        if table is None:
            out = np.asarray(rows)
            self._check_rows(i, c, out, np.arange(self.num_tables))
            return out, steps
        t = self._table(table)
        one = np.asarray(rows[t], dtype=np.int64)
        self._check_rows(i, c, one[None, :], np.array([t]))
        return one, steps

    def table_accesses(self, table: int) -> tuple[np.ndarray, np.ndarray]:
        """All rows (int64[positions]) and steps (int64[positions]) of one table."""
        parts = list(self.iter_chunks(table))
        if not parts:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def steps_array(self) -> np.ndarray:
        parts = [self._steps(i, c) for i, c in enumerate(self.chunks)]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)


_MANIFEST_KEYS = {
    "num_tables",
    "table_rows",
    "positions",
    "requests",
    "steps",
    "model",
    "dims",
    "chunks",
}
_CHUNK_KEYS = {f.name for f in fields(TraceChunk)}


def _kind(x: Any) -> str:
    names: dict[type, str] = {list: "list", dict: "object", str: "string"}
    return names.get(type(x), type(x).__name__)


def _int(mf: Path, key: str, v: Any, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise FormatError(f"{mf}: {key!r} must be an integer >= {lo}; got {v!r}")
    return v


def _chunk(mf: Path, i: int, c: Any) -> TraceChunk:
    if not isinstance(c, dict) or set(c) != _CHUNK_KEYS:
        got = sorted(c) if isinstance(c, dict) else _kind(c)
        raise FormatError(
            f"{mf}: chunk {i} must be an object with keys {sorted(_CHUNK_KEYS)}; got {got}"
        )
    for key in ("rows", "steps"):
        name = c[key]
        if not isinstance(name, str) or not name.endswith(".npy") or os.path.basename(name) != name:
            raise FormatError(f"{mf}: chunk {i}: {key!r} must be a .npy file name; got {name!r}")
    pos = _int(mf, f"chunks[{i}].positions", c["positions"], 1)
    first = _int(mf, f"chunks[{i}].first_step", c["first_step"], 0)
    last = _int(mf, f"chunks[{i}].last_step", c["last_step"], first)
    return TraceChunk(c["rows"], c["steps"], pos, first, last)
