"""What every command shares, through ``main(argv)``: version, help, -q, usage errors,
progress bars only on a terminal and never under an error, a quiet closed pipe."""

from __future__ import annotations

import argparse
import importlib.metadata
import io
import json
import subprocess
import sys

import pytest

import rowcache
from rowcache.cli.app import build_parser, main
from tests.cli.support import TINY_CONFIG

CONFIG = TINY_CONFIG


@pytest.fixture
def small_trace(tmp_path, rng):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    lines = [json.dumps(rng.integers(3, 300, int(rng.integers(5, 60))).tolist()) for _ in range(80)]
    (tmp_path / "reqs.jsonl").write_text("\n".join(lines))
    argv = ["trace", str(tmp_path / "reqs.jsonl"), "-o", str(tmp_path / "tr")]
    argv += ["--config", str(tmp_path / "config.json"), "--batch", "4", "--chunk", "16"]
    assert main([*argv, "--decode", "8", "-q"]) == 0
    return tmp_path / "tr"


def one_error_line(capsys, prog: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"rowcache {prog}: error: "), err
    return err


def test_version_everywhere(capsys):
    assert rowcache.__version__ == importlib.metadata.version("rowcache")
    assert main(["--version"]) == 0
    first = f"rowcache {rowcache.__version__} from "  # then where, and the native extensions
    assert capsys.readouterr().out.startswith(first)
    got = subprocess.run(
        [sys.executable, "-m", "rowcache", "--version"], capture_output=True, text=True
    )
    assert got.returncode == 0 and got.stdout.startswith(first)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_help_every_command_described_every_option_helped_defaults_shown(capsys):
    commands = _subparsers(build_parser())
    assert set(commands) >= {"build", "inspect", "verify", "demo", "trace", "profile", "tune"}
    for name, p in commands.items():
        assert p.description, f"{name} has no description"
        for a in p._actions:
            assert a.help, f"{name} {a.option_strings or a.dest} has no help"
    assert main(["trace", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 64)" in out and "(default: deepseek)" in out
    assert main(["bench-io", "--help"]) == 0
    assert "(default: 1,4,16,32,64)" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["profile", "x", "--salts", "0"], "--salts"),
        (["profile", "x", "--rate", "2"], "--rate"),
        (["trace", "x", "-o", "y", "--batch", "0"], "--batch"),
        (["bench-io", "x", "--queue-depths", "1,x"], "--queue-depths"),
        (["bench-io", "x", "--record-bytes", "0"], "--record-bytes"),
        (["tune", "p.json", "--target-rate", "-1"], "--target-rate"),
        (["tune", "p.json", "--target-rate", "0"], "--target-rate"),
        (["tune", "p.json", "--target-rate", "2"], "--target-rate"),
        (["tune", "p.json", "--target-rate", "nan"], "--target-rate"),
        (["tune", "p.json", "--arena", "1e400B"], "--arena"),
        (["tune", "p.json", "--arena", "12GB"], "--arena"),
        (["build", "s", "--shard-mib", "0"], "--shard-mib"),
        (["demo", "--device", "tpu"], "--device"),
        (["demo", "--arena-fraction", "0"], "--arena-fraction"),
    ],
)
def test_usage_errors_name_the_flag_one_line_exit_2(argv, flag, capsys):
    assert main(argv) == 2
    err = one_error_line(capsys, argv[0])
    assert f"argument {flag}" in err


def test_no_command_is_a_usage_error(capsys):
    assert main([]) == 2
    assert capsys.readouterr().err.startswith("rowcache: error: ")


def test_quiet_and_no_bars_off_a_terminal(small_trace, capsys):
    # stderr is not a terminal under capsys: no bar even without --no-progress.
    assert main(["profile", str(small_trace), "--sizes", "64,128"]) == 0
    assert capsys.readouterr().err == ""
    save = small_trace.parent / "p.json"
    assert main(["profile", str(small_trace), "--sizes", "64", "-o", str(save)]) == 0
    assert "saved" in capsys.readouterr().err
    assert main(["-q", "profile", str(small_trace), "--sizes", "64", "-o", str(save)]) == 0
    assert capsys.readouterr().err == ""
    assert main(["profile", str(small_trace), "-q", "--sizes", "64", "-o", str(save)]) == 0
    assert capsys.readouterr().err == ""


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_an_error_never_shares_a_line_with_a_progress_bar(small_trace, monkeypatch):
    import numpy as np

    rows = small_trace / "rows-00000.npy"
    bad = np.load(rows)
    bad[3, -1] = 10**6  # table 3 fails after tables 0-2 were drawn on the bar
    np.save(rows, bad)
    term = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert main(["profile", str(small_trace), "--sizes", "64"]) == 2
    text = term.getvalue()
    assert "profile:" in text  # a bar was drawn: stderr is a terminal
    last = text.split("\n")[-2]  # the error line, after the bar's own newline
    assert last.startswith("rowcache profile: error: "), repr(text)
    assert "table 3 has row id 1000000" in last and "rows-00000.npy" in last


def test_closed_pipe_exits_quietly(small_trace):
    """`rowcache profile trace | head -n 1`: no 'Broken pipe' error, no traceback."""
    sizes = ",".join(str(s) for s in range(1, 4000))  # ~400 KB of report: more than a pipe holds
    cmd = f"{sys.executable} -m rowcache profile {small_trace} --sizes {sizes} | head -n 1"
    got = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0 and got.stdout.count("\n") == 1 and "tokens" in got.stdout
    assert got.stderr == "", got.stderr
    # Without the handling the writer dies of EPIPE; with it, it exits 141 like `yes | head`.
    status = subprocess.run(
        ["bash", "-c", f"{cmd}; echo ${{PIPESTATUS[0]}} >&2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert status.stderr.strip().splitlines()[-1] == "141", status.stderr


def test_broken_pipe_through_main(small_trace, monkeypatch):
    class Closed(io.StringIO):
        def write(self, s: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", Closed())
    assert main(["profile", str(small_trace), "--sizes", "64"]) == 141
