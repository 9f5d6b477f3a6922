"""Sharded Hugging Face checkpoints (issue 39, item 12): ``model.safetensors.index.json`` or its
directory, through ``Checkpoint``, ``table_sources``, ``load_pretrained``, ``build_store`` and
``rowcache build --safetensors``: the ``weight_map`` is followed, a shard without n-gram tables
is skipped, the report says which tables came from which file; a malformed index is refused
in one line (each case in a child process: ``tests.store.refusals``)."""

from __future__ import annotations

import json
import os
import shutil
import struct

import numpy as np
import pytest

import rowcache
from rowcache.cli.app import main
from rowcache.embed import Checkpoint, load_pretrained, table_sources
from rowcache.embed.layer import NgramEmbedding
from rowcache.kernels.reference import BF16
from tests.embed.support import DIMS, bits, random_weights, token_stream
from tests.store.refusals import assert_refused, run_cases

INDEX = "model.safetensors.index.json"
TABLE = "model.ngram_embeddings.embedders.{i}.weight"
PROJ = "model.ngram_embeddings.post_projs.{i}.weight"
SHARDS = [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
_DT = {np.dtype(BF16): "BF16", np.dtype(np.float32): "F32"}


def save(path, tensors):
    """A .safetensors file by the format's definition (safetensors.numpy has no bfloat16)."""
    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        raw = np.ascontiguousarray(a).tobytes()
        header[name] = {
            "dtype": _DT[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [off, off + len(raw)],
        }
        blobs.append(raw)
        off += len(raw)
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def write_checkpoint(path, weights):
    """Three shards: the word table and tables 0, 1; tables 2, 3; then one with no n-gram table."""
    word, tables, projs = weights
    parts = [
        {"model.embed_tokens.weight": word}
        | {TABLE.format(i=i): tables[i] for i in (0, 1)}
        | {PROJ.format(i=i): projs[i] for i in (0, 1)},
        {TABLE.format(i=i): tables[i] for i in (2, 3)}
        | {PROJ.format(i=i): projs[i] for i in (2, 3)}
        | {"model.norm.weight": np.ones(DIMS.hidden_size, np.float32)},
        {"lm_head.weight": word, "model.layers.0.mlp.gate.weight": np.ones((4, 8), np.float32)},
    ]
    path.mkdir()
    weight_map = {}
    for fn, tensors in zip(SHARDS, parts):
        save(path / fn, tensors)
        weight_map.update(dict.fromkeys(tensors, fn))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (path / INDEX).write_text(json.dumps(index))
    (path / "config.json").write_text(json.dumps(DIMS.to_config()))
    return path


@pytest.fixture
def weights(rng):
    return random_weights(rng)


@pytest.fixture
def ckpt(tmp_path, weights):
    return write_checkpoint(tmp_path / "ckpt", weights)


def test_checkpoint_takes_the_index_file_or_the_directory(ckpt):
    files = [str(ckpt / fn) for fn in SHARDS]
    by_index, by_dir = Checkpoint(ckpt / INDEX), Checkpoint(ckpt)
    assert by_index.files == by_dir.files
    assert by_index.ngram_tables() == {0: files[0], 1: files[0], 2: files[1], 3: files[1]}
    want = {str(i): (files[i // 2], TABLE.format(i=i)) for i in range(4)}
    assert table_sources(ckpt / INDEX) == table_sources(ckpt) == want
    # without the index every shard's header is read; the shard without tables is no error
    os.unlink(ckpt / INDEX)
    assert Checkpoint(ckpt).ngram_tables() == by_index.ngram_tables()
    assert table_sources(ckpt) == want


@pytest.mark.parametrize("given", ["index", "directory"])
def test_load_pretrained_and_build_store_follow_the_weight_map(ckpt, weights, tmp_path, rng, given):
    word, tables, projs = weights
    path = ckpt / INDEX if given == "index" else ckpt
    emb = load_pretrained(path, cached=[1, 2], arena_bytes="64KiB", store=tmp_path / "st")
    want = NgramEmbedding(DIMS, word, tables, projs)
    x = token_stream(rng, 90)
    np.testing.assert_array_equal(bits(emb.embed(x, 90)), bits(want.embed(x, 90)))
    # a tensor of the index as a build_store source: (index, tensor) follows the weight_map
    store = rowcache.build_store(
        tmp_path / "one", {"t3": (str(ckpt / INDEX), TABLE.format(i=3))}, progress=False
    )
    with store:
        assert store.meta["params"]["sources"] == [f"{ckpt / SHARDS[1]}:{TABLE.format(i=3)}"]
        got = store.read_rows("t3", np.arange(tables[3].shape[0]))
        np.testing.assert_array_equal(bits(got), bits(tables[3]))


@pytest.mark.parametrize("given", ["index", "directory", "each shard"])
def test_cli_build_from_a_sharded_checkpoint_says_which_file_gave_which_table(
    ckpt, weights, tmp_path, capsys, given
):
    args = {
        "index": ["--safetensors", str(ckpt / INDEX)],
        "directory": ["--safetensors", str(ckpt)],
        "each shard": [a for fn in SHARDS for a in ("--safetensors", str(ckpt / fn))],
    }[given]
    assert main(["build", str(tmp_path / "s"), *args, "--no-progress", "--json"]) == 0
    cap = capsys.readouterr()
    rep = json.loads(cap.out)
    assert [t["name"] for t in rep["tables"]] == [f"ngram.{i}" for i in range(4)]
    assert [t["rows"] for t in rep["tables"]] == [DIMS.table_rows(i) for i in range(4)]
    for i, t in enumerate(rep["tables"]):
        assert t["source"] == f"{ckpt / SHARDS[i // 2]}:{TABLE.format(i=i)}"
    lines = cap.err.splitlines()
    assert any(SHARDS[0] in ln and "ngram.0, ngram.1" in ln for ln in lines), cap.err
    assert any(SHARDS[1] in ln and "ngram.2, ngram.3" in ln for ln in lines), cap.err
    assert any(SHARDS[2] in ln and "skipped" in ln for ln in lines), cap.err
    assert "Traceback" not in cap.err
    with rowcache.RowStore.open(tmp_path / "s") as store:
        for i in range(4):
            got = store.read_rows(f"ngram.{i}", np.arange(DIMS.table_rows(i)))
            np.testing.assert_array_equal(bits(got), bits(weights[1][i]))


def test_cli_build_table_from_an_index_names_the_tensor(ckpt, weights, tmp_path, capsys):
    spec = f"t3={ckpt / INDEX}:{TABLE.format(i=3)}"
    assert main(["build", str(tmp_path / "s"), "--table", spec, "--no-progress", "--json"]) == 0
    (table,) = json.loads(capsys.readouterr().out)["tables"]
    assert (table["name"], table["source"]) == ("t3", f"{ckpt / SHARDS[1]}:{TABLE.format(i=3)}")
    assert main(["build", str(tmp_path / "x"), "--table", f"t={ckpt / INDEX}"]) == 2
    assert "INDEX.json:TENSOR" in _one_line(capsys)


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_cli_build_refuses_no_ngram_table_and_a_table_from_two_files(ckpt, tmp_path, capsys):
    assert main(["build", str(tmp_path / "a"), "--safetensors", str(ckpt / SHARDS[2])]) == 2
    err = _one_line(capsys)
    assert SHARDS[2] in err and "no n-gram tables" in err
    assert not os.path.exists(tmp_path / "a")
    copy = tmp_path / "copy.safetensors"
    shutil.copy(ckpt / SHARDS[0], copy)
    assert (
        main(["build", str(tmp_path / "b"), "--safetensors", str(ckpt), "--safetensors", str(copy)])
        == 2
    )
    err = _one_line(capsys)
    assert "ngram.0" in err and SHARDS[0] in err and str(copy) in err


# --- a malformed index, config.json or shard: one line, in a child process -----------------
T0 = TABLE.format(i=0)


def _deep(n: int) -> bytes:
    return b"[" * n + b"]" * n


def _wm(mapping) -> bytes:
    return json.dumps({"weight_map": mapping}).encode()


ALL_TO = lambda fn: _wm({TABLE.format(i=i): fn for i in range(4)})  # noqa: E731

# name -> (index bytes or "fifo"/"sparse", what the message names: "index" / "shard" /
# "config", phrases, error, calls the case makes: the API's and the CLI's)
MALFORMED = {
    "index not JSON": (b"{nope", "index", ("not JSON",)),
    "index a list": (b"[]", "index", ("not a JSON object",)),
    "index without weight_map": (b'{"metadata": {}}', "index", ("weight_map",)),
    "weight_map a list": (b'{"weight_map": [1]}', "index", ("weight_map",)),
    "a shard name not a string": (_wm({T0: 5}), "index", ("weight_map", repr(T0))),
    "a shard outside the directory": (_wm({T0: "../out.safetensors"}), "index", ("inside",)),
    "an absolute shard path": (_wm({T0: "/etc/passwd"}), "index", ("inside",)),
    "index nested 100,000 deep": (_deep(100_000), "index", ("nest",)),
    "index over 100 MB": ("sparse", "index", ("100,000,000",)),
    "index a FIFO": ("fifo", "index", ("regular file",)),
    "a missing shard": (ALL_TO("model-00009-of-00009.safetensors"), "shard", ("does not exist",)),
    "a truncated shard": (ALL_TO("cut.safetensors"), "shard", ("truncated",)),
    "config.json nested 100,000 deep": (ALL_TO("cut.safetensors"), "config", ("nest",)),
}


def _malformed_case(d, how, names):
    d.mkdir()
    config = _deep(100_000) if names == "config" else json.dumps(DIMS.to_config()).encode()
    (d / "config.json").write_bytes(config)
    index = d / INDEX
    if how == "fifo":
        os.mkfifo(index)
    elif how == "sparse":
        with open(index, "wb") as f:
            f.write(b'{"weight_map": {')
            f.truncate(100_000_001)
    else:
        index.write_bytes(how)
    rng = np.random.default_rng(0)
    save(
        d / "cut.safetensors", {T0: rng.standard_normal((DIMS.table_rows(0), 8)).astype(np.float32)}
    )
    with open(d / "cut.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(d / "cut.safetensors") - 100)
    out = str(d / "store")
    calls = [
        ("table_sources", [str(index)]),
        ("table_sources", [str(d)]),
        ("load_pretrained", [str(index), {"cached": [0], "arena_bytes": "1MiB"}]),
        ("load_pretrained", [str(d), {"cached": "all", "arena_bytes": "1MiB"}]),
    ]
    if names == "index":  # the index is read when the checkpoint is opened
        calls += [("checkpoint", [str(index)]), ("checkpoint", [str(d)])]
    if names != "config":  # neither the CLI nor build_store reads config.json
        calls += [
            ("build_store", [out + "-api", {"t": [str(index), T0]}]),
            ("cli", ["build", out + "-idx", "--safetensors", str(index), "--no-progress"]),
            ("cli", ["build", out + "-dir", "--safetensors", str(d), "--no-progress"]),
        ]
    named = {
        "index": index,
        "shard": d / "model-00009-of-00009.safetensors",
        "config": d / "config.json",
    }[names]
    if names == "shard" and b"cut" in how:
        named = d / "cut.safetensors"
    return calls, str(named)


@pytest.fixture(scope="module")
def malformed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("index")
    cases, named = {}, {}
    for i, (name, (how, names, _)) in enumerate(MALFORMED.items()):
        cases[name], named[name] = _malformed_case(tmp / f"c{i}", how, names)
    return {"named": named} | run_cases(cases, tmp)


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_index_config_or_shard_refused_in_one_line(malformed, case):
    phrases = MALFORMED[case][2]
    error = "ConfigError" if case == "a missing shard" else "FormatError"
    assert_refused(malformed[case], malformed["named"][case], *phrases, error=error)
