"""The tools' side of issue 39 (items 14, 18, 19): empty inputs refused where they enter,
bench-io's worker threads stopped and their errors raised in the caller, process pools that
return in order and raise their workers' errors, and tune's advice that never contradicts
itself."""

from __future__ import annotations

import errno
import json

import numpy as np
import pytest

from rowcache.errors import ConfigError, FormatError
from rowcache.tools.trace import Trace
from rowcache.tools.trace_build import build_trace
from rowcache.tools.tune import tune
from rowcache.tools.workers import process_map


def _dims():
    from rowcache.embed.ngram.dims import NgramDims
    from tests.cli.support import TINY_CONFIG

    return NgramDims.from_config(TINY_CONFIG)


def test_build_trace_refuses_requests_without_tokens(tmp_path):
    with pytest.raises(ConfigError, match="no tokens"):
        build_trace(iter([np.zeros(0, np.int64)]), _dims(), tmp_path / "t", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_a_trace_without_tokens_is_refused_at_open(tmp_path):
    t = build_trace([np.arange(3, 40)], _dims(), tmp_path / "t", progress=False)
    m = json.loads((t.path / "manifest.json").read_text())
    for c in m["chunks"]:
        (t.path / c["rows"]).unlink()
        (t.path / c["steps"]).unlink()
    m.update(chunks=[], positions=0, requests=0, steps=0)
    (t.path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(FormatError, match="no tokens"):
        Trace.open(t.path)


def _profile(last_misses: float, unique: float) -> dict:
    """Two tables of 100 accesses each over 10 tokens; misses fall to ``last_misses``."""
    curve = {
        "sizes": [10, 20, 40],
        "misses": [80.0, 50.0, last_misses],
        "accesses": 100,
        "unique": unique,
    }
    return {
        "tokens": 10,
        "record_bytes": 8,
        "dtype": "bf16",
        "tables": {"0": curve, "1": curve},
        "table_rows": [1000, 1000],
    }


def test_tune_unreachable_target_below_the_floor_names_the_floor():
    prof = _profile(last_misses=30.0, unique=30.0)  # flat at its compulsory floor, 0.3
    with pytest.raises(ConfigError, match="compulsory floor") as e:
        tune(prof, target_fault_rate=0.1)
    assert "larger sizes" not in str(e.value)
    rep = tune(prof, arena_bytes=10_000, target_fault_rate=0.1)
    text = " ".join(rep.notes)
    assert "compulsory floor" in text and "larger sizes" not in text


def test_tune_unreachable_target_above_the_floor_asks_for_larger_sizes():
    prof = _profile(last_misses=30.0, unique=5.0)  # still falling at the largest size
    with pytest.raises(ConfigError, match="larger sizes"):
        tune(prof, target_fault_rate=0.1)
    rep = tune(prof, arena_bytes=10_000, target_fault_rate=0.1)
    text = " ".join(rep.notes)
    assert "larger sizes" in text and "gains nothing" not in text


def test_tune_zero_arena_is_explained_as_such():
    with pytest.raises(ConfigError, match="arena_bytes") as e:
        tune(_profile(30.0, 30.0), arena_bytes=0)
    assert "reserve" not in str(e.value)


def test_bench_io_worker_errors_reach_the_caller(tmp_path, monkeypatch, capsys):
    import rowcache.tools.benchio as benchio

    f = tmp_path / "f.bin"
    f.write_bytes(b"\1" * (1 << 16))
    real = benchio.os.preadv
    calls = []

    def flaky(fd, bufs, off):
        calls.append(off)
        if len(calls) > 3:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, bufs, off)

    monkeypatch.setattr(benchio.os, "preadv", flaky)
    with pytest.raises(OSError, match="Input/output error"):
        benchio.measure_io(f, queue_depths=[4], seconds=5, direct=False, progress=False)
    assert "Traceback" not in capsys.readouterr().err


def _square_or_fail(x: int) -> int:
    if x < 0:
        raise ConfigError(f"x={x} is negative")
    return x * x


def test_process_map_keeps_order_and_raises_a_workers_error():
    assert process_map(_square_or_fail, [(i,) for i in range(5)], workers=2) == [0, 1, 4, 9, 16]
    with pytest.raises(ConfigError, match="x=-1"):
        process_map(_square_or_fail, [(1,), (-1,)], workers=2)
