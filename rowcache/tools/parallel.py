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
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np

from ..errors import ConfigError
from .shards import HASH_SPACE, Sample, key_hash, rate_threshold
from .trace import Trace

SHARED = "shared"


def sample_chunk(
    path: str,
    rows_file: str,
    steps_file: str,
    offset: int,
    threshold: int,
    salts: int,
    shared: bool,
) -> dict[tuple[str, int], tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Sample one chunk: ``{(table or "shared", salt): (keys, positions, steps)}``.

    Positions count from the trace start (``offset`` = the chunk's first position);
    shared-arena positions are ``position * tables + table`` (position-major order).
    A plain function of file names so that process pools and Dask can ship it.
    """
    rows = np.load(f"{path}/{rows_file}", mmap_mode="r")
    steps = np.load(f"{path}/{steps_file}")
    t_count = rows.shape[0]
    out: dict[tuple[str, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    for t in range(t_count):
        keys = np.asarray(rows[t], dtype=np.int64)
        for salt in range(salts):
            keep = np.flatnonzero(key_hash(keys, salt) < threshold)
            out[(str(t), salt)] = (keys[keep], keep + offset, steps[keep])
            if shared:
                # The shared arena samples combined keys, hashed as such.
                combined = (np.int64(t) << 40) | keys
                k2 = np.flatnonzero(key_hash(combined, salt) < threshold)
                piece = (combined[k2], (k2 + offset) * t_count + t, steps[k2])
                prev = out.get((SHARED, salt))
                if prev is not None:
                    piece = (
                        np.concatenate((prev[0], piece[0])),
                        np.concatenate((prev[1], piece[1])),
                        np.concatenate((prev[2], piece[2])),
                    )
                out[(SHARED, salt)] = piece
    if shared:
        for salt in range(salts):
            k, p, s = out[(SHARED, salt)]
            order = np.argsort(p, kind="stable")
            out[(SHARED, salt)] = (k[order], p[order], s[order])
    return out


def sample_trace(
    trace: Trace,
    rate: float,
    *,
    salts: int = 1,
    shared: bool = True,
    workers: int = 1,
    dask_client: Any = None,
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

    Returns
    -------
    dict mapping ``(table name or "shared", salt)`` to :class:`Sample` whose
    ``batch_ids`` are the server steps.
    """
    if int(workers) < 1:
        raise ConfigError(f"workers must be >= 1; got {workers}")
    threshold = rate_threshold(rate)
    offsets = np.concatenate(([0], np.cumsum([c.positions for c in trace.chunks])))
    args = [
        (str(trace.path), c.rows, c.steps, int(offsets[i]), threshold, int(salts), bool(shared))
        for i, c in enumerate(trace.chunks)
    ]
    cols = [list(a) for a in zip(*args)] if args else [[] for _ in range(7)]
    if dask_client is not None:
        parts = dask_client.gather(dask_client.map(sample_chunk, *cols, pure=False))
    elif workers > 1 and len(args) > 1:
        with ProcessPoolExecutor(max_workers=int(workers)) as ex:
            parts = list(ex.map(sample_chunk, *cols))
    else:
        parts = [sample_chunk(*a) for a in args]
    names: Sequence[str] = [str(t) for t in range(trace.num_tables)] + ([SHARED] if shared else [])
    out: dict[tuple[str, int], Sample] = {}
    for name in names:
        total = trace.positions * (trace.num_tables if name == SHARED else 1)
        for salt in range(int(salts)):
            pieces = [p[(name, salt)] for p in parts]
            k, pos, st = (
                (np.concatenate([x[i] for x in pieces]) for i in range(3))
                if pieces
                else (np.zeros(0, np.int64) for _ in range(3))
            )
            out[(name, salt)] = Sample(k, pos, total, threshold / HASH_SPACE, threshold, st)
    return out
