"""The store: builder, reader, RowStore, verify, and bad inputs."""

from __future__ import annotations

import json
import os
import struct

import lmdb
import ml_dtypes
import numpy as np
import pytest

import rowcache
from rowcache.errors import ConfigError, CorruptDataError, FormatError, RowRangeError
from rowcache.format import layout as fmt
from rowcache.io.native import NATIVE_BUILT
from rowcache.store.handle import RowStore
from rowcache.store.marker import write_marker

BF16 = ml_dtypes.bfloat16


def bf16_table(rng, rows, dim):
    return rng.standard_normal((rows, dim), dtype=np.float32).astype(BF16)


def fp8_rule(x):
    """Independent statement of the FP8 rule, row by row with Python scalars."""
    x32 = np.asarray(x, dtype=np.float32)
    codes = np.empty(x32.shape, np.uint8)
    scales = np.empty(x32.shape[0], np.float32)
    for r in range(x32.shape[0]):
        amax = max(abs(float(v)) for v in x32[r])
        s = np.float32(1.0) if amax == 0 else np.float32(np.float32(amax) / np.float32(448.0))
        scales[r] = s
        for c in range(x32.shape[1]):
            q = np.float32(x32[r, c]) / s
            q = min(max(float(q), -448.0), 448.0)
            codes[r, c] = np.array(np.float32(q)).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return codes, scales


@pytest.fixture
def small(tmp_path, rng):
    tab = {"a": bf16_table(rng, 1000, 64), "b": bf16_table(rng, 257, 48)}
    store = rowcache.build_store(tmp_path / "s", tab, shard_bytes=8192, progress=False)
    yield store, tab
    store.close()


def test_build_bf16_roundtrip_bit_exact(small, rng):
    store, tab = small
    for name, arr in tab.items():
        ids = rng.integers(0, arr.shape[0], 500)
        got = store.read_rows(name, ids)
        assert got.dtype == BF16 and got.shape == (500, arr.shape[1])
        np.testing.assert_array_equal(got.view(np.uint16), arr[ids].view(np.uint16))


def test_read_rows_duplicates_order_and_index_names(small):
    store, tab = small
    ids = np.array([5, 3, 5, 999, 0, 3, 3])
    np.testing.assert_array_equal(
        store.read_rows(0, ids).view(np.uint16), tab["a"][ids].view(np.uint16)
    )
    np.testing.assert_array_equal(
        store.read_rows("a", ids).view(np.uint16), store.read_rows(0, ids).view(np.uint16)
    )


def test_read_rows_empty_batch(small):
    store, _ = small
    out = store.read_rows("a", np.array([], dtype=np.int64))
    assert out.shape == (0, 64)


def test_rows_at_shard_boundaries(small):
    store, tab = small
    info = store.table_info("a")
    assert info.shards > 2
    rps = info.rows_per_shard
    ids = np.array([rps - 1, rps, 2 * rps - 1, 2 * rps, info.rows - 1, 0])
    np.testing.assert_array_equal(
        store.read_rows("a", ids).view(np.uint16), tab["a"][ids].view(np.uint16)
    )


@pytest.mark.parametrize("source", ["bf16", "f32"])
def test_build_fp8_matches_independent_rule(tmp_path, rng, source):
    x = rng.standard_normal((40, 20), dtype=np.float32) * rng.uniform(0.01, 100, (40, 1)).astype(
        np.float32
    )
    x[3] = 0.0  # all-zero row: scale 1.0
    x[4, 0] = 1e-30  # tiny values
    if source == "bf16":
        x = x.astype(BF16)
    store = rowcache.build_store(
        tmp_path / "f", {"t": x}, dtype="fp8", progress=False, shard_bytes=4096
    )
    codes, scales = store.read_rows("t", np.arange(40))
    want_codes, want_scales = fp8_rule(x)
    np.testing.assert_array_equal(codes, want_codes)
    np.testing.assert_array_equal(scales.view(np.uint32), want_scales.view(np.uint32))
    assert scales[3] == 1.0
    info = store.table_info("t")
    assert info.record_bytes == 24 and info.rows_per_page == 4096 // 24


def test_fp8_random_reads_and_page_padding(tmp_path, rng):
    x = bf16_table(rng, 3000, 256)  # 260-byte records: 15 to a page, 196 bytes of padding
    store = rowcache.build_store(
        tmp_path / "f", [x], dtype="fp8", progress=False, shard_bytes=3 * 4096
    )
    ids = rng.integers(0, 3000, 2000)
    codes, scales = store.read_rows("0", ids)
    from rowcache.kernels.reference import quantize_fp8_reference

    c0, s0 = quantize_fp8_reference(x[ids])
    np.testing.assert_array_equal(codes, c0)
    np.testing.assert_array_equal(scales, s0)


def test_sources_npy_uint16_view_f32_and_safetensors(tmp_path, rng):
    a = bf16_table(rng, 100, 16)
    np.save(tmp_path / "a.npy", a.view(np.uint16))
    f = rng.standard_normal((50, 8), dtype=np.float32)
    np.save(tmp_path / "f.npy", f)
    st = pytest.importorskip("safetensors.numpy")
    w = bf16_table(rng, 70, 32)
    # safetensors.numpy cannot write bfloat16 directly: write the file by the format's definition.
    header = {
        "model.ngram_embeddings.embedders.0.weight": {
            "dtype": "BF16",
            "shape": [70, 32],
            "data_offsets": [0, w.nbytes],
        }
    }
    hb = json.dumps(header).encode()
    with open(tmp_path / "m.safetensors", "wb") as fh:
        fh.write(struct.pack("<Q", len(hb)) + hb + w.tobytes())
    st.save_file({"x": f}, str(tmp_path / "f32.safetensors"))
    store = rowcache.build_store(
        tmp_path / "s",
        {
            "a": str(tmp_path / "a.npy"),
            "f": tmp_path / "f.npy",
            "w": (str(tmp_path / "m.safetensors"), "model.ngram_embeddings.embedders.0.weight"),
            "x": f"{tmp_path}/f32.safetensors:x",
        },
        progress=False,
    )
    ids = np.arange(50)
    np.testing.assert_array_equal(store.read_rows("a", ids).view(np.uint16), a[ids].view(np.uint16))
    np.testing.assert_array_equal(
        store.read_rows("f", ids).view(np.uint16), f.astype(BF16).view(np.uint16)
    )
    np.testing.assert_array_equal(store.read_rows("w", ids).view(np.uint16), w[ids].view(np.uint16))
    np.testing.assert_array_equal(
        store.read_rows("x", ids).view(np.uint16), f.astype(BF16).view(np.uint16)
    )


@pytest.mark.parametrize(
    "direct,merge_gap,qd", [(False, 0, 1), (False, 4096, 8), (True, 0, 4), (True, 1 << 16, 4)]
)
def test_reader_modes_agree(tmp_path, rng, direct, merge_gap, qd):
    x = bf16_table(rng, 5000, 64)
    rowcache.build_store(tmp_path / "s", [x], progress=False, shard_bytes=64 * 4096)
    try:
        store = RowStore.open(tmp_path / "s", direct=direct, merge_gap=merge_gap, queue_depth=qd)
    except ConfigError as e:  # tmpfs refuses O_DIRECT: the error must say so
        assert "O_DIRECT" in str(e)
        return
    ids = rng.integers(0, 5000, 3000)
    try:
        got = store.read_rows(0, ids)
    except ConfigError as e:
        assert direct and "O_DIRECT" in str(e)
        return
    np.testing.assert_array_equal(got.view(np.uint16), x[ids].view(np.uint16))


def test_reader_coalesces_rows_sharing_a_page(small):
    store, _ = small
    rows = np.array([0, 1, 2, 7, 8, 300])  # 128-byte records: 32 to a page
    _, stats = store.read_records("a", rows)
    assert stats.rows == 6 and stats.read_ops == 2
    ext = store.reader.plan(0, rows)
    assert len(ext[0]) == 2


# -- bad inputs -------------------------------------------------------------
def test_row_ids_out_of_range_negative_and_too_large(small):
    store, _ = small
    with pytest.raises(RowRangeError, match=r"row_ids\[1\] = -1"):
        store.read_rows("a", np.array([0, -1]))
    with pytest.raises(RowRangeError, match="1000"):
        store.read_rows("a", np.array([1000]))
    assert isinstance(RowRangeError("x"), IndexError)


def test_row_ids_bad_dtype_and_shape(small):
    store, _ = small
    with pytest.raises(ConfigError, match="row_ids must be an integer array"):
        store.read_rows("a", np.array([1.5]))
    with pytest.raises(ValueError, match="1-D"):
        store.read_rows("a", np.zeros((2, 2), dtype=np.int64))


def test_unknown_table(small):
    store, _ = small
    with pytest.raises(ConfigError, match="table='zz' is not in this store"):
        store.read_rows("zz", np.array([0]))
    with pytest.raises(ConfigError):
        store.read_rows(7, np.array([0]))


def test_build_bad_inputs(tmp_path, rng):
    x = bf16_table(rng, 10, 4)
    with pytest.raises(ConfigError, match="dtype='int8'"):
        rowcache.build_store(tmp_path / "a", [x], dtype="int8")
    with pytest.raises(ConfigError, match="2-D"):
        rowcache.build_store(tmp_path / "a", [np.zeros(5, np.float32)], progress=False)
    with pytest.raises(ConfigError, match="int32"):
        rowcache.build_store(tmp_path / "a", [np.zeros((5, 2), np.int32)], progress=False)
    with pytest.raises(ConfigError, match="does not exist"):
        rowcache.build_store(tmp_path / "a", ["/nonexistent.npy"], progress=False)
    with pytest.raises(ConfigError, match="tables is empty"):
        rowcache.build_store(tmp_path / "a", {}, progress=False)
    with pytest.raises(ConfigError, match="no tensor named"):
        np.save(tmp_path / "ok.npy", x.view(np.uint16))
        hb = json.dumps(
            {"t": {"dtype": "BF16", "shape": [10, 4], "data_offsets": [0, 80]}}
        ).encode()
        with open(tmp_path / "m.safetensors", "wb") as fh:
            fh.write(struct.pack("<Q", len(hb)) + hb + x.tobytes())
        rowcache.build_store(
            tmp_path / "a", [(str(tmp_path / "m.safetensors"), "nope")], progress=False
        )
    assert not os.path.exists(tmp_path / "a")


def test_existing_path_needs_overwrite_and_overwrite_replaces(tmp_path, rng):
    x, y = bf16_table(rng, 10, 4), bf16_table(rng, 12, 4)
    rowcache.build_store(tmp_path / "s", [x], progress=False)
    with pytest.raises(ConfigError, match="overwrite=True"):
        rowcache.build_store(tmp_path / "s", [y], progress=False)
    s = rowcache.build_store(tmp_path / "s", [y], progress=False, overwrite=True)
    assert s.tables[0].rows == 12
    assert sorted(os.listdir(tmp_path)) == ["s"]


class Boom(RuntimeError):
    pass


def test_interrupted_build_leaves_nothing_that_opens(tmp_path, rng, monkeypatch):
    x = bf16_table(rng, 5000, 64)
    old = rowcache.build_store(tmp_path / "s", [x[:10]], progress=False)
    import rowcache.store.builder as b

    calls = {"n": 0}
    real = b.to_records  # (rowcache.store.pages, as the builder names it)

    def failing(dtype, block):
        calls["n"] += 1
        if calls["n"] == 3:
            raise Boom("disk on fire")
        return real(dtype, block)

    monkeypatch.setattr(b, "CHUNK_BYTES", 4096 * 4)
    monkeypatch.setattr(b, "to_records", failing)
    with pytest.raises(Boom):
        rowcache.build_store(tmp_path / "new", [x], progress=False)
    with pytest.raises(Boom):
        calls["n"] = 0
        rowcache.build_store(tmp_path / "s", [x], progress=False, overwrite=True)
    assert not os.path.exists(tmp_path / "new")
    assert sorted(os.listdir(tmp_path)) == ["s"]
    # The store that was to be replaced is intact.
    again = RowStore.open(tmp_path / "s")
    assert again.tables[0].rows == 10 and again.verify().ok
    old.close()


def test_store_without_meta_record_does_not_open(tmp_path, rng):
    rowcache.build_store(tmp_path / "s", [bf16_table(rng, 10, 4)], progress=False)
    env = lmdb.open(str(tmp_path / "s" / fmt.INDEX_NAME), subdir=True)
    with env.begin(write=True) as txn:
        txn.delete(fmt.META_KEY)
    env.close()
    write_marker(tmp_path / "s")  # as a builder that wrote these records would
    with pytest.raises(FormatError, match="no meta record"):
        RowStore.open(tmp_path / "s")


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("version", 99, "'version' is 99"),
        ("format", "other", "'format'"),
        ("dtype", "int4", "'dtype'"),
        ("page_size", 512, "'page_size'"),
    ],
)
def test_corrupt_meta_field_is_named(tmp_path, rng, field, value, match):
    rowcache.build_store(tmp_path / "s", [bf16_table(rng, 10, 4)], progress=False)
    env = lmdb.open(str(tmp_path / "s" / fmt.INDEX_NAME), subdir=True)
    with env.begin(write=True) as txn:
        meta = json.loads(txn.get(fmt.META_KEY))
        meta[field] = value
        txn.put(fmt.META_KEY, json.dumps(meta).encode())
    env.close()
    write_marker(tmp_path / "s")  # as a builder that wrote these records would
    with pytest.raises(FormatError, match=match):
        RowStore.open(tmp_path / "s")


def test_inconsistent_table_field_is_named(tmp_path, rng):
    rowcache.build_store(tmp_path / "s", [bf16_table(rng, 10, 4)], progress=False)
    env = lmdb.open(str(tmp_path / "s" / fmt.INDEX_NAME), subdir=True)
    with env.begin(write=True) as txn:
        meta = json.loads(txn.get(fmt.META_KEY))
        meta["tables"][0]["record_bytes"] = 9
        txn.put(fmt.META_KEY, json.dumps(meta).encode())
    env.close()
    write_marker(tmp_path / "s")  # as a builder that wrote these records would
    with pytest.raises(FormatError, match=r"tables\[0\].record_bytes"):
        RowStore.open(tmp_path / "s")


def test_flipped_byte_caught_by_verify(small):
    store, _ = small
    path = os.path.join(store.path, store.shards[0][1].file)
    with open(path, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x10]))
    rep = store.verify()
    assert not rep.ok and len(rep.problems) == 1 and store.shards[0][1].file in rep.problems[0]
    assert "CRC32" in rep.problems[0]


def test_truncated_shard_short_read_names_shard_and_offset(small):
    store, _ = small
    info = store.table_info("a")
    rec = store.shards[0][0]
    os.truncate(os.path.join(store.path, rec.file), rec.length - 10)
    with pytest.raises(CorruptDataError, match=rf"short read of shard {rec.file} at offset \d+"):
        store.read_rows("a", np.array([info.rows_per_shard - 1]))
    assert "bytes" in store.verify().problems[0]


def test_missing_shard_file(small):
    store, _ = small
    rec = store.shards[0][2]
    os.remove(os.path.join(store.path, rec.file))
    with pytest.raises(CorruptDataError, match=rf"{rec.file} .*is missing"):
        RowStore.open(store.path)
    store2 = RowStore.open(store.path, check_shards=False)
    with pytest.raises(CorruptDataError, match=rec.file):
        store2.read_rows("a", np.array([store2.table_info("a").rows_per_shard * 2]))
    assert any("missing" in p for p in store2.verify().problems)


def test_eio_is_reported_with_shard_and_offset(small, monkeypatch):
    store, _ = small

    def eio(fd, bufs, off):
        raise OSError(5, "Input/output error")

    # the store reads through a reader of the Python engine, the one that calls os.preadv
    python = store.new_reader(**store.reader.options(engine="python"))
    assert python.engine == "python"
    monkeypatch.setattr(store, "reader", python)
    monkeypatch.setattr(os, "preadv", eio)
    with pytest.raises(CorruptDataError, match=r"read of shard t0000-s\d+\.bin at offset \d+"):
        store.read_rows("a", np.array([1, 2, 500]))


def test_reader_bad_settings(small):
    store, _ = small
    with pytest.raises(ConfigError, match="queue_depth=0"):
        RowStore.open(store.path, queue_depth=0)
    with pytest.raises(ConfigError, match="merge_gap"):
        RowStore.open(store.path, merge_gap=-1)
    with pytest.raises(ConfigError, match="out must be uint8"):
        store.read_records("a", np.array([1]), out=np.empty((1, 3), np.uint8))


def test_open_engine_reaches_the_reader_and_a_bad_engine_is_named(tmp_path):
    """RowStore.open(engine=...) is the store reader's engine (the caches copy it); an
    engine that does not exist is a ConfigError naming what is allowed."""
    path = str(tmp_path / "s")
    rowcache.build_store(path, {"t": np.arange(64 * 8, dtype=np.float32).reshape(64, 8)})
    with RowStore.open(path, engine="python") as store:
        assert store.reader.engine == "python"
        want = store.read_rows("t", np.array([3, 60]))
    if NATIVE_BUILT:
        with RowStore.open(path, engine="threads") as store:
            assert store.reader.engine == "threads"
            assert np.array_equal(store.read_rows("t", np.array([3, 60])), want)
            # a cache's sibling reader (other queue depth) and its prefetch reader copy it
            from rowcache.cache.parts import PartReader

            demand, _ = PartReader.demand_reader(store, "cpu", "posix", 4, None)
            assert demand.engine == "threads" and demand.queue_depth == 4
            parts = PartReader(store, [0], np.array([0, 64]), demand)
            assert parts.prefetch_reader().engine == "threads"
    with pytest.raises(ConfigError, match=r"engine='disk'.*allowed: auto, uring, threads"):
        RowStore.open(path, engine="disk")
