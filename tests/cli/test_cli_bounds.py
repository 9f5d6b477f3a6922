"""Every integer flag has bounds, and no input or output file of a tool waits on a FIFO
(issue 51, items 5 and 6).

``trace --batch 100000000000`` grew to 23.8 GB in a minute; huge ``demo --chunk/--tokens``,
``trace --chunk`` and ``bench-io --queue-depths`` ended in tracebacks. Each integer flag now
takes an ``int_in(low, high)`` type (``rowcache.cli.app``): the table below is every one of
them, checked against the parser (a new integer flag without bounds fails here), and each
refuses a negative, a zero where it needs >= 1, a huge value and a non-integer in one line
through ``main(argv)``. ``tune --disk FIFO`` and ``profile -o FIFO`` waited forever; they
run here in a forked child with an alarm (``tests.store.refusals``), where a hang shows as
SIGALRM.
"""

from __future__ import annotations

import json
import os

import pytest

from rowcache.cli.app import build_parser, main
from tests.cli.support import TINY_CONFIG
from tests.store.refusals import run_cases

# (command, flag, low, high): every integer flag of the CLI and its documented range.
INT_FLAGS = [
    ("demo", "--hidden", 12, 12_288),
    ("demo", "--tokens", 1, 1_000_000_000),
    ("demo", "--decode-tokens", 0, 1_000_000_000),
    ("demo", "--chunk", 1, 1 << 20),
    ("demo", "--seed", 0, 2**63 - 1),
    ("trace", "--batch", 1, 1 << 16),
    ("trace", "--chunk", 1, 1 << 20),
    ("trace", "--decode", 0, 1 << 24),
    ("trace", "--max-request-tokens", 1, 1 << 24),
    ("trace", "--max-requests", 0, 1 << 40),
    ("trace", "--chunk-positions", 1, 1 << 26),
    ("profile", "--sample-size", 1, 1 << 28),
    ("profile", "--salts", 1, 1000),
    ("profile", "--policy-table", 0, 1 << 20),
    ("profile", "--workers", 1, 1024),
    ("profile", "--heavy", 0, 1 << 28),
    ("tune", "--queue-depth", 1, 1024),
    ("bench-io", "--record-bytes", 1, 1 << 26),
    ("bench-io", "--queue-depths", 1, 1024),  # a list: each value
]


def subparsers():
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    return sub.choices


def argv_of(command, tmp_path):
    """The command's required arguments (never reached: the flag is refused first)."""
    return {
        "demo": ["demo"],
        "trace": ["trace", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "tr")],
        "profile": ["profile", str(tmp_path / "tr")],
        "tune": ["tune", str(tmp_path / "prof.json")],
        "bench-io": ["bench-io", str(tmp_path)],
    }[command]


def test_the_table_is_every_integer_flag_of_the_cli():
    found = set()
    for name, p in subparsers().items():
        for a in p._actions:
            if getattr(a.type, "bounds", None) is not None:
                found.add((name, a.option_strings[-1], *a.type.bounds))
            elif a.type is not None:  # no integer flag left unbounded (int, the old positive_int)
                assert a.type is not int and "int" not in a.type.__name__, (name, a.type)
    assert found == set(INT_FLAGS)


def bad_values(low, high):
    values = ["-5", str(high + 1), "1" + "0" * 30, "1.5", "abc", "1e13", ""]
    if low >= 1:
        values.append("0")
    if low > 1:
        values.append(str(low - 1))
    return values


@pytest.mark.parametrize("command, flag, low, high", INT_FLAGS)
def test_an_integer_flag_out_of_its_range_is_one_line_naming_it(
    tmp_path, capsys, command, flag, low, high
):
    for value in bad_values(low, high):
        for given in (value, f"4,{value}") if flag == "--queue-depths" and value else (value,):
            assert main([*argv_of(command, tmp_path), flag, given]) == 2, (flag, given)
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and "Traceback" not in err, err
            assert err.startswith(f"rowcache {command}: error: argument {flag}"), err
            assert repr(value)[:30].rstrip("'") in err, (value, err)
            assert f"from {low:,} to {high:,}" in err, err


@pytest.mark.parametrize("command, flag, low, high", INT_FLAGS)
def test_an_integer_flag_takes_its_bounds_and_help_shows_them(command, flag, low, high):
    p = subparsers()[command]
    (action,) = [a for a in p._actions if flag in a.option_strings]
    want = [low, high] if flag == "--queue-depths" else low
    assert action.type(str(low) if flag != "--queue-depths" else f"{low},{high}") == want
    if flag != "--queue-depths":
        assert action.type(f" {high} ") == high
    assert f"[{low:,}..{high:,}]" in " ".join(p.format_help().split()), flag


def test_a_list_flag_refuses_too_many_values(tmp_path, capsys):
    argv = [*argv_of("bench-io", tmp_path), "--queue-depths", ",".join(["1"] * 65)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "give 1 to 64 integers" in err, err


# --- FIFOs in place of a tool's input or output (item 5) ------------------------------------
@pytest.fixture
def made(tmp_path, rng):
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    reqs = [json.dumps(rng.integers(3, 300, 30).tolist()) for _ in range(20)]
    (tmp_path / "reqs.jsonl").write_text("\n".join(reqs))
    trace = ["trace", str(tmp_path / "reqs.jsonl"), "-o", str(tmp_path / "tr"), "-q"]
    assert main([*trace, "--config", str(tmp_path / "config.json")]) == 0
    prof = str(tmp_path / "prof.json")
    assert main(["profile", str(tmp_path / "tr"), "--sizes", "64,128", "-o", prof, "-q"]) == 0
    os.mkfifo(tmp_path / "fifo")
    return tmp_path


def test_a_fifo_as_a_tools_input_or_output_is_refused_at_once(made):
    w, fifo = made, str(made / "fifo")
    prof, tr, reqs = str(made / "prof.json"), str(made / "tr"), str(made / "reqs.jsonl")
    cases = {
        "tune --disk": (["tune", prof, "--arena", "1M", "--disk", fifo], "--disk"),
        "tune profile": (["tune", fifo, "--arena", "1M"], fifo),
        "tune -o": (["tune", prof, "--arena", "1M", "-o", fifo], "-o/--out"),
        "profile -o": (["profile", tr, "--sizes", "64", "-o", fifo], "-o/--out"),
        "profile --png": (["profile", tr, "--sizes", "64", "--png", fifo], "--png"),
        "bench-io -o": (["bench-io", str(w / "reqs.jsonl"), "-o", fifo], "-o/--out"),
        "trace --config": (["trace", reqs, "-o", str(w / "t2"), "--config", fifo], "--config"),
        "trace --engram": (["trace", reqs, "-o", str(w / "t3"), "--engram", fifo], "--engram"),
    }
    got = run_cases({k: [("cli", argv)] for k, (argv, _) in cases.items()}, w)
    for name, (argv, flag) in cases.items():
        outcome = got[name]
        assert outcome["status"] == 0, f"{name}: the child ended with status {outcome['status']}"
        (call,) = outcome["calls"]
        assert "result" in call, (name, call)
        rc, err = call["result"]["rc"], call["result"]["stderr"]
        assert rc == 2 and err.count("\n") == 1, (name, rc, err)
        assert err.startswith(f"rowcache {argv[0]}: error: "), (name, err)
        assert flag in err and "regular file" in err and fifo in err, (name, err)
    assert not (w / "t2").exists() and not (w / "t3").exists()
