"""Replacing a store: the atomic switch under crashes, what overwrite may replace,
leftovers of earlier builds, and handles that outlive a replacement."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import rowcache
from rowcache import NgramRowCache
from rowcache.errors import ConfigError, CorruptDataError, FormatError, StoreChangedError
from rowcache.format import layout as fmt
from rowcache.store import replace
from rowcache.store.handle import RowStore, find_leftovers
from rowcache.store.marker import write_marker

BF16 = ml_dtypes.bfloat16

# What `path` must open as after a build is killed at each named step of its switch.
EXCHANGE_STEPS = {
    "committed": "old",
    "exchanged": "new",
    "old-renamed": "new",
    "synced": "new",
    "old-removing": "new",
    "old-removed": "new",
}
FALLBACK_STEPS = {
    "committed": "old",
    "old-moved": "old",  # path is missing here: the next open restores the old store
    "new-moved": "new",
    "old-renamed": "new",
    "synced": "new",
    "old-removing": "new",
    "old-removed": "new",
}

# One process forks a build per step; each child dies by os._exit at its step.
CRASH_SCRIPT = r"""
import json, os, sys
import numpy as np
from rowcache import build_store
from rowcache.store import replace
work, fallback, steps = sys.argv[1], sys.argv[2] == "1", json.loads(sys.argv[3])
new = np.load(os.path.join(work, "new.npy"))
if fallback:
    replace._EXCHANGE = None
codes = {}
for step in steps:
    pid = os.fork()
    if pid == 0:
        replace.test_hook = lambda name, step=step: os._exit(77) if name == step else None
        try:
            build_store(os.path.join(work, step, "s"), {"t": new}, overwrite=True,
                        progress=False, shard_bytes=8192)
        except BaseException:
            os._exit(1)
        os._exit(0)
    codes[step] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print(json.dumps(codes))
"""


def table(rng, rows, dim=16):
    return rng.standard_normal((rows, dim), dtype=np.float32)


def read_all(store):
    return store.read_rows("t", np.arange(store.tables[0].rows)).view(np.uint16)


@pytest.mark.parametrize("mode", ["exchange", "fallback"])
def test_build_killed_at_every_step_of_the_switch_leaves_old_or_new(tmp_path, rng, mode):
    if mode == "exchange" and replace._EXCHANGE is None:
        pytest.skip("no renameat2 on this platform")
    steps = EXCHANGE_STEPS if mode == "exchange" else FALLBACK_STEPS
    old, new = table(rng, 300), table(rng, 500)
    np.save(tmp_path / "new.npy", new)
    rowcache.build_store(tmp_path / "proto", {"t": old}, shard_bytes=8192, progress=False).close()
    for step in steps:
        os.mkdir(tmp_path / step)
        shutil.copytree(tmp_path / "proto", tmp_path / step / "s")
    out = subprocess.run(
        [sys.executable, "-c", CRASH_SCRIPT, str(tmp_path), str(int(mode == "fallback")),
         json.dumps(list(steps))],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    codes = json.loads(out.stdout.splitlines()[-1])
    for step, want in steps.items():
        assert codes[step] == 77, f"the build never reached step {step!r}: {codes}"
        path = tmp_path / step / "s"
        assert all(not lo.live for lo in find_leftovers(path))
        with RowStore.open(path) as store:  # old or new, complete; never nothing
            assert store.verify().ok
            data = old if want == "old" else new
            np.testing.assert_array_equal(read_all(store), data.astype(BF16).view(np.uint16))
        # The next build of the path removes whatever the killed one left.
        rowcache.build_store(path, {"t": old[:10]}, overwrite=True, progress=False).close()
        assert find_leftovers(path) == []
        assert sorted(os.listdir(tmp_path / step)) == ["s"], step


def test_switch_failure_leaves_path_as_it_was(tmp_path, rng, monkeypatch):
    old = table(rng, 50)
    rowcache.build_store(tmp_path / "s", {"t": old}, progress=False).close()

    def no_exchange(a, b):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(replace, "exchange", no_exchange)
    with pytest.raises(OSError, match="Input/output error"):
        rowcache.build_store(tmp_path / "s", {"t": table(rng, 60)}, overwrite=True, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["s"]
    with RowStore.open(tmp_path / "s") as store:
        np.testing.assert_array_equal(read_all(store), old.astype(BF16).view(np.uint16))


# -- what overwrite=True may replace --------------------------------------------
def test_overwrite_refuses_a_directory_that_is_not_a_store(tmp_path, rng):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match=r"not a rowcache store .*notes\.txt"):
        rowcache.build_store(precious, [table(rng, 10)], overwrite=True, progress=False)
    assert (precious / "notes.txt").read_text() == "keep me"
    assert sorted(os.listdir(tmp_path)) == ["precious"]
    # A store with a stray file in it is not a store either.
    rowcache.build_store(tmp_path / "s", [table(rng, 10)], progress=False).close()
    (tmp_path / "s" / "mine.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"mine\.txt"):
        rowcache.build_store(tmp_path / "s", [table(rng, 10)], overwrite=True, progress=False)


def test_overwrite_refuses_empty_path_files_and_links(tmp_path, rng, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(ConfigError, match="path=''"):
        rowcache.build_store("", [table(rng, 10)], overwrite=True, progress=False)
    with pytest.raises(ConfigError, match="not a rowcache store"):
        rowcache.build_store(".", [table(rng, 10)], overwrite=True, progress=False)
    with pytest.raises(ConfigError, match="not a directory"):
        rowcache.build_store("keep.txt", [table(rng, 10)], overwrite=True, progress=False)
    rowcache.build_store("real", [table(rng, 10)], progress=False).close()
    os.symlink("real", "link")
    with pytest.raises(ConfigError, match="symbolic link"):
        rowcache.build_store("link", [table(rng, 10)], overwrite=True, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["keep.txt", "link", "real"]


def test_overwrite_replaces_an_empty_directory_and_an_old_format_store(tmp_path, rng):
    (tmp_path / "e").mkdir()
    rowcache.build_store(tmp_path / "e", [table(rng, 10)], overwrite=True, progress=False).close()
    import lmdb

    rowcache.build_store(tmp_path / "s", [table(rng, 10)], progress=False).close()
    env = lmdb.open(str(tmp_path / "s" / fmt.INDEX_NAME), subdir=True, lock=False)
    with env.begin(write=True) as txn:
        meta = json.loads(txn.get(fmt.META_KEY))
        meta["version"] = 1
        txn.put(fmt.META_KEY, json.dumps(meta).encode())
    env.close()
    write_marker(tmp_path / "s")
    with pytest.raises(FormatError, match="version"):
        RowStore.open(tmp_path / "s")
    s = rowcache.build_store(tmp_path / "s", [table(rng, 12)], overwrite=True, progress=False)
    assert s.tables[0].rows == 12 and s.meta["version"] == fmt.write_version("bf16")
    s.close()


# -- leftovers ------------------------------------------------------------------
def test_leftovers_reported_removed_but_never_one_a_live_build_owns(tmp_path, rng):
    path = str(tmp_path / "s")
    rowcache.build_store(path, [table(rng, 10)], progress=False).close()
    dead_build = tmp_path / ".s.building-dead"
    dead_build.mkdir()
    (dead_build / "t0000-s000000.bin").write_bytes(b"\0" * 4096)
    dead_old = tmp_path / ".s.old-dead"
    shutil.copytree(path, dead_old)
    live, lock = replace.new_sibling(path, "building")  # as a running build holds it
    try:
        found = {os.path.basename(lo.path): lo for lo in find_leftovers(path)}
        assert set(found) == {".s.building-dead", ".s.old-dead", os.path.basename(live)}
        assert found[".s.building-dead"].bytes == 4096 and found[".s.old-dead"].kind == "old"
        assert [lo.live for lo in sorted(found.values(), key=lambda x: x.path)] == [
            lo.path == live for lo in sorted(found.values(), key=lambda x: x.path)
        ]
        with RowStore.open(path) as store:
            rep = store.verify()
            assert rep.ok and len(rep.leftovers) == 3
        rowcache.build_store(path, [table(rng, 11)], overwrite=True, progress=False).close()
        assert [lo.path for lo in find_leftovers(path)] == [live]
        assert os.path.isdir(live)
    finally:
        lock.close()
    assert [lo.live for lo in find_leftovers(path)] == [False]
    rowcache.build_store(tmp_path / "t", [table(rng, 5)], progress=False).close()  # other path
    assert os.path.isdir(live)  # a build of another path leaves it alone
    assert [lo.path for lo in replace.remove_leftovers(path)] == [live]
    assert sorted(os.listdir(tmp_path)) == ["s", "t"]


# -- a handle reads the store it opened ----------------------------------------
def test_handle_opened_before_an_overwrite_never_mixes_stores(tmp_path, rng, monkeypatch):
    old, new = table(rng, 2000, 32), table(rng, 2000, 32)
    path = tmp_path / "s"
    rowcache.build_store(path, {"t": old}, progress=False, shard_bytes=4 * 4096).close()
    h = RowStore.open(path)
    rows_per_shard = h.tables[0].rows_per_shard
    first_shard = np.arange(2, 4)
    np.testing.assert_array_equal(  # opens shard 0's file before the overwrite
        h.read_rows("t", first_shard).view(np.uint16), old[first_shard].astype(BF16).view(np.uint16)
    )
    seen: dict[str, np.ndarray] = {}

    def during_switch(step):
        if step == "synced":  # the new store is at `path`; the old one not yet removed
            seen["all"] = read_all(h)

    monkeypatch.setattr(replace, "test_hook", during_switch)
    rowcache.build_store(path, {"t": new}, overwrite=True, progress=False).close()
    np.testing.assert_array_equal(seen["all"], old.astype(BF16).view(np.uint16))
    assert h.changed()
    # The old store's files are gone now: a shard already open still reads the old rows,
    # one never opened is an error, never the new store's rows.
    np.testing.assert_array_equal(
        h.read_rows("t", first_shard).view(np.uint16), old[first_shard].astype(BF16).view(np.uint16)
    )
    mixed = np.array([2, 3, 5 * rows_per_shard, 5 * rows_per_shard + 1])
    try:
        got = h.read_rows("t", mixed)
    except StoreChangedError as e:
        assert "open the path again" in str(e) and str(path) in str(e)
    else:
        np.testing.assert_array_equal(got.view(np.uint16), old[mixed].astype(BF16).view(np.uint16))
    # A cache on the old handle: old rows or a named error, never new ones.
    cache = NgramRowCache(h, "t", slots=64)
    try:
        slots = cache.resolve(mixed)
    except CorruptDataError:
        pass
    else:
        np.testing.assert_array_equal(
            cache.table[slots].view(np.uint16), old[mixed].astype(BF16).view(np.uint16)
        )
    h.close()
    with RowStore.open(path) as h2:
        assert not h2.changed() and h2.store_id != h.store_id
        np.testing.assert_array_equal(read_all(h2), new.astype(BF16).view(np.uint16))
