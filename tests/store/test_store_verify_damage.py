"""``RowStore.verify`` on a damaged store (issue 39, item 17): every damaged shard named
(missing, cut short, a bad page, not a regular file), never a hang."""

from __future__ import annotations

import os
import subprocess
import sys

import ml_dtypes
import numpy as np

import rowcache
from rowcache.store.handle import RowStore


def _store(tmp_path, rng):
    x = rng.standard_normal((5000, 32), dtype=np.float32).astype(ml_dtypes.bfloat16)
    s = rowcache.build_store(tmp_path / "s", {"t": x}, progress=False, shard_bytes=16 * 4096)
    files = [r.file for r in s.shards[0]]
    s.close()
    return tmp_path / "s", files


def test_verify_reports_every_damaged_shard_by_name(tmp_path, rng):
    path, files = _store(tmp_path, rng)
    os.truncate(path / files[0], 100)
    os.unlink(path / files[1])
    with open(path / files[3], "r+b") as f:
        f.write(b"\0\1\2")
    with RowStore.open(path, check_shards=False) as s:
        rep = s.verify()
    assert not rep.ok and rep.damaged_shards == [files[0], files[1], files[3]]
    assert [p.split(":")[0] for p in rep.problems] == [files[0], files[1], files[3]]
    assert "100 bytes" in rep.problems[0] and "missing" in rep.problems[1]


def test_verify_of_a_shard_replaced_by_a_fifo_reports_it_and_does_not_hang(tmp_path, rng):
    path, files = _store(tmp_path, rng)
    code = (
        "import os, sys\n"
        "from rowcache.store.handle import RowStore\n"
        "s = RowStore.open(sys.argv[1])\n"
        "f = os.path.join(sys.argv[1], sys.argv[2])\n"
        "os.unlink(f); os.mkfifo(f)\n"
        "rep = s.verify()\n"
        "print(rep.damaged_shards, rep.problems[0])\n"
    )
    got = subprocess.run(
        [sys.executable, "-c", code, str(path), files[2]],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert got.returncode == 0, got.stderr
    assert got.stdout.startswith(f"['{files[2]}']") and "not a regular file" in got.stdout
