"""A build and an open under an address-space limit (``ulimit -v``): the LMDB index's map is
sized from its records, not a fixed 16 GiB (issue 51, item 4), and grows should a bound
ever be short. The limited cases run in a child process, which sets ``RLIMIT_AS`` before it
imports numpy."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import lmdb
import numpy as np
import pytest

import rowcache
import rowcache.store.builder as builder
from rowcache.errors import FormatError
from rowcache.format import layout as fmt
from rowcache.store.handle import RowStore

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

AS_SCRIPT = r"""
import json, resource, sys
limit = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
import numpy as np
import rowcache
import rowcache.store.builder as builder
from rowcache.store.handle import RowStore
builder.FP8_ENGINE = "cpu"
rng = np.random.default_rng(0)
tables = {"a": rng.standard_normal((6000, 64), dtype=np.float32),
          "b": rng.standard_normal((777, 48), dtype=np.float32)}
out = {}
for dtype in ("bf16", "fp8"):
    path = f"{sys.argv[1]}-{dtype}"
    try:
        rowcache.build_store(path, tables, dtype=dtype, shard_bytes=8192, progress=False).close()
        with RowStore.open(path) as s:
            s.verify()
            got = s.read_rows("b", np.arange(777))
            out[dtype] = {"shards": sum(t.shards for t in s.tables),
                          "rows": int(np.asarray(got[0] if isinstance(got, tuple) else got).shape[0])}
    except BaseException as e:
        out[dtype] = {"error": type(e).__name__, "message": str(e)}
print(json.dumps(out))
"""


@pytest.mark.parametrize("gib", [2, 3])
def test_a_build_and_an_open_under_an_address_space_limit_of_a_few_gib(tmp_path, gib):
    # Under 2 GiB of address space the 16 GiB map of the index was an ENOMEM once every
    # shard was written.
    res = subprocess.run(
        [sys.executable, "-c", AS_SCRIPT, str(tmp_path / "s"), str(gib << 30)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.splitlines()[-1])
    for dtype in ("bf16", "fp8"):
        assert "error" not in got[dtype], got[dtype]
        assert got[dtype]["rows"] == 777 and got[dtype]["shards"] > 50, got[dtype]


def test_the_index_map_bound_covers_what_lmdb_writes_and_stays_small(tmp_path, rng):
    x = rng.standard_normal((20000, 64), dtype=np.float32)
    seen = []
    real = builder.index_map_bytes

    def spy(recs, meta):
        seen.append(real(recs, meta))
        return seen[-1]

    builder.index_map_bytes = spy
    try:
        rowcache.build_store(tmp_path / "s", [x, x[:999]], shard_bytes=8192, progress=False).close()
    finally:
        builder.index_map_bytes = real
    used = os.path.getsize(tmp_path / "s" / fmt.INDEX_NAME / fmt.INDEX_FILE)
    (bound,) = seen
    assert used <= bound <= 64 << 20, (used, bound)


@pytest.mark.parametrize("grows", [0, 2])
def test_a_map_that_fills_is_doubled_or_a_one_line_error(tmp_path, rng, monkeypatch, grows):
    x = rng.standard_normal((20000, 64), dtype=np.float32)
    monkeypatch.setattr(builder, "index_map_bytes", lambda recs, meta: 64 << 10)
    monkeypatch.setattr(builder, "MAP_GROWS", grows)
    path = tmp_path / "s"
    if grows == 0:  # 64 KiB cannot hold 300 shards' records: refused, nothing left
        with pytest.raises(FormatError, match=r"still filled its map at 65,536 bytes") as e:
            rowcache.build_store(path, [x], shard_bytes=8192, progress=False)
        assert "\n" not in str(e.value)
        assert isinstance(e.value.__cause__, lmdb.MapFullError)
        assert os.listdir(tmp_path) == []
        return
    rowcache.build_store(path, [x], shard_bytes=8192, progress=False).close()  # 256 KiB do
    with RowStore.open(path) as s:
        s.verify()
        np.testing.assert_array_equal(
            np.asarray(s.read_rows(0, np.arange(20000)), dtype=np.float32),
            x.astype(rowcache.store.sources.BF16).astype(np.float32),
        )
