"""Malformed ``.safetensors`` files are refused in one line naming the file and the tensor
(issue 39, item 11): through ``rowcache.build_store``, ``rowcache.embed.Checkpoint`` and
``rowcache build --table / --safetensors``, each case in a child process (``refusals``), never
a traceback, a ``MemoryError``, a ``RecursionError``, a signal or a hang."""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np
import pytest

import rowcache
from rowcache.errors import FormatError
from rowcache.store.sources import safetensors_header
from tests.store.refusals import assert_refused, run_cases

T = "model.ngram_embeddings.embedders.0.weight"
GOOD = np.arange(20 * 8, dtype=np.float32).reshape(20, 8)
DATA = GOOD.tobytes()  # 640 bytes


def entry(shape=(20, 8), offsets=(0, 640), dtype="F32"):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def st(header, data=DATA, *, hlen=None) -> bytes:
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(head) if hlen is None else hlen) + head + data


def _deep(n: int) -> bytes:
    return b"[" * n + b"]" * n


# name -> (file bytes, or a special maker's name; phrases the refusal holds besides the file)
CASES = {
    "empty file": (b"", ("8-byte header length",)),
    "shorter than its length field": (b"\x05\x00\x00", ("8-byte header length",)),
    "header length 2**62": (st(b"{}", hlen=2**62), ("header length",)),
    "header length of 1 TiB": (st({T: entry()}, hlen=1 << 40), ("header length",)),
    "header over 100 MB": ("sparse", ("100,000,000",)),
    "an index JSON named .safetensors": (
        json.dumps({"metadata": {}, "weight_map": {T: "m-1.safetensors"}}).encode(),
        ("JSON", "index"),
    ),
    "header not JSON": (st(b"\xff\xfe{not json"), ("not JSON",)),
    "header a list": (st([1, 2]), ("a list", "not a JSON object")),
    "header a string": (st("x"), ("not a JSON object",)),
    "header nested 100,000 deep": (st(_deep(100_000)), ("nest",)),
    "a tensor nested 100,000 deep": (
        st(b'{"' + T.encode() + b'": ' + _deep(100_000) + b"}"),
        ("nest",),
    ),
    "entry not an object": (st({T: [1, 2]}), (repr(T), "not an object")),
    "dtype missing": (st({T: {"shape": [20, 8], "data_offsets": [0, 640]}}), (repr(T), "dtype")),
    "dtype not a string": (st({T: entry(dtype=5)}), (repr(T), "dtype")),
    "shape negative": (st({T: entry(shape=(-20, 8))}), (repr(T), "shape")),
    "shape not a list": (st({T: {**entry(), "shape": "20x8"}}), (repr(T), "shape")),
    "shape of booleans": (st({T: {**entry(), "shape": [True, 8]}}), (repr(T), "shape")),
    "shape of 100,000 dimensions": (
        st({T: entry(shape=(2**62,) * 100_000)}),
        (repr(T), "dimensions"),
    ),
    "offsets reversed": (st({T: entry(offsets=(640, 0))}), (repr(T), "data_offsets")),
    "offsets not a pair": (st({T: entry(offsets=(0,))}), (repr(T), "data_offsets")),
    "offsets past the end": (
        st({T: entry(shape=(200, 8), offsets=(0, 6400))}),
        (repr(T), "truncated"),
    ),
    "offsets past the end by 2**70": (
        st({T: entry(shape=(2**34, 2**34), offsets=(0, 2**70))}),
        (repr(T), "truncated"),
    ),
    "shape and offsets disagree": (st({T: entry(offsets=(0, 320))}), (repr(T), "shape")),
    "a huge shape over small offsets": (st({T: entry(shape=(2**62, 2**62))}), (repr(T), "shape")),
    "metadata not an object": (st({"__metadata__": [1], T: entry()}), ("__metadata__",)),
    "a FIFO": ("fifo", ("regular file",)),
}


def _make(path, how):
    if how == "fifo":
        os.mkfifo(path)
    elif how == "sparse":  # a 100 MB header is refused before a byte of it is read
        hlen = 100_000_001
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", hlen) + b"{")
            f.truncate(8 + hlen + 640)
    else:
        path.write_bytes(how)


def _calls(path, out):
    return [
        ("build_store", [f"{out}-api", {"t": [str(path), T]}]),
        ("checkpoint", [str(path)]),
        ("cli", ["build", f"{out}-table", "--table", f"t={path}:{T}", "--no-progress"]),
        ("cli", ["build", f"{out}-ngram", "--safetensors", str(path), "--no-progress"]),
    ]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("malformed")
    cases = {}
    for i, (name, (how, _)) in enumerate(CASES.items()):
        path = tmp / f"c{i}.safetensors"
        _make(path, how)
        cases[name] = _calls(path, tmp / f"s{i}")
    good = tmp / "good.safetensors"
    good.write_bytes(st({T: entry(), "__metadata__": {"format": "pt"}}))
    cases["valid"] = _calls(good, tmp / "good")
    return {"paths": {n: tmp / f"c{i}.safetensors" for i, n in enumerate(CASES)}} | run_cases(
        cases, tmp
    )


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_safetensors_refused_in_one_line_naming_file_and_tensor(outcomes, case):
    assert_refused(outcomes[case], str(outcomes["paths"][case]), *CASES[case][1])


def test_valid_safetensors_builds_through_every_entry(outcomes):
    calls = outcomes["valid"]["calls"]
    assert outcomes["valid"]["status"] == 0
    assert [c.get("error") for c in calls] == [None] * 4, calls
    assert calls[1]["result"] == [T]
    assert [c["result"]["rc"] for c in calls[2:]] == [0, 0], calls


def test_safetensors_header_takes_what_the_safetensors_library_writes(tmp_path):
    """The checks refuse nothing a valid file holds: every dtype, 0-d and empty tensors,
    metadata, the library's padded header."""
    save_file = pytest.importorskip("safetensors.numpy").save_file
    tensors = {
        "f32": GOOD,
        "f16": GOOD.astype(np.float16),
        "i64": np.arange(7, dtype=np.int64),
        "u8": np.arange(5, dtype=np.uint8),
        "bool": np.array([True, False, True]),
        "scalar": np.array(3.5, dtype=np.float64),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }
    path = tmp_path / "lib.safetensors"
    save_file(tensors, str(path), metadata={"format": "np"})
    header = safetensors_header(str(path))
    assert set(tensors) <= set(header)
    store = rowcache.build_store(
        tmp_path / "s", {"a": (str(path), "f32"), "b": f"{path}:f16"}, progress=False
    )
    with store:
        np.testing.assert_array_equal(store.read_rows("a", np.arange(20)).astype(np.float32), GOOD)


def test_safetensors_header_error_is_a_format_error_naming_file_and_tensor(tmp_path):
    """In process, for the cases no child is needed for: the error's type and its one line."""
    bf = GOOD.astype(ml_dtypes.bfloat16)
    path = tmp_path / "m.safetensors"
    path.write_bytes(st({T: entry(dtype="BF16", offsets=(0, 640))}, bf.tobytes()))
    with pytest.raises(FormatError, match=r"m\.safetensors: tensor '.*embedders\.0\.weight'"):
        safetensors_header(str(path))
    path.write_bytes(st({T: entry(dtype="BF16", offsets=(0, 320))}, bf.tobytes()))
    assert safetensors_header(str(path))[T]["shape"] == [20, 8]
