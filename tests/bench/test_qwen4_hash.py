"""The Qwen4 hash judge (``bench/qwen4_hash.py``): its quick run checks native against the
NumPy spec and reports both, with their ratio, at the release's shape."""

from __future__ import annotations

import json

import pytest

from rowcache.kernels import host
from tests.support import run_judge


def test_qwen4_hash_quick_reports_native_and_reference_with_their_ratio():
    if host.native is None:
        pytest.skip("no native module")
    proc = run_judge("qwen4_hash", "--quick", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [r["shape"] for r in rows] == ["prefill 1x2048", "decode 64x1"]
    for r in rows:
        assert r["threads"] == 1 and r["path"] in ("scalar", "avx2", "avx512")
        assert r["native_ns"] > 0 and r["reference_ns"] > 0 and r["scalar_ns"] > 0
        assert r["speedup"] == pytest.approx(r["reference_ns"] / r["native_ns"])


def test_qwen4_hash_refuses_a_bad_repeat():
    proc = run_judge("qwen4_hash", "--repeat", "0")
    assert proc.returncode == 2 and "--repeat 0: give at least 1" in proc.stderr
