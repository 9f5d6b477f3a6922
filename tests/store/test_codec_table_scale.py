"""Stores of the ``fp8_table_scale`` codec: E4M3 codes written verbatim, one bf16 scale a
table in the meta record; the sources that give them (arrays, ``.npy``, ``F8_E4M3``
safetensors tensors, ``ConcatRows`` across the files of an indexed checkpoint); the checks
of the meta record at open; the refusals of bad inputs; older stores still open."""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np
import pytest

import rowcache
from rowcache.errors import ConfigError, FormatError
from rowcache.format import layout as fmt
from rowcache.kernels.reference import BF16
from rowcache.store import builder
from rowcache.store.handle import RowStore
from rowcache.store.sources import ConcatRows, Fp8TableScaleSource
from tests.store.test_store_checks import edit_json

SCALE = np.array(0x3B8C, np.uint16).view(BF16)  # 0.004272..., a bf16 value


def codes_table(rng, rows, dim, nan=False):
    c = rng.integers(0, 256, size=(rows, dim), dtype=np.uint8)
    if not nan:
        bad = (c & 0x7F) == 0x7F
        c[bad] &= 0xFE  # 0x7E / 0xFE: the largest finite codes
    return c


def write_safetensors(path, tensors):
    """A .safetensors file by the format's definition: {name: (dtype, array)}."""
    header, blobs, off = {}, [], 0
    for name, (dtype, arr) in tensors.items():
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {
            "dtype": dtype,
            "shape": list(arr.shape),
            "data_offsets": [off, off + len(raw)],
        }
        blobs.append(raw)
        off += len(raw)
    hb = json.dumps(header).encode()
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(hb)) + hb + b"".join(blobs))


def test_build_from_codes_reads_them_back_verbatim(tmp_path, rng):
    codes = codes_table(rng, 5000, 160)
    store = rowcache.build_store(
        tmp_path / "s", {"t": Fp8TableScaleSource(codes, SCALE)}, progress=False
    )
    try:
        assert store.dtype == "fp8_table_scale" and store.meta["version"] == 3
        info = store.tables[0]
        assert (info.record_bytes, info.rows_per_page, info.params) == (
            160,
            25,
            {"scale": float(SCALE)},
        )
        ids = rng.integers(0, 5000, size=3000)
        np.testing.assert_array_equal(store.read_rows("t", ids), codes[ids])
        np.testing.assert_array_equal(store.read_rows("t", np.arange(5000)), codes)
        # one byte a value plus page padding: 25 records of 160 B a 4 KiB page
        on_disk = sum(os.path.getsize(os.path.join(store.path, r.file)) for r in store.shards[0])
        assert on_disk == -(-5000 // 25) * 4096
        assert on_disk <= codes.nbytes * 4096 / 4000 + 4096
        assert store.verify().ok
        raw = store.meta["tables"][0]
        assert raw["params"] == {"scale": float(SCALE)} and store.meta["params"]["fp8_rule"]
    finally:
        store.close()
    again = RowStore.open(tmp_path / "s")  # the open validates the records it wrote
    try:
        assert again.tables[0].params == {"scale": float(SCALE)}
    finally:
        again.close()


def test_codes_streamed_in_chunks_and_sharded(tmp_path, rng, monkeypatch):
    monkeypatch.setattr(builder, "CHUNK_BYTES", 3 * 4096)  # many chunks, a partial last page
    codes = codes_table(rng, 4001, 100)
    store = rowcache.build_store(
        tmp_path / "s",
        {"t": Fp8TableScaleSource(codes, 1.0)},
        dtype="fp8_table_scale",
        progress=False,
        shard_bytes=7 * 4096,
    )
    try:
        assert store.tables[0].shards > 1
        np.testing.assert_array_equal(store.read_rows(0, np.arange(4001)), codes)
    finally:
        store.close()


def test_sources_npy_e4m3_safetensors_and_scale_tensor(tmp_path, rng):
    a = codes_table(rng, 300, 64)
    np.save(tmp_path / "a.npy", a)
    write_safetensors(
        tmp_path / "m.safetensors",
        {
            "emb.weight": ("F8_E4M3", a),
            "emb.weight_scale": ("BF16", np.array([SCALE]).view(np.uint16)),
            "u8": ("U8", a),
        },
    )
    e4m3 = a.view(ml_dtypes.float8_e4m3fn)
    st = str(tmp_path / "m.safetensors")
    specs = {
        "array": Fp8TableScaleSource(a, SCALE),
        "e4m3_array": Fp8TableScaleSource(e4m3, SCALE),
        "npy": Fp8TableScaleSource(str(tmp_path / "a.npy"), SCALE),
        "st": Fp8TableScaleSource((st, "emb.weight"), (st, "emb.weight_scale")),
        "st_text": Fp8TableScaleSource(f"{st}:emb.weight", f"{st}:emb.weight_scale"),
        "u8": Fp8TableScaleSource((st, "u8"), float(SCALE)),
    }
    store = rowcache.build_store(tmp_path / "s", specs, progress=False)
    try:
        for name in specs:
            np.testing.assert_array_equal(store.read_rows(name, np.arange(300)), a)
            assert store.table_info(name).params == {"scale": float(SCALE)}
    finally:
        store.close()


def test_concat_rows_across_the_files_of_an_indexed_checkpoint_equals_one_array(
    tmp_path, rng, monkeypatch
):
    monkeypatch.setattr(builder, "CHUNK_BYTES", 2 * 4096)  # chunks straddle the parts
    parts = [codes_table(rng, n, 96) for n in (700, 1, 333, 1200)]
    whole = np.concatenate(parts)
    files = {}
    for k, p in enumerate(parts):
        fn = f"model-{k // 2:05d}.safetensors"
        files.setdefault(fn, {})[f"emb.shard_{k}"] = ("F8_E4M3", p)
    files["model-00000.safetensors"]["emb.weight_scale"] = (
        "BF16",
        np.array([SCALE]).view(np.uint16),
    )
    weight_map = {}
    for fn, tensors in files.items():
        write_safetensors(tmp_path / fn, tensors)
        weight_map.update({t: fn for t in tensors})
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    src = Fp8TableScaleSource(
        ConcatRows([(str(index), f"emb.shard_{k}") for k in range(4)]),
        (str(index), "emb.weight_scale"),
    )
    store = rowcache.build_store(
        tmp_path / "s", {"t": src, "one": Fp8TableScaleSource(whole, SCALE)}, progress=False
    )
    try:
        assert store.tables[0].rows == whole.shape[0]
        np.testing.assert_array_equal(store.read_rows("t", np.arange(whole.shape[0])), whole)
        a = open(os.path.join(store.path, store.shards[0][0].file), "rb").read()
        b = open(os.path.join(store.path, store.shards[1][0].file), "rb").read()
        assert a == b  # the same bytes as from one array
        assert "concat(" in store.meta["params"]["sources"][0]
    finally:
        store.close()


def test_concat_rows_of_value_tables_builds_bf16_and_fp8(tmp_path, rng):
    parts = [rng.standard_normal((n, 24)).astype(np.float32) for n in (50, 77)]
    np.save(tmp_path / "p1.npy", parts[1])
    for dtype in ("bf16", "fp8"):
        store = rowcache.build_store(
            tmp_path / dtype,
            {"cat": ConcatRows([parts[0], str(tmp_path / "p1.npy")]), "one": np.concatenate(parts)},
            dtype=dtype,
            progress=False,
        )
        try:
            assert store.meta["version"] == 2  # bf16 and fp8 stores are written as before codecs
            ids = np.arange(127)
            got, want = store.read_rows("cat", ids), store.read_rows("one", ids)
            for g, w in zip(got if dtype == "fp8" else [got], want if dtype == "fp8" else [want]):
                np.testing.assert_array_equal(
                    np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8)
                )
        finally:
            store.close()


def one_line_config_error(tmp_path, tables, match, **kw):
    with pytest.raises(ConfigError, match=match) as e:
        rowcache.build_store(tmp_path / "bad", tables, progress=False, **kw)
    assert "\n" not in str(e.value)
    assert not os.path.exists(tmp_path / "bad")


def test_bad_inputs_are_refused_in_one_line(tmp_path, rng):
    c = codes_table(rng, 20, 8)
    for bad_codes, match in (
        (c.astype(np.float32), "codes of dtype float32"),
        (c.view(np.int8), "codes of dtype int8"),
        (c[0], "2-D"),
        (np.zeros((0, 8), np.uint8), "2-D"),
        (12, "codes of type int"),
    ):
        one_line_config_error(tmp_path, {"t": Fp8TableScaleSource(bad_codes, 1.0)}, match)
    for bad_scale, match in (
        (np.ones(2, BF16), "one bfloat16 value"),
        (np.ones((1, 2), np.float32), "one bfloat16 value"),
        (float("nan"), "must be finite"),
        (float("inf"), "must be finite"),
        (np.array(0x7F80, np.uint16).view(BF16), "must be finite"),
        (0.1, "not a bfloat16 value"),
        ("half", "one bfloat16 value"),
    ):
        one_line_config_error(tmp_path, {"t": Fp8TableScaleSource(c, bad_scale)}, match)
    one_line_config_error(
        tmp_path,
        {"t": Fp8TableScaleSource(ConcatRows([c, codes_table(rng, 5, 9)]), 1.0)},
        "parts need one width",
    )
    with pytest.raises(ConfigError, match=r"ConcatRows\.parts is empty"):
        ConcatRows([])
    with pytest.raises(ConfigError, match="give a list of sources"):
        ConcatRows("a.npy")
    one_line_config_error(
        tmp_path, {"t": Fp8TableScaleSource(c, 1.0)}, "pass dtype='fp8_table_scale'", dtype="bf16"
    )
    one_line_config_error(
        tmp_path, {"t": c.astype(np.float32)}, "Fp8TableScaleSource", dtype="fp8_table_scale"
    )
    one_line_config_error(
        tmp_path,
        {"a": Fp8TableScaleSource(c, 1.0), "b": c.astype(np.float32)},
        "mix encoded and value",
    )
    one_line_config_error(tmp_path, {"t": c}, "Fp8TableScaleSource")  # codes as a value table
    one_line_config_error(tmp_path, {"t": c.astype(np.float32)}, "allowed: None, bf16", dtype="fp4")
    nan = c.copy()
    nan[13, 5] = 0xFF
    one_line_config_error(
        tmp_path,
        {"t": Fp8TableScaleSource(nan, 1.0)},
        r"row 13, column 5 is the E4M3 NaN code 0xff",
    )
    store = rowcache.build_store(
        tmp_path / "nan", {"t": Fp8TableScaleSource(nan, 1.0)}, allow_nonfinite=True, progress=False
    )
    try:
        np.testing.assert_array_equal(store.read_rows("t", np.arange(20)), nan)
    finally:
        store.close()


def test_safetensors_scale_and_codes_of_the_wrong_kind(tmp_path, rng):
    c = codes_table(rng, 10, 8)
    st = str(tmp_path / "m.safetensors")
    write_safetensors(
        st,
        {
            "w": ("F8_E4M3", c),
            "s2": ("BF16", np.ones(2, np.uint16)),
            "f": ("BF16", c.view(np.uint16)),
        },
    )
    one_line_config_error(tmp_path, {"t": Fp8TableScaleSource((st, "w"), (st, "s2"))}, "one BF16")
    one_line_config_error(
        tmp_path, {"t": Fp8TableScaleSource((st, "f"), 1.0)}, "codes of dtype bfloat16"
    )
    one_line_config_error(
        tmp_path, {"t": (st, "w")}, "Fp8TableScaleSource"
    )  # E4M3 as a value table


def test_open_validates_the_codec_fields(tmp_path, rng):
    c = codes_table(rng, 40, 16)

    def fresh():
        p = tmp_path / "s"
        rowcache.build_store(
            p, {"t": Fp8TableScaleSource(c, SCALE)}, overwrite=True, progress=False
        ).close()
        return str(p)

    for edit, match in (
        (lambda m: m["tables"][0].pop("params"), "missing \\['params'\\]"),
        (lambda m: m["tables"][0].update(params={}), "'params' is {}"),
        (lambda m: m["tables"][0].update(params={"scale": 0.1}), "'params.scale' is 0.1"),
        (lambda m: m["tables"][0].update(params={"scale": "1.0"}), "'params.scale' is '1.0'"),
        (lambda m: m["tables"][0].update(params={"scale": True}), "'params.scale' is True"),
        (lambda m: m["tables"][0].update(params={"scale": 1e300}), "'params.scale'"),
        (lambda m: m["tables"][0].update(params={"scale": 1.0, "x": 1}), "'params' is"),
        (lambda m: m["tables"][0].update(record_bytes=20), "record_bytes"),
        (lambda m: m.update(version=2), "allowed in format version 2: bf16, fp8"),
        (lambda m: m.update(dtype="fp8_block"), "'dtype' is 'fp8_block'"),
    ):
        path = fresh()
        edit_json(path, fmt.META_KEY, edit)
        with pytest.raises(FormatError, match=match) as e:
            RowStore.open(path)
        assert "\n" not in str(e.value)
    path = fresh()
    edit_json(path, fmt.META_KEY, lambda m: m["tables"][0].update(params={"scale": float("nan")}))
    with pytest.raises(FormatError, match=r"'params\.scale' is nan"):
        RowStore.open(path)


def test_older_stores_still_open(tmp_path, rng):
    """A version 2 store (every bf16 or fp8 store built before codecs, and those built now:
    its meta record has no ``params``) opens; ``params`` in a version 2 table is refused."""
    x = rng.standard_normal((100, 16)).astype(np.float32)
    for dtype in ("bf16", "fp8"):
        p = str(tmp_path / dtype)
        rowcache.build_store(p, [x], dtype=dtype, progress=False).close()
        with RowStore.open(p) as store:
            assert store.meta["version"] == 2 and "params" not in store.meta["tables"][0]
            assert store.tables[0].params == {} and store.dtype == dtype
        edit_json(p, fmt.META_KEY, lambda m: m["tables"][0].update(params={}))
        with pytest.raises(FormatError, match="unknown fields \\['params'\\]"):
            RowStore.open(p)
