"""``rowcache demo`` at a tiny size: real tokenizer, real stdlib text, cached == resident."""

from __future__ import annotations

import argparse
import json

import pytest

from rowcache.cli.demo import register, render
from rowcache.errors import ConfigError
from rowcache.tools.demo import DemoConfig, run_demo, text_files

TINY = {"hidden_size": 48, "ratio": 0.05, "max_tokens": 4000, "decode_tokens": 150, "chunk": 256}


def _parse(argv):
    parser = argparse.ArgumentParser(prog="rowcache")
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_demo_tiny_cached_equals_resident(tmp_path):
    rep = run_demo(DemoConfig(**TINY, arena_fraction=0.2, workdir=str(tmp_path)), progress=False)
    assert rep.equal and rep.mismatched_steps == 0
    assert rep.tokens == 4000 and rep.prefill_tokens == 3850 and rep.decode_tokens == 150
    assert rep.table_rows == [int(0.05 * 131072) + 2 * i + 1 for i in range(12)]
    assert rep.arena_slots[0] == int(0.2 * rep.table_rows[0])
    assert 0 < rep.hit_rate < 1 and rep.faults_per_token > 0 and rep.rows_read > 0
    # order-2 n-grams repeat most in real text
    fo = rep.faults_per_token_by_order
    assert fo["2"] < fo["4"]  # order-2 n-grams repeat most
    assert sum(fo.values()) == pytest.approx(rep.faults_per_token)
    assert rep.arena_bytes < rep.resident_table_bytes
    assert rep.cached_tokens_per_s > 0 and rep.resident_tokens_per_s > 0
    assert "bit for bit" in render(rep)
    assert (tmp_path / "store").is_dir()  # a given workdir is kept


def test_demo_cli_json_fp8(capsys):
    args = _parse(
        [
            "demo",
            "--hidden",
            "48",
            "--ratio",
            "0.05",
            "--tokens",
            "2500",
            "--decode-tokens",
            "50",
            "--chunk",
            "300",
            "--dtype",
            "fp8",
            "--arena-fraction",
            "0.5",
            "--json",
            "--no-progress",
        ]
    )
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["equal"] is True and out["config"]["dtype"] == "fp8"
    assert out["tokens"] == 2500 and out["device_bytes"] is None
    assert set(out["faults_per_token_by_order"]) == {"2", "3", "4"}


def test_demo_text_is_the_stdlib():
    files = text_files(None)
    assert len(files) > 100 and all(f.endswith(".py") for f in files)
    assert not any("site-packages" in f for f in files)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"hidden_size": 50}, "divisible by the 12"),
        ({"arena_fraction": 0.0}, "arena_fraction"),
        ({"decode_tokens": 4000}, "decode_tokens"),
        ({"dtype": "int8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"chunk": 0}, "chunk"),
    ],
)
def test_demo_bad_config(kw, match):
    with pytest.raises(ConfigError, match=match):
        DemoConfig(**(TINY | kw))


def test_demo_bad_text(tmp_path):
    with pytest.raises(ConfigError, match=r"no \.py files"):
        run_demo(DemoConfig(**TINY, text=str(tmp_path)), progress=False)


@pytest.mark.gpu
def test_demo_gpu_tiny(tmp_path):
    rep = run_demo(DemoConfig(**TINY, device="cuda", workdir=str(tmp_path)), progress=False)
    assert rep.equal and rep.device_bytes and rep.device_bytes > 0


def test_demo_cli_tokens_1000_through_main(capsys):
    from rowcache.cli.app import main

    argv = ["demo", "--hidden", "48", "--ratio", "0.02", "--tokens", "1000", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["equal"] and out["tokens"] == 1000 and out["decode_tokens"] == 100


def test_demo_cli_errors_name_the_flag_or_the_file(tmp_path, capsys):
    from rowcache.cli.app import main

    tiny = ["demo", "--ratio", "0.02", "--tokens", "500"]
    assert main([*tiny, "--hidden", "50"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--hidden 50 must be divisible" in err
    assert main([*tiny, "--decode-tokens", "500", "--hidden", "48"]) == 2
    assert "--decode-tokens 500 must be in [0, --tokens 500)" in capsys.readouterr().err
    for bad in (tmp_path / "none.json", tmp_path):
        assert main([*tiny, "--tokenizer", str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--tokenizer" in err and str(bad) in err
    junk = tmp_path / "junk.json"
    junk.write_text('{"not": "a tokenizer"}')
    assert main([*tiny, "--hidden", "48", "--tokenizer", str(junk)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{junk}: not an HF tokenizer.json" in err
    assert "Traceback" not in err


def test_demo_report_explains_reads_and_counts_the_store_on_disk(tmp_path):
    from rowcache.store.handle import RowStore

    cfg = DemoConfig(**TINY, dtype="fp8", workdir=str(tmp_path))
    rep = run_demo(cfg, progress=False)
    text = render(rep)
    assert "merged read operations" in text and "whole 4 KiB pages" in text
    with RowStore.open(tmp_path / "store") as store:
        on_disk = sum(r.length for recs in store.shards for r in recs)
    assert rep.store_bytes == on_disk > sum(t.nbytes for t in store.tables)


def test_demo_cli_cuda_without_a_gpu_names_the_flag(capsys):
    from rowcache.cli.app import main
    from rowcache.kernels.loader import gpu_available

    if gpu_available():
        pytest.skip("a GPU is usable here")
    assert main(["demo", "--device", "cuda", "--tokens", "500", "--ratio", "0.02"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device cpu" in err and "device='cpu'" not in err


def test_demo_too_large_for_the_machine_is_refused_before_allocating():
    """Issue 39 item 15: `demo --ratio 100000` (tens of TiB) was killed by the kernel with no
    word; now, in a child process, one line with the estimate, what is available and the
    largest ratio that fits, exit 2 (before any allocation: the child's timeout would
    catch a run that started building)."""
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-m", "rowcache", "demo", "--ratio", "100000", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "--ratio 100000" in lines[0] and "GiB of host memory" in lines[0]
    assert "is available: give --ratio" in lines[0], lines[0]


def test_demo_memory_estimate_suggests_a_ratio_that_fits(monkeypatch):
    import rowcache.tools.demo as demo

    cfg = DemoConfig(**(TINY | {"ratio": 8.0}))
    host, device = cfg.memory_need()
    assert device == 0 and host > 300 << 20
    fp8 = DemoConfig(**(TINY | {"ratio": 8.0, "dtype": "fp8"}))
    assert fp8.memory_need()[0] > host  # the quantized copies and their temporaries
    have = host - (1 << 20)
    monkeypatch.setattr(demo, "available_memory", lambda: have)
    with pytest.raises(ConfigError, match=r"give ratio=([0-9.]+) or less") as e:
        demo.check_memory(cfg)
    import re

    fits = float(re.search(r"give ratio=([0-9.]+)", str(e.value)).group(1))
    assert 0 < fits < 8.0
    smaller = DemoConfig(**(TINY | {"ratio": fits}))
    assert smaller.memory_need()[0] <= have
    demo.check_memory(smaller)  # the suggestion is accepted
    monkeypatch.setattr(demo, "available_memory", lambda: None)  # not Linux: no check
    demo.check_memory(cfg)
