"""What an adversarial run and a new user broke in the CLI (issue 39, items 13, 14, 17, 19, 21),
through ``main(argv)``: deeply nested JSON, empty inputs, every output read back by the
command that consumes it, ``verify`` of a damaged store, messages that misled, ``-o/--out``
everywhere, and what ``profile``'s exact method costs."""

from __future__ import annotations

import dataclasses
import errno
import json
import os

import ml_dtypes
import numpy as np
import pytest

import rowcache
from rowcache.cli.app import build_parser, main
from tests.cli.support import TINY_CONFIG

DEEP = "[" * 100_000 + "]" * 100_000  # a RecursionError for json.loads


def err_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert ": error: " in err, err
    return err


@pytest.fixture
def w(tmp_path, rng):
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    lines = [json.dumps(rng.integers(3, 300, int(rng.integers(5, 60))).tolist()) for _ in range(80)]
    (tmp_path / "reqs.jsonl").write_text("\n".join(lines))
    return tmp_path


def trace_argv(w, *inputs, out="tr", config="config.json"):
    argv = ["trace", *[str(w / i) for i in inputs], "-o", str(w / out), "-q"]
    return [*argv, "--config", str(w / config), "--batch", "4", "--chunk", "16"]


@pytest.fixture
def tr(w):
    assert main([*trace_argv(w, "reqs.jsonl"), "--chunk-positions", "1000"]) == 0
    return w / "tr"


@pytest.fixture
def prof(tr, capsys):
    p = tr.parent / "prof.json"
    assert main(["profile", str(tr), "--sizes", "64,128,256,1024", "-o", str(p), "-q"]) == 0
    capsys.readouterr()
    return p


# --- 13: deeply nested JSON -----------------------------------------------------------------
def test_deeply_nested_json_is_a_one_line_error_naming_the_file(w, tr, prof, capsys):
    deep = w / "deep.json"
    deep.write_text(DEEP)
    (w / "deep.jsonl").write_text(DEEP + "\n")
    cases = [
        (["tune", str(deep), "--arena", "1M"], str(deep)),
        (["tune", str(prof), "--arena", "1M", "--disk", str(deep)], "--disk"),
        (trace_argv(w, "reqs.jsonl", out="t2", config="deep.json"), "--config"),
        (trace_argv(w, "deep.jsonl", out="t3"), "deep.jsonl:1"),
    ]
    for argv, names in cases:
        assert main(argv) == 2, argv
        err = err_line(capsys)
        assert names in err and "nested" in err, err
    (tr / "manifest.json").write_text(DEEP)
    assert main(["profile", str(tr)]) == 2
    assert "manifest.json" in (e := err_line(capsys)) and "nested" in e


def test_a_store_whose_meta_record_is_deeply_nested_is_refused(tmp_path, rng, capsys):
    import lmdb

    from rowcache.format import layout as fmt
    from rowcache.store.marker import write_marker

    x = rng.standard_normal((100, 16), dtype=np.float32).astype(ml_dtypes.bfloat16)
    rowcache.build_store(tmp_path / "s", {"t": x}, progress=False).close()
    env = lmdb.open(str(tmp_path / "s" / fmt.INDEX_NAME), subdir=True, lock=False)
    with env.begin(write=True) as txn:
        txn.put(fmt.META_KEY, DEEP.encode())
    env.close()
    write_marker(tmp_path / "s")  # as a builder that wrote this meta record would
    for cmd in ("inspect", "verify"):
        assert main([cmd, str(tmp_path / "s")]) == 2
        assert str(tmp_path / "s") in (e := err_line(capsys)) and "not valid JSON" in e, e


# --- 14: empty input; every output read back by its consumer ------------------------------
@pytest.mark.parametrize(
    ("name", "content"), [("e.jsonl", ""), ("e.jsonl", "\n[]\n\n"), ("e.txt", "\n\n")]
)
def test_trace_refuses_inputs_without_tokens_and_leaves_nothing(w, capsys, name, content):
    (w / name).write_text(content)
    assert main([*trace_argv(w, name, out="te"), "--tokenizer", "bytes"]) == 2
    assert "no tokens" in err_line(capsys)
    assert sorted(p.name for p in w.iterdir()) == sorted(["config.json", "reqs.jsonl", name])


def test_profile_refuses_a_trace_without_tokens(tr, capsys):
    m = json.loads((tr / "manifest.json").read_text())
    for f in tr.glob("*.npy"):
        f.unlink()
    m.update(chunks=[], positions=0, requests=0, steps=0)
    (tr / "manifest.json").write_text(json.dumps(m))
    for method in ("exact", "shards"):
        assert main(["profile", str(tr), "--method", method]) == 2
        assert "no tokens" in err_line(capsys)


def test_shards_curve_of_an_empty_sample_is_never_negative():
    from rowcache.tools.mrc import curve_from_samples
    from rowcache.tools.shards import sample_fixed_rate

    smp = sample_fixed_rate([(np.zeros(0, np.int64), np.zeros(0, np.int64))], 0.01)
    assert curve_from_samples([smp], [64]).min_feasible >= 0


@pytest.mark.parametrize(
    "flags",
    [
        [],
        ["--method", "shards", "--rate", "1", "--salts", "2", "--heavy", "4"],
        ["--per-access", "--no-shared"],
        ["--dtype", "fp8", "--policies", "sieve", "--policy-rate", "1"],
    ],
)
def test_every_output_is_read_by_the_command_that_consumes_it(w, tr, capsys, flags):
    """trace -o -> profile; profile -o (and --json) -> tune; bench-io -o -> tune --disk;
    tune -o -> from_pretrained(tune=...)'s reader."""
    from rowcache.embed.checkpoint import tune_slots

    p, d, t = w / "p.json", w / "disk.json", w / "tune.json"
    assert main(["profile", str(tr), "--sizes", "64,256", "-o", str(p), "-q", *flags]) == 0
    capsys.readouterr()
    assert main(["profile", str(tr), "--sizes", "64,256", "--json", "-q", *flags]) == 0
    (w / "stdout.json").write_text(capsys.readouterr().out)
    big = w / "f.bin"
    big.write_bytes(b"\1" * (1 << 16))
    argv = ["bench-io", str(big), "--queue-depths", "1", "--seconds", "0.01", "-q"]
    assert main([*argv, "--record-bytes", "100", "-o", str(d)]) == 0
    for prof in (p, w / "stdout.json"):
        assert main(["tune", str(prof), "--arena", "1M", "--disk", str(d), "-o", str(t)]) == 0
        rows = json.loads(t.read_text())["rows"]
        assert tune_slots(str(t)) == rows and len(rows) == 4
    capsys.readouterr()


def test_profile_refuses_sizes_no_table_can_run_at_rather_than_save_what_tune_refuses(tr, capsys):
    out = tr.parent / "p.json"
    assert main(["profile", str(tr), "--sizes", "1,2", "-o", str(out)]) == 2
    err = err_line(capsys)
    assert "--sizes" in err and "min feasible" in err
    assert not out.exists()


# --- 17: verify of a damaged store ----------------------------------------------------------
def test_verify_names_each_damaged_shard_and_exits_1(tmp_path, rng, capsys):
    x = rng.standard_normal((5000, 32), dtype=np.float32).astype(ml_dtypes.bfloat16)
    s = rowcache.build_store(tmp_path / "s", {"t": x}, progress=False, shard_bytes=16 * 4096)
    files = [r.file for r in s.shards[0]]
    s.close()
    assert len(files) >= 4
    os.truncate(tmp_path / "s" / files[0], 5000)
    os.unlink(tmp_path / "s" / files[1])
    with open(tmp_path / "s" / files[2], "r+b") as f:
        f.seek(4096 + 10)
        f.write(b"\xff\xfe")
    assert main(["verify", str(tmp_path / "s"), "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert rep["ok"] is False and rep["damaged_shards"] == files[:3]
    for f in files[:3]:
        assert any(p.startswith(f) for p in rep["problems"]), (f, rep["problems"])
    assert main(["verify", str(tmp_path / "s")]) == 1
    out = capsys.readouterr().out
    assert all(f in out for f in files[:3]) and "3 of" in out and files[3] not in out


# --- 19: messages that mislead ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("flags", "flag", "want"),
    [
        (["--arena", "0"], "--arena", "> 0"),
        (["--arena", "-5GiB"], "--arena", "> 0"),
        (["--arena=-5GiB"], "--arena", "> 0"),
        (["--memory", "0", "--reserve", "0"], "--memory", "> 0"),
        (["--memory", "8G", "--reserve", "-1"], "--reserve", ">= 0"),
    ],
)
def test_size_flags_refuse_zero_and_negative_naming_the_flag(prof, capsys, flags, flag, want):
    assert main(["tune", str(prof), *flags]) == 2
    err = err_line(capsys)
    assert flag in err and want in err, err
    assert "expected one argument" not in err and "must exceed reserve" not in err


def test_tune_target_below_the_compulsory_floor_is_not_told_to_profile_more(prof, capsys):
    assert main(["tune", str(prof), "--target-rate", "0.000001"]) == 2
    err = err_line(capsys)
    assert "compulsory" in err and "larger sizes" not in err
    assert main(["tune", str(prof), "--arena", "1G", "--target-rate", "0.000001", "--json"]) == 0
    notes = " ".join(json.loads(capsys.readouterr().out)["notes"])
    assert "compulsory" in notes and "profile larger" not in notes


def test_tune_says_which_answer_to_use(prof, capsys):
    assert main(["tune", str(prof), "--arena", "1G", "--target-rate", "0.9"]) == 0
    out = capsys.readouterr().out
    use = [ln for ln in out.splitlines() if ln.startswith("use:")]
    assert len(use) == 1 and "target" in use[0], out
    assert "target_fault_rate" not in out and "fault_rate <=" not in out
    assert main(["tune", str(prof), "--memory", "1G", "--reserve", "0"]) == 0
    use = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("use:")]
    assert len(use) == 1 and "FP8" in use[0]


def test_demo_arena_too_small_for_a_step_names_the_flags(capsys):
    assert main(["demo", "--arena-fraction", "0.0001"]) == 2
    err = err_line(capsys)
    assert "--arena-fraction" in err and "--chunk" in err
    assert "slots=" not in err and "end_batch" not in err


def test_os_errors_name_the_store_not_its_temporary_directory(tmp_path, capsys, monkeypatch):
    import rowcache.cli.store as cli_store

    tmp = tmp_path / ".s.building-k2j3h4"

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp / "t0000-s000000.bin"))

    monkeypatch.setattr(cli_store, "build_store", full)
    np.save(tmp_path / "a.npy", np.zeros((4, 4), np.float32))
    assert main(["build", str(tmp_path / "s"), "--table", f"a={tmp_path / 'a.npy'}"]) == 2
    err = err_line(capsys)
    assert ".building-" not in err and str(tmp_path / "s") in err and "space" in err


def test_demo_report_counts_in_words():
    from rowcache.cli.demo import render
    from rowcache.tools.demo import DemoConfig, DemoReport

    values: dict = {f.name: 1 for f in dataclasses.fields(DemoReport)}
    values.update(
        config=dataclasses.asdict(DemoConfig(arena_fraction=0.004)),
        tokenizer="deepseek",
        table_rows=[1] * 12,
        arena_slots=[1] * 12,
        faults_per_token_by_order={"2": 1.0},
        equal=True,
        device_bytes=None,
        native={"rowcache.kernels._host": "built"},
    )
    text = render(DemoReport(**values))
    assert "1 file " in text and "1 files" not in text and "0.4% of their rows" in text


def _subparsers():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices


def test_outputs_are_dash_o_everywhere_and_save_is_a_hidden_alias(tr, capsys):
    for name, p in _subparsers().items():
        for a in p._actions:
            if a.dest == "out":
                assert a.option_strings == ["-o", "--out"], name
            assert "--save" not in a.option_strings or a.help == "==SUPPRESS==", name
    assert main(["profile", "--help"]) == 0
    assert "--save" not in capsys.readouterr().out
    out = tr.parent / "old.json"
    assert main(["profile", str(tr), "--sizes", "64", "--save", str(out), "-q"]) == 0
    assert "--save is deprecated" in capsys.readouterr().err and out.is_file()
    assert main(["profile", str(tr), "--save", str(out), "-o", str(out)]) == 2
    err_line(capsys)


# --- 21: what profile's exact method costs ----------------------------------------------------
def test_profile_help_says_what_exact_costs_and_the_run_shows_it(tr, capsys, monkeypatch):
    assert main(["profile", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "3.6 min" in text and "12.4 GB" in text and "--method shards" in text
    import io
    import sys

    import rowcache.cli.tools as cli_tools

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert main(["profile", str(tr), "--sizes", "64"]) == 0
    monkeypatch.undo()
    err = term.getvalue()
    assert "exact" in err and "peak" in err and "accesses" in err and "access/s" in err

    monkeypatch.setattr(cli_tools, "available_memory", lambda: 1000)
    assert main(["profile", str(tr), "--sizes", "64", "--method", "exact"]) == 2
    err = err_line(capsys)
    assert "available" in err and "--method shards" in err
    # no --method: the default samples instead, and says why
    assert main(["profile", str(tr), "--sizes", "64", "--rate", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tables"]["0"]["method"] == "shards"
    assert main(["profile", str(tr), "--sizes", "64"]) == 0
    assert "method shards: the default" in capsys.readouterr().out


def test_profile_progress_is_counted_in_accesses_and_names_each_curve(tr, capsys):
    from rowcache.tools.profile import profile_trace
    from rowcache.tools.trace import Trace

    profile_trace(Trace.open(tr), [64], progress=True)
    err = capsys.readouterr().err
    assert "access" in err and "shared" in err
