"""bench/mrc.py runs at a tiny size and reports every claim."""

from __future__ import annotations

import importlib.util
import json
import pathlib


def test_bench_mrc_quick(capsys):
    path = pathlib.Path(__file__).resolve().parents[2] / "bench" / "mrc.py"
    spec = importlib.util.spec_from_file_location("bench_mrc", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--quick", "--json", "--synthetic", "20000", "--text-mb", "0.1"]) == 0
    out = json.loads(capsys.readouterr().out)
    claims = [r["claim"] for r in out["results"]]
    assert any(c.startswith("exact LRU") for c in claims)
    assert any("SHARDS" in c and "error" in c for c in claims)
    err = next(r for r in out["results"] if "error" in r["claim"])
    assert 0 <= err["project"] < 0.2
