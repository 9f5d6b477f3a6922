"""``from_pretrained`` never writes into the checkpoint, and takes a Hugging Face repo id
(issue 51, item 9). Each case runs in a child process:

- a read-only checkpoint (a directory another user owns: the child drops to ``nobody`` when
  it runs as root, for whom permissions do not hold) loads with cached tables, LongCat's
  ``TorchNgramEmbedding`` and Qwen4's ``TorchQwen4NgramEmbedding`` alike: the store goes to
  the user's cache directory (``ROWCACHE_CACHE_DIR``), keyed by the checkpoint, and the
  checkpoint's directory is left as it was; an unwritable cache directory or ``store=`` is
  one ``ConfigError`` line naming ``store=``;
- a repo id resolves through ``huggingface_hub`` from a Hugging Face cache laid out as
  ``snapshot_download`` leaves it (``HF_HUB_CACHE``, ``HF_HUB_OFFLINE=1``: no network
  here), only the shards holding the tables needed; a repo id the cache lacks is one line.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("huggingface_hub")
save_file = pytest.importorskip("safetensors.numpy").save_file

from rowcache.embed import NgramDims, Qwen4NgramConfig, Qwen4NgramHash  # noqa: E402
from rowcache.kernels.reference import BF16  # noqa: E402

DIMS = NgramDims(vocab_size=300, hidden_size=48, max_ngram=3, splits=2, ratio=2.5, eos_token_id=2)
QWEN4 = {
    "model_type": "qwen4_exp_text",
    "vocab_size": 50,
    "eos_token_id": [7],
    "ngram_size": 4,
    "heads_per_ngram": 3,
    "ngram_vocab_size_base": 4000,
    "make_ngram_vocab_size_divisible_by": 64,
    "split_ngram_parts": 4,
    "ple_layer_ids": [1],
    "ple_embed_dim": 36,
}
QWEN4_TABLE = "model.layers.0.ple.ple_embedding.ngram_embedding.weight"


def longcat_tensors(rng):
    bf = lambda a: a.astype(np.float32).astype(BF16)  # noqa: E731
    t = {"model.embed_tokens.weight": bf(rng.standard_normal((300, 48)) * 0.1)}
    for i in range(DIMS.num_tables):
        t[f"model.ngram_embeddings.embedders.{i}.weight"] = bf(
            rng.standard_normal((DIMS.table_rows(i), DIMS.table_dim))
        )
        t[f"model.ngram_embeddings.post_projs.{i}.weight"] = bf(
            rng.standard_normal((48, DIMS.table_dim)) * 0.2
        )
    return t


def save_longcat(path, rng, other=None):
    """A LongCat checkpoint in two shards and an index: the n-gram tensors in the first, the
    ``other`` tensors (the rest of a model) in the second."""
    path.mkdir(parents=True)
    t = longcat_tensors(rng)
    other = other if other is not None else {"model.norm.weight": np.ones(48, np.float32)}
    save_file(t, str(path / "model-00001-of-00002.safetensors"))
    save_file(other, str(path / "model-00002-of-00002.safetensors"))
    weight_map = {k: "model-00001-of-00002.safetensors" for k in t}
    weight_map.update({k: "model-00002-of-00002.safetensors" for k in other})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({**DIMS.to_config(), "num_layers": 2}))


def save_qwen4(path, rng):
    path.mkdir(parents=True)
    h = Qwen4NgramHash(Qwen4NgramConfig.from_config(QWEN4))
    table = rng.standard_normal((h.table_rows(), h.config.head_dim)).astype(BF16)
    save_file({QWEN4_TABLE: table}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(QWEN4))


def listing(path):
    return sorted(
        (os.path.relpath(os.path.join(d, f), path), os.path.getsize(os.path.join(d, f)))
        for d, _, files in os.walk(path)
        for f in files
    )


def run_child(code, env, *args, timeout=300):
    """``python -c code args...`` with ``env`` added; its last stdout line, as JSON."""
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **env},
    )
    assert proc.returncode == 0, f"exit {proc.returncode} (a signal if < 0): {proc.stderr[-3000:]}"
    return json.loads(proc.stdout.splitlines()[-1])


# --- a read-only checkpoint ----------------------------------------------------------------

READ_ONLY = r"""
import ctypes, datetime, json, os, sys, tempfile
import numpy as np
import torch
import rowcache.store.builder, rowcache.cache.row_cache, rowcache.embed.qwen4.checkpoint
from rowcache.embed import TorchNgramEmbedding, TorchQwen4NgramEmbedding
from rowcache.errors import RowCacheError
if os.getuid() == 0:  # root writes anywhere: be a user to whom the checkpoint is read-only
    os.setgid(65534)  # (everything imported first: root's Python may be unreadable to nobody)
    os.setuid(65534)
    ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: /proc/self/fd stays readable

base = sys.argv[1]
longcat, qwen4 = os.path.join(base, "longcat"), os.path.join(base, "qwen4")
ids = torch.tensor([[5, 9, 2, 17, 40, 41, 9, 5]])
out = {"uid": os.getuid(), "writable": os.access(longcat, os.W_OK)}


def attempt(key, fn):
    try:
        out[key] = {"ok": fn()}
    except (RowCacheError, OSError) as e:
        out[key] = {"error": type(e).__name__, "message": str(e)}


def longcat_cached(**kw):
    mod = TorchNgramEmbedding.from_pretrained(longcat, cached="all", arena_bytes="64KiB", **kw)
    resident = TorchNgramEmbedding.from_pretrained(longcat)
    return [torch.equal(mod(ids), resident(ids)), mod.emb.caches[0].store.path]


def qwen4_cached(**kw):
    mod = TorchQwen4NgramEmbedding.from_pretrained(qwen4, arena=0.5, progress=False, **kw)
    return [list(mod(ids % 50).shape), mod.memory.table.cache.store.path]


os.environ["ROWCACHE_CACHE_DIR"] = os.path.join(base, "cache")
attempt("longcat", longcat_cached)
attempt("longcat again", longcat_cached)  # the store is reused, not rebuilt
attempt("qwen4", qwen4_cached)
os.environ["ROWCACHE_CACHE_DIR"] = os.path.join(base, "locked")  # a cache directory not ours
attempt("longcat locked cache", longcat_cached)
attempt("qwen4 locked cache", qwen4_cached)
os.environ["ROWCACHE_CACHE_DIR"] = os.path.join(base, "cache")
attempt("longcat store inside", lambda: longcat_cached(store=os.path.join(longcat, "st")))
attempt("qwen4 store inside", lambda: qwen4_cached(store=os.path.join(qwen4, "st")))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def read_only():
    """Checkpoints in directories of mode 0555 (files 0444) under a fresh directory that
    ``nobody`` can enter, a cache directory anyone may write and one nobody but root may."""
    base = tempfile.mkdtemp(prefix="rowcache-ro-")
    try:
        os.chmod(base, 0o755)
        rng = np.random.default_rng(0)
        save_longcat(_p(base, "longcat"), rng)
        save_qwen4(_p(base, "qwen4"), rng)
        for name in ("longcat", "qwen4"):
            root = os.path.join(base, name)
            for f in os.listdir(root):
                os.chmod(os.path.join(root, f), 0o444)
            os.chmod(root, 0o555)
        os.mkdir(os.path.join(base, "cache"), 0o777)
        os.chmod(os.path.join(base, "cache"), 0o777)
        os.mkdir(os.path.join(base, "locked"), 0o555)
        before = {n: listing(os.path.join(base, n)) for n in ("longcat", "qwen4")}
        got = run_child(READ_ONLY, {}, base, timeout=600)
        after = {n: listing(os.path.join(base, n)) for n in ("longcat", "qwen4")}
        yield base, got, before, after
    finally:
        for d, _, _ in os.walk(base):
            os.chmod(d, 0o755)
        shutil.rmtree(base, ignore_errors=True)


def _p(base, name):
    import pathlib

    return pathlib.Path(base) / name


def test_a_read_only_checkpoint_loads_with_its_store_in_the_user_cache(read_only):
    base, got, before, after = read_only
    assert got["uid"] != 0 and not got["writable"], got  # the checkpoint is read-only to it
    assert after == before  # nothing written into either checkpoint
    for key in ("longcat", "longcat again"):
        assert "ok" in got[key], got[key]
        same, store = got[key]["ok"]
        assert same, "cached rows equal the resident ones"
        assert store.startswith(os.path.join(base, "cache", "stores", "longcat-")), store
    assert got["longcat"]["ok"][1] == got["longcat again"]["ok"][1]
    assert "ok" in got["qwen4"], got["qwen4"]
    shape, store = got["qwen4"]["ok"]
    assert shape == [1, 8, 36]
    assert store.startswith(os.path.join(base, "cache", "stores", "qwen4-")), store
    assert store.endswith("rowcache-qwen4-layer1"), store


@pytest.mark.parametrize("model", ["longcat", "qwen4"])
def test_an_unwritable_store_place_is_one_line_naming_store(read_only, model):
    base, got, _, _ = read_only
    r = got[f"{model} locked cache"]
    assert r.get("error") == "ConfigError", r  # was a PermissionError traceback
    msg = r["message"]
    assert msg.startswith("store='") and os.path.join(base, "locked") in msg, msg
    assert "ROWCACHE_CACHE_DIR" in msg and "Permission denied" in msg and "\n" not in msg, msg
    r = got[f"{model} store inside"]
    assert r.get("error") == "ConfigError", r
    msg = r["message"]
    assert msg.startswith(f"store='{os.path.join(base, model, 'st')}'"), msg
    assert "writable directory" in msg and "\n" not in msg, msg


# --- a Hugging Face repo id, offline ---------------------------------------------------------

REPO_ID = r"""
import json, os, sys
import torch
from rowcache.embed import TorchNgramEmbedding, TorchQwen4NgramEmbedding
from rowcache.errors import RowCacheError

local_longcat, local_qwen4 = sys.argv[1], sys.argv[2]
ids = torch.tensor([[5, 9, 2, 17, 40, 41, 9, 5]])
out = {}
by_id = TorchNgramEmbedding.from_pretrained("tiny-org/LongCat-Tiny", cached="all",
                                            arena_bytes="64KiB")
by_path = TorchNgramEmbedding.from_pretrained(local_longcat)
out["longcat same"] = torch.equal(by_id(ids), by_path(ids))
out["longcat store"] = by_id.emb.caches[0].store.path
q = TorchQwen4NgramEmbedding.from_pretrained("tiny-org/Qwen4-Tiny", arena=0.5, progress=False)
out["qwen4 shape"] = list(q(ids % 50).shape)
for key, repo in (("missing", "tiny-org/Not-Downloaded"), ("bad", "not/a/repo/id")):
    try:
        TorchNgramEmbedding.from_pretrained(repo)
        out[key] = {"ok": True}
    except RowCacheError as e:
        out[key] = {"error": type(e).__name__, "message": str(e)}
print(json.dumps(out))
"""


def hf_cache_entry(hub, repo, source, skip=()):
    """``source``'s files laid out as ``snapshot_download`` leaves them in the Hugging Face
    cache: blobs named by their hash, a snapshot of links to them, ``refs/main``."""
    folder = hub / ("models--" + repo.replace("/", "--"))
    commit = hashlib.sha1(repo.encode()).hexdigest()
    snap = folder / "snapshots" / commit
    (folder / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    for f in sorted(os.listdir(source)):
        if f in skip:
            continue
        data = (source / f).read_bytes()
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f).symlink_to(os.path.relpath(blob, snap))
    return snap


def test_a_repo_id_resolves_from_the_hugging_face_cache_offline(tmp_path):
    rng = np.random.default_rng(1)
    # the rest of the model is in a second shard that was never downloaded: not needed
    save_longcat(tmp_path / "longcat", rng, other={"model.layers.0.w": np.ones((4, 4), np.float32)})
    save_qwen4(tmp_path / "qwen4", rng)
    hub = tmp_path / "hub"
    snap = hf_cache_entry(
        hub,
        "tiny-org/LongCat-Tiny",
        tmp_path / "longcat",
        skip={"model-00002-of-00002.safetensors"},
    )
    hf_cache_entry(hub, "tiny-org/Qwen4-Tiny", tmp_path / "qwen4")
    env = {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    got = run_child(REPO_ID, env, str(tmp_path / "longcat"), str(tmp_path / "qwen4"), timeout=600)
    assert got["longcat same"], "the repo id's snapshot serves the same rows as the local copy"
    assert "tiny-org--LongCat-Tiny-" in got["longcat store"], got["longcat store"]
    assert str(snap) not in got["longcat store"]  # nothing written into the HF cache
    assert got["qwen4 shape"] == [1, 8, 36]
    for key in ("missing", "bad"):
        r = got[key]
        assert r.get("error") == "ConfigError" and "\n" not in r["message"], r
    assert "tiny-org/Not-Downloaded" in got["missing"]["message"]
    assert str(hub) in got["missing"]["message"] and "HF_HUB_OFFLINE" in got["missing"]["message"]
    assert not any(p.name.startswith("rowcache") for p in hub.rglob("*"))
