"""Attacks on a store run each in a forked child of one fresh interpreter, with a timeout.

A flipped bit, a FIFO or a file cut short under a memory map could end a call in a signal
(SIGBUS) or a hang; in a child each shows as what it is (the child's exit status: < 0 for
a signal, -14 for SIGALRM after ``ALARM`` seconds, a hang) instead of taking pytest down.
One interpreter imports rowcache once and forks per case, so a dozen attacks cost one
start-up. A case is Python source run with ``work`` (its own empty directory) and the
helpers below in scope; it sets ``result`` to what the test should see, or raises. Used by
``tests/store/test_store_attacks.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

SCRIPT = r"""
import json, os, signal, sys, traceback
import numpy as np
import ml_dtypes
import rowcache
from rowcache.errors import RowCacheError
from rowcache.store.handle import RowStore

ALARM = int(sys.argv[2])


def build(path, rows=300, dim=16, seed=0, **kw):
    '''A one-table store "t" of random bf16 rows in small shards; returns the rows.'''
    x = np.random.default_rng(seed).standard_normal((rows, dim), dtype=np.float32)
    x = x.astype(ml_dtypes.bfloat16)
    kw.setdefault("shard_bytes", 8192)
    rowcache.build_store(path, {"t": x}, progress=False, **kw).close()
    return x


def rows_of(store):
    return store.read_rows("t", np.arange(store.tables[0].rows)).view(np.uint16)


def outcome(fn):
    '''{"ok": fn()} or {"error": class name, "message": text} for a RowCacheError or OSError.'''
    try:
        return {"ok": fn()}
    except (RowCacheError, OSError) as e:
        return {"error": type(e).__name__, "message": str(e)}


results = {}
for name, code in json.load(open(sys.argv[1])).items():
    work = os.path.join(os.path.dirname(sys.argv[1]), name)
    os.mkdir(work)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        signal.alarm(ALARM)
        scope = dict(globals(), work=work, result=None)
        try:
            exec(code, scope)
            out = {"result": scope["result"]}
        except BaseException as e:
            out = {"error": type(e).__name__, "message": str(e)[:2000]}
            if not isinstance(e, RowCacheError):
                out["traceback"] = traceback.format_exc()[-3000:]
        with os.fdopen(w, "w") as f:
            f.write(json.dumps(out, default=repr))
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        data = f.read()
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    results[name] = {"status": status, **(json.loads(data) if data else {})}
print(json.dumps(results))
"""


def run_attacks(cases: dict[str, str], workdir: Any, alarm: int = 20) -> dict[str, Any]:
    """``{case: {"status": exit status of its child (< 0: a signal; -14: it hung for
    ``alarm`` s), "result": what it set} or {..., "error", "message"[, "traceback"]}}``."""
    spec = workdir / "cases.json"
    spec.write_text(json.dumps(cases))
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(spec), str(alarm)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads(proc.stdout.splitlines()[-1]))


def assert_clean(outcome: dict[str, Any]) -> dict[str, Any]:
    """The child ended normally (no signal, no hang) and the case ran to its end; returns
    what the case set as ``result``."""
    assert outcome["status"] == 0, f"the child ended with status {outcome['status']} ({outcome})"
    assert "error" not in outcome, outcome
    return dict(outcome["result"])
