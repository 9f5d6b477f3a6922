"""The trace builder against a step-by-step server model, the token readers, the format."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rowcache.embed.ngram.dims import NgramDims
from rowcache.embed.ngram.ids import ngram_ids
from rowcache.errors import ConfigError, FormatError
from rowcache.tools.tokens import iter_requests, make_tokenizer
from rowcache.tools.trace import ServerModel, Trace
from rowcache.tools.trace_build import build_trace


@pytest.fixture
def dims():
    return NgramDims(vocab_size=300, hidden_size=8, max_ngram=3, splits=2, ratio=3, eos_token_id=2)


def server_brute(requests, model):
    """Step loop: fill free slots in slot order, then one unit per live slot."""
    queue = list(requests)
    live: dict[int, list] = {}
    out_rows, out_steps = [], []
    step = 0
    while queue or live:
        for slot in range(model.batch):
            if slot not in live and queue:
                live[slot] = [queue.pop(0), 0]
        for slot in sorted(live):
            req, cur = live[slot]
            p, _, _ = model.units(len(req[0]))
            n = min(model.chunk, p - cur) if cur < p else 1
            out_rows.append(req[1][:, cur : cur + n])
            out_steps.extend([step] * n)
            live[slot][1] = cur + n
            if cur + n == len(req[0]):
                del live[slot]
        step += 1
    return np.concatenate(out_rows, axis=1), np.array(out_steps)


def test_trace_equals_step_by_step_server(tmp_path, dims, rng):
    reqs = [rng.integers(0, 300, int(rng.integers(1, 60))) for _ in range(40)]
    model = ServerModel(batch=5, chunk=7, decode=9)
    trace = build_trace(
        iter(reqs), dims, tmp_path / "t", model=model, chunk_positions=50, progress=False
    )
    exp_rows, exp_steps = server_brute([(r, ngram_ids(dims, r)) for r in reqs], model)
    assert trace.positions == sum(r.size for r in reqs) == exp_steps.size
    assert trace.requests == 40 and trace.steps == exp_steps[-1] + 1
    assert len(trace.chunks) == -(-trace.positions // 50)
    got = np.concatenate([c[0] for c in trace.iter_chunks()], axis=1)
    np.testing.assert_array_equal(got, exp_rows)
    np.testing.assert_array_equal(trace.steps_array(), exp_steps)
    rows1, _steps1 = trace.table_accesses(1)
    np.testing.assert_array_equal(rows1, exp_rows[1])


def test_trace_flushes_in_bounded_pieces(tmp_path, dims, rng):
    reqs = [rng.integers(0, 300, 30) for _ in range(200)]
    model = ServerModel(batch=3, chunk=8, decode=4)
    t = build_trace(reqs, dims, tmp_path / "t", model=model, chunk_positions=16, progress=False)
    exp_rows, _exp_steps = server_brute([(r, ngram_ids(dims, r)) for r in reqs], model)
    np.testing.assert_array_equal(np.concatenate([c[0] for c in t.iter_chunks()], axis=1), exp_rows)
    with pytest.raises(ConfigError, match="exists"):
        build_trace(reqs, dims, tmp_path / "t", model=model, progress=False)


def test_trace_open_rejects_other_formats(tmp_path):
    with pytest.raises(FormatError, match="manifest"):
        Trace.open(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "x", "version": 1}))
    with pytest.raises(FormatError, match="format"):
        Trace.open(tmp_path)


def test_server_model_validates():
    with pytest.raises(ConfigError, match="batch"):
        ServerModel(batch=0)
    with pytest.raises(ConfigError, match="decode"):
        ServerModel(decode=-1)
    assert ServerModel(chunk=4, decode=3).units(10) == (7, 3, 5)
    assert ServerModel(chunk=4, decode=3).units(1) == (1, 0, 1)


def test_iter_requests_reads_npy_jsonl_and_text(tmp_path):
    np.save(tmp_path / "a.npy", np.array([5, 6, 2, 7, 8, 9, 2, 10], dtype=np.int32))
    (tmp_path / "b.jsonl").write_text("[11, 12]\n\n[13]\n")
    (tmp_path / "c.txt").write_text("hello world.\nmore\n\nsecond para\n")
    got = list(iter_requests([tmp_path], vocab_size=300, eos_token_id=2, max_request_tokens=2))
    flat = [g.tolist() for g in got]
    assert flat[:6] == [[5, 6], [2], [7, 8], [9, 2], [10], [11, 12]]
    assert flat[6] == [13]
    words = make_tokenizer("words", 300)
    assert flat[7:] == [words("hello world.\nmore\n")[i : i + 2].tolist() for i in (0, 2)] + [
        words("second para\n").tolist()
    ]
    assert all(0 <= t < 300 for g in got for t in g)


def test_tokenizers_offline_and_errors():
    b = make_tokenizer("bytes", 300)
    assert b("ab").tolist() == [97 + 3, 98 + 3]
    w = make_tokenizer("words", 1000)
    assert w("the cat, the").tolist()[0] == w("the").tolist()[0]
    assert len(w("the cat, the")) == 4
    with pytest.raises(ConfigError, match="tokenizer"):
        make_tokenizer("no-such-tokenizer.json", 300)
    with pytest.raises(ConfigError, match="exist"):
        list(iter_requests(["/no/such/path"], vocab_size=300, eos_token_id=2))


def test_hf_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({"[UNK]": 0, "hello": 5, "world": 6}, unk_token="[UNK]")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    enc = make_tokenizer(str(tmp_path / "tokenizer.json"), 300)
    assert enc("hello world hello").tolist() == [5, 6, 5]
    small = make_tokenizer(str(tmp_path / "tokenizer.json"), 6)
    with pytest.raises(ConfigError, match="vocab_size"):
        small("world")
