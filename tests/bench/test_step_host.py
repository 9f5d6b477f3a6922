"""bench.step_host runs (a few steps a shape) and reports every shape with its baseline."""

import json

from bench import step_host


def test_step_host_reports_every_shape(capsys):
    assert step_host.main(["--steps", "3", "--repeats", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert [r["shape"] for r in rows] == [s for s, _ in step_host.SHAPES]
    for r in rows:
        assert r["step_us"] > 0 and r["hash_us"] > 0
        assert abs(r["ratio"] - r["step_us"] / r["hash_us"]) < 1e-9
