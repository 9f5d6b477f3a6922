"""`rowcache trace/profile/tune/bench-io` through an argparse parser with their register()s."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from rowcache.cli import tools as commands_tools
from rowcache.cli import tune as commands_tune
from rowcache.errors import ConfigError
from rowcache.tools.mrc import miss_ratio_curve
from rowcache.tools.trace import Trace
from tests.cli.support import TINY_CONFIG


def run(argv, capsys):
    parser = argparse.ArgumentParser(prog="rowcache")
    sub = parser.add_subparsers(dest="command", required=True)
    commands_tools.register(sub)
    commands_tune.register(sub)
    args = parser.parse_args(argv)
    code = args.func(args)
    return code, capsys.readouterr().out


@pytest.fixture
def workdir(tmp_path, rng):
    cfg = dict(TINY_CONFIG)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    lines = [
        json.dumps((rng.zipf(1.3, int(rng.integers(5, 80))) % 300).tolist()) for _ in range(120)
    ]
    (tmp_path / "reqs.jsonl").write_text("\n".join(lines))
    return tmp_path


def test_trace_profile_tune_pipeline(workdir, capsys):
    w = workdir
    code, out = run(
        [
            "trace",
            str(w / "reqs.jsonl"),
            "-o",
            str(w / "tr"),
            "--config",
            str(w / "config.json"),
            "--batch",
            "4",
            "--chunk",
            "16",
            "--decode",
            "8",
            "--no-progress",
            "--json",
        ],
        capsys,
    )
    info = json.loads(out)
    assert code == 0 and info["requests"] == 120 and info["tables"] == 4
    code, out = run(
        [
            "profile",
            str(w / "tr"),
            "--sizes",
            "64,128,256,512",
            "--no-progress",
            "--json",
            "--policies",
            "sieve,opt",
            "--policy-rate",
            "1.0",
            "--png",
            str(w / "p.png"),
            "-o",
            str(w / "prof.json"),
        ],
        capsys,
    )
    rep = json.loads(out)
    assert code == 0 and rep["tokens"] == info["tokens"] and rep["record_bytes"] == 4
    assert (w / "p.png").stat().st_size > 1000
    # The CLI's per-table curve is the exact batch curve of that table's accesses.
    trace = Trace.open(w / "tr")
    rows, steps = trace.table_accesses(1)
    exact = miss_ratio_curve(rows, [64, 128, 256, 512], batch=steps)
    got = [np.nan if x is None else x for x in rep["tables"]["1"]["misses"]]
    np.testing.assert_array_equal(got, exact.misses)
    opt = rep["policies"]["opt"]["misses"]
    assert all(o <= s for o, s in zip(opt, rep["policies"]["sieve"]["misses"]))
    # Text rendering.
    code, out = run(["profile", str(w / "tr"), "--sizes", "64,512", "--no-progress"], capsys)
    assert "faults/tok" in out and "compulsory" in out
    # Tune on the saved profile.
    code, out = run(["tune", str(w / "prof.json"), "--arena", "4KiB", "--json"], capsys)
    t = json.loads(out)
    assert code == 0 and t["used_bytes"] <= 4096 and set(t["rows"]) == {"0", "1", "2", "3"}
    code, out = run(
        ["tune", str(w / "prof.json"), "--memory", "10KiB", "--reserve", "2KiB"], capsys
    )
    assert "faults/token" in out and "FP8" in out


def test_bench_io_saves_a_device_profile(tmp_path, capsys):
    f = tmp_path / "disk.bin"
    f.write_bytes(np.random.default_rng(0).integers(0, 255, 1 << 20, dtype=np.uint8).tobytes())
    code, out = run(
        [
            "bench-io",
            str(f),
            "--record-bytes",
            "512",
            "--queue-depths",
            "1,2",
            "--seconds",
            "0.05",
            "--no-progress",
            "--out",
            str(tmp_path / "dev.json"),
            "--json",
        ],
        capsys,
    )
    prof = json.loads(out)
    assert code == 0 and set(prof["random"]) == {"512", "4096"}
    assert all(r > 0 for row in prof["random"].values() for r in row.values())
    assert prof["sequential_bytes_per_s"] > 0
    assert json.loads((tmp_path / "dev.json").read_text())["file_bytes"] == 1 << 20


def test_cli_errors_name_the_argument(workdir, capsys):
    with pytest.raises(ConfigError, match="not a count"):
        run(["profile", str(workdir), "--sizes", "abc"], capsys)
    with pytest.raises(ConfigError, match="not a profile"):
        run(["tune", str(workdir / "config.json"), "--arena", "1G"], capsys)


def test_through_rowcache_main(workdir, capsys, monkeypatch):
    from rowcache.cli import app as cli

    missing = [m for m in ("rowcache.cli.tools", "rowcache.cli.tune")
               if m not in cli.COMMAND_MODULES]  # fmt: skip
    if missing:
        monkeypatch.setattr(cli, "COMMAND_MODULES", [*cli.COMMAND_MODULES, *missing])
    prof = {
        "tokens": 10,
        "record_bytes": 4,
        "dtype": "bf16",
        "tables": {"0": {"sizes": [2, 4], "misses": [6, 3], "accesses": 10}},
    }
    (workdir / "p.json").write_text(json.dumps(prof))
    assert cli.main(["tune", str(workdir / "p.json"), "--arena", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rows"] == {"0": 4} and out["faults_per_token"] == 0.3
    assert cli.main(["tune", str(workdir / "p.json"), "--arena", "lots"]) == 2
    assert "arena" in capsys.readouterr().err
