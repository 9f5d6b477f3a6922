"""``NgramRowCache.pause_prefetch``: no piece starts on the prefetch thread, and nothing
blocks on the pause. Each case runs in a child process (a deadlock shows as its timeout,
not as a hung suite): the cache's own calls that need pieces not started read them on
their thread, a handle waits for the resume, and a process that raises while paused
exits."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.support import ROOT

PRELUDE = """
import sys, threading, tempfile, pathlib
import numpy as np
from rowcache import NgramRowCache
from rowcache.cache.row_cache import Tuning
from tests.cache.support import Gate, make_store

rng = np.random.default_rng(7)
store, x = make_store(pathlib.Path(tempfile.mkdtemp()), rng)
gate = Gate()
cache = NgramRowCache.assemble(store, "t", slots=200, tuning=Tuning(piece_rows=8),
                               part_reader=gate.wrap)
ids = np.arange(100, 164)  # 8 pieces of 8 rows
h = cache.prefetch(ids)
assert h.rows == 64 and gate.started.wait(10)  # piece 0 being read, held by the gate
threading.Timer(0.05, gate.open.set).start()
cache.pause_prefetch()  # returns once piece 0 has landed; pieces 1..7 stay queued
queued = [j for j in h.pieces(taken=False) if not j.started]
assert len(queued) == 7, len(queued)

def same(got, rows):
    np.testing.assert_array_equal(cache.table[got].view(np.uint16), x[rows].view(np.uint16))
"""


def child(body: str) -> subprocess.CompletedProcess:
    """Run PRELUDE + ``body`` in a fresh interpreter (repository root on its path); a
    hang fails the test through the timeout."""
    code = PRELUDE + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )


def test_paused_prefetch_starts_no_piece_and_resumes():
    """While paused no queued piece starts (a handle's wait times out); after the resume
    every piece lands and the rows read back exactly."""
    proc = child(
        """
        import time
        time.sleep(0.2)
        assert not any(j.started for j in queued)
        assert not h.wait(timeout=0.1) and not h.done()
        cache.resume_prefetch()
        cache.resume_prefetch()  # a second resume changes nothing
        assert h.wait(10) and h.exception() is None
        same(cache.resolve(ids), ids)
        s = cache.stats()
        assert (s.misses, s.prefetched) == (0, 64), s
        cache.end_step()
        cache.close()
        print("ok")
        """
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_the_caches_own_calls_read_paused_pieces_on_their_thread():
    """Paused: a resolve of rows of queued pieces takes them over, a prefetch queues more,
    a resolve that needs every piece's slots (exhaustion otherwise) reads them itself, and
    close() returns: none waits for the resume."""
    proc = child(
        """
        want = np.array([141, 150, 143])  # rows of queued pieces
        same(cache.resolve(want), want)
        assert [r.tolist() for r in gate.caller_reads] == [[141, 143, 150]]
        cache.end_step()
        h2 = cache.prefetch(np.arange(1000, 1100))  # queued behind the pause
        assert h2.rows == 100 and not h2.done()
        big = np.arange(2000, 2190)  # 190 rows of 200 slots: every reserved slot needed
        same(cache.resolve(big), big)
        assert cache.inspect().check() == []
        cache.end_step()
        cache.close()  # waits for what is left: read here
        assert h.done() and h2.done()
        print("ok")
        """
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_a_process_that_raises_while_paused_exits():
    """An exception with the prefetch paused and pieces queued ends the process (the
    prefetch thread's tasks do not hold it at exit)."""
    proc = child(
        """
        raise RuntimeError("a server's loop failed")
        """
    )
    assert proc.returncode == 1 and "a server's loop failed" in proc.stderr, proc.stderr
