"""Stores of the ``fp8_block_e8m0`` codec: E4M3 codes and one UE8M0 byte a block of values,
both written verbatim as one record a row (codes, then scale bytes); the sources that give
them (arrays, ``.npy``, ``F8_E4M3`` / ``F8_E8M0`` safetensors tensors, ``ConcatRows`` of the
two tensors split differently over the files of an indexed checkpoint, streamed row-aligned);
``DecodedRows`` to bf16 and fp8 stores; the NaN refusals; the checks of the meta record."""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest

import rowcache
from rowcache.errors import ConfigError, FormatError
from rowcache.format import layout as fmt
from rowcache.kernels.reference import dequantize_fp8_block_reference, quantize_fp8_reference
from rowcache.store import builder
from rowcache.store.handle import RowStore
from rowcache.store.sources import ConcatRows, DecodedRows, Fp8BlockScaleSource
from tests.store.test_codec_table_scale import write_safetensors
from tests.store.test_store_checks import edit_json


def block_table(rng, rows, dim=256, block=32):
    """Finite E4M3 codes and UE8M0 bytes (0, 2**-127, kept like any other byte)."""
    codes = rng.integers(0, 256, size=(rows, dim), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] &= 0xFE
    scales = rng.integers(100, 140, size=(rows, dim // block), dtype=np.uint8)
    scales.reshape(-1)[:3] = [0, 1, 246]  # 246: the largest byte no code overflows at
    return codes, scales


def test_build_reads_back_verbatim_at_264_bytes_a_row(tmp_path, rng):
    codes, scales = block_table(rng, 5000)
    store = rowcache.build_store(
        tmp_path / "s", {"t": Fp8BlockScaleSource(codes, scales)}, progress=False
    )
    try:
        assert store.dtype == "fp8_block_e8m0" and store.meta["version"] == 3
        info = store.tables[0]
        assert (info.dim, info.record_bytes, info.rows_per_page, info.params) == (
            256,
            264,
            15,
            {"block_size": 32},
        )
        ids = rng.integers(0, 5000, size=3000)
        got_codes, got_scales = store.read_rows("t", ids)
        np.testing.assert_array_equal(got_codes, codes[ids])
        np.testing.assert_array_equal(got_scales, scales[ids])
        # one record a row, 15 to a 4 KiB page: 273 B of disk a row, ~264/256 a value
        on_disk = sum(os.path.getsize(os.path.join(store.path, r.file)) for r in store.shards[0])
        assert on_disk == -(-5000 // 15) * 4096
        assert 264 / 256 <= on_disk / codes.size < 1.07
        assert store.verify().ok
        assert "ue8m0" in store.meta["params"]["fp8_rule"]
        assert store.meta["tables"][0]["params"] == {"block_size": 32}
    finally:
        store.close()
    with RowStore.open(tmp_path / "s") as again:  # the open validates what it wrote
        assert again.tables[0].params == {"block_size": 32}


def test_streamed_in_chunks_and_sharded_with_other_blocks(tmp_path, rng, monkeypatch):
    monkeypatch.setattr(builder, "CHUNK_BYTES", 3 * 4096)  # many chunks, a partial last page
    codes, scales = block_table(rng, 4001, dim=96, block=16)  # 102-byte records
    store = rowcache.build_store(
        tmp_path / "s",
        {"t": Fp8BlockScaleSource(codes, scales, block_size=16)},
        dtype="fp8_block_e8m0",
        progress=False,
        shard_bytes=7 * 4096,
    )
    try:
        info = store.tables[0]
        assert info.shards > 1 and info.record_bytes == 102 and info.params == {"block_size": 16}
        got_codes, got_scales = store.read_rows(0, np.arange(4001))
        np.testing.assert_array_equal(got_codes, codes)
        np.testing.assert_array_equal(got_scales, scales)
    finally:
        store.close()


def test_sources_npy_fp8_dtypes_and_safetensors(tmp_path, rng):
    codes, scales = block_table(rng, 300, dim=64)
    np.save(tmp_path / "c.npy", codes)
    np.save(tmp_path / "s.npy", scales)
    st = str(tmp_path / "m.safetensors")
    write_safetensors(
        st,
        {
            "e.weight": ("F8_E4M3", codes),
            "e.scale": ("F8_E8M0", scales),
            "u8c": ("U8", codes),
            "u8s": ("U8", scales),
        },
    )
    specs = {
        "array": Fp8BlockScaleSource(codes, scales),
        "fp8_dtypes": Fp8BlockScaleSource(
            codes.view(ml_dtypes.float8_e4m3fn), scales.view(ml_dtypes.float8_e8m0fnu), 32
        ),
        "npy": Fp8BlockScaleSource(str(tmp_path / "c.npy"), str(tmp_path / "s.npy")),
        "st": Fp8BlockScaleSource((st, "e.weight"), (st, "e.scale")),
        "st_text": Fp8BlockScaleSource(f"{st}:e.weight", f"{st}:e.scale"),
        "u8": Fp8BlockScaleSource((st, "u8c"), (st, "u8s")),
    }
    store = rowcache.build_store(tmp_path / "s", specs, progress=False)
    try:
        for name in specs:
            got_codes, got_scales = store.read_rows(name, np.arange(300))
            np.testing.assert_array_equal(got_codes, codes)
            np.testing.assert_array_equal(got_scales, scales)
    finally:
        store.close()


def test_two_tensors_split_differently_over_an_indexed_checkpoint_stream_row_aligned(
    tmp_path, rng, monkeypatch
):
    """Codes and scales in parts of other row counts, in other files: every chunk takes its
    rows from both, and the store's bytes equal those built from one array each."""
    monkeypatch.setattr(builder, "CHUNK_BYTES", 2 * 4096)  # chunks straddle both kinds of parts
    codes, scales = block_table(rng, 2234)
    code_parts = np.split(codes, [700, 701, 1034])
    scale_parts = np.split(scales, [50, 1500])
    files: dict[str, dict] = {}
    for k, p in enumerate(code_parts):
        files.setdefault(f"model-{k % 3:05d}.safetensors", {})[f"w.{k}"] = ("F8_E4M3", p)
    for k, p in enumerate(scale_parts):
        files.setdefault(f"model-{(k + 1) % 3:05d}.safetensors", {})[f"s.{k}"] = ("F8_E8M0", p)
    weight_map = {}
    for fn, tensors in files.items():
        write_safetensors(tmp_path / fn, tensors)
        weight_map.update({t: fn for t in tensors})
    index = str(tmp_path / "model.safetensors.index.json")
    with open(index, "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    src = Fp8BlockScaleSource(
        ConcatRows([(index, f"w.{k}") for k in range(len(code_parts))]),
        ConcatRows([(index, f"s.{k}") for k in range(len(scale_parts))]),
    )
    store = rowcache.build_store(
        tmp_path / "s", {"t": src, "one": Fp8BlockScaleSource(codes, scales)}, progress=False
    )
    try:
        got_codes, got_scales = store.read_rows("t", np.arange(2234))
        np.testing.assert_array_equal(got_codes, codes)
        np.testing.assert_array_equal(got_scales, scales)
        a = open(os.path.join(store.path, store.shards[0][0].file), "rb").read()
        b = open(os.path.join(store.path, store.shards[1][0].file), "rb").read()
        assert a == b
        assert store.meta["params"]["sources"][0].startswith("blocks(concat(")
    finally:
        store.close()


def test_decoded_rows_build_bf16_and_fp8_stores(tmp_path, rng):
    codes, scales = block_table(rng, 500, dim=64)
    values = dequantize_fp8_block_reference(codes, scales)
    src = DecodedRows(Fp8BlockScaleSource(codes, scales))
    with rowcache.build_store(tmp_path / "b", {"t": src}, dtype="bf16", progress=False) as s:
        assert s.dtype == "bf16"
        np.testing.assert_array_equal(
            s.read_rows("t", np.arange(500)).view(np.uint16), values.view(np.uint16)
        )
    with rowcache.build_store(tmp_path / "f", {"t": src}, dtype="fp8", progress=False) as s:
        got_codes, got_scales = s.read_rows("t", np.arange(500))
        want_codes, want_scales = quantize_fp8_reference(values)
        np.testing.assert_array_equal(got_codes, want_codes)
        np.testing.assert_array_equal(got_scales, want_scales)
    with pytest.raises(ConfigError, match="DecodedRows takes an encoded source"):
        rowcache.build_store(tmp_path / "x", {"t": DecodedRows(values)}, progress=False)
    nan = scales.copy()
    nan[3, 1] = 0xFF  # a NaN block decodes to NaN values: refused as values are
    with pytest.raises(ConfigError, match=r"row 3, column 32 is nan"):
        rowcache.build_store(
            tmp_path / "y", {"t": DecodedRows(Fp8BlockScaleSource(codes, nan))}, progress=False
        )


def one_line_config_error(tmp_path, tables, match, **kw):
    with pytest.raises(ConfigError, match=match) as e:
        rowcache.build_store(tmp_path / "bad", tables, progress=False, **kw)
    assert "\n" not in str(e.value)
    assert not os.path.exists(tmp_path / "bad")


def test_bad_inputs_are_refused_in_one_line(tmp_path, rng):
    c, s = block_table(rng, 20, dim=64)
    for bad, match in (
        (Fp8BlockScaleSource(c, s[:19]), "have 20 rows and the scales .* 19"),
        (Fp8BlockScaleSource(c, s[:, :1], 32), "1 bytes a row; rows of 64 codes in blocks of 32"),
        (Fp8BlockScaleSource(c, s, block_size=16), "blocks of 16 need 4"),
        (Fp8BlockScaleSource(c, s, block_size=24), "dividing the rows' 64 values"),
        (Fp8BlockScaleSource(c, np.zeros((20, 3), np.uint8)), "block_size=None"),
        (Fp8BlockScaleSource(c, s.astype(np.float32)), "scales of dtype float32"),
        (Fp8BlockScaleSource(c.astype(np.float32), s), "codes of dtype float32"),
        (Fp8BlockScaleSource(c.view(ml_dtypes.float8_e8m0fnu), s), "codes of dtype float8_e8m0"),
        (Fp8BlockScaleSource(c, s.view(ml_dtypes.float8_e4m3fn)), "scales of dtype float8_e4m3"),
        (Fp8BlockScaleSource(c, s[0]), "2-D"),
    ):
        one_line_config_error(tmp_path, {"t": bad}, match)
    one_line_config_error(
        tmp_path,
        {"t": Fp8BlockScaleSource(c, s)},
        "or wrap each source in DecodedRows",
        dtype="bf16",
    )
    one_line_config_error(
        tmp_path, {"t": c.astype(np.float32)}, "Fp8BlockScaleSource", dtype="fp8_block_e8m0"
    )
    one_line_config_error(
        tmp_path,
        {"a": Fp8BlockScaleSource(c, s), "b": c.astype(np.float32)},
        "mix encoded and value",
    )


def test_nan_codes_and_nan_scale_bytes_refused_unless_allowed(tmp_path, rng):
    c, s = block_table(rng, 40, dim=64)
    nan_code = c.copy()
    nan_code[13, 5] = 0x7F
    one_line_config_error(
        tmp_path,
        {"t": Fp8BlockScaleSource(nan_code, s)},
        r"row 13, column 5 is the E4M3 NaN code 0x7f",
    )
    nan_scale = s.copy()
    nan_scale[17, 1] = 0xFF
    one_line_config_error(
        tmp_path,
        {"t": Fp8BlockScaleSource(c, nan_scale)},
        r"row 17, block 1 \(columns 32..63\) has the UE8M0 scale byte 0xff, NaN",
    )
    # a scale byte 0x7F (2**0) or 0xFE beside codes is no NaN: only the code columns are codes
    ok = s.copy()
    ok[:, 0] = 0x7F
    ok[:, 1] = 0xFE
    with rowcache.build_store(tmp_path / "ok", {"t": Fp8BlockScaleSource(c, ok)}, progress=False):
        pass
    store = rowcache.build_store(
        tmp_path / "nan",
        {"t": Fp8BlockScaleSource(nan_code, nan_scale)},
        allow_nonfinite=True,
        progress=False,
    )
    try:  # stored verbatim, as asked
        got_codes, got_scales = store.read_rows("t", np.arange(40))
        np.testing.assert_array_equal(got_codes, nan_code)
        np.testing.assert_array_equal(got_scales, nan_scale)
    finally:
        store.close()


def test_open_validates_the_codec_fields(tmp_path, rng):
    c, s = block_table(rng, 40, dim=64)

    def fresh():
        p = tmp_path / "s"
        rowcache.build_store(
            p, {"t": Fp8BlockScaleSource(c, s)}, overwrite=True, progress=False
        ).close()
        return str(p)

    for edit, match in (
        (lambda m: m["tables"][0].pop("params"), r"missing \['params'\]"),
        (lambda m: m["tables"][0].update(params={}), "'params' is {}"),
        (lambda m: m["tables"][0].update(params={"block_size": 0}), "'params.block_size' is 0"),
        (lambda m: m["tables"][0].update(params={"block_size": "32"}), "'params.block_size'"),
        (lambda m: m["tables"][0].update(params={"block_size": True}), "'params.block_size'"),
        (lambda m: m["tables"][0].update(params={"block_size": 24}), "dividing dim 64"),
        (lambda m: m["tables"][0].update(params={"block_size": 32, "x": 1}), "'params' is"),
        # another block size that divides: the records' size no longer fits
        (lambda m: m["tables"][0].update(params={"block_size": 16}), "record_bytes"),
        (lambda m: m["tables"][0].update(record_bytes=64), "record_bytes"),
        (lambda m: m.update(version=2), "allowed in format version 2: bf16, fp8"),
    ):
        path = fresh()
        edit_json(path, fmt.META_KEY, edit)
        with pytest.raises(FormatError, match=match) as e:
            RowStore.open(path)
        assert "\n" not in str(e.value)
