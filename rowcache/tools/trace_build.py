"""Writing a row-id trace: the modelled server's schedule hashed into chunk files.

Owns :func:`build_trace` (requests streamed in, scheduled by
:class:`rowcache.tools.trace.ServerModel`, hashed by the traced tables'
(``rowcache.tools.trace_tables``: LongCat's or Engram's), written as
``rows-NNNNN.npy`` / ``steps-NNNNN.npy`` chunks into a temporary sibling that is moved
into place whole), its chunk writer and :func:`write_manifest` (the manifest last and
atomically: a trace is valid once it exists). Memory stays bounded: requests stream in,
and the steps that no later request can join are flushed. The format and its reader are
``rowcache.tools.trace``.
"""

from __future__ import annotations

import heapq
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from rowcache.errors import ConfigError
from rowcache.store.replace import sibling_stem
from rowcache.tools.trace import (
    MANIFEST,
    TRACE_FORMAT,
    TRACE_VERSION,
    ServerModel,
    Trace,
    TraceChunk,
    schedule_request,
)
from rowcache.tools.trace_tables import as_trace_tables


class TraceWriter:
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
    out: Path, writer: Any, tables: Any, model: Any, requests: int, steps: int
) -> None:
    """Write a trace's manifest last and atomically: the trace is valid once it exists.

    ``writer`` is the trace's chunk writer (closed); ``tables`` the
    :class:`~rowcache.tools.trace_tables.TraceTables` the rows address; ``model`` the
    ServerModel that scheduled the requests.
    """
    manifest = {
        "format": TRACE_FORMAT,
        "version": TRACE_VERSION,
        "num_tables": tables.num_tables,
        "table_rows": [tables.table_rows(i) for i in range(tables.num_tables)],
        "positions": writer.positions,
        "requests": requests,
        "steps": steps,
        "model": asdict(model),
        "dims": tables.manifest(),
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
    progress: bool | None = None,
) -> Trace:
    """Schedule ``requests`` on the modelled server and write their row-id trace.

    Parameters
    ----------
    requests : iterable of int[L_r]
        Token ids of each request, in arrival order.
    dims : rowcache.embed.NgramDims (LongCat's tables) or rowcache.embed.EngramHash
        (Engram's head tables; ``rowcache.tools.trace_tables``)
    out : path
        A new (or, with ``overwrite``, replaced) trace directory.
    model : ServerModel
    chunk_positions : int
        Token positions per chunk file.
    progress : bool or None
        A bar on stderr (None, the default: only when stderr is a terminal).

    Returns
    -------
    Trace
    """
    model = model or ServerModel()
    tables = as_trace_tables(dims)
    if chunk_positions < 1:
        raise ConfigError(f"chunk_positions must be >= 1; got {chunk_positions}")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"trace directory {out} is a file")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ConfigError(
            f"trace directory {out} exists and is not empty; pass overwrite=True to replace it"
        )
    # Write into a temporary sibling and move it into place when complete: a failed or
    # interrupted run leaves neither a half trace nor an empty directory behind.
    created = _missing_ancestor(out.parent)
    out.parent.mkdir(parents=True, exist_ok=True)
    # mkdtemp adds 8 characters: sibling_stem keeps a long trace name's sibling within NAME_MAX
    tmp = Path(tempfile.mkdtemp(prefix=f".{sibling_stem(out.name)}.tmp-", dir=out.parent))
    try:
        tmp.chmod(0o777 & ~_umask())  # mkdtemp's 0700 would become the trace's mode
        _write_trace(requests, tables, tmp, model, int(chunk_positions), progress)
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise
    return Trace.open(out)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _missing_ancestor(path: Path) -> Path | None:
    """The outermost of ``path`` and its parents that does not exist yet (None: it exists)."""
    top = None
    for p in (path, *path.parents):
        if p.exists():
            break
        top = p
    return top


def _move_into_place(tmp: Path, out: Path) -> None:
    """``tmp`` becomes ``out``; an existing ``out`` keeps its other files, loses its old trace."""
    if not out.exists():
        tmp.rename(out)
        return
    old = out / MANIFEST
    if old.exists():
        old.unlink()  # first: the old trace stops being a trace before its chunks go
    for f in out.iterdir():
        if f.name.startswith(("rows-", "steps-")) and f.suffix == ".npy":
            f.unlink()
    for f in sorted(tmp.iterdir(), key=lambda f: f.name == MANIFEST):
        os.replace(f, out / f.name)  # the manifest last
    tmp.rmdir()


def _request_ids(tables: Any, tokens: np.ndarray) -> np.ndarray:
    """The ids of every table at every position of one request: int64[T, L]."""
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise ConfigError(
            f"request tokens must be a 1-D integer array of token ids, got "
            f"{tokens.dtype}{list(tokens.shape)}"
        )
    return tables.request_ids(tokens)


def _write_trace(
    requests: Iterable[np.ndarray],
    tables: Any,
    out: Path,
    model: ServerModel,
    chunk_positions: int,
    progress: bool | None,
) -> None:
    writer = TraceWriter(out, int(chunk_positions))
    bar = None
    if progress is not False:
        from tqdm import tqdm

        # None: tqdm's rule, a bar only when stderr is a terminal
        bar = tqdm(
            unit="tok", unit_scale=True, desc="trace", disable=None if progress is None else False
        )
    # Slot heap: (step at which the slot is free, slot index).
    free: list[tuple[int, int]] = [(0, s) for s in range(model.batch)]
    pend_rows: list[np.ndarray] = []
    pend_key: list[np.ndarray] = []
    pend_n = 0
    n_req = 0
    last_step = -1
    stride = np.int64(model.batch)
    biggest = max(tables.table_rows(i) for i in range(tables.num_tables))
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
        ids = _request_ids(tables, tokens)
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
    if bar is not None:
        bar.close()
    if n_req == 0:
        raise ConfigError(
            "the inputs hold no tokens (every request was empty): there is nothing to trace"
        )
    flush(None)
    writer.close()
    write_manifest(out, writer, tables, model, n_req, last_step + 1)
