"""What the CLI tests share: a tiny LongCat-style model config, and the CLI (or any Python)
run in a child process (:func:`run_cli`, :func:`run_python`) with what a refused command
prints (:func:`one_error_line`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

# a tiny LongCat-style model config (``config.json`` keys) shared by the CLI tests
TINY_CONFIG = {
    "vocab_size": 300,
    "hidden_size": 8,
    "emb_neighbor_num": 3,
    "emb_split_num": 2,
    "ngram_vocab_size_ratio": 3,
    "eos_token_id": 2,
}


CHILD_MAIN = "import sys\nfrom rowcache.cli.app import main\nsys.exit(main(sys.argv[1:]))\n"


def run_python(
    code: str,
    *argv: str,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float = 120,
    label: str = "python -c",
) -> subprocess.CompletedProcess:
    """``python -c CODE ARGV`` in a child process: its exit status, stdout and stderr (text);
    ``env`` is added to this process's environment; ``label`` names the command in a failure.

    What went wrong shows as what it is: a signal as a negative ``returncode``, a traceback in
    ``stderr``, and a hang as a failed test naming the command and what it printed (the
    child's process group killed after ``timeout`` seconds).
    """
    cmd = [sys.executable, "-c", code, *argv]
    p = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError(
            f"{label} {' '.join(argv)}: still running after {timeout:g} s; stdout "
            f"{out[-2000:]!r}, stderr {err[-2000:]!r}"
        ) from None
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def run_cli(
    *argv: str,
    prelude: str = "",
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess:
    """``rowcache ARGV`` in a child process, as a user runs it (:func:`run_python`).
    ``prelude`` is Python run first in the child (fault injection: a slow disk)."""
    code = prelude + "\n" + CHILD_MAIN
    return run_python(code, *argv, env=env, cwd=cwd, timeout=timeout, label="rowcache")


def one_error_line(p: subprocess.CompletedProcess, prog: str) -> str:
    """The one line a refused command printed (exit 2, no traceback, nothing on stdout);
    ``prog`` is the subcommand ("" for ``rowcache`` itself)."""
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.stderr.startswith(" ".join(["rowcache", prog]).strip() + ": error: "), p.stderr
    assert p.stdout == "", p.stdout
    return p.stderr.strip()
