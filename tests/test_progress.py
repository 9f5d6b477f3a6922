"""The library's progress bars by default (issue 51, item 12): only when stderr is a terminal,
as the CLI shows them. They defaulted on and wrote ``\\r`` lines into logs. One child process
calls every long library function with its default ``progress``, once with stderr a pipe (a
log: nothing written) and once with stderr a terminal (a pty: every bar drawn)."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios

CHILD = """
import tempfile
import numpy as np
import rowcache
from rowcache import embed
from rowcache.tools import build_trace, measure_io, profile_trace
from rowcache.tools.demo import DemoConfig, run_demo

d = tempfile.mkdtemp()
store = rowcache.build_store(d + "/store", {"t": np.ones((4000, 64), np.float32)})
measure_io(d + "/store", queue_depths=[1], seconds=0.02)
dims = embed.NgramDims(vocab_size=300, hidden_size=8, max_ngram=3, splits=2, ratio=3,
                       eos_token_id=2)
rng = np.random.default_rng(0)
trace = build_trace([rng.integers(3, 300, 60) for _ in range(20)], dims, d + "/trace")
profile_trace(trace, [16, 64])
run_demo(DemoConfig(hidden_size=48, ratio=0.02, max_tokens=600, chunk=128, tokenizer="bytes"))
print("done")
"""
BARS = ("build bf16", "bench-io", "trace", "profile", "demo")


def _run(stderr_is_a_terminal: bool) -> tuple[str, bytes]:
    """The child's stdout, and what it wrote on its stderr (a pipe, or a pty's other end)."""
    if not stderr_is_a_terminal:
        p = subprocess.run(
            [sys.executable, "-c", CHILD], capture_output=True, timeout=300, cwd=os.getcwd()
        )
        assert p.returncode == 0, p.stderr.decode()[-3000:]
        return p.stdout.decode(), p.stderr
    master, slave = pty.openpty()
    # a terminal of 120 columns (a new pty has 0, where a bar draws nothing)
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    p = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=slave, start_new_session=True
    )
    os.close(slave)
    got = bytearray()
    try:
        poller = select.poll()  # (not select(): the suite's process may hold fds >= 1024)
        poller.register(master, select.POLLIN)
        while True:  # read as it comes: a full pty would block the child
            ready = poller.poll(300_000)
            assert ready, "the child wrote nothing on its terminal for 300 s"
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:  # EIO: the child closed its end
                break
            if not chunk:
                break
            got += chunk
        out, _ = p.communicate(timeout=60)
    finally:
        os.close(master)
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, bytes(got).decode(errors="replace")[-3000:]
    return out.decode(), bytes(got)


def test_library_progress_bars_only_on_a_terminal_by_default():
    out, log = _run(stderr_is_a_terminal=False)
    assert out.strip() == "done"
    assert log == b"", log[-2000:]  # nothing in a log: no bars, no \r lines
    out, term = _run(stderr_is_a_terminal=True)
    assert out.strip() == "done"
    text = term.decode(errors="replace")
    assert "\r" in text
    for bar in BARS:
        assert f"{bar}:" in text or f"{bar} " in text, (bar, text[-2000:])
