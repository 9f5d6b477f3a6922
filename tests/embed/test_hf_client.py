"""A real client: transformers' LongcatFlashForCausalLM decoding from TorchNgramEmbedding (CPU)."""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

import longcat_generate as client  # noqa: E402

from rowcache.embed import TorchNgramEmbedding  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return client.write_tiny_checkpoint(str(tmp_path_factory.mktemp("hf") / "ckpt"))


@pytest.fixture(scope="module")
def model(ckpt):
    return client.load_base_model(ckpt)


PROMPT = [[1, 17, 250, 31, 9, 400, 77, 5, 2, 19], [1, 88, 2, 300, 12, 12, 12, 6, 140, 141]]


def test_checkpoint_is_hf_layout(ckpt):
    import json

    index = json.loads((pathlib.Path(ckpt) / "model.safetensors.index.json").read_text())
    names = set(index["weight_map"])
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names
    assert {f"model.ngram_embeddings.embedders.{i}.weight" for i in range(12)} <= names
    assert len(set(index["weight_map"].values())) == 2


def test_greedy_tokens_identical_resident_and_cached(ckpt, model, tmp_path):
    resident = TorchNgramEmbedding.from_pretrained(ckpt)
    cached = TorchNgramEmbedding.from_pretrained(
        ckpt, cached="all", store=tmp_path / "store", arena_bytes="4KiB"
    )
    prompt = torch.tensor(PROMPT)
    a = client.greedy(model, resident, prompt, 12)
    b = client.greedy(model, cached, prompt, 12)
    assert a.shape == (2, 12)
    assert torch.equal(a, b)
    stats = [c.stats() for c in cached.emb.caches]
    assert sum(s.evictions for s in stats) > 0  # the arenas were too small to keep every row
    # the n-gram rows matter: the embedding is not the scaled word row alone
    word = model.get_input_embeddings()
    embeds = resident(prompt).float()
    assert not torch.allclose(embeds, word(prompt) / 13, atol=1e-3)


def test_incremental_embeddings_equal_one_pass(ckpt, model):
    """What greedy() feeds the model step by step equals embedding the whole text once."""
    mod = TorchNgramEmbedding.from_pretrained(ckpt)
    prompt = torch.tensor(PROMPT)
    toks = client.greedy(model, mod, prompt, 6)
    seq = torch.cat([prompt, toks], 1)
    whole = mod(seq)
    keep = mod.dims.max_ngram - 1
    steps = [mod(prompt)]
    for t in range(prompt.shape[1], seq.shape[1]):
        steps.append(mod(seq[:, t : t + 1], seq[:, t - keep : t]))
    got = torch.cat(steps, 1)
    assert np.array_equal(got.view(torch.int16).numpy(), whole.view(torch.int16).numpy())


def test_example_main_runs(ckpt, capsys):
    assert client.main(["--steps", "4", "--dir", ckpt + "-main"]) == 0
    assert "identical tokens" in capsys.readouterr().out


def test_example_imports_the_installed_rowcache_and_times_after_a_warm_up(tmp_path):
    """Issue 51, items 8 and 12, in a child as a user runs it: the example imports the
    rowcache on the path (here a copy standing for an install), not the checkout it sits
    in, says which copy and whether its extensions are built, and times after a warm-up."""
    import os
    import subprocess

    from tests.support import ROOT, package_copy

    inst = package_copy(tmp_path / "site", native=True)
    p = subprocess.run(
        [sys.executable, str(EXAMPLES / "longcat_generate.py"), "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(inst)},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert lines[0].startswith("rowcache ") and f"from {inst / 'rowcache'};" in lines[0], lines[0]
    assert str(ROOT / "rowcache") not in p.stdout
    assert "native extensions: all 3 built" in lines[0], lines[0]
    timed = [ln for ln in lines if "tok/s" in ln]
    assert len(timed) == 2 and all("after a 2-step warm-up" in ln for ln in timed), timed
    assert lines[-1] == "identical tokens"
