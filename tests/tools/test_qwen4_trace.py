"""Qwen4 traces (issue 49 item 4): `rowcache trace --qwen4` writes each head of
Qwen3.8-Flash-Next's n-gram table as a table of the trace, with the hash's rows less the
head's offset; profile and tune read it, with its rows' bytes (FP8 160 B, BF16 320 B)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rowcache.cli.app import main
from rowcache.embed import Qwen4NgramConfig, Qwen4NgramHash
from rowcache.embed.qwen4.hash import hash_reference
from rowcache.errors import ConfigError
from rowcache.tools.profile import profile_trace
from rowcache.tools.trace import Trace
from rowcache.tools.trace_build import build_trace
from rowcache.tools.trace_tables import Qwen4TraceTables
from rowcache.tools.tune import tune

# a small table: 4 heads per order over ~1,000-row primes, 8-value rows
SMALL = Qwen4NgramConfig(
    eos_token_id=248_044,
    heads_per_ngram=4,
    ngram_vocab_size_base=1000,
    ple_layer_ids=(2,),
    ple_embed_dim=64,
)
EOS = 248_044


def _requests() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    reqs = [rng.integers(0, 2000, n) for n in (40, 7, 300, 1)]
    reqs[2][[5, 6, 100]] = EOS  # EOS segments inside a request
    return reqs


@pytest.mark.parametrize("cfg", [SMALL, Qwen4NgramConfig.release()], ids=["small", "release"])
def test_trace_rows_are_the_hash_of_each_request(tmp_path, cfg):
    requests = _requests()
    tables = Qwen4TraceTables(cfg, tokenizer=None)
    trace = build_trace(requests, tables, tmp_path / "t", progress=False)
    h = Qwen4NgramHash(cfg)
    assert trace.num_tables == cfg.heads == tables.num_tables
    assert list(trace.table_rows) == h.primes.tolist()
    assert trace.dims["head_offsets"] == h.offsets.tolist()
    assert trace.dims["padded_rows"] == [h.table_rows()]
    assert trace.dims["kind"] == "qwen4" and trace.dims["proxy_tokens"] is None
    assert trace.dims["table_orders"] == [2] * cfg.heads_per_ngram + [3] * cfg.heads_per_ngram
    assert trace.dims["hidden_size"] == cfg.heads * cfg.head_dim
    assert trace.positions == sum(r.size for r in requests)
    # each request is one sequence: its trace rows plus the head offsets are the hash of the
    # request alone (EOS before its start), which is the spec's statement on EOS-padded ids
    for r in requests:
        ids = tables.request_ids(r)
        assert ids.shape == (cfg.heads, r.size)
        assert ((ids >= 0) & (ids < h.primes[:, None])).all()
        np.testing.assert_array_equal(ids + h.offsets[:, None], h.hash(r)[0].T)
        padded = np.concatenate([[EOS, EOS], r])[None, :]
        spec = hash_reference(padded, 2, EOS, h.multipliers, h.primes, h.offsets)[0]
        np.testing.assert_array_equal(ids + h.offsets[:, None], spec.T)
    # not the stream hashed whole: the second request's first rows see EOS, not the first's end
    whole = h.hash(np.concatenate(requests[:2]))[0, requests[0].size]
    assert (tables.request_ids(requests[1])[:, 0] + h.offsets != whole).any()
    # every request's rows, table by table, are in the trace (in the server's order)
    rows, _ = trace.read_chunk(0)
    got = sorted(map(tuple, rows.T.tolist()))
    want = np.concatenate([tables.request_ids(r) for r in requests], axis=1)
    assert got == sorted(map(tuple, want.T.tolist()))


def test_profile_and_tune_take_the_row_bytes_of_each_dtype(tmp_path):
    tables = Qwen4TraceTables(SMALL, None)
    trace = build_trace(_requests() * 3, tables, tmp_path / "t", progress=False)
    bf16 = profile_trace(trace, [64, 256, 1024], progress=False)
    fp8 = profile_trace(trace, [64, 256, 1024], dtype="fp8", progress=False)
    dim = SMALL.head_dim  # 8 values a row
    assert (bf16.record_bytes, fp8.record_bytes) == (2 * dim, dim)  # no per-row scale
    assert bf16.to_dict()["row_bytes"] == {"bf16": 2 * dim, "fp8": dim}
    np.testing.assert_array_equal(fp8.arena_bytes(), np.array([64, 256, 1024]) * 8 * dim)
    used = sum(Qwen4NgramHash(SMALL).primes.tolist())
    # tune: a bf16 profile tuned for fp8 takes the fp8 rows of the manifest, not dim + 4
    rep = tune(bf16.to_dict(), arena_bytes="1MiB", dtype="fp8")
    assert rep.record_bytes == dim and rep.fp8_host_bytes == used * dim
    assert tune(fp8.to_dict(), arena_bytes="1MiB", dtype="bf16").record_bytes == 2 * dim
    # a profile whose record_bytes contradicts its row_bytes is refused
    bad = bf16.to_dict() | {"record_bytes": 2 * dim + 2}
    with pytest.raises(ConfigError, match="'row_bytes' for bf16"):
        tune(bad, arena_bytes="1MiB")


def _text(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("def f(x):\n    return x + 1\n" * 200)
    (src / "b.py").write_text("import os\nprint(os.getcwd())\n" * 300)
    return src


def test_cli_trace_qwen4_release_then_profile_and_tune(tmp_path, capsys):
    src = _text(tmp_path)
    out = tmp_path / "trace"
    assert main(["trace", str(src), "--qwen4", "release", "-o", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tables"] == 16 and summary["requests"] == 2 and summary["tokens"] > 1000
    trace = Trace.open(out)
    h = Qwen4NgramHash(Qwen4NgramConfig.release())
    assert list(trace.table_rows) == h.primes.tolist()
    dims = trace.dims
    assert dims["row_bytes"] == {"bf16": 320, "fp8": 160} and dims["hidden_size"] == 2560
    assert dims["tokenizer"] == "deepseek" and dims["proxy_tokens"] is True
    assert dims["tokens"].startswith("DeepSeek-tokenized text standing in for Qwen's")
    assert dims["eos_token_id"] == 248_044 and dims["split_ngram_parts"] == 128
    prof = tmp_path / "profile.json"
    argv = ["profile", str(out), "--method", "exact", "--sizes", "1K,64K", "-o", str(prof)]
    assert main([*argv, "--dtype", "fp8", "-q"]) == 0
    rep = json.loads(prof.read_text())
    assert rep["num_tables"] == 16 and rep["record_bytes"] == 160
    assert rep["arena_bytes"] == [1000 * 16 * 160, 64000 * 16 * 160]
    assert rep["table_orders"] == [2] * 8 + [3] * 8
    capsys.readouterr()
    assert main(["tune", str(prof), "--memory", "121GiB", "--reserve", "100GiB", "--json"]) == 0
    t = json.loads(capsys.readouterr().out)
    assert t["record_bytes"] == 160 and t["budget_bytes"] == 21 * 2**30
    assert t["fp8_host_bytes"] == 320_001_446 * 160 and t["fp8_host_fits"] is False
    assert main(["tune", str(prof), "--arena", "64MiB", "--dtype", "bf16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["record_bytes"] == 320


def test_cli_trace_qwen4_config_directory(tmp_path, capsys):
    """A checkpoint's directory: its config.json's text_config fixes the tables."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    text = {
        "eos_token_id": [EOS, 1],
        "heads_per_ngram": 4,
        "ngram_vocab_size_base": 1000,
        "ple_layer_ids": [2],
        "ple_embed_dim": 64,
    }
    (ckpt / "config.json").write_text(json.dumps({"text_config": text}))
    ids = tmp_path / "ids.jsonl"
    ids.write_text("[1, 2, 3, 4]\n[5, 6]\n")
    out = tmp_path / "t"
    assert main(["trace", str(ids), "--qwen4", str(ckpt), "-o", str(out), "-q"]) == 0
    trace = Trace.open(out)
    assert trace.num_tables == 8 and trace.requests == 2 and trace.positions == 6
    assert list(trace.table_rows) == Qwen4NgramHash(SMALL).primes.tolist()
    assert trace.dims["tokenizer"] is None and trace.dims["proxy_tokens"] is None
    assert trace.dims["split_ngram_parts"] == 512 and "split_ngram_parts" in trace.dims["defaulted"]
    assert trace.dims["row_bytes"] == {"bf16": 16, "fp8": 8}


def _refused(tmp_path, capsys, extra):
    (tmp_path / "a.py").write_text("x = 1\n")
    argv = ["trace", str(tmp_path / "a.py"), "-o", str(tmp_path / "t"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "t").exists()
    return err


@pytest.mark.parametrize(
    "config, match",
    [
        (None, "--qwen4 {p}: no such file or directory; give release or a qwen4_exp config"),
        ("{", "not JSON"),
        ("[1, 2]", "holds list, not an object"),
        (json.dumps({"model_type": "llama"}), "config has no 'eos_token_id'"),
        (
            json.dumps({"eos_token_id": 1, "ple_layer_ids": [2], "ngram_size": 1}),
            "config['ngram_size']: ngram_size=1: give an integer in [2, 16]",
        ),
        (
            json.dumps({"eos_token_id": 1, "ple_layer_ids": [2], "ple_embed_dim": 100}),
            "config['ple_embed_dim']: ple_embed_dim=100: must be divisible by the heads",
        ),
    ],
    ids=["missing", "not-json", "not-object", "not-qwen4", "bad-field", "bad-width"],
)
def test_cli_trace_qwen4_bad_config(tmp_path, capsys, config, match):
    path = tmp_path / "config.json"
    if config is not None:
        path.write_text(config)
    err = _refused(tmp_path, capsys, ["--qwen4", str(path)])
    assert f"--qwen4 {path}: " in err and match.format(p=path) in err, err


def test_cli_trace_qwen4_empty_value(tmp_path, capsys):
    err = _refused(tmp_path, capsys, ["--qwen4", ""])
    want = "--qwen4 : no such file or directory; give release or a qwen4_exp config.json"
    assert err.endswith(want + " (or its directory)")


def test_cli_trace_qwen4_directory_without_config(tmp_path, capsys):
    (tmp_path / "ckpt").mkdir()
    err = _refused(tmp_path, capsys, ["--qwen4", str(tmp_path / "ckpt")])
    assert "config.json" in err and "cannot be read" in err and "give release" in err


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--qwen4", "release", "--engram", "demo"], "--qwen4 and --engram: give one"),
        (["--qwen4", "release", "--config", "c.json"], "--qwen4 and --config: give one"),
        (["--qwen4", "release", "--tokenizer", "nope.json"], "--tokenizer: tokenizer 'nope"),
    ],
)
def test_cli_trace_qwen4_refusals(tmp_path, capsys, extra, match):
    assert match in _refused(tmp_path, capsys, extra)


def test_build_trace_takes_a_config(tmp_path):
    """``build_trace(requests, Qwen4NgramConfig)``: the config's head tables, ids as given."""
    requests = _requests()
    trace = build_trace(requests, SMALL, tmp_path / "t", progress=False)
    assert trace.dims["kind"] == "qwen4" and trace.dims["tokenizer"] is None
    assert trace.dims["tokens"] == "token ids as given (.npy / .jsonl inputs)"
    assert list(trace.table_rows) == Qwen4NgramHash(SMALL).primes.tolist()
