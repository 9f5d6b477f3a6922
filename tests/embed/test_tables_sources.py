"""``Bf16Table`` takes what ``build_store`` takes: a uint16-viewed bf16 array, a ``.npy`` path."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from rowcache.embed.tables import Bf16Table
from rowcache.errors import ConfigError


def test_bf16_table_from_uint16_view_and_npy_path(tmp_path, rng):
    a = rng.standard_normal((20, 8), dtype=np.float32).astype(ml_dtypes.bfloat16)
    ids = np.array([3, 0, 19, 3])
    want = a[ids].view(np.uint16)
    for src in (a, a.view(np.uint16)):
        got = Bf16Table(src).gather(ids)
        np.testing.assert_array_equal(got.view(np.uint16), want)
    np.save(tmp_path / "t.npy", a.view(np.uint16))
    t = Bf16Table(tmp_path / "t.npy")
    assert (t.rows, t.dim) == (20, 8)
    np.testing.assert_array_equal(t.gather(ids).view(np.uint16), want)
    np.save(tmp_path / "f.npy", a.astype(np.float32))
    np.testing.assert_array_equal(
        Bf16Table(str(tmp_path / "f.npy")).gather(ids).view(np.uint16), want
    )


def test_bf16_table_bad_paths(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        Bf16Table(tmp_path / "none.npy")
    (tmp_path / "cut.npy").write_bytes(b"\x93NUMPY")
    with pytest.raises(ConfigError, match=r"cut\.npy: not a readable \.npy"):
        Bf16Table(tmp_path / "cut.npy")
    with pytest.raises(ConfigError, match="int32"):
        Bf16Table(np.zeros((2, 2), np.int32))
