"""Parallel SHARDS sampling of trace chunks equals the serial sample; Dask when installed."""

from __future__ import annotations

import numpy as np
import pytest

from rowcache.embed.ngram.dims import NgramDims
from rowcache.tools.mrc import miss_ratio_curve
from rowcache.tools.parallel import SHARED, sample_trace
from rowcache.tools.profile import profile_trace
from rowcache.tools.trace import ServerModel
from rowcache.tools.trace_build import build_trace


@pytest.fixture
def trace(tmp_path, rng):
    dims = NgramDims(vocab_size=400, hidden_size=8, max_ngram=3, splits=2, ratio=20, eos_token_id=2)
    reqs = [(rng.zipf(1.2, int(rng.integers(5, 60))) % 400) for _ in range(300)]
    model = ServerModel(batch=6, chunk=16, decode=10)
    return build_trace(
        reqs, dims, tmp_path / "tr", model=model, chunk_positions=1500, progress=False
    )


def serial_curves(trace, sizes, rate, salts):
    out = {}
    for t in range(trace.num_tables):
        pairs = list(trace.iter_chunks(t))
        out[str(t)] = miss_ratio_curve(pairs, sizes, method="shards", sample_rate=rate, salts=salts)
    tcol = (np.arange(trace.num_tables, dtype=np.int64) << 40)[:, None]
    pairs = [
        ((tcol | r.astype(np.int64)).T.ravel(), np.repeat(s, trace.num_tables))
        for r, s in trace.iter_chunks()
    ]
    out[SHARED] = miss_ratio_curve(
        pairs, sizes * trace.num_tables, method="shards", sample_rate=rate, salts=salts
    )
    return out


def test_process_pool_profile_equals_serial(trace):
    assert len(trace.chunks) > 2
    sizes = np.array([50, 200, 800])
    serial = serial_curves(trace, sizes, 0.5, 2)
    rep = profile_trace(
        trace, sizes, method="shards", sample_rate=0.5, salts=2, workers=2, progress=False
    )
    for name, c in rep.curves.items():
        np.testing.assert_array_equal(c.misses, serial[name].misses)
        np.testing.assert_array_equal(c.miss_ratio_std, serial[name].miss_ratio_std)
    np.testing.assert_array_equal(rep.shared.misses, serial[SHARED].misses)


def test_sample_trace_keeps_whole_keys(trace):
    samples = sample_trace(trace, 0.3, salts=1, shared=False)
    rows, steps = trace.table_accesses(0)
    smp = samples[("0", 0)]
    np.testing.assert_array_equal(rows[smp.positions], smp.keys)
    np.testing.assert_array_equal(steps[smp.positions], smp.batch_ids)
    kept = np.isin(rows, np.unique(smp.keys))
    assert kept.sum() == smp.keys.size  # every access of a sampled key is kept


def test_dask_local_cluster_equals_serial(trace):
    distributed = pytest.importorskip("dask.distributed")
    sizes = np.array([50, 400])
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        rep = profile_trace(
            trace, sizes, method="shards", sample_rate=0.5, dask_client=client, progress=False
        )
    serial = serial_curves(trace, sizes, 0.5, 1)
    for name, c in rep.curves.items():
        np.testing.assert_array_equal(c.misses, serial[name].misses)


def test_exact_profile_in_processes_equals_serial(trace):
    sizes = np.array([100, 300, 900])
    a = profile_trace(trace, sizes, workers=2, shared=False, progress=False)
    b = profile_trace(trace, sizes, workers=1, shared=False, progress=False)
    for name in b.curves:
        np.testing.assert_array_equal(a.curves[name].misses, b.curves[name].misses)


def test_sample_trace_with_heavy_rows_equals_serial(trace):
    sizes = np.array([100, 400])
    rep = profile_trace(
        trace, sizes, method="shards", sample_rate=0.2, heavy=30, shared=False, progress=False
    )
    for t in range(trace.num_tables):
        pairs = list(trace.iter_chunks(t))
        c = miss_ratio_curve(pairs, sizes, method="shards", sample_rate=0.2, heavy=30)
        np.testing.assert_allclose(rep.curves[str(t)].misses, c.misses, rtol=1e-12)
