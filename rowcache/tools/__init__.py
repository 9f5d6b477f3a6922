"""Offline tools: traces, miss-ratio curves, policy comparison, cache sizing, disk profiling.

``build_trace`` turns token streams into per-table row-id traces of a modelled server;
``miss_ratio_curve`` draws exact LRU curves (per access, or with the cache's batch
semantics) and SHARDS estimates; ``simulate`` runs SIEVE and Belady's OPT;
``profile_trace`` and ``tune`` turn curves and a ``measure_io`` device profile into an
arena size and split.
"""

from __future__ import annotations

from rowcache.tools.benchio import DeviceProfile, measure_io
from rowcache.tools.mrc import MissRatioCurve, combine_keys, curve_from_samples, miss_ratio_curve
from rowcache.tools.parallel import sample_trace
from rowcache.tools.policies import simulate
from rowcache.tools.profile import ProfileReport, profile_trace
from rowcache.tools.shards import Sample, sample_fixed_rate, sample_fixed_size, top_keys
from rowcache.tools.stack import batch_stack_distances, lru_stack_distances
from rowcache.tools.tokens import iter_requests, make_tokenizer
from rowcache.tools.trace import ServerModel, Trace
from rowcache.tools.trace_build import build_trace
from rowcache.tools.tune import TuneReport, parse_bytes, tune

__all__ = [
    "DeviceProfile",
    "MissRatioCurve",
    "ProfileReport",
    "Sample",
    "ServerModel",
    "Trace",
    "TuneReport",
    "batch_stack_distances",
    "build_trace",
    "combine_keys",
    "curve_from_samples",
    "iter_requests",
    "lru_stack_distances",
    "make_tokenizer",
    "measure_io",
    "miss_ratio_curve",
    "parse_bytes",
    "profile_trace",
    "sample_fixed_rate",
    "sample_fixed_size",
    "sample_trace",
    "simulate",
    "top_keys",
    "tune",
]
