"""Engram traces (issue 40, part 4): `rowcache trace --engram` writes every head of every
Engram layer as a table of the trace, with the hash's ids; profile and tune read it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rowcache.cli.app import main
from rowcache.embed.engram.config import EngramConfig
from rowcache.embed.engram.hash import EngramHash
from rowcache.embed.engram.vocab import CompressedVocab
from rowcache.errors import ConfigError
from rowcache.tools.tokens import tokenizer_json_path
from rowcache.tools.trace import Trace
from rowcache.tools.trace_build import build_trace
from rowcache.tools.trace_tables import EngramTraceTables

SMALL = EngramConfig(vocab_per_ngram=(3000, 5000), n_head_per_ngram=4, n_embed_per_ngram=64)


@pytest.fixture(scope="module")
def small_hash(tmp_path_factory):
    vocab = CompressedVocab.from_tokenizer(
        tokenizer_json_path("deepseek"), cache_dir=tmp_path_factory.mktemp("vocab")
    )
    return EngramHash(SMALL, vocab)


def test_trace_rows_are_the_hash_of_each_request(tmp_path, small_hash):
    rng = np.random.default_rng(0)
    requests = [rng.integers(0, 129_280, n) for n in (40, 7, 300)]
    trace = build_trace(requests, small_hash, tmp_path / "t", progress=False)
    tables = EngramTraceTables(small_hash)
    assert trace.num_tables == 16 == tables.num_tables
    want_rows = np.concatenate([small_hash.primes[layer].reshape(-1) for layer in (1, 15)])
    assert list(trace.table_rows) == want_rows.tolist()
    assert (
        trace.dims["kind"] == "engram"
        and trace.dims["table_orders"] == [2] * 4 + [3] * 4 + [2] * 4 + [3] * 4
    )
    assert trace.dims["hidden_size"] == 16 * SMALL.head_dim
    assert trace.positions == 347
    # every request's ids, table by table, are in the trace (its order is the server's)
    rows, _ = trace.read_chunk(0)
    got = sorted(map(tuple, rows.T.tolist()))
    want = sorted(
        map(tuple, np.concatenate([tables.request_ids(r) for r in requests], axis=1).T.tolist())
    )
    assert got == want
    one = small_hash.hash(requests[1][None, :])
    np.testing.assert_array_equal(tables.request_ids(requests[1])[:8], one[1][0].T)


def test_cli_trace_engram_then_profile_and_tune(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ROWCACHE_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("def f(x):\n    return x + 1\n" * 200)
    (src / "b.py").write_text("import os\nprint(os.getcwd())\n" * 300)
    out = tmp_path / "trace"
    assert main(["trace", str(src), "--engram", "demo", "-o", str(out), "-q"]) == 0
    trace = Trace.open(out)
    assert trace.num_tables == 32 and trace.requests == 2
    prof = tmp_path / "profile.json"
    argv = ["profile", str(out), "--method", "exact", "--sizes", "1K,64K", "-o", str(prof), "-q"]
    assert main(argv) == 0
    rep = json.loads(prof.read_text())
    assert rep["num_tables"] == 32 and rep["record_bytes"] == 128
    assert rep["table_orders"] == ([2] * 8 + [3] * 8) * 2
    capsys.readouterr()
    assert main(["tune", str(prof), "--arena", "64MiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--engram", "demo", "--tokenizer", "words"], "needs a real tokenizer"),
        (["--engram", "nope.json"], "--engram nope.json: give demo, v41 or a readable"),
        (["--engram", "demo", "--config", "c.json"], "give one"),
    ],
)
def test_cli_trace_engram_refusals(tmp_path, capsys, extra, match):
    (tmp_path / "a.py").write_text("x = 1\n")
    argv = ["trace", str(tmp_path / "a.py"), "-o", str(tmp_path / "t"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err
    assert not (tmp_path / "t").exists()


def test_cli_trace_engram_bad_config_names_the_key(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"engram_layer_ids": [3, 3]}))
    (tmp_path / "a.py").write_text("x = 1\n")
    assert (
        main(["trace", str(tmp_path / "a.py"), "-o", str(tmp_path / "t"), "--engram", str(cfg)])
        == 2
    )
    assert "config['engram_layer_ids']" in capsys.readouterr().err


def test_profile_and_tune_size_fp8_block_e8m0_arenas_of_264_byte_records(tmp_path, small_hash):
    """V4.1's rows (256 values) as the fp8_block_e8m0 codec stores them: 256 codes and 8
    scale bytes, which is what an arena slot of that codec holds (its pages pack 15 records:
    disk, not arena bytes); rows that do not split into blocks of 32 are refused by name."""
    from rowcache.format.codecs import get_codec
    from rowcache.format.layout import TableInfo
    from rowcache.tools.profile import profile_trace
    from rowcache.tools.tune import tune

    v41 = EngramConfig(
        vocab_per_ngram=(700, 900, 1100),
        max_ngram=4,
        n_embed_per_ngram=2048,
        n_head_per_ngram=8,
        layer_ids=(1, 14),
    )
    h = EngramHash(v41, small_hash.vocab)
    rng = np.random.default_rng(1)
    trace = build_trace(
        [rng.integers(0, 129_280, n) for n in (300, 50, 700)], h, tmp_path / "t", progress=False
    )
    sizes = [64, 256, 1024]
    prof = profile_trace(trace, sizes, dtype="fp8_block_e8m0", shared=False, progress=False)
    record = get_codec("fp8_block_e8m0").arena_width(256, {"block_size": 32})
    assert prof.record_bytes == record == 264
    assert prof.to_dict()["row_bytes"] == {"bf16": 512, "fp8": 260, "fp8_block_e8m0": 264}
    np.testing.assert_array_equal(prof.arena_bytes(), np.array(sizes) * 48 * 264)
    assert (
        TableInfo.make("t", 1000, 256, "fp8_block_e8m0", 1 << 30, {"block_size": 32}).rows_per_page
        == 15
    )
    rep = tune(prof.to_dict(), arena_bytes="64MiB")
    assert rep.dtype == "fp8_block_e8m0" and rep.record_bytes == 264
    assert rep.used_bytes == sum(rep.rows.values()) * 264 <= 64 << 20
    # a bf16 profile tuned for the block codec takes its 264-byte rows, and back
    bf16 = profile_trace(trace, sizes, shared=False, progress=False)
    assert tune(bf16.to_dict(), arena_bytes="64MiB", dtype="fp8_block_e8m0").record_bytes == 264
    assert tune(prof.to_dict(), arena_bytes="64MiB", dtype="bf16").record_bytes == 512
    # the demo's 16-value rows do not split into blocks of 32
    demo = build_trace([rng.integers(0, 129_280, 40)], small_hash, tmp_path / "d", progress=False)
    with pytest.raises(ConfigError, match="rows of 16 values do not split into blocks of 32"):
        profile_trace(demo, sizes, dtype="fp8_block_e8m0", progress=False)
    with pytest.raises(ConfigError, match=r"allowed: bf16, fp8$"):
        tune(
            profile_trace(demo, sizes, progress=False).to_dict(),
            arena_bytes="64MiB",
            dtype="fp8_block_e8m0",
        )


def test_cli_profile_and_tune_take_the_block_scaled_codec(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ROWCACHE_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "a.py").write_text("def f(x):\n    return x + 1\n" * 100)
    out = tmp_path / "trace"
    assert main(["trace", str(tmp_path / "a.py"), "--engram", "v41", "-o", str(out), "-q"]) == 0
    prof = tmp_path / "profile.json"
    argv = ["profile", str(out), "--method", "exact", "--sizes", "1K,4K", "-o", str(prof), "-q"]
    assert main([*argv, "--dtype", "fp8_block_e8m0"]) == 0
    rep = json.loads(prof.read_text())
    assert rep["dtype"] == "fp8_block_e8m0" and rep["record_bytes"] == 264
    assert rep["arena_bytes"] == [1000 * 48 * 264, 4000 * 48 * 264]
    capsys.readouterr()
    assert main(["tune", str(prof), "--arena", "64MiB", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["record_bytes"] == 264 and got["used_bytes"] == sum(got["rows"].values()) * 264
