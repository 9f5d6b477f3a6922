"""`trace`, `profile`, `tune`, `bench-io` through ``main(argv)`` on bad inputs: one line
naming the file (chunk, line) or the flag, exit 2, nothing left behind, no silent
wrong result."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rowcache.cli.app import main
from rowcache.tools.trace import Trace
from tests.cli.support import TINY_CONFIG

CONFIG = TINY_CONFIG


def err_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert ": error: " in err
    return err


@pytest.fixture
def w(tmp_path, rng):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    lines = [
        json.dumps((rng.zipf(1.3, int(rng.integers(5, 80))) % 297 + 3).tolist()) for _ in range(150)
    ]
    (tmp_path / "reqs.jsonl").write_text("\n".join(lines))
    (tmp_path / "text.txt").write_text("def f(x):\n    return x\n\nclass A:\n    pass\n")
    return tmp_path


def trace_argv(w, *inputs, out="tr", chunk_positions=None):
    argv = ["trace", *[str(w / i) for i in inputs], "-o", str(w / out), "-q"]
    argv += ["--config", str(w / "config.json"), "--batch", "4", "--chunk", "16", "--decode", "8"]
    if chunk_positions:
        argv += ["--chunk-positions", str(chunk_positions)]
    return argv


@pytest.fixture
def tr(w):
    assert main(trace_argv(w, "reqs.jsonl", chunk_positions=1000)) == 0
    return w / "tr"


def manifest(tr):
    return json.loads((tr / "manifest.json").read_text())


def set_manifest(tr, m):
    (tr / "manifest.json").write_text(json.dumps(m))


# --- trace ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["missing", "not-a-tokenizer", "directory"])
def test_trace_bad_tokenizer_one_line_exit_2_no_output_dir(w, capsys, kind):
    tok = {"missing": w / "nope.json", "not-a-tokenizer": w / "reqs.jsonl", "directory": w}[kind]
    argv = [*trace_argv(w, "text.txt"), "--tokenizer", str(tok)]
    assert main(argv) == 2
    err = err_line(capsys)
    assert "--tokenizer" in err and str(tok) in err
    assert not (w / "tr").exists()


def test_trace_default_tokenizer_is_deepseek_words_only_by_name(w, capsys):
    assert main([*trace_argv(w, "text.txt", out="real"), "--config", str(w / "none.json")]) == 2
    assert "--config" in err_line(capsys)
    # LongCat dims (the default): the real tokenizer's ids are < 131072.
    argv = ["trace", str(w / "text.txt"), "-o", str(w / "real"), "-q", "--json"]
    assert main(argv) == 0
    deepseek = json.loads(capsys.readouterr().out)
    assert main([*argv[:3], str(w / "words"), "-q", "--json", "--tokenizer", "words"]) == 0
    words = json.loads(capsys.readouterr().out)
    assert deepseek["tokens"] != words["tokens"]  # a different tokenizer ran
    from rowcache.tools.tokens import make_tokenizer

    expected = make_tokenizer("deepseek", 131072)
    assert deepseek["tokens"] == sum(
        expected(p).size for p in ("def f(x):\n    return x\n", "class A:\n    pass\n")
    )


def test_trace_stdlib_flag(w, capsys):
    argv = ["trace", "--stdlib", "-o", str(w / "std"), "-q", "--json", "--tokenizer", "words"]
    assert main([*argv, "--max-requests", "50", "--config", str(w / "config.json")]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == 50
    assert main(["trace", "-o", str(w / "none")]) == 2
    assert "--stdlib" in err_line(capsys)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("[1, 2]\n[3, 1.5]\n", r"reqs2.jsonl:2: token ids must be integers; got 1.5"),
        ("[1, 2]\n{oops\n", r"reqs2.jsonl:2: not JSON"),
        ("[1, 2]\n[3, 400]\n", r"reqs2.jsonl:2: token id 400 is outside \[0, 300\)"),
        ('[1, 2]\n[3, "a"]\n', r"reqs2.jsonl:2: token ids must be integers"),
        ("[[1, 2]]\n", r"reqs2.jsonl:1: token ids must be integers"),
    ],
)
def test_trace_jsonl_refused_with_file_and_line(w, capsys, content, match):
    (w / "reqs2.jsonl").write_text(content)
    assert main(trace_argv(w, "reqs2.jsonl")) == 2
    import re

    assert re.search(match, err_line(capsys))
    assert not (w / "tr").exists()


def test_trace_bad_npy_and_missing_input_leave_nothing(w, capsys):
    np.save(w / "t.npy", np.arange(3, 100, dtype=np.int32))
    data = (w / "t.npy").read_bytes()
    (w / "cut.npy").write_bytes(data[: len(data) // 2])
    (w / "empty.npy").write_bytes(b"")
    for name, match in [("cut.npy", "cut.npy: not a readable .npy"), ("empty.npy", "empty.npy")]:
        assert main(trace_argv(w, name, out="sub/tr")) == 2
        assert match in err_line(capsys)
        assert not (w / "sub").exists()  # not even the parent it would have created
    assert main(trace_argv(w, "nothing.jsonl")) == 2
    assert "nothing.jsonl" in err_line(capsys) and not (w / "tr").exists()


def test_trace_overwrite_names_the_flag_and_keeps_other_files(w, capsys, tr):
    assert main(trace_argv(w, "reqs.jsonl")) == 2
    assert "--overwrite" in err_line(capsys)
    (tr / "notes.txt").write_text("mine")
    assert main([*trace_argv(w, "reqs.jsonl"), "--overwrite"]) == 0
    assert (tr / "notes.txt").read_text() == "mine" and Trace.open(tr).chunks


# --- profile: traces that are not what their manifest says ---------------------------------
def _break(tr, how):
    m = manifest(tr)
    if how == "list":
        set_manifest(tr, [m])
    elif how == "extra-key":
        m["chunks"][0]["extra"] = 1
        set_manifest(tr, m)
    elif how == "six-tables":
        m["num_tables"] = 6
        set_manifest(tr, m)
    elif how == "six-tables-rows":
        m["num_tables"] = 6
        m["table_rows"] = m["table_rows"] + m["table_rows"][:2]
        set_manifest(tr, m)
    elif how == "empty-steps":
        (tr / m["chunks"][1]["steps"]).write_bytes(b"")
    elif how == "two-of-four":
        rows = np.load(tr / m["chunks"][0]["rows"])
        np.save(tr / m["chunks"][0]["rows"], rows[:2])
    elif how == "part-of-the-chunks":
        m["chunks"] = m["chunks"][:2]
        set_manifest(tr, m)
    elif how == "part-and-positions":
        m["chunks"] = m["chunks"][:2]
        m["positions"] = sum(c["positions"] for c in m["chunks"])
        set_manifest(tr, m)
    elif how in ("negative-row", "row-too-big"):
        f = tr / m["chunks"][1]["rows"]
        rows = np.load(f)
        rows[2, 5] = -1 if how == "negative-row" else m["table_rows"][2]
        np.save(f, rows)
    return m


@pytest.mark.parametrize(
    ("how", "match"),
    [
        ("list", "manifest.json: a trace manifest is a JSON object; got a list"),
        ("extra-key", "manifest.json: chunk 0 must be an object with keys"),
        ("six-tables", "'table_rows' must list the rows of each of the 6 tables"),
        ("six-tables-rows", r"rows-00000.npy \(chunk 0\): shape \(4, 1000\)"),
        ("empty-steps", r"steps-00001.npy \(chunk 1\): not a readable .npy file"),
        ("two-of-four", r"rows-00000.npy \(chunk 0\): shape \(2, 1000\)"),
        ("part-of-the-chunks", "its 2 chunks hold 2000 positions but 'positions' says"),
        ("part-and-positions", "also holds .* other chunk files"),
        ("negative-row", r"rows-00001.npy \(chunk 1\): table 2 has row id -1"),
        ("row-too-big", r"rows-00001.npy \(chunk 1\): table 2 has row id \d+, outside"),
    ],
)
@pytest.mark.parametrize("method", ["exact", "shards"])
def test_profile_refuses_a_malformed_trace(tr, capsys, how, match, method):
    import re

    assert len(manifest(tr)["chunks"]) >= 3
    _break(tr, how)
    argv = ["profile", str(tr), "--sizes", "64,128", "--method", method]
    if method == "shards":
        argv += ["--rate", "0.5"]
    assert main(argv) == 2
    err = err_line(capsys)
    assert re.search(match, err), err


def test_profile_sizes_out_of_range(tr, capsys):
    assert main(["profile", str(tr), "--sizes", "1e30"]) == 2
    assert "--sizes" in err_line(capsys)


def test_profile_too_sparse_a_sample_says_so(w, capsys, tr):
    assert main(["profile", str(tr), "--method", "shards", "--rate", "1e-9", "--sizes", "64"]) == 2
    err = err_line(capsys)
    assert "kept none" in err and "--rate" in err
    (w / "one.jsonl").write_text("[5]\n")
    assert main(trace_argv(w, "one.jsonl", out="one")) == 0
    assert main(["profile", str(w / "one"), "--method", "shards", "--sizes", "4"]) == 2
    assert "all zeros" in err_line(capsys)


def test_profile_shards_min_feasible_matches_the_values_and_json_is_rounded(tr, capsys):
    argv = ["profile", str(tr), "--method", "shards", "--rate", "0.3", "--json", "--salts", "2"]
    sizes = ",".join(str(s) for s in range(1, 60))
    assert main([*argv, "--sizes", sizes]) == 0
    rep = json.loads(capsys.readouterr().out)
    for c in rep["tables"].values():
        for s, r in zip(c["sizes"], c["miss_ratio"]):
            assert (r is None) == (s < c["min_feasible"]), (s, c["min_feasible"])
        assert len(repr(c["sample_rate"])) < 16 and len(repr(c["unique"])) < 16
    text_argv = ["profile", str(tr), "--method", "shards", "--rate", "0.3", "--sizes", "2,40"]
    assert main(text_argv) == 0
    out = capsys.readouterr().out
    assert "nan" not in out and "n/a: below the table's min feasible rows" in out


def test_profile_outputs_checked_before_the_computation(tr, capsys, monkeypatch):
    import rowcache.tools.profile as prof

    def never(*a, **k):
        raise AssertionError("computed before checking the outputs")

    monkeypatch.setattr(prof, "profile_trace", never)
    assert main(["profile", str(tr), "-o", str(tr / "no" / "dir" / "p.json")]) == 2
    assert "-o/--out" in err_line(capsys)
    assert main(["profile", str(tr), "--png", str(tr)]) == 2
    assert "--png" in err_line(capsys)
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # not installed
    assert main(["profile", str(tr), "--png", str(tr.parent / "c.png")]) == 2
    assert "--png" in (e := err_line(capsys)) and "matplotlib" in e


def test_profile_png_failure_keeps_the_save(tr, capsys, monkeypatch):
    import rowcache.tools.plot as plot

    def broken(rep, path):
        raise OSError("disk full")

    monkeypatch.setattr(plot, "plot_profile", broken)
    save = tr.parent / "p.json"
    argv = ["profile", str(tr), "--sizes", "64", "-o", str(save), "--png", str(save) + ".png"]
    assert main(argv) == 2
    err = err_line(capsys)
    assert "--png" in err and "disk full" in err and f"saved to {save}" in err
    assert json.loads(save.read_text())["tokens"] > 0


def test_profile_plot_groups_tables_by_order(tr, capsys):
    assert main(["profile", str(tr), "--sizes", "64,128", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["table_orders"] == [2, 2, 3, 3]  # max_ngram 3, 2 splits


# --- tune ---------------------------------------------------------------------------------
@pytest.fixture
def prof(tr, capsys):
    p = tr.parent / "prof.json"
    assert main(["profile", str(tr), "--sizes", "64,128,256,512", "-o", str(p), "-q"]) == 0
    capsys.readouterr()
    return p


def test_tune_budget_flags(prof, capsys):
    assert main(["tune", str(prof)]) == 2
    err = err_line(capsys)
    assert "--arena" in err and "--memory" in err and "arena_bytes" not in err
    assert main(["tune", str(prof), "--memory", "121GiB"]) == 2
    assert "--memory needs --reserve" in err_line(capsys)
    assert main(["tune", str(prof), "--memory", "1K", "--reserve", "2K"]) == 2
    assert "must exceed --reserve" in err_line(capsys)
    assert main(["tune", str(prof), "--arena", "12G", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["budget_bytes"] == 12 << 30
    assert main(["tune", str(prof), "--arena", "12GB"]) == 2
    assert "ambiguous" in (e := err_line(capsys)) and "12GiB" in e


def test_tune_target_alone_gives_the_smallest_arena(prof, capsys):
    assert main(["tune", str(prof), "--target-rate", "0.9", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["meets_target"] is True and rep["budget_bytes"] == rep["min_bytes_for_target"]
    assert main(["tune", str(prof), "--target-rate", "0.000001"]) == 2
    assert "no profiled size reaches the target" in err_line(capsys)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: [d], "a JSON object is expected"),
        (lambda d: d | {"record_bytes": 0}, "'record_bytes' 0 is not a bf16 row size"),
        (lambda d: d | {"tokens": 0}, "'tokens' must be an integer >= 1"),
        (lambda d: {k: v for k, v in d.items() if k != "tables"}, "missing 'tables'"),
        (
            lambda d: d | {"tables": {"0": d["tables"]["0"] | {"misses": [1]}}},
            "'sizes' and 'misses' must be equal",
        ),
    ],
)
def test_tune_refuses_a_malformed_profile_naming_the_file(prof, capsys, edit, match):
    bad = prof.parent / "bad.json"
    bad.write_text(json.dumps(edit(json.loads(prof.read_text()))))
    assert main(["tune", str(bad), "--arena", "1M"]) == 2
    err = err_line(capsys)
    assert str(bad) in err and match in err, err


def test_tune_disk_flag_and_the_deprecated_device_alias(prof, capsys, tmp_path):
    disk = tmp_path / "disk.json"
    big = tmp_path / "f.bin"
    big.write_bytes(b"\1" * (1 << 16))
    argv = ["bench-io", str(big), "--queue-depths", "1", "--seconds", "0.02", "-q"]
    assert main([*argv, "--out", str(disk)]) == 0
    capsys.readouterr()
    assert main(["tune", str(prof), "--arena", "1M", "--disk", str(disk)]) == 0
    assert "µs" in capsys.readouterr().out
    assert main(["tune", str(prof), "--arena", "1M", "--device", str(disk)]) == 0
    assert "--device is deprecated, use --disk" in capsys.readouterr().err
    assert main(["tune", str(prof), "--arena", "1M", "--disk", str(prof)]) == 2
    err = err_line(capsys)
    assert "--disk" in err and "fault-rate profile" in err and "unexpected keyword" not in err
    assert main(["tune", str(prof), "--arena", "1M", "--disk", "cpu"]) == 2
    assert "--disk: cpu: not a disk profile" in err_line(capsys)
    assert (
        main(["tune", str(prof), "--arena", "1M", "--disk", str(disk), "--queue-depth", "3"]) == 2
    )
    assert "--queue-depth 3 was not measured" in err_line(capsys)


# --- bench-io -----------------------------------------------------------------------------
def test_bench_io_bytes_actually_read_latency_and_small_file_warning(tmp_path, capsys):
    f = tmp_path / "disk.bin"
    f.write_bytes(np.random.default_rng(0).integers(0, 255, 1 << 20, dtype=np.uint8).tobytes())
    argv = ["bench-io", str(f), "--record-bytes", "512", "--queue-depths", "1,2"]
    assert main([*argv, "--seconds", "0.05", "--json"]) == 0
    prof = json.loads(capsys.readouterr().out)
    page = 4096 if prof["direct"] else 512
    assert prof["bytes_per_read"] == {"512": page, "4096": 4096}
    lat = prof["latency_us"]["512"]["2"]
    assert 0 < lat["p50"] <= lat["p99"]
    assert any("only 1.0 MiB" in n and "flatter the disk" in n for n in prof["notes"])
    from rowcache.tools.benchio import DeviceProfile, profile_summary

    rows = profile_summary(DeviceProfile(**prof))
    r = next(x for x in rows if x["read_bytes"] == 512 and x["queue_depth"] == 1)
    assert r["MB_per_s"] == pytest.approx(r["reads_per_s"] * page / 1e6)
    assert main([*argv, "--seconds", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "p50 µs" in out and "p99 µs" in out and "note:" in out
    # A directory: its largest file.
    assert main(["bench-io", str(tmp_path), "--queue-depths", "1", "--seconds", "0.02"]) == 0
    assert "disk.bin" in capsys.readouterr().out
    assert main(["bench-io", str(f), "--out", str(tmp_path / "no" / "d.json")]) == 2
    assert "--out" in err_line(capsys)


def test_trace_folder_skips_binary_and_pycache_a_named_binary_is_refused(w, capsys):
    d = w / "src"
    (d / "__pycache__").mkdir(parents=True)
    (d / "a.py").write_text("x = 1\n")
    (d / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\xa7\r\r\n\0\0\0\0" * 64)
    (d / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    argv = ["trace", str(d), "-o", str(w / "t1"), "-q", "--json", "--tokenizer", "words"]
    assert main([*argv, "--config", str(w / "config.json")]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == 3  # x, =, 1
    argv = ["trace", str(d / "logo.png"), "-o", str(w / "t2"), "--tokenizer", "words"]
    assert main(argv) == 2
    assert "logo.png is a binary file" in err_line(capsys) and not (w / "t2").exists()


def test_trace_token_files_need_no_tokenizer(w, capsys):
    d = w / "ids"
    d.mkdir()
    (d / "a.jsonl").write_text("[5, 6, 7]\n")
    argv = ["trace", str(d), "-o", str(w / "t"), "-q", "--tokenizer", str(w / "none.json")]
    assert main([*argv, "--config", str(w / "config.json")]) == 0


def test_bench_io_measures_even_when_threads_start_after_the_deadline(tmp_path, capsys):
    f = tmp_path / "disk.bin"
    f.write_bytes(b"\1" * (1 << 16))
    argv = ["bench-io", str(f), "--queue-depths", "1,8", "--seconds", "0.000001", "--json"]
    assert main(argv) == 0
    prof = json.loads(capsys.readouterr().out)
    assert all(r > 0 for row in prof["random"].values() for r in row.values())
