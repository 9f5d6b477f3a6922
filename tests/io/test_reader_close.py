"""A ``RowReader`` lets go of its shard files: ``close()`` or garbage collection of a reader
dropped without it closes every descriptor it opened, whatever its engine, so many readers
made, read through and dropped leave a process's open files where they were. Run in a child
process (a leak, a hang or a signal shows as what it is)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent(
    """
    import gc, os, sys, tempfile
    import numpy as np, ml_dtypes
    import rowcache
    from rowcache.io.reader import RowReader

    def fds():
        gc.collect()
        return len(os.listdir("/proc/self/fd"))

    root = tempfile.mkdtemp()
    x = np.arange(3000 * 32, dtype=np.float32).reshape(3000, 32).astype(ml_dtypes.bfloat16)
    store = rowcache.build_store(root + "/s", {"t": x, "u": x[:900]}, progress=False,
                                 shard_bytes=8 * 4096)
    engine, mode = sys.argv[1], sys.argv[2]
    files = [[s.file for s in shards] for shards in store.shards]

    def round_():
        r = RowReader(store.path, store.tables, files, engine=engine)
        got, _ = r.read_parts([(0, np.arange(0, 3000, 7)), (1, np.arange(0, 900, 5))])
        assert got.shape[0] == 429 + 180
        if mode == "close":
            r.close()
            r.close()  # idempotent

    round_()
    base = fds()
    for _ in range(80):
        round_()
    print(base, fds(), sum(len(f) for f in files))
    """
)


@pytest.mark.parametrize("mode", ["close", "dropped"])
@pytest.mark.parametrize("engine", ["uring", "threads", "python"])
def test_readers_leave_the_descriptor_count_where_it_was(engine, mode):
    p = subprocess.run(
        [sys.executable, "-c", CHILD, engine, mode], capture_output=True, text=True, timeout=240
    )
    if p.returncode != 0 and "io_uring" in p.stderr and engine == "uring":
        pytest.skip("no io_uring here")
    assert p.returncode == 0, p.stderr[-2000:]
    base, after, shard_files = (int(v) for v in p.stdout.split())
    assert shard_files > 2  # (several files a reader: a leak would be 80 x that)
    assert after == base, (engine, mode, base, after)
