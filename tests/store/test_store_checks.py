"""What the store checks: page CRCs, verify per page, records' types, shard file names,
LMDB files that would crash LMDB, LMDB errors, and bad builder inputs."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import crc32c
import lmdb
import ml_dtypes
import numpy as np
import pytest

import rowcache
import rowcache.store.handle as store_mod
from rowcache.errors import ConfigError, CorruptDataError, FormatError, RowRangeError
from rowcache.format import layout as fmt
from rowcache.io.reader import RowReader
from rowcache.store.handle import RowStore, lmdb_error
from rowcache.store.marker import write_marker

BF16 = ml_dtypes.bfloat16


@pytest.fixture
def small(tmp_path, rng):
    tab = {
        "a": rng.standard_normal((1000, 64), dtype=np.float32).astype(BF16),
        "b": rng.standard_normal((257, 48), dtype=np.float32).astype(BF16),
    }
    store = rowcache.build_store(tmp_path / "s", tab, shard_bytes=4 * 4096, progress=False)
    yield store, tab
    store.close()


def edit_index(path, fn):
    """Edit a store's index records as a faulty or hostile builder would write them, and
    record the edited index in the marker as the builder does (a damaged index is the
    checksum's case, a wrong record the records' checks')."""
    env = lmdb.open(os.path.join(path, fmt.INDEX_NAME), subdir=True, lock=False)
    with env.begin(write=True) as txn:
        fn(txn)
    env.close()
    write_marker(path)


def edit_json(path, key, fn):
    def go(txn):
        obj = json.loads(txn.get(key))
        fn(obj)
        txn.put(key, json.dumps(obj).encode())

    edit_index(path, go)


# -- page CRCs ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_page_crcs_are_crc32c_of_every_page_of_padded_shards(tmp_path, rng, dtype):
    x = rng.standard_normal((3001, 256), dtype=np.float32)  # fp8: 260-byte records
    store = rowcache.build_store(
        tmp_path / "s", [x], dtype=dtype, progress=False, shard_bytes=5 * 4096
    )
    info = store.tables[0]
    assert store.meta["version"] == fmt.write_version(dtype) == 2  # bf16, fp8: as before codecs
    for s, rec in enumerate(store.shards[0]):
        data = open(os.path.join(store.path, rec.file), "rb").read()
        assert len(data) == rec.length == info.shard_bytes(s) and len(data) % 4096 == 0
        want = [crc32c.crc32c(data[i : i + 4096]) for i in range(0, len(data), 4096)]
        crcs = store.page_crcs[0][s]
        assert crcs.dtype == np.uint32 and crcs.tolist() == want and rec.pages == len(want)
        assert rec.crc32 == rec.page_crc32c == crc32c.crc32c(crcs.astype("<u4").tobytes())
    last = store.shards[0][-1]
    tail = open(os.path.join(store.path, last.file), "rb").read()
    used = (last.rows % info.rows_per_page) * info.record_bytes
    if used:  # the padding after the last row is zeros
        assert not any(tail[len(tail) - 4096 + used :])
    ids = rng.integers(0, 3001, 500)
    got = store.read_rows(0, ids)
    if dtype == "bf16":
        np.testing.assert_array_equal(got.view(np.uint16), x[ids].astype(BF16).view(np.uint16))


def test_reader_is_handed_the_page_crcs_when_it_takes_them(small, monkeypatch):
    store, _ = small
    got = {}

    class CheckingReader(RowReader):
        def __init__(self, root, tables, shard_files, *, page_crcs=None, **kw):
            got["page_crcs"] = page_crcs
            super().__init__(root, tables, shard_files, **kw)

    monkeypatch.setattr(store_mod, "RowReader", CheckingReader)
    with RowStore.open(store.path) as s2:
        assert got["page_crcs"] is s2.page_crcs
        assert [len(a) for a in got["page_crcs"][0]] == [r.pages for r in s2.shards[0]]
        r = s2.new_reader(CheckingReader, queue_depth=2)
        assert got["page_crcs"] is s2.page_crcs and r.root == s2.root
        r.close()
    monkeypatch.undo()
    # A reader without the keyword (this branch's RowReader) is built without it.
    with RowStore.open(store.path) as s3:
        assert isinstance(s3.reader, RowReader)


def test_verify_names_page_offset_table_and_rows_of_each_bad_page(small):
    store, _ = small
    rec = store.shards[0][1]  # table 'a': 128-byte records, 32 to a page, 128 rows a shard
    with open(os.path.join(store.path, rec.file), "r+b") as f:
        for off in (2 * 4096 + 100, 3 * 4096 + 4095):
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0x01]))
    rep = store.verify()
    assert not rep.ok and rep.bad_pages == 2 and len(rep.problems) == 2
    assert rep.pages_checked == sum(r.pages for recs in store.shards for r in recs)
    p0, p1 = rep.problems
    assert rec.file in p0 and "page 2 (offset 8192)" in p0 and "CRC32C" in p0
    assert "table 'a' rows 192..223" in p0 and "page 3" in p1 and "rows 224..255" in p1


def test_verify_finds_swapped_shard_files(small):
    store, _ = small
    a, b = (os.path.join(store.path, r.file) for r in store.shards[0][:2])
    os.rename(a, a + ".tmp")
    os.rename(b, a)
    os.rename(a + ".tmp", b)
    rep = store.verify()
    bad_files = {p.split(":")[0] for p in rep.problems}
    assert bad_files == {store.shards[0][0].file, store.shards[0][1].file}
    assert rep.bad_pages == store.shards[0][0].pages + store.shards[0][1].pages


def test_verify_caps_reported_pages_per_shard(tmp_path, rng, monkeypatch):
    monkeypatch.setattr(store_mod, "MAX_REPORTED_PAGES", 3)
    store = rowcache.build_store(
        tmp_path / "s", [rng.standard_normal((2000, 64), dtype=np.float32)], progress=False
    )
    p = os.path.join(store.path, store.shards[0][0].file)
    data = bytearray(open(p, "rb").read())
    for page in range(10):
        data[page * 4096] ^= 0xFF
    open(p, "wb").write(bytes(data))
    rep = store.verify()
    assert rep.bad_pages == 10 and len(rep.problems) == 4
    assert "7 more bad pages" in rep.problems[-1] and "pages 3..9" in rep.problems[-1]


def test_open_checks_shard_file_sizes(small):
    store, _ = small
    rec = store.shards[1][0]
    p = os.path.join(store.path, rec.file)
    os.truncate(p, rec.length - 1)
    with pytest.raises(CorruptDataError, match=rf"{rec.file} .*is {rec.length - 1} bytes"):
        RowStore.open(store.path)
    os.truncate(p, rec.length + 4096)
    with pytest.raises(CorruptDataError, match=rf"the index says {rec.length}"):
        RowStore.open(store.path)
    with RowStore.open(store.path, check_shards=False) as s2:  # to verify a damaged store
        assert any("bytes, expected" in q for q in s2.verify().problems)


# -- format version and records' types -------------------------------------------
def test_old_format_version_names_found_supported_and_rebuild(small):
    store, _ = small
    edit_json(store.path, fmt.META_KEY, lambda m: m.update(version=1))
    with pytest.raises(FormatError) as e:
        RowStore.open(store.path)
    msg = str(e.value)
    assert "'version' is 1" in msg and "older format" in msg
    assert "format versions 2, 3" in msg and "rowcache build" in msg


@pytest.mark.parametrize(
    "field,value",
    [
        ("rows", "1000"),
        ("rows", 1000.0),
        ("rows", True),
        ("dim", None),
        ("dim", 0),
        ("pages_per_shard", -1),
        ("name", 7),
    ],
)
def test_meta_table_fields_are_type_checked(small, field, value):
    store, _ = small
    edit_json(store.path, fmt.META_KEY, lambda m: m["tables"][0].update({field: value}))
    with pytest.raises(FormatError, match=rf"tables\[0\]'?: field '{field}' is"):
        RowStore.open(store.path)


def test_meta_duplicate_table_names_and_unknown_fields(small):
    store, _ = small
    edit_json(store.path, fmt.META_KEY, lambda m: m["tables"][1].update(name="a"))
    with pytest.raises(FormatError):  # 'b' renamed 'a' is inconsistent or a duplicate
        RowStore.open(store.path)
    edit_json(store.path, fmt.META_KEY, lambda m: m["tables"][1].update(name="b", extra=1))
    with pytest.raises(FormatError, match=r"unknown fields \['extra'\]"):
        RowStore.open(store.path)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("page_crc32c", "x", "'page_crc32c' is 'x'"),
        ("page_crc32c", 1 << 33, "expected a uint32"),
        ("rows", "64", "'rows' is '64'"),
        ("length", 16384.0, "'length' is 16384.0"),
        ("first_row", None, "'first_row' is None"),
        ("file", 123, "'file' is 123"),
        ("pages", 3, "'pages' is 3"),
        ("offset", 4096, "'offset' is 4096"),
    ],
)
def test_shard_record_fields_are_type_checked(small, field, value, match):
    store, _ = small
    edit_json(store.path, fmt.shard_key(0, 1), lambda r: r.update({field: value}))
    with pytest.raises(FormatError, match=match):
        RowStore.open(store.path)


@pytest.mark.parametrize(
    "name",
    [
        "/etc/passwd",
        "../other/t0000-s000000.bin",
        "sub/t0000-s000001.bin",
        "..",
        ".",
        "",
        fmt.INDEX_NAME,
        ".hidden.bin",
        "a\\b.bin",
        "a\0b",
    ],
)
def test_shard_file_must_be_a_plain_name_inside_the_store(small, name):
    store, _ = small
    edit_json(store.path, fmt.shard_key(0, 1), lambda r: r.update(file=name))
    with pytest.raises(FormatError, match="plain file name inside the store"):
        RowStore.open(store.path)


def test_shard_file_that_is_a_link_out_of_the_store_is_refused(small, tmp_path):
    store, _ = small
    rec = store.shards[0][1]
    outside = tmp_path / "outside.bin"
    outside.write_bytes(open(os.path.join(store.path, rec.file), "rb").read())
    os.remove(os.path.join(store.path, rec.file))
    os.symlink(outside, os.path.join(store.path, rec.file))
    with pytest.raises(FormatError, match="not a regular file"):
        RowStore.open(store.path)
    with pytest.raises(FormatError, match="not a regular file"):
        RowStore.open(store.path, check_shards=False)
    # two records naming one file
    os.remove(os.path.join(store.path, rec.file))
    os.rename(outside, os.path.join(store.path, rec.file))
    edit_json(store.path, fmt.shard_key(0, 2), lambda r: r.update(file=rec.file))
    with pytest.raises(FormatError, match="named by two shard records"):
        RowStore.open(store.path)


def test_page_crc_record_missing_or_corrupt(small):
    store, _ = small
    key = fmt.crc_key(0, 1)
    raw = {}

    def flip(txn):
        raw["v"] = bytearray(txn.get(key))
        raw["v"][5] ^= 1
        txn.put(key, bytes(raw["v"]))

    edit_index(store.path, flip)
    with pytest.raises(FormatError, match=r"page-CRC record .*index is corrupt"):
        RowStore.open(store.path)
    edit_index(store.path, lambda txn: txn.delete(key))
    with pytest.raises(FormatError, match="page-CRC record is missing"):
        RowStore.open(store.path)


# -- LMDB files that would crash LMDB, LMDB errors ---------------------------------
OPEN_SCRIPT = r"""
import json, os, sys
from rowcache.errors import RowCacheError
from rowcache.store.handle import RowStore
out = {}
for p in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            RowStore.open(p).verify()
            os._exit(0)
        except RowCacheError:
            os._exit(3)
        except OSError:
            os._exit(4)
        except BaseException:
            os._exit(5)
    out[p] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print(json.dumps(out))
"""


def open_in_children(paths):
    res = subprocess.run(
        [sys.executable, "-c", OPEN_SCRIPT, *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(res.stdout.splitlines()[-1])


def test_truncated_or_flipped_data_mdb_never_kills_the_process(tmp_path, rng):
    x = rng.standard_normal((3000, 64), dtype=np.float32)
    proto = tmp_path / "proto"
    rowcache.build_store(proto, [x], progress=False, shard_bytes=8 * 4096).close()
    data = open(proto / fmt.INDEX_NAME / "data.mdb", "rb").read()
    assert len(data) >= 5 * 4096
    cases = {}
    sizes = [0, 100, 4096, 8000, 8192, 9000, 12288, 12289, len(data) - 4096, len(data) - 1]
    flips = [(int(rng.integers(0, len(data))), 1 << int(rng.integers(0, 8))) for _ in range(40)]
    for i, case in enumerate(sizes + flips):
        p = tmp_path / f"c{i}"
        import shutil

        shutil.copytree(proto, p)
        d = bytearray(data)
        if isinstance(case, int):
            d = d[:case]
        else:
            d[case[0]] ^= case[1]
        open(p / fmt.INDEX_NAME / "data.mdb", "wb").write(bytes(d))
        cases[str(p)] = case
    codes = open_in_children(cases)
    for p, code in codes.items():
        assert code >= 0, f"{cases[p]}: the process died by signal {-code}"
        assert code in (0, 3), f"{cases[p]}: exit {code} (not a RowCacheError)"
        if isinstance(cases[p], int):
            assert code == 3, f"truncated to {cases[p]} bytes and it opened"
    cut = tmp_path / f"c{sizes.index(9000)}"
    with pytest.raises(
        FormatError, match=r"data.mdb is 9,000 bytes, the store's marker .* records"
    ):
        RowStore.open(cut)
    os.unlink(cut / fmt.MARKER_NAME)  # a store built before markers: its LMDB header's word
    with pytest.raises(FormatError, match=r"data.mdb is 9000 bytes but its LMDB header says"):
        RowStore.open(cut)


def test_build_never_leaves_an_lmdb_lock_file(small):
    store, _ = small
    assert sorted(os.listdir(os.path.join(store.path, fmt.INDEX_NAME))) == ["data.mdb"]


FSIZE_SCRIPT = r"""
import os, resource, sys
import numpy as np
import rowcache
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), int(sys.argv[2])))
x = np.random.default_rng(0).standard_normal((200000, 8), dtype=np.float32)
try:
    rowcache.build_store(sys.argv[1], [x], progress=False, shard_bytes=8192)
except OSError as e:
    print("OSError", e.errno, str(e).replace(chr(10), " "))
except BaseException as e:
    print("other", type(e).__name__, e)
else:
    print("built")
"""


def test_file_size_limit_in_the_index_write_is_an_oserror_with_errno(tmp_path):
    # 8 KiB shards fit under the limit; the index (about 200 bytes a shard) does not.
    res = subprocess.run(
        [sys.executable, "-c", FSIZE_SCRIPT, str(tmp_path / "s"), str(64 << 10)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    kind, code, msg = res.stdout.strip().split(" ", 2)
    # LMDB itself says EIO for a short write; the builder names the cause.
    assert kind == "OSError" and int(code) == errno.EFBIG, res.stdout
    assert "the index of" in msg and "ulimit -f" in msg
    assert os.listdir(tmp_path) == []  # no store, no leftover


def test_lmdb_errors_map_to_project_errors():
    e = lmdb_error(lmdb.DiskError("mdb_txn_commit: No space left on device"), "/x", "writing")
    assert isinstance(e, OSError) and e.errno == errno.ENOSPC and "writing /x" in str(e)
    e = lmdb_error(lmdb.Error("/x/data.mdb: Input/output error"), "/x", "reading")
    assert isinstance(e, OSError) and e.errno == errno.EIO
    e = lmdb_error(lmdb.CorruptedError("mdb_get: MDB_CORRUPTED: Located page was wrong type"), "/x", "reading")  # fmt: skip
    assert isinstance(e, FormatError) and "rowcache build" in str(e)


# -- builder inputs -----------------------------------------------------------------
def test_duplicate_table_names_after_str_are_refused(tmp_path, rng):
    a = rng.standard_normal((10, 4), dtype=np.float32)
    with pytest.raises(ConfigError, match=r"two entries named '1' \(keys 1 and '1'\)"):
        rowcache.build_store(tmp_path / "s", {1: a, "1": a}, progress=False)
    assert not os.path.exists(tmp_path / "s")


@pytest.mark.parametrize("src_dtype", ["bf16", "f32", "f16"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_refused_naming_table_row_and_column(
    tmp_path, rng, monkeypatch, src_dtype, bad
):
    import rowcache.store.builder as b

    monkeypatch.setattr(b, "CHUNK_BYTES", 4096)  # the bad row lies many chunks in
    x = rng.standard_normal((3000, 16), dtype=np.float32)
    x[2345, 7] = bad
    x = x.astype({"bf16": BF16, "f32": np.float32, "f16": np.float16}[src_dtype])
    for dtype in ("bf16", "fp8"):
        with pytest.raises(ConfigError, match=r"tables\['emb'\]: row 2345, column 7 is .*allow_nonfinite=True"):  # fmt: skip
            rowcache.build_store(tmp_path / "s", {"emb": x}, dtype=dtype, progress=False)
        assert os.listdir(tmp_path) == []
    s = rowcache.build_store(tmp_path / "s", {"emb": x}, progress=False, allow_nonfinite=True)
    got = s.read_rows("emb", [2345]).astype(np.float32)[0, 7]
    assert np.isnan(got) if np.isnan(bad) else got == bad


def test_uint64_ids_beyond_int64_are_reported_as_given(small):
    store, _ = small
    big = np.array([3, 2**63 + 5], dtype=np.uint64)
    with pytest.raises(RowRangeError, match=r"row_ids\[1\] = 9223372036854775813 is outside"):
        store.read_rows("a", big)
    with pytest.raises(RowRangeError, match=r"row_ids\[0\] = 18446744073709551615"):
        store.read_rows("a", np.array([2**64 - 1], dtype=np.uint64))
