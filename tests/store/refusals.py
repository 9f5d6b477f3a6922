"""Calls that a malformed input must refuse, each run in a forked child of one fresh interpreter.

A header length of 2**62, a FIFO or deeply nested JSON could end a call in a huge allocation, a
hang or a signal; in a child each shows as what it is (an exit status, a ``MemoryError`` under
the child's address-space limit) instead of taking pytest down. One interpreter imports
rowcache once and forks per case, so a dozen cases cost one start-up. Used by the tests of
``.safetensors`` files and of attacks on a store (``tests/store``) and of sharded checkpoints
and Engram checkpoints (``tests/embed``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

SCRIPT = r"""
import contextlib, io, json, os, resource, signal, sys, traceback
import rowcache
from rowcache import embed
from rowcache.cli.app import build_parser, main
from rowcache.errors import RowCacheError

build_parser()  # imports every command's module once, before the forks

LIMIT = 24 << 30  # address space: a 1 TiB read buffer must fail here
ALARM = 30  # seconds a case may take before SIGALRM ends it (a hang)


def call(kind, args):
    if kind == "build_store":
        path, tables = args
        tables = {k: tuple(v) if isinstance(v, list) else v for k, v in tables.items()}
        rowcache.build_store(path, tables, progress=False).close()
        return None
    if kind == "checkpoint":
        return sorted(embed.Checkpoint(args[0]).files)
    if kind == "table_sources":
        return embed.table_sources(args[0])
    if kind == "load_pretrained":
        embed.load_pretrained(args[0], **args[1])
        return None
    if kind == "load_engram_memory":
        embed.load_engram_memory(args[0], **args[1])
        return None
    if kind == "cli":
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(args)
        return {"rc": rc, "stderr": err.getvalue()}
    if kind == "python":
        scope = {"__name__": "case"}
        exec(args, scope)
        return scope.get("result")
    raise AssertionError(kind)


def run(calls):
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))
    signal.alarm(ALARM)
    out = []
    for kind, args in calls:
        try:
            out.append({"kind": kind, "result": call(kind, args)})
        except RowCacheError as e:
            out.append({"kind": kind, "error": type(e).__name__, "message": str(e)})
        except BaseException as e:  # what must never happen; kept with its traceback
            out.append({"kind": kind, "error": type(e).__name__, "message": str(e)[:500],
                        "traceback": traceback.format_exc()[-3000:]})
    return out


results = {}
for case in json.load(open(sys.argv[1])):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            data = json.dumps(run(case["calls"]))
        except BaseException as e:
            data = json.dumps([{"kind": "?", "error": type(e).__name__, "message": str(e)}])
        with os.fdopen(w, "w") as f:
            f.write(data)
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        data = f.read()
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    results[case["name"]] = {"status": status, "calls": json.loads(data) if data else []}
print(json.dumps(results))
"""


def run_cases(cases: dict[str, list[tuple[str, Any]]], workdir: Any) -> dict[str, Any]:
    """``{case: {"status": exit status of its child (< 0: a signal), "calls": [outcome]}}``.

    ``cases`` maps a name to calls ``(kind, args)``: kind ``build_store`` (args ``[path,
    tables]``, a tuple source as a list), ``checkpoint``, ``table_sources`` (``[path]``),
    ``load_pretrained`` or ``load_engram_memory`` (``[path, kwargs]``), ``cli`` (argv of
    ``rowcache``) or ``python``
    (args: Python source run in a fresh scope; its ``result`` variable, JSON-serializable, is
    the call's result: an attack that builds, damages and opens a store). An outcome is
    ``{"kind", "result"}`` or ``{"kind", "error", "message"}`` (with ``traceback`` for an
    error that is not a ``RowCacheError``).
    """
    spec = workdir / "cases.json"
    spec.write_text(json.dumps([{"name": k, "calls": v} for k, v in cases.items()]))
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(spec)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads(proc.stdout.splitlines()[-1]))


def assert_refused(outcome: dict[str, Any], *phrases: str, error: str = "FormatError") -> None:
    """Every call of a case was refused in one line holding each of ``phrases``: a
    ``RowCacheError`` named ``error`` from the API, exit status 2 and one stderr line from the
    CLI; the child ended normally (no signal, no hang)."""
    assert outcome["status"] == 0, f"the child ended with status {outcome['status']}"
    assert outcome["calls"], "no call ran"
    for o in outcome["calls"]:
        if o["kind"] == "cli":
            assert "result" in o, o
            rc, err = o["result"]["rc"], o["result"]["stderr"]
            assert rc == 2, (rc, err)
            assert err.count("\n") == 1 and err.startswith("rowcache build: error: "), err
            text = err
        else:
            assert o.get("error") == error, o
            text = o["message"]
            assert "\n" not in text, text
        for bad in ("Traceback", "MemoryError", "RecursionError"):
            assert bad not in text, text
        for p in phrases:
            assert p in text, (p, o["kind"], text)
