"""Ctrl-C (issue 39, item 18): a long command stops its worker threads and processes, prints
one line and exits 130. Each command runs in a child process that a terminal's Ctrl-C would
reach (SIGINT to its whole process group, pool workers included) once its work has started."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

import pytest

from rowcache.cli.app import main
from tests.cli.support import TINY_CONFIG

# The child says "ready" on stdout once the work is under way: from a bench-io worker
# thread's first read, or from a pool worker (which then sleeps, so the pool is busy).
CHILD = r"""
import os, sys, threading, time
import rowcache.tools.parallel as parallel
import rowcache.tools.profile as profile
from rowcache.cli.app import main

said = threading.Lock()
def ready():
    if said.acquire(blocking=False):
        os.write(1, b"ready\n")

real_preadv = os.preadv
def preadv(*a):
    if threading.current_thread() is not threading.main_thread():  # not the O_DIRECT probe
        ready()
    return real_preadv(*a)
os.preadv = preadv

def slow(*a, **k):
    ready()
    time.sleep(60)

profile.miss_ratio_curve = slow  # the exact curves' worker processes (fork: patched too)
parallel.sample_chunk = slow     # the SHARDS sampling workers
if sys.argv[1] == "trace":
    ready()
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture
def tr(tmp_path, rng):
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    lines = [json.dumps(rng.integers(3, 300, 40).tolist()) for _ in range(40)]
    (tmp_path / "reqs.jsonl").write_text("\n".join(lines))
    argv = ["trace", str(tmp_path / "reqs.jsonl"), "-o", str(tmp_path / "tr"), "-q"]
    argv += ["--config", str(tmp_path / "config.json"), "--chunk-positions", "400"]
    assert main(argv) == 0
    return tmp_path / "tr"


def test_ctrl_c_stops_workers_prints_one_line_exits_130(tmp_path, tr):
    big = tmp_path / "f.bin"
    big.write_bytes(b"\1" * (1 << 20))
    # bench-io's points last 600 s: only a prompt stop, not a deadline, ends it within 60 s
    runs = {
        "bench-io": ["bench-io", str(big), "--queue-depths", "8", "--seconds", "600"],
        "profile": ["profile", str(tr), "--workers", "2", "--sizes", "64"],
        "profile-shards": ["profile", str(tr), "--workers", "2", "--method", "shards"],
        "trace": ["trace", "--stdlib", "--tokenizer", "bytes", "-o", str(tmp_path / "t2")],
    }
    kids = {
        name: subprocess.Popen(
            [sys.executable, "-c", CHILD, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group, as a terminal's foreground job
        )
        for name, argv in runs.items()
    }
    try:
        for name, p in kids.items():
            assert _line(p, 120) == b"ready\n", (name, _stderr(p))
        time.sleep(0.3)
        sent = time.monotonic()
        for p in kids.values():
            os.killpg(p.pid, signal.SIGINT)
        for name, p in kids.items():
            try:
                _, err = p.communicate(timeout=max(1.0, sent + 60 - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                _, err = p.communicate()
                raise AssertionError(
                    f"{name}: still running 60 s after Ctrl-C; stderr {err.decode()[-2000:]!r}"
                ) from None
            cmd = runs[name][0]
            assert p.returncode == 130, (name, p.returncode, err.decode())
            assert err.decode() == f"rowcache {cmd}: interrupted\n", (name, err.decode())
            assert _group_gone(p.pid), f"{name}: a worker outlived the command"
    finally:
        for p in kids.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert not (tmp_path / "t2").exists()
    leftovers = [f for f in os.listdir(tmp_path) if f.startswith(".t2")]
    assert leftovers == []


def _line(p: subprocess.Popen, seconds: float) -> bytes:
    """The child's first line of stdout, or b"" when it says nothing for ``seconds`` (a
    child that hangs before its work starts fails the test instead of hanging it)."""
    assert p.stdout is not None
    ready, _, _ = select.select([p.stdout], [], [], seconds)
    return p.stdout.readline() if ready else b""


def _stderr(p: subprocess.Popen) -> str:
    """What a child that did not start its work printed (it is killed first)."""
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
    _, err = p.communicate()
    return err.decode()[-2000:]


def _group_gone(pgid: int, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_ctrl_c_anywhere_in_main_is_one_line(monkeypatch, capsys):
    import rowcache.cli.app as app

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(app, "build_parser", interrupted)
    assert main(["inspect", "x"]) == 130
    assert capsys.readouterr().err == "rowcache: interrupted\n"
