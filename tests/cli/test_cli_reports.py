"""Versioned reports (issue 51, item 10), each step in a child process as a user runs it.

``profile -o``, ``bench-io -o`` and ``tune -o`` carry ``format`` and ``version``, and the
profile and the tune report the shape of the tables they were made for. A tune report
applied to a checkpoint of another shape is refused in one line naming the file and both
shapes (a tune.json made for 10.2M-row tables once clamped 1,033,594 slots to 1,537 of a
small checkpoint without a word); one of the right shape loads; a report of another kind
or a newer version is refused; one from before versions loads with a warning."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from tests.cli.support import TINY_CONFIG, one_error_line, run_cli, run_python

# load_pretrained in a child: a ConfigError is the one line it prints (exit 2)
LOAD = """
import sys
from rowcache.embed.checkpoint import load_pretrained
from rowcache.errors import ConfigError
try:
    emb = load_pretrained(sys.argv[1], tune=sys.argv[2], store=sys.argv[3])
except ConfigError as e:
    print(f"ConfigError: {e}", file=sys.stderr)
    sys.exit(2)
print(sorted(c.num_slots for c in emb.caches))
"""


def _checkpoint(path, config: dict) -> dict[str, int]:
    """A LongCat n-gram checkpoint of ``config`` (random bf16 weights): its tables' shape."""
    torch = pytest.importorskip("torch")
    save_file = pytest.importorskip("safetensors.torch").save_file
    from rowcache.embed import NgramDims

    dims = NgramDims.from_config(config)
    g = torch.Generator().manual_seed(0)
    T, d, D = dims.num_tables, dims.table_dim, dims.hidden_size

    def bf16(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": bf16(dims.vocab_size, D)}
    for i in range(T):
        tensors[f"model.ngram_embeddings.embedders.{i}.weight"] = bf16(dims.table_rows(i), d)
        tensors[f"model.ngram_embeddings.post_projs.{i}.weight"] = bf16(D, d)
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({**config, "model_type": "longcat_flash_ngram"}))
    return {str(i): dims.table_rows(i) for i in range(T)}


def _tune_report(w, config_json, name: str) -> tuple[dict, dict]:
    """trace -> profile -o -> tune -o for the model of ``config_json``: (profile, tune)."""
    tr, prof, tune = w / f"tr-{name}", w / f"profile-{name}.json", w / f"tune-{name}.json"
    p = run_cli("trace", str(w / "reqs.jsonl"), "-o", str(tr), "--config", str(config_json))
    assert p.returncode == 0, p.stderr
    p = run_cli("profile", str(tr), "--sizes", "64,256", "-o", str(prof), "-q")
    assert p.returncode == 0, p.stderr
    p = run_cli(
        "tune", str(prof), "--arena", "4KiB", "--disk", str(w / "disk.json"), "-o", str(tune), "-q"
    )
    assert p.returncode == 0 and p.stderr == "", p.stderr
    return json.loads(prof.read_text()), json.loads(tune.read_text())


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    """A disk profile, and tune reports made (trace, profile, tune, each a child) for the
    tiny config's model and for the same model with 10x the rows."""
    w = tmp_path_factory.mktemp("reports")
    rng = np.random.default_rng(3)
    lines = [json.dumps(rng.integers(3, 300, 60).tolist()) for _ in range(60)]
    (w / "reqs.jsonl").write_text("\n".join(lines))
    (w / "disk.bin").write_bytes(bytes(1 << 16))
    p = run_cli("bench-io", str(w / "disk.bin"), "--queue-depths", "1", "--seconds", "0.02",
                "-o", str(w / "disk.json"), "-q")  # fmt: skip
    assert p.returncode == 0, p.stderr
    (w / "small.json").write_text(json.dumps(TINY_CONFIG))
    (w / "big.json").write_text(json.dumps({**TINY_CONFIG, "ngram_vocab_size_ratio": 30}))
    _tune_report(w, w / "small.json", "small")
    _tune_report(w, w / "big.json", "big")
    return w


@pytest.fixture(scope="module")
def ckpt(w):
    """A checkpoint of the tiny config (written with torch's safetensors) beside the reports."""
    _checkpoint(w / "ckpt", TINY_CONFIG)
    return w / "ckpt"


def _json(path) -> dict:
    return json.loads(path.read_text())


def _load(w, tune, store) -> subprocess.CompletedProcess:
    """``load_pretrained(checkpoint, tune=..., store=...)`` in a child."""
    return run_python(LOAD, str(w / "ckpt"), str(tune), str(w / store), timeout=300)


def test_reports_carry_format_version_and_the_shape_they_were_made_for(w):
    shape = {str(i): 3 * 300 + 2 * i + 1 for i in range(4)}  # the tiny config's tables
    disk, prof, tune = (
        _json(w / "disk.json"),
        _json(w / "profile-small.json"),
        _json(w / "tune-small.json"),
    )
    assert (disk["format"], disk["version"], disk["record_bytes"]) == ("rowcache.bench-io", 1, 512)
    assert (prof["format"], prof["version"], prof["shape"]) == ("rowcache.profile", 1, shape)
    assert (tune["format"], tune["version"], tune["shape"]) == ("rowcache.tune", 1, shape)
    big = {k: v + 27 * 300 for k, v in shape.items()}  # int(30 * 300) + 2i + 1
    assert _json(w / "tune-big.json")["shape"] == big


def test_a_tune_report_of_another_shape_is_refused_naming_the_file_and_both_shapes(w, ckpt):
    p = _load(w, w / "tune-small.json", "st")  # the right shape loads, its slots as chosen
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout) == sorted(_json(w / "tune-small.json")["rows"].values())
    p = _load(w, w / "tune-big.json", "st2")
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr[-3000:]
    err = p.stderr
    assert f"{w / 'tune-big.json'} was made for 4 tables 0..3 of 9,001 to 9,007 rows" in err, err
    assert "applied to 4 tables 0..3 of 901 to 907 rows" in err, err
    assert not (w / "st2").exists()  # refused before anything was built
    p = _load(w, w / "profile-small.json", "st4")  # a profile given as a tune report
    assert p.returncode == 2 and "is a fault-rate profile" in p.stderr, p.stderr[-3000:]


def test_other_reports_and_newer_versions_are_refused_older_ones_warned(w):
    prof, tune, disk = w / "profile-small.json", w / "tune-small.json", w / "disk.json"
    cases = [
        (["tune", str(tune), "--arena", "4KiB"], f"{tune} is a tune report (from `rowcache tune"),
        (["tune", str(disk), "--arena", "4KiB"], f"{disk} is a disk profile (from `rowcache"),
        (["tune", str(prof), "--arena", "4KiB", "--disk", str(prof)], "is a fault-rate profile"),
    ]
    for argv, want in cases:
        err = one_error_line(run_cli(*argv), "tune")
        assert want in err, err
    newer = w / "newer.json"
    newer.write_text(json.dumps({**_json(prof), "version": 99}))
    err = one_error_line(run_cli("tune", str(newer), "--arena", "4KiB"), "tune")
    assert "of version 99, made by a newer rowcache; this one reads versions 1..1" in err, err
    # from before versions: read, with one warning line
    old = {k: v for k, v in _json(prof).items() if k not in ("format", "version", "shape")}
    (w / "old.json").write_text(json.dumps(old))
    p = run_cli("tune", str(w / "old.json"), "--arena", "4KiB", "--json")
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("rowcache tune: warning: "), p.stderr
    assert "without a format version" in p.stderr and str(w / "old.json") in p.stderr
    rep = json.loads(p.stdout)
    assert rep["format"] == "rowcache.tune" and rep["shape"] == _json(prof)["shape"]


def test_an_unversioned_tune_report_loads_with_a_warning_naming_what_it_cannot_check(w, ckpt):
    old = w / "old-tune.json"
    old.write_text(json.dumps({"rows": {"0": 2_000, "1": 50}, "dtype": "bf16"}))
    p = _load(w, old, "st3")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "UserWarning" in p.stderr and f"{old}: a tune report" in p.stderr, p.stderr
    assert "without a format version" in p.stderr and "exceed the rows of table(s) 0" in p.stderr
    assert json.loads(p.stdout) == [50, 901]  # table 0 clamped to its rows, as before
