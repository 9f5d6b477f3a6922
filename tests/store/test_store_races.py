"""A store's path under concurrent builds, links and replacements, closed handles and full
disks (issue 39, items 3-8 and 10): each call returns the store it built or opened, or says
what happened in a named error; never another build's store, a bare OSError, a FormatError
for a healthy store, or a read through a reused descriptor."""

from __future__ import annotations

import errno
import gc
import os
import shutil
import threading
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

import rowcache
from rowcache import NgramRowCache
from rowcache.errors import ConfigError, CorruptDataError, FormatError, StoreChangedError
from rowcache.format import layout as fmt
from rowcache.store import builder, replace
from rowcache.store.handle import RowStore, find_leftovers

BF16 = ml_dtypes.bfloat16


def table(rng, rows, dim=16):
    return rng.standard_normal((rows, dim), dtype=np.float32).astype(BF16)


def build(path, x, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("shard_bytes", 8192)
    return rowcache.build_store(path, {"t": x}, **kw)


def read_all(store):
    return store.read_rows("t", np.arange(store.tables[0].rows)).view(np.uint16)


def same_rows(store, x):
    """True if ``store`` reads back ``x``; a StoreChangedError (its files removed since) is
    the other allowed answer and returns None."""
    try:
        return bool(np.array_equal(read_all(store), x.view(np.uint16)))
    except StoreChangedError:
        return None


@pytest.fixture(params=["exchange", "fallback"])
def switch_mode(request, monkeypatch):
    """Each test of the switch with renameat2's exchange, and with it disabled (the
    two-rename fallback)."""
    if request.param == "exchange" and replace._EXCHANGE is None:
        pytest.skip("no renameat2 on this platform")
    if request.param == "fallback":
        monkeypatch.setattr(replace, "_EXCHANGE", None)
    return request.param


# -- 3: links ----------------------------------------------------------------------
def test_links_in_place_of_the_index_its_file_the_marker_or_a_shard_are_refused(tmp_path, rng):
    s, other = tmp_path / "s", tmp_path / "other"
    build(s, table(rng, 600)).close()
    build(other, table(rng, 600)).close()  # a valid store the links point into
    for rel, what in (
        (fmt.INDEX_NAME, "index directory"),
        (f"{fmt.INDEX_NAME}/{fmt.INDEX_FILE}", "index file"),
        (fmt.MARKER_NAME, "marker"),
        ("t0000-s000001.bin", "shard"),
    ):
        os.rename(s / rel, tmp_path / "saved")
        os.symlink(other / rel, s / rel)
        match = r"is not a regular file \(a link" if what == "shard" else "symbolic link"
        with pytest.raises(FormatError, match=match) as e:
            RowStore.open(s)
        assert os.path.basename(rel) in str(e.value) or what in str(e.value)
        os.unlink(s / rel)
        os.rename(tmp_path / "saved", s / rel)
    # A shard replaced by a link after the open: the read refuses to follow it.
    with RowStore.open(s) as h:
        os.unlink(s / "t0000-s000002.bin")
        os.symlink(other / "t0000-s000002.bin", s / "t0000-s000002.bin")
        with pytest.raises(CorruptDataError, match=r"t0000-s000002\.bin .*symbolic link"):
            h.read_rows("t", [599])


# -- 4: two builds of one path at once ------------------------------------------------
@pytest.mark.parametrize("overwrite", [False, True])
def test_two_builds_of_one_path_at_once_each_return_their_own_store(
    tmp_path, rng, monkeypatch, switch_mode, overwrite
):
    for round_ in range(3):
        path = tmp_path / f"s{round_}"
        if overwrite:
            build(path, table(rng, 50)).close()
        xs = [table(rng, 300), table(rng, 400)]
        committed = threading.Barrier(2, timeout=10)
        switched = threading.Barrier(2, timeout=30)

        def hook(step, committed=committed, switched=switched):
            if step == "committed":  # both builds are complete before either switches
                committed.wait()
            # With the exchange, the first to switch returns only after the second switched
            # (a build that opened `path` by name after its switch returned the other's).
            # The fallback's second build waits for the first's lock: no such wait there.
            if step == "synced" and overwrite and switch_mode == "exchange":
                switched.wait()

        monkeypatch.setattr(replace, "test_hook", hook)
        out: list[object] = [None, None]

        def run(i, path=path, xs=xs, out=out):
            try:
                out[i] = build(path, xs[i], overwrite=overwrite)
            except Exception as e:
                out[i] = e

        threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        monkeypatch.setattr(replace, "test_hook", None)
        won = [r for r in out if isinstance(r, RowStore)]
        for i, r in enumerate(out):
            if isinstance(r, RowStore):
                assert r.path == str(path) and r.tables[0].rows == len(xs[i])
                assert same_rows(r, xs[i]) in (True, None)  # its own rows, never the other's
                r.close()
            else:
                assert isinstance(r, ConfigError) and "appeared during the build" in str(r), out
        assert len(won) == (2 if overwrite else 1), out
        with RowStore.open(path) as h:  # the path holds one of the two, complete
            assert any(same_rows(h, x) for x in xs)
        assert not any(lo.live for lo in find_leftovers(path))


# -- 5: opening while another thread rebuilds the path --------------------------------
def test_open_while_another_thread_rebuilds_gives_old_or_new_or_store_changed(
    tmp_path, rng, switch_mode
):
    path = tmp_path / "s"
    xs = [table(rng, 300), table(rng, 400)]
    build(path, xs[0]).close()
    done = threading.Event()
    errors: list[BaseException] = []

    def rebuild():
        try:
            for k in range(8):
                build(path, xs[(k + 1) % 2], overwrite=True).close()
        except BaseException as e:
            errors.append(e)
        finally:
            done.set()

    t = threading.Thread(target=rebuild)
    t.start()
    opened = changed = 0
    try:
        while not done.is_set():
            try:
                h = RowStore.open(path)
            except StoreChangedError:
                changed += 1
                continue
            with h:
                x = xs[0] if h.tables[0].rows == len(xs[0]) else xs[1]
                assert same_rows(h, x) in (True, None)
            opened += 1
    finally:
        t.join(60)
    assert not errors, errors
    assert opened > 0, (opened, changed)


# -- 6: a cache whose store was replaced ----------------------------------------------
def test_a_cache_whose_store_was_replaced_gives_its_own_rows_or_store_changed(tmp_path, rng):
    old, new = table(rng, 2000, 32), table(rng, 2000, 32)
    path = tmp_path / "s"
    build(path, old, shard_bytes=4 * 4096).close()
    h = RowStore.open(path)
    cache = NgramRowCache(h, "t", slots=64)  # no shard opened yet
    build(path, new, overwrite=True).close()  # the old store's files are removed
    rows = np.array([2, 3, 900, 1999])
    try:
        slots = cache.resolve(rows)
    except StoreChangedError as e:
        assert str(path) in str(e) and "open the path again" in str(e)
    else:
        np.testing.assert_array_equal(
            np.asarray(cache.table[slots]).view(np.uint16), old[rows].view(np.uint16)
        )
    with pytest.raises(StoreChangedError, match="open the path again"):
        h.read_rows("t", rows)
    h.close()


# -- 7: the fallback switch and what overwrite may delete ------------------------------
class Crash(Exception):
    pass


def test_a_store_deleted_after_a_fallback_switch_is_never_brought_back(tmp_path, rng, monkeypatch):
    monkeypatch.setattr(replace, "_EXCHANGE", None)
    path = tmp_path / "s"
    build(path, table(rng, 100)).close()

    def crash(step):
        if step == "new-moved":  # the new store is at `path`; the old one not yet renamed
            raise Crash

    monkeypatch.setattr(replace, "test_hook", crash)
    new = table(rng, 120)
    with pytest.raises(Crash):
        build(path, new, overwrite=True)
    monkeypatch.setattr(replace, "test_hook", None)
    assert [lo.kind for lo in find_leftovers(path)] == ["switch"]
    with RowStore.open(path) as h:
        assert same_rows(h, new)
    shutil.rmtree(path)  # the user deletes the store
    with pytest.raises(FormatError, match="no such directory"):
        RowStore.open(path)
    assert not os.path.lexists(path)
    again = table(rng, 30)
    with build(path, again) as h:  # a new build of the path: nothing old comes back
        assert same_rows(h, again)
    assert find_leftovers(path) == []


def test_overwrite_deletes_only_what_the_format_marks_as_a_store(tmp_path, rng):
    x = table(rng, 20)
    # A directory that merely holds an index.lmdb/ with someone's files in it.
    d = tmp_path / "d"
    (d / fmt.INDEX_NAME).mkdir(parents=True)
    (d / fmt.INDEX_NAME / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not a rowcache store"):
        build(d, x, overwrite=True)
    assert (d / fmt.INDEX_NAME / "notes.txt").read_text() == "keep me"
    # A store with someone's file put in its index directory is not replaced either.
    build(tmp_path / "s", x).close()
    (tmp_path / "s" / fmt.INDEX_NAME / "mine.txt").write_text("x")
    with pytest.raises(ConfigError, match="not a rowcache store"):
        build(tmp_path / "s", x, overwrite=True)
    os.unlink(tmp_path / "s" / fmt.INDEX_NAME / "mine.txt")
    # Without a marker (a store built before markers): replaced only if its index is LMDB's.
    os.unlink(tmp_path / "s" / fmt.MARKER_NAME)
    with RowStore.open(tmp_path / "s") as h:  # it still opens, with the header check alone
        assert same_rows(h, x)
    fake = tmp_path / "fake"
    (fake / fmt.INDEX_NAME).mkdir(parents=True)
    (fake / fmt.INDEX_NAME / fmt.INDEX_FILE).write_bytes(b"my own data" * 100)
    with pytest.raises(ConfigError, match="not a rowcache store"):
        build(fake, x, overwrite=True)
    assert (fake / fmt.INDEX_NAME / fmt.INDEX_FILE).read_bytes() == b"my own data" * 100
    y = table(rng, 25)
    with build(tmp_path / "s", y, overwrite=True) as h:
        assert same_rows(h, y)
    assert sorted(os.listdir(tmp_path / "s")) == [
        fmt.INDEX_NAME, fmt.MARKER_NAME, "t0000-s000000.bin"
    ]  # fmt: skip
    # A marker that is damaged does not mark a store.
    (tmp_path / "s" / fmt.MARKER_NAME).write_text("{}")
    with pytest.raises(ConfigError, match="not a rowcache store"):
        build(tmp_path / "s", x, overwrite=True)


# -- 8: a closed handle ------------------------------------------------------------------
def refused_calls(h):
    rows = np.arange(2, 5)
    return [
        lambda: h.read_rows("t", rows),
        lambda: h.read_records("t", rows),
        h.verify,
        h.new_reader,
        h.changed,
    ]


def test_a_closed_handle_refuses_every_call_and_its_readers_read_only_its_store(tmp_path, rng):
    a, b = table(rng, 600), table(rng, 600)
    build(tmp_path / "a", a).close()
    build(tmp_path / "b", b).close()
    h = RowStore.open(tmp_path / "a")
    reader = h.new_reader()  # as a cache holds one
    h.close()
    h.close()  # twice is harmless
    for call in refused_calls(h):
        with pytest.raises(ConfigError, match=r"RowStore\(.*\) is closed"):
            call()
    del h
    gc.collect()
    others = [RowStore.open(tmp_path / "b") for _ in range(4)]  # descriptor numbers reused
    try:
        recs, _ = reader.read_records(0, np.arange(600))
        np.testing.assert_array_equal(
            fmt.decode_records("bf16", 16, recs).view(np.uint16), a.view(np.uint16)
        )
    finally:
        for o in others:
            o.close()


# -- 10: a full disk -----------------------------------------------------------------------
def test_a_build_that_does_not_fit_is_refused_up_front_saying_need_and_free(
    tmp_path, rng, monkeypatch
):
    x = table(rng, 5000, 64)  # 640 KB of shards
    monkeypatch.setattr(builder, "STATVFS", lambda p: SimpleNamespace(f_bavail=1000, f_frsize=4096))
    with pytest.raises(OSError) as e:
        build(tmp_path / "s", x)
    assert e.value.errno == errno.ENOSPC
    msg = str(e.value)
    assert "needs" in msg and "4,096,000 bytes" in msg and str(tmp_path) in msg, msg
    assert os.listdir(tmp_path) == []  # nothing written
    monkeypatch.setattr(builder, "STATVFS", os.statvfs)
    with build(tmp_path / "s", x) as h:  # what it asks for covers what a build writes
        infos = h.tables
    used = sum(f.stat().st_size for f in (tmp_path / "s").rglob("*") if f.is_file())
    assert used <= builder.needed_bytes(infos) < used + (32 << 20)
