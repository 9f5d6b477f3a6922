"""The native fault path (rowcache.io._rcio) against the Python reference engine: same records,
same errors, page checksums checked, one batch across a shared arena's parts."""

from __future__ import annotations

import os
import threading

import crc32c
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rowcache
import rowcache.io.native as native_mod
import rowcache.io.reader as reader_mod
from rowcache import NgramRowCache
from rowcache.errors import ConfigError, CorruptDataError, RowRangeError
from rowcache.io.checksum import PAGE, page_crcs, page_crcs_of_file
from rowcache.io.reader import RowReader
from rowcache.kernels.reference import BF16

_rcio = pytest.importorskip("rowcache.io._rcio", reason="the native extension is not built here")
ENGINES = ["uring", "threads", "python", "uring+threads"]
NATIVE = ["uring", "threads", "uring+threads"]


def store_crcs(store):
    return [
        [page_crcs_of_file(os.path.join(store.path, r.file)) for r in recs] for recs in store.shards
    ]


def shard_files(store):
    return [[r.file for r in recs] for recs in store.shards]


def make_reader(store, checked=True, **kw):
    crcs = store_crcs(store) if checked else None
    return RowReader(store.path, store.tables, shard_files(store), page_crcs=crcs, **kw)


def direct_ok(path) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Stores of several shapes: record sizes, shard sizes, table counts, both dtypes."""
    rng = np.random.default_rng(7)
    out = []
    shapes = [
        ("bf16", [32, 32, 32], [3000, 700, 5001], 8),
        ("fp8", [60, 60], [2500, 999], 3),
        ("bf16", [2100], [300], 6),  # records larger than a page (4,200 bytes)
    ]
    for i, (dtype, dims, rows, shard_pages) in enumerate(shapes):
        tabs = {
            f"t{k}": rng.standard_normal((n, d), dtype=np.float32).astype(BF16)
            for k, (n, d) in enumerate(zip(rows, dims))
        }
        path = tmp_path_factory.mktemp(f"s{i}") / "store"
        store = rowcache.build_store(
            path, tabs, dtype=dtype, progress=False, shard_bytes=shard_pages * PAGE
        )
        out.append(store)
    return out


def expected_records(store, parts):
    ref = make_reader(store, checked=False, engine="python")
    try:
        recs = [ref.read_records(t, r)[0] for t, r in parts]
    finally:
        ref.close()
    return np.concatenate(recs) if recs else np.empty((0, store.tables[0].record_bytes), np.uint8)


# -- CRC32C ------------------------------------------------------------------
@given(data=st.binary(max_size=20_000), value=st.integers(0, 2**32 - 1))
@settings(max_examples=200, deadline=None)
def test_crc32c_native_equals_package(data, value):
    want = crc32c.crc32c(data, value)
    assert _rcio.crc32c(data, value) == want
    assert _rcio.crc32c(data, value, True) == want  # the table path (no SSE4.2)


@given(data=st.binary(max_size=5 * PAGE + 100))
@settings(max_examples=100, deadline=None)
def test_page_crcs_equal_package_per_page(data, tmp_path_factory):
    want = [crc32c.crc32c(data[j : j + PAGE]) for j in range(0, len(data), PAGE)]
    assert page_crcs(data).tolist() == want
    p = tmp_path_factory.mktemp("c") / "f"
    p.write_bytes(data)
    assert page_crcs_of_file(p, chunk_pages=2).tolist() == want


def test_page_crcs_fallback_without_extension(monkeypatch):
    data = np.random.default_rng(0).integers(0, 256, 3 * PAGE + 7, dtype=np.uint8)
    want = page_crcs(data)
    monkeypatch.setattr("rowcache.io.checksum._rcio", None)
    np.testing.assert_array_equal(page_crcs(data), want)


# -- native == Python ---------------------------------------------------------
@st.composite
def read_case(draw):
    si = draw(st.integers(0, 2))
    return (
        si,
        draw(st.randoms(use_true_random=False)),
        {
            "engine": draw(st.sampled_from(NATIVE)),
            "queue_depth": draw(st.integers(1, 64)),
            "merge_gap": draw(st.sampled_from([0, 4096, 16 << 10, 1 << 20])),
            "max_extent": draw(st.sampled_from([PAGE, 3 * PAGE, 1 << 20])),
            "direct": draw(st.booleans()),
            "checked": draw(st.booleans()),
            "spin_us": draw(st.sampled_from([0, 1, 100])),  # polling or sleeping: same reads
        },
    )


@given(case=read_case())
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_native_reads_equal_python_reference(stores, case):
    si, rnd, kw = case
    store = stores[si]
    if kw["direct"] and not direct_ok(os.path.join(store.path, store.shards[0][0].file)):
        kw["direct"] = False
    rng = np.random.default_rng(rnd.getrandbits(32))
    parts = []
    for t in rng.permutation(len(store.tables))[: rng.integers(1, len(store.tables) + 1)]:
        n = store.tables[t].rows
        k = int(rng.integers(0, min(n, 400) + 1))
        parts.append((int(t), np.unique(rng.integers(0, n, k))))
    reader = make_reader(store, **kw)
    assert reader.engine == kw["engine"]
    rec = store.tables[0].record_bytes
    out = np.full((sum(r.size for _, r in parts) + 3, rec), 0xAB, dtype=np.uint8)
    got, stats = reader.read_parts(parts, out=out)
    want = expected_records(store, parts)
    np.testing.assert_array_equal(got, want)
    assert (out[got.shape[0] :] == 0xAB).all()
    assert stats.rows == want.shape[0] and stats.bytes_read % PAGE == 0
    py = make_reader(store, **{**kw, "engine": "python"})
    _, py_stats = py.read_parts(parts)
    assert py_stats == stats  # one plan, whatever the engine
    reader.close()
    py.close()


def test_records_equal_source_values(stores):
    store = stores[0]
    reader = make_reader(store)
    rows = np.arange(0, 5001, 7)
    recs, _ = reader.read_records(2, rows)
    full = store.read_rows(2, np.arange(5001))
    np.testing.assert_array_equal(recs.view(np.uint16), full[rows].view(np.uint16))


def test_threads_share_one_native_reader(stores):
    store = stores[0]
    reader = make_reader(store, engine="uring", queue_depth=8)
    want = expected_records(store, [(0, np.arange(0, 3000, 3))])
    errors = []

    def work():
        for _ in range(20):
            got, _ = reader.read_records(0, np.arange(0, 3000, 3))
            if not np.array_equal(got, want):
                errors.append("mismatch")

    ts = [threading.Thread(target=work) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors


def test_python_path_when_extension_is_missing(stores, monkeypatch):
    store = stores[1]
    parts = [(0, np.arange(0, 2500, 11)), (1, np.arange(3, 999, 5))]
    want = expected_records(store, parts)
    monkeypatch.setattr(native_mod, "_rcio", None)
    monkeypatch.setattr(reader_mod, "NATIVE_BUILT", False)  # (as imported where it is built)
    r = make_reader(store)
    assert r.engine == "python"
    np.testing.assert_array_equal(r.read_parts(parts)[0], want)
    with pytest.raises(ConfigError, match=r"rowcache\.io\._rcio"):
        make_reader(store, engine="uring")


def test_bad_reader_settings(stores):
    store = stores[0]
    with pytest.raises(ConfigError, match="engine='fast'"):
        make_reader(store, engine="fast")
    crcs = store_crcs(store)
    crcs[1][0] = crcs[1][0][:-1]
    with pytest.raises(ConfigError, match=r"page_crcs\[1\]\[0\]"):
        RowReader(store.path, store.tables, shard_files(store), page_crcs=crcs)
    with pytest.raises(ConfigError, match="parts=\\[\\]"):
        make_reader(store).read_parts([])


# -- injected failures -----------------------------------------------------------
def fresh_store(tmp_path, tables=3, rows=2000, dim=32):
    rng = np.random.default_rng(3)
    tabs = {
        f"t{k}": rng.standard_normal((rows, dim), dtype=np.float32).astype(BF16)
        for k in range(tables)
    }
    store = rowcache.build_store(tmp_path / "s", tabs, progress=False, shard_bytes=4 * PAGE)
    return store, tabs


def cache_on(store, engine, slots=500):
    store.reader = make_reader(store, engine=engine, queue_depth=16)
    return NgramRowCache(store, [f"t{k}" for k in range(len(store.tables))], slots=slots)


def snapshot(cache):
    row_slot, slot_row = cache.inspect().slot_map()
    return row_slot.copy(), slot_row.copy(), cache.table.copy(), cache.stats()


def assert_unchanged(cache, before):
    row_slot, slot_row = cache.inspect().slot_map()
    np.testing.assert_array_equal(row_slot, before[0])
    np.testing.assert_array_equal(slot_row, before[1])
    np.testing.assert_array_equal(cache.table.view(np.uint16), before[2].view(np.uint16))
    after = cache.stats()
    for f in ("rows_read", "bytes_read", "read_ops", "misses", "hits", "evictions"):
        assert getattr(after, f) == getattr(before[3], f), f


def shared_ids(cache, rng, per_part=30):
    return np.concatenate(
        [cache.global_ids(k, rng.choice(1000, per_part, replace=False)) for k in range(3)]
    )


@pytest.mark.parametrize("engine", ENGINES)
def test_flipped_byte_raises_names_shard_offset_row_and_maps_nothing(tmp_path, engine):
    store, tabs = fresh_store(tmp_path)
    cache = cache_on(store, engine)
    rng = np.random.default_rng(1)
    cache.resolve(shared_ids(cache, rng))
    cache.end_step()
    before = snapshot(cache)
    info = store.tables[1]
    row = 1234  # table t1: flip one byte inside its record
    shard, off = info.locate(np.array([row]))
    rec = store.shards[1][int(shard[0])]
    with open(os.path.join(store.path, rec.file), "r+b") as f:
        f.seek(int(off[0]) + 5)
        b = f.read(1)
        f.seek(int(off[0]) + 5)
        f.write(bytes([b[0] ^ 0x01]))
    ids = np.concatenate(
        [cache.global_ids(0, [5, 6]), cache.global_ids(1, [row, 3]), cache.global_ids(2, [9])]
    )
    page_off = int(off[0]) // PAGE * PAGE
    with pytest.raises(CorruptDataError) as ei:
        cache.resolve(ids)
    msg = str(ei.value)
    assert rec.file in msg and f"byte offset {page_off}" in msg and "'t1'" in msg
    assert f"row {row}" in msg and "checksum" in msg
    assert_unchanged(cache, before)
    cache.end_step()
    good = cache.resolve(np.concatenate([cache.global_ids(0, [5, 6]), cache.global_ids(2, [9])]))
    np.testing.assert_array_equal(
        cache.table[good[:2]].view(np.uint16), tabs["t0"][[5, 6]].view(np.uint16)
    )


@pytest.mark.parametrize("engine", ENGINES)
def test_truncated_shard_short_read_in_one_part_leaves_every_part_unchanged(tmp_path, engine):
    store, _ = fresh_store(tmp_path)
    cache = cache_on(store, engine)
    before = snapshot(cache)
    info = store.tables[2]
    last = info.shard_rows(1)[0] + info.shard_rows(1)[1] - 1  # the last row of shard 1
    rec = store.shards[2][1]
    os.truncate(os.path.join(store.path, rec.file), rec.length - 100)
    # the page checks would also catch it; without them, the short read itself must
    store.reader = make_reader(store, checked=False, engine=engine)
    cache = NgramRowCache(store, [f"t{k}" for k in range(len(store.tables))], slots=500)
    ids = np.concatenate(
        [cache.global_ids(0, [1, 2, 3]), cache.global_ids(1, [7]), cache.global_ids(2, [last, 0])]
    )
    with pytest.raises(CorruptDataError, match=rf"short read of shard {rec.file} at offset \d+"):
        cache.resolve(ids)
    assert_unchanged(cache, before)
    assert cache.inspect().pinned == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_missing_shard_file_maps_nothing(tmp_path, engine):
    store, _ = fresh_store(tmp_path)
    cache = cache_on(store, engine)
    before = snapshot(cache)
    rec = store.shards[1][2]
    os.remove(os.path.join(store.path, rec.file))
    row = store.tables[1].shard_rows(2)[0]
    with pytest.raises(CorruptDataError, match=rf"{rec.file}.*missing"):
        cache.resolve(np.concatenate([cache.global_ids(0, [4]), cache.global_ids(1, [row])]))
    assert_unchanged(cache, before)


@pytest.mark.parametrize("engine", ENGINES)
def test_one_fault_batch_for_all_parts_of_a_shared_arena(tmp_path, engine):
    store, tabs = fresh_store(tmp_path)
    cache = cache_on(store, engine)
    calls = []
    real = store.reader.read_batch  # the cache's demand reader

    def spy(rows, bounds, tables, bases, out):
        calls.append(int(np.count_nonzero(np.diff(bounds))))  # parts with rows
        return real(rows, bounds, tables, bases, out)

    store.reader.read_batch = spy
    rng = np.random.default_rng(5)
    per = [np.sort(rng.choice(2000, 40, replace=False)) for _ in range(3)]
    ids = np.concatenate([cache.global_ids(k, per[k]) for k in range(3)])
    slots = cache.resolve(ids)
    assert calls == [3]  # one dispatch for the three parts
    s = cache.stats()
    assert s.rows_read == 120 and s.misses == 120 and s.bytes_read % PAGE == 0
    for k in range(3):
        got = cache.table[slots[40 * k : 40 * (k + 1)]]
        np.testing.assert_array_equal(got.view(np.uint16), tabs[f"t{k}"][per[k]].view(np.uint16))


def test_errno_failure_in_python_engine_is_reported_per_read(tmp_path, monkeypatch):
    store, _ = fresh_store(tmp_path)
    reader = make_reader(store, engine="python")  # the engine that calls os.preadv
    real = os.preadv
    target = reader.files.fd(1, 0)

    def eio(fd, bufs, off):
        if fd == target:
            raise OSError(5, "Input/output error")
        return real(fd, bufs, off)

    monkeypatch.setattr(os, "preadv", eio)
    with pytest.raises(
        CorruptDataError,
        match=r"read of shard t0001-s000000\.bin at offset 0 .*'t1', row 3.*Errno 5",
    ):
        reader.read_parts([(0, np.array([1])), (1, np.array([3]))])


def test_native_rejects_rows_outside_their_table_and_bad_runs(stores):
    r = make_reader(stores[0], engine="uring")
    with pytest.raises(RowRangeError, match="row 3000 of table 't0'"):
        r.read_records(0, np.array([1, 3000]))
    with pytest.raises(ConfigError, match="bounds"):
        r.read_runs(np.array([1, 2]), np.array([0, 1]), np.array([0], np.int32), np.array([0]))
    with pytest.raises(ConfigError, match="read_runs"):  # bounds not rising
        r.read_runs(np.array([1, 2]), np.array([0, 2, 1, 2]), np.arange(3), np.zeros(3))


def test_native_reader_works_after_fork(stores):
    r = make_reader(stores[0], engine="uring", queue_depth=4)
    rows = np.arange(0, 3000, 13)
    want, _ = r.read_records(0, rows)
    pid = os.fork()
    if pid == 0:  # the child builds its own ring; the parent's is left alone
        ok = np.array_equal(r.read_records(0, rows)[0], want)
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    np.testing.assert_array_equal(r.read_records(0, rows)[0], want)


@pytest.mark.gpu
def test_kvikio_reader_follows_the_plan_and_checks_pages(tmp_path):
    pytest.importorskip("kvikio")
    from rowcache.io.kvikio_reader import KvikioRowReader

    store, _ = fresh_store(tmp_path)
    crcs = store_crcs(store)
    kv = KvikioRowReader(store.path, store.tables, shard_files(store), page_crcs=crcs)
    parts = [(2, np.arange(0, 2000, 9)), (0, np.arange(5, 2000, 17))]
    got, stats = kv.read_parts(parts)
    np.testing.assert_array_equal(got, expected_records(store, parts))
    assert stats == make_reader(store, engine="uring").read_parts(parts)[1]
    rec = store.shards[0][0]
    with open(os.path.join(store.path, rec.file), "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x40]))
    with pytest.raises(
        CorruptDataError, match=rf"checksum mismatch in shard {rec.file} at byte offset 0"
    ):
        kv.read_parts([(0, np.array([1]))])


@pytest.mark.gpu
def test_kvikio_reader_reads_the_file_it_opened_not_what_the_path_names_later(tmp_path):
    """A shard renamed over after its first read: kvikio reads the file the checks opened
    (its descriptor), as the other engines do; a shard replaced by a FIFO before its first
    read is refused, named, and never opened by kvikio (which would block)."""
    pytest.importorskip("kvikio")
    from rowcache.io.kvikio_reader import KvikioRowReader

    store, _ = fresh_store(tmp_path)
    kv = KvikioRowReader(store.path, store.tables, shard_files(store), page_crcs=store_crcs(store))
    parts = [(0, np.arange(0, 2000, 7))]
    want = expected_records(store, parts)
    np.testing.assert_array_equal(kv.read_parts(parts)[0], want)
    rec = store.shards[0][0]
    path = os.path.join(store.path, rec.file)
    other = path + ".other"
    with open(path, "rb") as f:
        junk = bytes(b ^ 0xFF for b in f.read())
    with open(other, "wb") as f:
        f.write(junk)
    os.replace(other, path)
    np.testing.assert_array_equal(kv.read_parts(parts)[0], want)
    kv2 = KvikioRowReader(store.path, store.tables, shard_files(store), page_crcs=store_crcs(store))
    os.remove(path)
    os.mkfifo(path)
    with pytest.raises(CorruptDataError, match=rf"{rec.file}.*not a regular file"):
        kv2.read_parts(parts)


def test_read_records_misuse_is_a_named_config_error(tmp_path):
    import ml_dtypes

    from rowcache.errors import ConfigError

    s = rowcache.build_store(
        tmp_path / "s", {"t": np.zeros((100, 8), ml_dtypes.bfloat16)}, progress=False
    )
    for bad, what in [
        (np.array([5, 3]), "sorted and unique"),
        (np.array([4, 4]), "sorted and unique"),
        (np.array([1.5]), "integer"),
        (np.zeros((2, 2), np.int64), "1-D"),
    ]:
        with pytest.raises(ConfigError, match=what):
            s.reader.read_records(0, bad)
    s.close()


@pytest.mark.parametrize("bad", [-1, 100_001, 1.5, True, "10"])
def test_spin_us_is_checked(stores, bad):
    with pytest.raises(ConfigError, match="spin_us"):
        make_reader(stores[0], spin_us=bad)


def test_options_carry_spin_us_and_prefetch_reader_sleeps(stores):
    r = make_reader(stores[0], spin_us=7)
    assert r.options()["spin_us"] == 7
    assert r.options(spin_us=0)["spin_us"] == 0
    made = []  # the cache's reads (a PartReader)
    NgramRowCache.assemble(stores[0], "t0", slots=64, part_reader=lambda r: made.append(r) or r)
    demand, prefetch = made[0].reader, made[0].prefetch_reader()
    assert demand.spin_us > 0 and prefetch.spin_us == 0
    assert not demand.background and prefetch.background


@pytest.mark.parametrize("engine", NATIVE)
def test_background_reader_yields_while_a_demand_batch_reads(stores, engine):
    """A background reader submits nothing while a foreground batch reads (held here
    through the test hook): its batch finishes only once the count drops; a foreground
    reader is never held; both give the reference records."""
    store = stores[0]
    rows = np.arange(0, 3000, 3)
    want = expected_records(store, [(0, rows)])
    bg = make_reader(store, engine=engine, queue_depth=8, background=True)
    fg = make_reader(store, engine=engine, queue_depth=8)
    assert bg.options()["background"] and not fg.options()["background"]
    got = {}
    assert _rcio.demand_hold(1) == 1
    try:
        t = threading.Thread(target=lambda: got.update(bg=bg.read_records(0, rows)[0]))
        t.start()
        t.join(0.3)
        assert t.is_alive(), "the background batch read while a demand batch was held"
        got["fg"] = fg.read_records(0, rows)[0]  # foreground: not held
    finally:
        assert _rcio.demand_hold(-1) == 0
    t.join(10)
    assert not t.is_alive()
    np.testing.assert_array_equal(got["bg"], want)
    np.testing.assert_array_equal(got["fg"], want)


def test_background_and_demand_readers_concurrently_read_the_reference_records(stores):
    """A prefetch-like background reader and demand readers in threads: every batch
    equals the reference (the yield never loses or reorders a read)."""
    store = stores[1]
    rng = np.random.default_rng(3)
    batches = [np.unique(rng.integers(0, 2500, int(rng.integers(1, 600)))) for _ in range(12)]
    want = [expected_records(store, [(0, b)]) for b in batches]
    errors = []

    def work(background, engine):
        r = make_reader(store, engine=engine, queue_depth=4, background=background)
        for _ in range(5):
            for b, w in zip(batches, want):
                if not np.array_equal(r.read_records(0, b)[0], w):
                    errors.append((background, engine))

    ts = [
        threading.Thread(target=work, args=(bgd, eng))
        for bgd in (True, False)
        for eng in ("uring", "threads")
    ]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not any(t.is_alive() for t in ts) and not errors
    assert _rcio.demand_hold(0) == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_read_batch_equals_read_runs_and_falls_back_for_errors(tmp_path, engine):
    """read_batch (the fault path's entry): the same records and stats as read_runs; a
    shard not opened yet and a bad row go through read_runs' handling."""
    store, _ = fresh_store(tmp_path)
    r = make_reader(store, engine=engine)
    rows = np.array([3, 700, 1999, 2000, 2001], dtype=np.int64)  # t0: 3, 700; t2: 5, 6, 7
    bounds = np.array([0, 2, 2, 5], dtype=np.int64)
    tables = np.arange(3, dtype=np.int32)
    bases = np.array([0, 0, 1994], dtype=np.int64)
    rec = store.tables[0].record_bytes
    out = np.zeros((5, rec), np.uint8)
    got = r.read_batch(rows, bounds, tables, bases, out)  # first use: opens its shards
    want, rs = make_reader(store, engine="python").read_runs(rows, bounds, tables, bases)
    np.testing.assert_array_equal(out, want)
    assert got == (rs.rows, rs.bytes_read, rs.read_ops)
    out[:] = 0
    assert r.read_batch(rows, bounds, tables, bases, out) == got  # the native fast path
    np.testing.assert_array_equal(out, want)
    if engine == "python":  # (its callers check rows; the native engines check them too)
        return
    with pytest.raises(RowRangeError, match="out of range"):
        r.read_batch(np.array([5000], np.int64), np.array([0, 1]), tables[:1], bases[:1],
                     out[:1])  # fmt: skip


@pytest.mark.parametrize("engine", ENGINES)
def test_a_batch_started_apart_reads_what_read_batch_reads_and_writes_its_flag(tmp_path, engine):
    """read_batch_start / read_batch_join: the records and stats of read_batch, read on the
    reader's own thread; the flag ``ctl`` says clean (``ctl[1] == seq``) only for a clean
    batch, and a failed one raises read_batch's named error at the join. The Python
    engine starts nothing (False): its caller reads as before."""
    store, _ = fresh_store(tmp_path)
    r = make_reader(store, engine=engine)
    rng = np.random.default_rng(3)
    rec = store.tables[0].record_bytes
    tables = np.arange(3, dtype=np.int32)
    ref = make_reader(store, engine="python")
    ctl = np.zeros(2, np.int32)
    for seq in range(1, 21):
        parts = [np.unique(rng.integers(0, t.rows, rng.integers(0, 60))) for t in store.tables]
        bases = np.array([0, 0, 0], dtype=np.int64)
        bounds = np.concatenate([[0], np.cumsum([p.size for p in parts])]).astype(np.int64)
        rows = np.concatenate(parts).astype(np.int64)
        out = np.zeros((rows.size, rec), np.uint8)
        started = r.read_batch_start(rows, bounds, tables, bases, out, ctl, seq)
        assert started == (engine != "python")
        if not started:
            return
        got = r.read_batch_join()
        assert tuple(ctl) == (seq, seq)
        want, rs = ref.read_runs(rows, bounds, tables, bases)
        np.testing.assert_array_equal(out, want)
        assert got == (rs.rows, rs.bytes_read, rs.read_ops)
    # one batch apart at a time: a second caller reads in its own thread, after it
    assert r.read_batch_start(rows, bounds, tables, bases, out, ctl, 30)
    assert not r.read_batch_start(rows, bounds, tables, bases, out, ctl, 31)
    out2 = np.zeros_like(out)
    assert r.read_batch(rows, bounds, tables, bases, out2) == got
    assert r.read_batch_join() == got and tuple(ctl) == (30, 30)
    np.testing.assert_array_equal(out2, out)
    with pytest.raises(RuntimeError, match="not joined"):  # (the native reader itself)
        r.read_engine.native.read_runs_start(rows, bounds, tables, bases, out, True, None, 32)
        r.read_engine.native.read_runs_start(rows, bounds, tables, bases, out, True, None, 33)
    r.read_engine.native.read_runs_join()
    # a flipped byte: the flag says failed, and the join raises the page check's error
    info = store.tables[1]
    shard, off = info.locate(np.array([77]))
    path = os.path.join(store.path, store.shards[1][int(shard[0])].file)
    with open(path, "r+b") as f:
        f.seek(int(off[0]) + 1)
        b = f.read(1)
        f.seek(int(off[0]) + 1)
        f.write(bytes([b[0] ^ 0x10]))
    rows = np.array([5, 77], dtype=np.int64)
    bounds = np.array([0, 1, 2, 2], dtype=np.int64)
    assert r.read_batch_start(rows, bounds, tables, bases, out[:2], ctl, 40)
    with pytest.raises(CorruptDataError, match="checksum"):
        r.read_batch_join()
    assert ctl[0] == 40 and ctl[1] != 40
    assert r.read_batch_start(rows[:1], np.array([0, 1, 1, 1]), tables, bases, out[:1], None, 0)
    assert r.read_batch_join()[0] == 1  # no flag: fine too
    r.close()


SPLIT_CHILD = r"""
import os, sys, numpy as np
from rowcache import RowStore
store = RowStore.open(sys.argv[1], engine="uring+threads", queue_depth=8)
assert store.reader.engine == "uring+threads", store.reader.engine
tasks = lambda: len(os.listdir("/proc/self/task"))
before = tasks()
rows = np.arange(0, 8 * 64 * 40, 64 * 40)  # 8 rows, one a page apart: 8 reads (one wave)
store.read_rows("t", rows)
one_wave = tasks()
store.read_rows("t", np.arange(0, 64 * 2000, 64 * 40))  # 50 reads: more than a queue depth
print(before, one_wave, tasks())
"""


def test_uring_plus_threads_reads_one_wave_by_the_ring_and_longer_batches_by_threads(tmp_path):
    """engine='uring+threads': a batch of at most queue_depth reads starts no pread thread
    (the ring reads it); a longer one starts the pool's queue_depth - 1 helpers. Run in a
    child process (its own threads to count, and a hang shows as a timeout)."""
    import subprocess
    import sys

    path = str(tmp_path / "s")
    # 64 rows of 64 bf16 a page (128 B records): rows 40 pages apart are in distinct pages
    rowcache.build_store(path, {"t": np.zeros((64 * 2000, 64), dtype=BF16)})
    p = subprocess.run(
        [sys.executable, "-c", SPLIT_CHILD, path], capture_output=True, text=True, timeout=120
    )
    if p.returncode and "io_uring" in p.stderr:
        pytest.skip(f"io_uring unavailable here: {p.stderr.strip()[-200:]}")
    assert p.returncode == 0, p.stderr
    before, one_wave, after = map(int, p.stdout.split())
    assert one_wave == before, "a one-wave batch started pread threads"
    assert after == before + 7, (before, one_wave, after)
