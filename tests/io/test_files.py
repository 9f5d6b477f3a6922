"""ShardFiles: how a reader opens a store's shard files and names them in its errors
(issue 39, items 2, 3, 6, 8): never through a link, the store's path as its user gave it
(not the /proc/self/fd path the handle reads through), and a shard gone because the path
holds another store now told apart from a damaged store. A FIFO's refusal runs in a child
(tests/store/test_store_attacks.py): a regression would hang."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from rowcache.errors import CorruptDataError, StoreChangedError
from rowcache.format import layout as fmt
from rowcache.io.files import ShardFiles


@pytest.fixture
def store_dir(tmp_path):
    """A directory of two one-page shard files of one table, opened as a handle would:
    ``(path, root)``, root the ``/proc/self/fd`` path of its descriptor."""
    path = tmp_path / "s"
    path.mkdir()
    for s in (0, 1):
        (path / fmt.shard_file_name(0, s)).write_bytes(bytes(4096))
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    root = f"/proc/self/fd/{fd}"
    if not os.path.isdir(root):
        os.close(fd)
        pytest.skip("no /proc/self/fd here")
    yield str(path), root
    os.close(fd)


def files_of(root, path):
    info = fmt.TableInfo.make("t", 256, 16, "bf16", 4096)  # 2 pages of 128 rows: 2 shards
    names = [[fmt.shard_file_name(0, s) for s in range(info.shards)]]
    return ShardFiles(root, [info], names, direct=False, store_path=path)


def test_errors_name_the_store_path_not_the_descriptor_path(store_dir):
    path, root = store_dir
    files = files_of(root, path)
    assert files.fd(0, 0) >= 0
    os.unlink(os.path.join(path, fmt.shard_file_name(0, 1)))
    with pytest.raises(CorruptDataError) as e:
        files.fd(0, 1)
    assert type(e.value) is CorruptDataError  # the store at `path` is this one: damaged
    assert path in str(e.value) and "/proc/self/fd" not in str(e.value)
    assert "t0000-s000001.bin" in str(e.value) and "rowcache verify" in str(e.value)


def test_a_shard_link_is_refused_not_followed(store_dir, tmp_path):
    path, root = store_dir
    (tmp_path / "outside.bin").write_bytes(bytes(4096))
    shard = os.path.join(path, fmt.shard_file_name(0, 1))
    os.unlink(shard)
    os.symlink(tmp_path / "outside.bin", shard)
    with pytest.raises(CorruptDataError, match=r"t0000-s000001\.bin .*symbolic link") as e:
        files_of(root, path).fd(0, 1)
    assert "/proc/self/fd" not in str(e.value)


def test_a_shard_gone_because_the_path_holds_another_store_is_store_changed(store_dir):
    path, root = store_dir
    files = files_of(root, path)
    os.rename(path, path + ".old")  # another build's switch: a new store at `path`
    os.mkdir(path)
    os.unlink(os.path.join(path + ".old", fmt.shard_file_name(0, 1)))  # the old one removed
    with pytest.raises(StoreChangedError, match="open the path again") as e:
        files.fd(0, 1)
    assert path in str(e.value)
    shutil.rmtree(path + ".old")


def test_opened_descriptors_are_numbered_by_file(store_dir):
    path, root = store_dir
    files = files_of(root, path)
    fds = files.fds_of(np.array([1, 0, 1]))
    assert fds[0] == fds[2] != fds[1] and (files.fds >= 0).all()
    files.close()
    assert (files.fds == -1).all()
