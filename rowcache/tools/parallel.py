"""SHARDS sampling of a trace's chunk files in parallel: processes, or a Dask cluster.

Owns the partition function :func:`sample_chunk` (one chunk file -> the sampled
accesses of every table, and of the shared arena, for every salt) and
:func:`sample_trace`, which maps it over the chunks with a process pool or a
``dask.distributed`` client and merges the pieces in trace order. A hash range of
row ids is exactly a SHARDS partition, so samples of disjoint chunks concatenate
into the sample of the whole trace. Curves are then computed in one process
(``mrc.curve_from_samples``): a 1% sample is small.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rowcache.errors import ConfigError
from rowcache.tools.shards import HASH_SPACE, Sample, is_member, key_hash, rate_threshold, top_keys
from rowcache.tools.trace import Trace

SHARED = "shared"


def sample_chunk(
    path: str,
    rows_file: str,
    steps_file: str,
    offset: int,
    threshold: int,
    salts: int,
    shared: bool,
    heavy: dict[str, np.ndarray] | None = None,
) -> dict[tuple[str, int], tuple[np.ndarray, ...]]:
    """Sample one chunk: ``{(table or "shared", salt): (keys, positions, steps, forced)}``.

    Positions count from the trace start (``offset`` = the chunk's first position);
    shared-arena positions are ``position * tables + table`` (position-major order).
    ``heavy`` maps a table name to sorted rows kept at every access (in the
    shared arena too).
    A plain function of file names so that process pools and Dask can ship it.
    """
    trace = Trace.open(path)
    i = next((i for i, c in enumerate(trace.chunks) if c.rows == rows_file), None)
    if i is None or trace.chunks[i].steps != steps_file:
        raise ConfigError(f"{path}: no chunk ({rows_file}, {steps_file}) in its manifest")
    rows, steps = trace.read_chunk(i)  # checked against the manifest
    t_count = rows.shape[0]
    out: dict[tuple[str, int], tuple[np.ndarray, ...]] = {}

    def pick(
        name: str, keys: np.ndarray, rows_t: np.ndarray, t: int, salt: int
    ) -> tuple[np.ndarray, np.ndarray]:
        mask = key_hash(keys, salt) < threshold
        forced = np.zeros(keys.size, dtype=bool)
        if heavy is not None and str(t) in heavy:
            # The shared arena's heavy keys are the tables' heavy rows: test the rows.
            forced = is_member(rows_t, heavy[str(t)])
            mask |= forced
        keep = np.flatnonzero(mask)
        return keep, forced[keep]

    for t in range(t_count):
        keys = np.asarray(rows[t], dtype=np.int64)
        combined = (np.int64(t) << 40) | keys
        for salt in range(salts):
            keep, forced = pick(str(t), keys, keys, t, salt)
            out[(str(t), salt)] = (keys[keep], keep + offset, steps[keep], forced)
            if shared:
                # The shared arena samples combined keys, hashed as such.
                k2, f2 = pick(SHARED, combined, keys, t, salt)
                piece: tuple[np.ndarray, ...] = (
                    combined[k2],
                    (k2 + offset) * t_count + t,
                    steps[k2],
                    f2,
                )
                prev = out.get((SHARED, salt))
                if prev is not None:
                    piece = tuple(np.concatenate((x, y)) for x, y in zip(prev, piece))
                out[(SHARED, salt)] = piece
    if shared:
        for salt in range(salts):
            k, p, s, f = out[(SHARED, salt)]
            order = np.argsort(p, kind="stable")
            out[(SHARED, salt)] = (k[order], p[order], s[order], f[order])
    return out


def sample_trace(
    trace: Trace,
    rate: float,
    *,
    salts: int = 1,
    shared: bool = True,
    workers: int = 1,
    dask_client: Any = None,
    heavy: int = 0,
) -> dict[tuple[str, int], Sample]:
    """Fixed-rate SHARDS samples of every table (and the shared arena) of ``trace``.

    Parameters
    ----------
    trace : Trace
    rate : float in (0, 1]
    salts : int
        Independent samples (hash salts) for error bars.
    workers : int
        Processes (1 = in this process); ignored with ``dask_client``.
    dask_client : dask.distributed.Client, optional
        Runs :func:`sample_chunk` on the cluster (the trace path must be visible to
        the workers).
    heavy : int
        Also keep every access of each table's ``heavy`` most frequent rows (one
        counting pass first); the shared arena keeps all of them.

    Returns
    -------
    dict mapping ``(table name or "shared", salt)`` to :class:`Sample` whose
    ``batch_ids`` are the server steps.
    """
    if int(workers) < 1:
        raise ConfigError(f"workers must be >= 1; got {workers}")
    threshold = rate_threshold(rate)
    offsets = np.concatenate(([0], np.cumsum([c.positions for c in trace.chunks])))
    hv: dict[str, np.ndarray] | None = None
    if heavy:
        hv = {str(t): top_keys(trace.iter_chunks(t), int(heavy)) for t in range(trace.num_tables)}
    args = [
        (str(trace.path), c.rows, c.steps, int(offsets[i]), threshold, int(salts), bool(shared), hv)
        for i, c in enumerate(trace.chunks)
    ]
    cols = [list(a) for a in zip(*args)] if args else [[] for _ in range(8)]
    if dask_client is not None:
        parts = dask_client.gather(dask_client.map(sample_chunk, *cols, pure=False))
    elif workers > 1 and len(args) > 1:
        from rowcache.tools.workers import process_map

        parts = process_map(sample_chunk, args, workers=int(workers))
    else:
        parts = [sample_chunk(*a) for a in args]
    names: Sequence[str] = [str(t) for t in range(trace.num_tables)] + ([SHARED] if shared else [])
    out: dict[tuple[str, int], Sample] = {}
    for name in names:
        total = trace.positions * (trace.num_tables if name == SHARED else 1)
        for salt in range(int(salts)):
            pieces = [p[(name, salt)] for p in parts]
            if pieces:
                k, pos, st, fo = (np.concatenate([x[i] for x in pieces]) for i in range(4))
            else:
                k, pos, st = (np.zeros(0, np.int64) for _ in range(3))
                fo = np.zeros(0, dtype=bool)
            out[(name, salt)] = Sample(
                k, pos, total, threshold / HASH_SPACE, threshold, st, fo if heavy else None
            )
    return out
