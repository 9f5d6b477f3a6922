"""A row cache lets go of what it opened: ``close()``, a ``with`` block, or garbage collection
stop its prefetch thread and close the readers it made (their descriptors), so many caches
made, prefetched through and dropped leave a process's open files where they were, and a
rebuilt store's old shard files are not held open. Run in a child process (a leak, a hang
or a signal shows as what it is)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import gc, os, sys, tempfile, threading
    import numpy as np, ml_dtypes
    import rowcache

    def fds():
        return len(os.listdir("/proc/self/fd"))

    root = tempfile.mkdtemp()
    x = np.arange(3000 * 32, dtype=np.float32).reshape(3000, 32).astype(ml_dtypes.bfloat16)
    store = rowcache.build_store(root + "/s", {"t": x}, progress=False, shard_bytes=16 * 4096)
    mode = sys.argv[1]

    def use(cache):
        cache.prefetch(np.arange(0, 900, 3)).wait(10)
        cache.resolve(np.arange(100, 140))
        cache.end_step()

    def round_():
        if mode == "with":
            with rowcache.NgramRowCache(store, "t", slots=400, queue_depth=8) as c:
                use(c)
        elif mode == "close":
            c = rowcache.NgramRowCache(store, "t", slots=400, queue_depth=8)
            use(c)
            c.close()
            c.close()  # idempotent
        else:  # dropped: garbage collection releases them
            c = rowcache.NgramRowCache(store, "t", slots=400, queue_depth=8)
            use(c)
            del c
            gc.collect()

    round_()  # the store's own reader and threads, opened once
    base, threads = fds(), threading.active_count()
    for _ in range(60):
        round_()
    print(base, fds(), threads, threading.active_count())
    """
)


def _run(mode: str) -> list[int]:
    p = subprocess.run(
        [sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=240
    )
    assert p.returncode == 0, p.stderr[-2000:]
    return [int(v) for v in p.stdout.split()]


def test_closed_caches_leave_the_descriptor_count_where_it_was():
    for mode in ("close", "with"):
        base, after, threads, threads_after = _run(mode)
        assert after == base, (mode, base, after)
        assert threads_after == threads, (mode, threads, threads_after)


def test_dropped_caches_are_released_by_garbage_collection():
    base, after, threads, threads_after = _run("dropped")
    assert after == base, (base, after)
    assert threads_after == threads, (threads, threads_after)
